#!/usr/bin/env python3
"""Train one config with several MoE backends, one after another, and compare them.

    # one node, torchrun-style local launch (N processes; GPUs when present, else gloo on CPU)
    python scripts/compare_backends.py --config configs/deepseek-v3-proxy.args \
        --backends mok,alltoall,hybridep --nproc-per-node 2 --iters 50 --warmup 5

    # the one-GPU proxy: throughput and the MoE share of the step from the torch profiler
    python scripts/compare_backends.py --config configs/deepseek-v3-1gpu.args \
        --backends mok,mok_fp8,alltoall,alltoall_fp8 --iters 16 --warmup 4 --profile-iters 12:13

    # inside a Slurm allocation (salloc / sbatch scripts/slurm/compare.sbatch): one srun per backend
    python scripts/compare_backends.py --launcher srun --config configs/deepseek-v3.args ...

    # soak: 500 steps with --deterministic-mode, mok twice (bitwise parameter digests every 100
    # steps), alltoall, the noise controls (mok_control, alltoall_control), loss agreement, NaN/inf,
    # throughput of steps 400-500 against 100-200
    python scripts/compare_backends.py --config configs/deepseek-v3-1gpu.args --soak \
        --backends mok,alltoall --rerun mok --iters 500

    # only re-report existing logs (e.g. of scripts/slurm/train.sbatch runs, or soak runs made
    # one backend per command): name a second run of B "B_rerun" for the bitwise check, and the
    # noise control of B "B_control"
    python scripts/compare_backends.py --from-logs mok=runs/a/logs/train.0.log alltoall=runs/b/logs/train.0.log

Anything after ``--`` is passed to Megatron (after the config, so it overrides it); with --from-logs
it is only recorded, as the flags the logs were run with over the config.

Backends: Megatron's --moe-backend choices (mok, alltoall, allgather, hybridep, deepep) and
  mok_fp8       mok with --mok-precision fp8 (block-scaled e4m3 expert GEMMs)
  mok_unfused   mok with --mok-wgrad-accumulation unfused: Megatron's DDP hook adds its bf16 weight
                gradients into main_grad, as it must for alltoall's experts without TransformerEngine
                (the like-for-like row where a recipe turns on fused accumulation)
  mok_graph, mok_fp8_graph   mok and mok_fp8 with Megatron's full-iteration CUDA graph
                (--cuda-graph-impl full_iteration --no-check-for-nan-in-loss-and-grad): each step's
                forward and backward replay as one graph, so the host launches nothing in between
  (on GPUs the mok variants also get --mok-strict, unless --no-strict: a fallback to the pure-PyTorch
  reference fails the run instead of being timed)
  alltoall_fp8  alltoall with Megatron's FP8 recipe: never run, always reported ``skipped`` with
                the reason (Megatron's FP8 runs inside TransformerEngine's layers; the recipes here
                use --transformer-impl local, and TransformerEngine is not installable on the GPU
                machines); listed so that the report says so.

Writes into --out (default bench/results/compare-<config>-<time>):
  compare.json   per backend: status (ok | failed | skipped), reason, tokens/s/GPU, median step time,
                 speedup over alltoall, loss curve, peak memory, the profiled step breakdown, ...
                 and with --soak the soak checks
  compare.png    loss curves, tokens/s/GPU, peak memory and the step breakdown (needs matplotlib)
  compare.md     a markdown summary
  logs/<backend>.log   every rank's output
  profile/<backend>/torch_profile/rank-0.json.gz   with --profile-iters: the torch profiler trace

--profile-iters S:E passes Megatron's own profiler flags (--profile --use-pytorch-profiler
--profile-step-start S --profile-step-end E --profile-ranks 0 --pytorch-profiler-collect-callstack):
rank 0 records the steps logged as iterations S..E-1 (E-S whole steps). The trace is split into
MoE layers, attention, dense (the rest of forward and backward), optimizer and other: forward
windows are the ``nn.Module: *MoELayer`` / ``*SelfAttention`` calls of the Python tracer; their
backward is found through the autograd sequence numbers (each backward node's
``autograd::engine::evaluate_function`` carries the sequence number of the forward op that made
it); every GPU kernel goes to the window that launched it. ``moe_share`` is the GPU time of the
profiled steps spent inside MoE windows (first to last kernel of each window, gaps included),
over the GPU time of the step; ``moe_kernel_share`` counts kernel time only. The logged iterations
S-1..E (profiler warm-up, recording, trace export) are left out of the timing.

--rerun B trains backend B a second time (reported as ``B_rerun``) and checks that the two runs
are bitwise identical: the same logged loss curve and, with --param-digest-every N, the same
per-rank digest of every parameter's bits every N iterations (Megatron flag
--mok-param-digest-every N of megatron_mok).

--soak (defaults: --iters 500, --param-digest-every 100, Megatron --deterministic-mode,
--noise-control: every backend) checks:
  * the loss curves of all backends agree with the first one within BF16 noise. First iteration
    (same weights, same batch, only the rounding order differs): within 2**-7 relative (two bf16
    ulps). Afterwards rounding differences compound through Adam, and where the loss spikes from
    step to step they decorrelate the per-iteration losses of two correct runs entirely; so the
    curves are compared as means over windows of iters/10 iterations, against the noise that
    rounding alone makes in the same recipe: the noise control B_control trains B once more with
    only the router's float precision changed (--moe-router-dtype fp32 <-> fp64), and a backend's
    worst window may differ by at most twice the worst window of any control from its own backend
    (at least 2 %). Without a control the bound is 2 %. The raw per-iteration maximum difference is
    reported too;
  * no NaN or inf in the loss or the grad norm (and no skipped/NaN iterations);
  * a rerun (--rerun) has bitwise identical parameter digests at every digest iteration;
  * the median step time of iterations 400-500 is within 2 % of iterations 100-200 (the windows
    scale with --iters; iterations that print a digest are left out). The check also states the
    GPU's SM clock, power and temperature in both windows (below), so that a drift that comes with
    a clock change shows as the GPU's.

Local GPU runs sample nvidia-smi once a second beside each backend (logs/B.gpu.csv: SM and memory
clocks, power, temperature); each backend's medians over its timed iterations go into compare.json
(gpu_telemetry) and compare.md. The iteration lines' time stamps place the samples.

tokens/s/GPU = global batch size * seq length / median step time / world size, where the step time is
Megatron's "elapsed time per iteration" of the iterations after the first --warmup ones. Peak memory is
torch.cuda.max_memory_allocated of the worst rank on GPU, the max RSS of the worst rank on CPU (both
from scripts/slurm/rank_stats.py). A backend that cannot run at all (no iteration logged and an error
such as "No module named 'deep_ep'") is reported as ``skipped`` with that error as the reason.
Exit code: 0 when no backend failed (skipped is fine) and every soak check passed, 1 otherwise,
2 on bad arguments.
"""

from __future__ import annotations

import argparse
import bisect
import datetime as _dt
import gzip
import importlib.util
import json
import math
import os
import re
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
from megatron_mok.tools import logparse  # noqa: E402  (pure python, no torch import)

# Megatron replays each step's forward and backward as one CUDA graph: no host work between kernels.
# Only a MoE layer without host syncs can be captured (not alltoall's dropless dispatcher); Megatron
# requires its per-micro-batch NaN check (a host sync) off.
FULL_ITERATION_GRAPH = ("--cuda-graph-impl", "full_iteration", "--no-check-for-nan-in-loss-and-grad")

# name -> (Megatron --moe-backend, extra Megatron args); None: never run (see not_runnable_reason)
BACKEND_VARIANTS = {
    "mok": ("mok", []),
    "mok_fp8": ("mok", ["--mok-precision", "fp8"]),
    "mok_unfused": ("mok", ["--mok-wgrad-accumulation", "unfused"]),
    "mok_graph": ("mok", [*FULL_ITERATION_GRAPH]),
    "mok_fp8_graph": ("mok", ["--mok-precision", "fp8", *FULL_ITERATION_GRAPH]),
    "alltoall": ("alltoall", []),
    "alltoall_fp8": ("alltoall", None),
    "allgather": ("allgather", []),
    "hybridep": ("hybridep", []),
    "deepep": ("deepep", []),
}
KNOWN_BACKENDS = tuple(BACKEND_VARIANTS)


def backend_args(name: str, gpu: bool, strict: bool = True):
    """(--moe-backend value, extra Megatron args) of a backend name, or None if it is never run.

    On GPUs the mok variants get --mok-strict: a call that would fall back to the pure-PyTorch
    reference raises instead of warning, so a comparison never times the reference by mistake."""
    moe_backend, extra = BACKEND_VARIANTS[name]
    if extra is None:
        return None
    if gpu and strict and moe_backend == "mok":
        extra = [*extra, "--mok-strict"]
    return moe_backend, list(extra)

MEGATRON_FP8_REASON = (
    "Megatron's FP8 recipe (--fp8-format/--fp8-recipe) runs inside TransformerEngine's layers and "
    "fp8_autocast (megatron/core/fp8_utils.py); TransformerEngine is not installable on the GPU machines, "
    "and {impl}: alltoall with Megatron FP8 cannot run here, so it was not run"
)

# Same defaults as scripts/slurm/train.sbatch: NVLink multicast off.
ENV_DEFAULTS = {
    "CUDA_DEVICE_MAX_CONNECTIONS": "1",
    "NCCL_NVLS_ENABLE": "0",
    "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
    "NVSHMEM_DISABLE_NVLS": "1",
    "PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True",
    "TORCH_NCCL_ASYNC_ERROR_HANDLING": "1",
    "PYTHONUNBUFFERED": "1",
}


def default_python() -> str:
    env = os.environ.get("MOK_PYTHON")
    if env:
        return env
    venv = REPO / ".venv" / "bin" / "python"
    if venv.exists():
        return str(venv)
    return sys.executable or "python3"


def _flag_value(args: list[str], flag: str) -> str | None:
    """The value after the last occurrence of ``flag`` in an argument list (None: absent)."""
    value = None
    for i, arg in enumerate(args[:-1]):
        if arg == flag:
            value = args[i + 1]
    return value


def read_config_args(path: Path) -> list[str]:
    """Whitespace-separated Megatron args; `#` starts a comment. No shell globbing."""
    out: list[str] = []
    for line in path.read_text().splitlines():
        out.extend(line.split("#", 1)[0].split())
    return out


def count_gpus() -> int:
    cvd = os.environ.get("CUDA_VISIBLE_DEVICES")
    if cvd not in (None, "", "NoDevFiles"):
        return len([d for d in cvd.split(",") if d.strip()])
    smi = shutil.which("nvidia-smi")
    if not smi:
        return 0
    try:
        out = subprocess.run([smi, "-L"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError):
        return 0
    return sum(1 for ln in out.splitlines() if ln.startswith("GPU "))


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("", 0))
        return s.getsockname()[1]


def _kill_all(procs, sig=signal.SIGTERM):
    for p in procs:
        if p.poll() is None:
            try:
                os.killpg(p.pid, sig)
            except (ProcessLookupError, PermissionError):
                pass


def _stop(p, grace: float) -> None:
    """SIGTERM p's process group, then SIGKILL it if it has not exited within grace seconds."""
    _kill_all([p])
    try:
        p.wait(timeout=grace)
    except subprocess.TimeoutExpired:
        _kill_all([p], signal.SIGKILL)
        p.wait()


# GPU telemetry beside a local run (nvidia-smi, once a second): a step-time drift that comes with a
# clock or power change is the GPU's, not the code's. Fields every driver has.
GPU_QUERY = ("timestamp", "index", "clocks.sm", "clocks.mem", "power.draw", "temperature.gpu")
GPU_SAMPLE_KEYS = ("sm_mhz", "mem_mhz", "power_w", "temp_c")
GPU_SAMPLES = "gpu samples"  # the key of a run's samples in its log fields (log_fields)
LOG_TIME = "log time (s)"  # the key of its iteration lines' time stamps there


def start_gpu_sampler(path: Path):
    """nvidia-smi writing GPU_QUERY every second into path; None without nvidia-smi."""
    smi = shutil.which("nvidia-smi")
    if smi is None:
        return None
    fh = open(path, "w")
    try:
        proc = subprocess.Popen([smi, f"--query-gpu={','.join(GPU_QUERY)}", "--format=csv,noheader,nounits",
                                 "-lms", "1000"], stdout=fh, stderr=subprocess.STDOUT, start_new_session=True)
    except OSError:
        fh.close()
        return None
    return proc, fh


def stop_gpu_sampler(sampler) -> None:
    if sampler is None:
        return
    proc, fh = sampler
    _stop(proc, 10)
    fh.close()


def read_gpu_samples(path: Path) -> list:
    """The samples of start_gpu_sampler's file: dicts of t (epoch seconds, local time), gpu and
    GPU_SAMPLE_KEYS; lines that are not samples (errors, [N/A] values) are skipped."""
    samples = []
    if not path.is_file():
        return samples
    for line in path.read_text(errors="replace").splitlines():
        parts = [p.strip() for p in line.split(",")]
        if len(parts) != len(GPU_QUERY):
            continue
        try:
            t = _dt.datetime.strptime(parts[0], "%Y/%m/%d %H:%M:%S.%f").timestamp()
            values = [float(v) for v in parts[2:]]
            gpu = int(parts[1])
        except ValueError:
            continue
        samples.append({"t": t, "gpu": gpu, **dict(zip(GPU_SAMPLE_KEYS, values))})
    return samples


def gpu_window(samples: list, t0: float, t1: float) -> dict | None:
    """Medians of the samples taken in [t0, t1] (all GPUs), and their count; None if there are none."""
    inside = [x for x in samples if t0 <= x["t"] <= t1]
    if not inside:
        return None
    return {"samples": len(inside), **{k: statistics.median(x[k] for x in inside) for k in GPU_SAMPLE_KEYS}}


def run_local(cmd_tail, nproc, python, entry, log_dir: Path, backend: str, timeout: float, env_extra, use_stats):
    """torchrun-style: nproc ranks on this host. Returns (exit_code, wall_s, combined_log_path)."""
    port = free_port()
    cpus = os.cpu_count() or 1
    procs, files = [], []
    t0 = time.time()
    for r in range(nproc):
        env = dict(os.environ)
        for k, v in ENV_DEFAULTS.items():
            env.setdefault(k, v)
        env.update(env_extra)
        env.update(
            RANK=str(r), LOCAL_RANK=str(r), WORLD_SIZE=str(nproc), LOCAL_WORLD_SIZE=str(nproc),
            NODE_RANK="0", GROUP_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
        )
        env.setdefault("OMP_NUM_THREADS", str(max(1, cpus // nproc)))
        env["PYTHONPATH"] = os.pathsep.join([str(REPO)] + [p for p in [env.get("PYTHONPATH")] if p])
        if use_stats:
            cmd = [python, str(REPO / "scripts" / "slurm" / "rank_stats.py"), "-m", entry, *cmd_tail]
        else:
            cmd = [python, "-m", entry, *cmd_tail]
        fh = open(log_dir / f"{backend}.rank{r}.log", "w")
        files.append(fh)
        procs.append(subprocess.Popen(cmd, cwd=REPO, env=env, stdout=fh, stderr=subprocess.STDOUT,
                                      start_new_session=True))
    rc = 0
    try:
        while True:
            codes = [p.poll() for p in procs]
            bad = [c for c in codes if c not in (None, 0)]
            if bad:  # like torchrun: one rank failed -> stop the others
                rc = bad[0]
                time.sleep(3)
                _kill_all(procs)
                break
            if all(c == 0 for c in codes):
                break
            if time.time() - t0 > timeout:
                rc = 124
                _kill_all(procs)
                break
            time.sleep(0.2)
        deadline = time.time() + 15
        for p in procs:
            try:
                p.wait(timeout=max(0.1, deadline - time.time()))
            except subprocess.TimeoutExpired:
                _kill_all([p], signal.SIGKILL)
                p.wait()
    finally:
        _kill_all(procs, signal.SIGKILL)
        for fh in files:
            fh.close()
    wall = time.time() - t0
    combined = log_dir / f"{backend}.log"
    with open(combined, "w") as out:
        for r in range(nproc):
            part = log_dir / f"{backend}.rank{r}.log"
            out.write(part.read_text(errors="replace"))
            part.unlink()
    if rc == 124:
        with open(combined, "a") as out:
            out.write(f"\nTimeoutError: {backend} did not finish within {timeout:.0f} s\n")
    return rc, wall, combined


def run_srun(cmd_tail, nnodes, nproc, python, entry, log_dir: Path, backend: str, timeout: float, env_extra, use_stats):
    """One srun step inside the current Slurm allocation, through scripts/slurm/launch_rank.sh."""
    env = dict(os.environ)
    for k, v in ENV_DEFAULTS.items():
        env.setdefault(k, v)
    env.update(env_extra)
    hosts = subprocess.run(["scontrol", "show", "hostnames", os.environ.get("SLURM_JOB_NODELIST", "")],
                           capture_output=True, text=True).stdout.split()
    env.update(
        MOK_REPO=str(REPO), MOK_PYTHON=python, MOK_ENTRY=entry, MOK_GPUS_PER_NODE=str(nproc),
        MOK_RANK_STATS="1" if use_stats else "0",
        MASTER_ADDR=hosts[0] if hosts else socket.gethostname(), MASTER_PORT=str(free_port()),
    )
    cpus = int(os.environ.get("SLURM_CPUS_ON_NODE", os.cpu_count() or 1))
    env.setdefault("OMP_NUM_THREADS", str(max(1, cpus // nproc)))
    cmd = ["srun", f"--nodes={nnodes}", f"--ntasks={nnodes * nproc}", f"--ntasks-per-node={nproc}",
           f"--cpus-per-task={max(1, cpus // nproc)}", "--kill-on-bad-exit=1", "--export=ALL",
           "bash", str(REPO / "scripts" / "slurm" / "launch_rank.sh"), *cmd_tail]
    combined = log_dir / f"{backend}.log"
    t0 = time.time()
    with open(combined, "w") as fh:
        p = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=fh, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            rc = p.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            _stop(p, 30)
            rc = 124
    if rc == 124:
        with open(combined, "a") as out:
            out.write(f"\nTimeoutError: {backend} did not finish within {timeout:.0f} s\n")
    return rc, time.time() - t0, combined


# ---------------------------------------------------------------------------------------------
# Torch profiler trace -> step breakdown (MoE layers, attention, dense, optimizer, other, idle)
# ---------------------------------------------------------------------------------------------

PROFILE_CATEGORIES = ("moe", "attention", "dense", "optimizer", "other")
# Module classes whose calls are windows of their own (first match wins): Megatron's MoELayer and
# megatron_mok's MoKMoELayer; SelfAttention / MLASelfAttention / CrossAttention.
MODULE_WINDOWS = (("moe", re.compile(r"MoELayer$")), ("attention", re.compile(r"(?:Self|Cross)Attention$")))
_MODULE_RE = re.compile(r"^nn\.Module: (\w+?)(?:_\d+)?$")
_FB_RE = re.compile(r"schedules\.py\(\d+\): forward_backward_")
_OPT_RE = re.compile(r"megatron/core/optimizer/\S*\.py\(\d+\): step$")
_DEVICE_CATS = ("kernel", "gpu_memcpy", "gpu_memset")
_LAUNCH_CATS = ("cuda_runtime", "cuda_driver")
_BWD_PREFIX = "autograd::engine::evaluate_function"


def load_trace(path) -> list:
    path = str(path)
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rt") as f:
        doc = json.load(f)
    return doc["traceEvents"] if isinstance(doc, dict) else doc


def _merge(iv):
    out = []
    for s, e in sorted(iv):
        if out and s <= out[-1][1]:
            if e > out[-1][1]:
                out[-1][1] = e
        else:
            out.append([s, e])
    return out


def _subtract(iv, minus):
    """Merged intervals iv without merged intervals minus."""
    out, j = [], 0
    for s, e in iv:
        cur = s
        while j < len(minus) and minus[j][1] <= cur:
            j += 1
        k = j
        while k < len(minus) and minus[k][0] < e:
            if minus[k][0] > cur:
                out.append([cur, minus[k][0]])
            cur = max(cur, minus[k][1])
            k += 1
        if cur < e:
            out.append([cur, e])
    return out


def _length(iv):
    return sum(e - s for s, e in iv)


class _Windows:
    """Time windows per thread; which one holds a (tid, ts) point."""

    def __init__(self):
        self.by_tid = {}

    def add(self, tid, start, end, key=None):
        self.by_tid.setdefault(tid, []).append((start, end, key))

    def freeze(self):
        for tid, ws in self.by_tid.items():
            ws.sort(key=lambda w: (w[0], w[1]))
            self.by_tid[tid] = (ws, [w[0] for w in ws], max(w[1] - w[0] for w in ws))
        return self

    def find(self, tid, ts):
        """The key of a window holding ts (True for a window without a key; None if none)."""
        entry = self.by_tid.get(tid)
        if entry is None:
            return None
        ws, starts, longest = entry
        i = bisect.bisect_right(starts, ts) - 1
        while i >= 0 and ws[i][0] >= ts - longest:  # a window holding ts starts at most `longest` earlier
            _, e, key = ws[i]
            if ts <= e:
                return key if key is not None else True
            i -= 1
        return None


def _outermost(events):
    """Drop events nested in another event of the list on the same thread."""
    out, last_end = [], {}
    for e in sorted(events, key=lambda e: (e["tid"], e["ts"], -e.get("dur", 0))):
        end = e["ts"] + e.get("dur", 0)
        if e["ts"] < last_end.get(e["tid"], float("-inf")):
            continue
        last_end[e["tid"]] = end
        out.append(e)
    return out


def profile_breakdown(events: list) -> dict:
    """Where the profiled steps' time goes, per category (microseconds per step and shares).

    GPU traces: device events (kernels, memcpy, memset) are attributed through their launch
    (CUDA runtime/driver event with the same correlation id) to the window that launched them.
    CPU-only traces (gloo runs, tests): the outermost CPU ops stand in for the device events.
    """
    xs = [e for e in events if e.get("ph") == "X" and "ts" in e]
    for e in xs:
        e["ts"] = float(e["ts"])
        e["dur"] = float(e.get("dur", 0.0) or 0.0)
    cpu_ops = [e for e in xs if e.get("cat") == "cpu_op"]
    py = [e for e in xs if e.get("cat") == "python_function"]
    annotations = [e for e in xs if e.get("cat") == "user_annotation"]
    device = [e for e in xs if e.get("cat") in _DEVICE_CATS]
    notes = []

    # -- work items: (launch tid, launch ts, start, end) ---------------------------------------
    if device:
        mode = "gpu"
        launches = {}
        for e in xs:
            if e.get("cat") in _LAUNCH_CATS:
                corr = (e.get("args") or {}).get("correlation")
                if corr is not None:
                    launches[corr] = (e["tid"], e["ts"])
        items = []
        unmatched = 0
        for e in device:
            corr = (e.get("args") or {}).get("correlation")
            tid, ts = launches.get(corr, (None, None))
            unmatched += tid is None
            items.append((tid, ts, e["ts"], e["ts"] + e["dur"]))
        if unmatched:
            notes.append(f"{unmatched} of {len(device)} device events have no launch event: counted as other")
    else:
        mode = "cpu"
        unmatched = 0
        items = [(e["tid"], e["ts"], e["ts"], e["ts"] + e["dur"]) for e in _outermost(cpu_ops)]
    if not items:
        raise ValueError("the trace holds neither device events nor CPU ops")

    # -- forward windows from the Python tracer's module calls ---------------------------------
    fwd = {cat: [] for cat, _ in MODULE_WINDOWS}
    for e in py:
        m = _MODULE_RE.match(e.get("name", ""))
        if not m:
            continue
        for cat, rx in MODULE_WINDOWS:
            if rx.search(m.group(1)):
                fwd[cat].append(e)
                break
    for cat in fwd:
        fwd[cat] = _outermost(fwd[cat])
    if not any(fwd.values()):
        notes.append("no nn.Module windows in the trace: record it with --pytorch-profiler-collect-callstack "
                     "(Python tracer); everything in forward/backward counts as dense")

    # forward ops with an autograd sequence number, per thread, sorted by time
    seq_ops = {}
    bwd_ops = []
    for e in cpu_ops:
        seq = (e.get("args") or {}).get("Sequence number")
        if seq is None:
            continue
        if e.get("name", "").startswith(_BWD_PREFIX):
            bwd_ops.append((int(seq), e))
        else:
            seq_ops.setdefault(e["tid"], []).append((e["ts"], int(seq)))
    for tid in seq_ops:
        seq_ops[tid].sort()
    bwd_ops.sort(key=lambda x: x[0])
    bwd_seqs = [s for s, _ in bwd_ops]
    # every backward node per thread, in time order: a window's backward also takes the
    # AccumulateGrad nodes (weight gradients, Megatron's main_grad hooks) that run right after it
    bwd_all = {}
    for e in cpu_ops:
        if e.get("name", "").startswith(_BWD_PREFIX):
            bwd_all.setdefault(e["tid"], []).append(e)
    for tid in bwd_all:
        bwd_all[tid].sort(key=lambda e: e["ts"])
    bwd_starts = {tid: [e["ts"] for e in evs] for tid, evs in bwd_all.items()}

    def extend_with_accumulate(tid, end):
        evs, starts = bwd_all.get(tid, []), bwd_starts.get(tid, [])
        i = bisect.bisect_left(starts, end)
        while i < len(evs) and "AccumulateGrad" in evs[i]["name"]:
            end = max(end, evs[i]["ts"] + evs[i]["dur"])
            i += 1
        return end

    windows = {cat: _Windows() for cat in fwd}
    counts = {cat: {"forward": 0, "backward": 0} for cat in fwd}
    for cat, evs in fwd.items():
        for n, e in enumerate(evs):
            start, end = e["ts"], e["ts"] + e["dur"]
            key = (cat, "f", n)
            windows[cat].add(e["tid"], start, end, key)
            counts[cat]["forward"] += 1
            ops = seq_ops.get(e["tid"], [])
            lo = bisect.bisect_left(ops, (start, -1))
            hi = bisect.bisect_right(ops, (end, float("inf")))
            seqs = [s for _, s in ops[lo:hi]]
            if not seqs:
                continue
            a, b = min(seqs), max(seqs)
            i, j = bisect.bisect_left(bwd_seqs, a), bisect.bisect_right(bwd_seqs, b)
            by_tid = {}
            for _, be in bwd_ops[i:j]:
                s0, e0 = by_tid.get(be["tid"], (float("inf"), float("-inf")))
                by_tid[be["tid"]] = (min(s0, be["ts"]), max(e0, be["ts"] + be["dur"]))
            for tid, (s0, e0) in by_tid.items():
                windows[cat].add(tid, s0, extend_with_accumulate(tid, e0), (cat, "b", n))
                counts[cat]["backward"] += 1
    for w in windows.values():
        w.freeze()

    def phase(rx, extra=()):
        evs = [e for e in py if rx.search(e.get("name", ""))] + list(extra)
        w = _Windows()
        for e in _outermost(evs):
            w.add(e["tid"], e["ts"], e["ts"] + e["dur"])
        return w.freeze(), len(evs)

    opt_w, n_opt = phase(_OPT_RE, [e for e in annotations if e.get("name", "").startswith("Optimizer.step#")])
    fb_events = _outermost([e for e in py if _FB_RE.search(e.get("name", ""))])
    fb_spans = [(e["ts"], e["ts"] + e["dur"]) for e in fb_events]
    if not fb_spans:
        notes.append("no forward_backward_* call in the trace: forward/backward work outside the module "
                     "windows counts as other")

    def in_fb(ts):
        return any(s <= ts <= e for s, e in fb_spans)

    def classify_item(tid, ts):
        if tid is None:
            return "other", None
        for cat in ("moe", "attention"):
            key = windows[cat].find(tid, ts) if cat in windows else None
            if key is not None:
                return cat, key
        if opt_w.find(tid, ts) is not None:
            return "optimizer", None
        if in_fb(ts):
            return "dense", None
        return "other", None

    # -- steps -----------------------------------------------------------------------------
    steps = sorted((e for e in annotations if e.get("name", "").startswith("ProfilerStep#")), key=lambda e: e["ts"])
    step_spans = [(e["ts"], e["ts"] + e["dur"]) for e in steps]
    step_starts = [s for s, _ in step_spans]

    def step_of(ts, start):
        if not step_spans:
            return 0
        t = ts if ts is not None else start
        i = bisect.bisect_right(step_starts, t) - 1
        if i >= 0 and t <= step_spans[i][1]:
            return i
        return None

    per_step = {}
    kernel_us = dict.fromkeys(PROFILE_CATEGORIES, 0.0)
    for tid, ts, start, end in items:
        si = step_of(ts, start)
        if si is None:
            continue
        cat, key = classify_item(tid, ts)
        kernel_us[cat] += end - start
        st = per_step.setdefault(si, {"items": [], "win": {}})
        st["items"].append((start, end, cat))
        if key is not None:
            s0, e0 = st["win"].get(key, (float("inf"), float("-inf")))
            st["win"][key] = (min(s0, start), max(e0, end))
    n_steps = len(per_step)
    if not n_steps:
        raise ValueError("no device work inside the profiled steps")

    wall = dict.fromkeys((*PROFILE_CATEGORIES, "idle"), 0.0)
    span_total = 0.0
    for st in per_step.values():
        lo = min(s for s, _, _ in st["items"])
        hi = max(e for _, e, _ in st["items"])
        span_total += hi - lo
        taken = []
        for cat in ("moe", "attention"):
            iv = _merge([list(v) for k, v in st["win"].items() if k[0] == cat])
            iv = _subtract(iv, taken)
            wall[cat] += _length(iv)
            taken = _merge(taken + iv)
        for cat in ("optimizer", "dense", "other"):
            iv = _subtract(_merge([[s, e] for s, e, c in st["items"] if c == cat]), taken)
            wall[cat] += _length(iv)
            taken = _merge(taken + iv)
        wall["idle"] += (hi - lo) - _length(taken)
    step_us = span_total / n_steps
    wall = {k: v / n_steps for k, v in wall.items()}
    kernel_us = {k: v / n_steps for k, v in kernel_us.items()}
    total_kernel = sum(kernel_us.values())
    return {
        "mode": mode,
        "steps": n_steps,
        "step_us": step_us,
        "breakdown_us": wall,
        "breakdown_share": {k: (v / step_us if step_us else None) for k, v in wall.items()},
        "kernel_us": kernel_us,
        "moe_share": wall["moe"] / step_us if step_us else None,
        "moe_kernel_share": kernel_us["moe"] / total_kernel if total_kernel else None,
        "windows": counts,
        "optimizer_windows": n_opt,
        "unmatched_device_events": unmatched,
        "notes": notes,
    }


def _trace_summary_module():
    """scripts/trace_summary.py (kernel time by name and category), or None."""
    path = REPO / "scripts" / "trace_summary.py"
    if not path.is_file():
        return None
    spec = importlib.util.spec_from_file_location("trace_summary", path)
    mod = importlib.util.module_from_spec(spec)
    try:
        spec.loader.exec_module(mod)
    except Exception:  # pragma: no cover - a broken helper must not break the comparison
        return None
    return mod


IDLE_GAP_US = 100.0  # the GPU idle stretches the report explains (trace_summary.host_gaps)


def analyze_trace(path: Path) -> dict:
    """profile_breakdown of one trace file, plus scripts/trace_summary.py's kernel categories and
    the GPU's idle stretches of at least IDLE_GAP_US with the host op at each (host_gaps)."""
    try:
        events = load_trace(path)
        out = profile_breakdown(events)
    except Exception as err:  # noqa: BLE001 - a trace that cannot be read must not lose the comparison
        return {"trace": str(path), "error": f"{type(err).__name__}: {err}"}
    out["trace"] = str(path)
    ts = _trace_summary_module()
    if ts is not None and out["mode"] == "gpu":
        try:
            s = ts.summarize(events, out["steps"])
            out["kernel_categories_us"] = s["by_category_us_per_step"]
            out["top_kernels"] = s["kernels"][:15]
            g = ts.host_gaps(events, IDLE_GAP_US)
            out["idle_gaps"] = {"min_gap_us": IDLE_GAP_US, "idle_us": g["idle_us"] / out["steps"],
                                "by_host_op_us": {k: v / out["steps"] for k, v in
                                                  list(g["idle_by_label_us"].items())[:6]}}
        except (ValueError, KeyError) as err:
            out["notes"].append(f"trace_summary: {err}")
    return out


def parse_profile_iters(text: str) -> tuple[int, int]:
    m = re.fullmatch(r"\s*(\d+)\s*:\s*(\d+)\s*", text or "")
    if not m or int(m.group(1)) < 1 or int(m.group(2)) <= int(m.group(1)):
        raise ValueError(f"--profile-iters wants S:E with 1 <= S < E, got {text!r}")
    return int(m.group(1)), int(m.group(2))


def profile_megatron_args(start: int, end: int, tb_dir: Path) -> list[str]:
    return ["--profile", "--use-pytorch-profiler", "--profile-step-start", str(start), "--profile-step-end", str(end),
            "--profile-ranks", "0", "--pytorch-profiler-collect-callstack", "--tensorboard-dir", str(tb_dir)]


def profile_excluded_iterations(start: int, end: int) -> set:
    """Logged iterations that the profiler slows down: warm-up (S-1), recording (S..E-1), export (E)."""
    return set(range(max(1, start - 1), end + 1))


# ---------------------------------------------------------------------------------------------
# Timing, speedups, soak checks
# ---------------------------------------------------------------------------------------------


def retime(log, summary: dict, warmup: int, exclude: set) -> dict:
    """Recompute the step-time numbers without the iterations in ``exclude`` (e.g. profiled ones)."""
    its = [r for r in log.unique_iterations() if isinstance(r.step_ms, (int, float)) and math.isfinite(r.step_ms)]
    drop = min(warmup, max(len(its) - 1, 0))
    steady = [r for r in its[drop:] if r.iteration not in exclude] or its[drop:][-1:]
    step_ms = [float(r.step_ms) for r in steady]
    out = dict(summary)
    out["step_ms"] = step_ms
    out["timed_iterations"] = [r.iteration for r in steady]
    out["excluded_from_timing"] = sorted(i for i in exclude if any(r.iteration == i for r in its))
    out["median_step_ms"] = statistics.median(step_ms) if step_ms else None
    out["mean_step_ms"] = statistics.fmean(step_ms) if step_ms else None
    gbs, seq, world = summary.get("global_batch_size"), summary.get("seq_length"), summary.get("world_size")
    med = out["median_step_ms"]
    out["tokens_per_s_per_gpu"] = gbs * seq / (med / 1000.0) / world if med and gbs and seq and world else None
    return out


SOAK_FIRST_ITER_REL_TOL = 2.0 ** -7  # two bf16 ulps, relative
SOAK_LOSS_REL_FLOOR = 0.02  # window means: a relative gap always allowed
SOAK_NOISE_FACTOR = 2.0  # window means: times the worst noise control's worst relative gap
SOAK_THROUGHPUT_TOL = 0.02
NOISE_CONTROL_SUFFIX = "_control"


def loss_windows(iters: int) -> int:
    """Iterations per window of the soak's loss comparison: 50 for 500 iterations."""
    return max(5, iters // 10)


def window_gaps(curve: dict, ref_curve: dict, iters: int) -> list[dict]:
    """Per window (a, b] of loss_windows(iters) iterations: the two curves' means over their common
    iterations and the gap relative to the reference's mean (windows with fewer than half their
    iterations in common are left out)."""
    w = loss_windows(iters)
    out = []
    for a in range(0, iters, w):
        its = [i for i in range(a + 1, a + w + 1) if i in curve and i in ref_curve]
        if 2 * len(its) < w:
            continue
        m, m_ref = statistics.fmean(curve[i] for i in its), statistics.fmean(ref_curve[i] for i in its)
        out.append({"window": [a, a + w], "mean": m, "ref_mean": m_ref,
                    "rel_gap": abs(m - m_ref) / max(abs(m_ref), 1e-12)})
    return out


def noise_control_args(cfg_args: list[str]) -> list[str]:
    """The Megatron flags of the soak's noise control: the same run with the router (routing scores
    and the experts' weighted sum) computed in the other float precision, fp32 <-> fp64. Only the
    rounding changes, so its gap from the plain run is what rounding alone opens in this recipe."""
    return ["--moe-router-dtype", "fp32" if _flag_value(cfg_args, "--moe-router-dtype") == "fp64" else "fp64"]


def loss_curve(result: dict) -> dict:
    """iteration -> lm loss of one backend's result."""
    return {int(i): l for i, l in result["loss_curve"]}


def soak_windows(iters: int) -> tuple[tuple[int, int], tuple[int, int]]:
    """(early, late) windows (a, b]: 100-200 and 400-500 for 500 iterations, scaled otherwise."""
    return (round(0.2 * iters), round(0.4 * iters)), (round(0.8 * iters), iters)


def window_gpu(fields: dict, window: tuple[int, int]) -> dict | None:
    """The GPU telemetry (gpu_window) while the iterations of window (a, b] ran: from the time stamp
    of iteration a's line to that of iteration b's (one-second stamps); None without either."""
    stamps = fields.get(LOG_TIME, {})
    a, b = window
    if a not in stamps or b not in stamps:
        return None
    return gpu_window(fields.get(GPU_SAMPLES) or [], stamps[a], stamps[b])


def soak_checks(results: dict, log_fields: dict, iters: int, digest_every: int) -> dict:
    """The soak's pass/fail checks over the ok backends (the first one is the loss reference)."""
    ok = {b: r for b, r in results.items() if r["status"] == "ok"}
    checks = {}
    early, late = soak_windows(iters)
    ref = next(iter(ok), None)
    ref_curve = loss_curve(ok[ref]) if ref else {}
    # the noise controls: each B_control against B (noise_control_args); the worst sets the loss tolerance
    controls = []
    for ctrl in ok:
        base = ctrl.removesuffix(NOISE_CONTROL_SUFFIX)
        if base == ctrl or base not in ok:
            continue
        gaps = window_gaps(loss_curve(ok[ctrl]), loss_curve(ok[base]), iters)
        if gaps:
            worst = max(gaps, key=lambda g: g["rel_gap"])
            controls.append({"control": ctrl, "of": base, "max_rel_gap": worst["rel_gap"], "window": worst["window"],
                             "window_gaps": gaps})
    noise = max(controls, key=lambda c: c["max_rel_gap"], default=None)
    if noise is not None:
        loss_tol = max(SOAK_LOSS_REL_FLOOR, SOAK_NOISE_FACTOR * noise["max_rel_gap"])
        tol_why = (f"{SOAK_NOISE_FACTOR:g} x the worst window of {len(controls)} noise control(s), "
                   f"{noise['control']} vs {noise['of']}: {100 * noise['max_rel_gap']:.1f} % at "
                   f"{noise['window'][0] + 1}-{noise['window'][1]}; at least {100 * SOAK_LOSS_REL_FLOOR:g} %")
    else:
        loss_tol = SOAK_LOSS_REL_FLOOR
        tol_why = f"{100 * SOAK_LOSS_REL_FLOOR:g} %: no noise control ran"
    per_backend = {}
    for b, r in results.items():
        pb = per_backend[b] = {"status": r["status"]}
        if r["status"] == "skipped":  # cannot run here (e.g. alltoall_fp8, no deep_ep): reported, not a failure
            pb["reason"] = r.get("reason")
            continue
        if r["status"] != "ok":
            checks[f"{b}: ran"] = {"ok": False, "detail": r.get("reason")}
            continue
        fields = log_fields.get(b, {})
        curve = loss_curve(r)
        bad = [i for i, l in curve.items() if not (isinstance(l, (int, float)) and math.isfinite(l))]
        bad_gn = [i for i, g in fields.get("grad norm", {}).items() if not math.isfinite(g)]
        skipped = sum(v for v in fields.get("number of skipped iterations", {}).values() if math.isfinite(v))
        nan_its = sum(v for v in fields.get("number of nan iterations", {}).values() if math.isfinite(v))
        pb["non_finite_loss_iterations"] = bad
        pb["non_finite_grad_norm_iterations"] = bad_gn
        pb["skipped_iterations"] = skipped
        pb["nan_iterations"] = nan_its
        checks[f"{b}: no NaN/inf"] = {"ok": not bad and not bad_gn and not skipped and not nan_its and bool(curve),
                                      "detail": f"loss non-finite at {bad[:5]}, grad norm at {bad_gn[:5]}, "
                                                f"{skipped:g} skipped, {nan_its:g} NaN iterations"}
        checks[f"{b}: ran all iterations"] = {"ok": r.get("last_iteration") == iters,
                                              "detail": f"last logged iteration {r.get('last_iteration')} of {iters}"}
        # throughput stability
        times = fields.get("elapsed time per iteration (ms)", {})
        digest_its = {i for i in times if digest_every and ((i - 1) % digest_every == 0 or i == iters)}

        def window(a, b_, times=times, skip=digest_its):
            """(median, 10th percentile) of the window's step times."""
            v = [t for i, t in times.items() if a < i <= b_ and i not in skip and math.isfinite(t)]
            if not v:
                return None, None
            return statistics.median(v), statistics.quantiles(v, n=10)[0] if len(v) > 1 else v[0]

        (t_early, p10_early), (t_late, p10_late) = window(*early), window(*late)
        pb["median_step_ms_early"], pb["median_step_ms_late"] = t_early, t_late
        # the fastest steps of a window: host hiccups only add time, so a leak or a slowdown moves them too
        pb["p10_step_ms_early"], pb["p10_step_ms_late"] = p10_early, p10_late
        pb["windows"] = {"early": list(early), "late": list(late)}
        if t_early and t_late:
            drift = t_late / t_early - 1.0
            pb["throughput_drift"] = drift
            detail = (f"median {t_early:.1f} ms -> {t_late:.1f} ms ({100 * drift:+.2f} %); 10th percentile "
                      f"{p10_early:.1f} ms -> {p10_late:.1f} ms ({100 * (p10_late / p10_early - 1):+.2f} %)")
            gpu = window_gpu(fields, early), window_gpu(fields, late)
            if all(gpu):
                pb["gpu_early"], pb["gpu_late"] = gpu
                detail += (f"; GPU SM clock {gpu[0]['sm_mhz']:.0f} -> {gpu[1]['sm_mhz']:.0f} MHz, power "
                           f"{gpu[0]['power_w']:.0f} -> {gpu[1]['power_w']:.0f} W, {gpu[0]['temp_c']:.0f} -> "
                           f"{gpu[1]['temp_c']:.0f} C (medians of {gpu[0]['samples']} and {gpu[1]['samples']} "
                           "samples)")
            checks[f"{b}: steps {late[0]}-{late[1]} within 2% of {early[0]}-{early[1]}"] = {
                "ok": abs(drift) <= SOAK_THROUGHPUT_TOL, "detail": detail}
        else:
            checks[f"{b}: throughput windows"] = {"ok": False, "detail": f"too few iterations for {early} and {late}"}
        # loss agreement with the reference (the noise controls and reruns are not compared)
        if b != ref and not b.endswith(("_rerun", NOISE_CONTROL_SUFFIX)):
            common = sorted(set(curve) & set(ref_curve))
            diffs = [abs(curve[i] - ref_curve[i]) for i in common]
            pb["loss_max_abs_diff_vs_" + ref] = max(diffs) if diffs else None
            if common:
                i0 = common[0]
                rel0 = abs(curve[i0] - ref_curve[i0]) / max(abs(ref_curve[i0]), 1e-12)
                pb["first_iteration_rel_diff"] = rel0
                checks[f"{b}: iteration {i0} loss vs {ref}"] = {
                    "ok": rel0 <= SOAK_FIRST_ITER_REL_TOL,
                    "detail": f"{curve[i0]:.6f} vs {ref_curve[i0]:.6f}: {rel0:.2e} relative "
                              f"(tolerance 2**-7 = {SOAK_FIRST_ITER_REL_TOL:.2e})"}
            gaps = window_gaps(curve, ref_curve, iters)
            pb["loss_window_gaps"] = gaps
            name = f"{b}: loss curve vs {ref} ({loss_windows(iters)}-iteration means)"
            if gaps:
                worst = max(gaps, key=lambda g: g["rel_gap"])
                pb["loss_window_max_rel_gap"] = worst["rel_gap"]
                checks[name] = {
                    "ok": worst["rel_gap"] <= loss_tol,
                    "detail": f"worst window {worst['window'][0] + 1}-{worst['window'][1]}: "
                              f"{worst['mean']:.4g} vs {worst['ref_mean']:.4g}, {100 * worst['rel_gap']:.1f} %; "
                              f"tolerance {100 * loss_tol:.1f} % ({tol_why})"}
            else:
                checks[name] = {"ok": False, "detail": "no common iterations"}
        rerun = r.get("bitwise_vs_first_run")
        if b.endswith("_rerun"):
            digests_ok = bool(rerun) and rerun["param_digests_identical"] is True
            n = len(rerun["param_digest_iterations"]) if rerun else 0
            checks[f"{b}: bitwise identical parameter digests"] = {
                "ok": digests_ok and rerun_identical(rerun),
                "detail": (f"{n} digest iterations, digests "
                           f"{'identical' if digests_ok else 'DIFFERENT or missing'}, loss curve "
                           f"{'identical' if rerun and rerun['loss_curve_identical'] else 'different'}")}
    return {
        "iters": iters,
        "param_digest_every": digest_every,
        "loss_reference": ref,
        "noise_control": noise,
        "noise_controls": controls,
        "tolerances": {
            "first_iteration_relative": SOAK_FIRST_ITER_REL_TOL,
            "loss_window_iterations": loss_windows(iters),
            "loss_window_relative": loss_tol,
            "loss_window_relative_floor": SOAK_LOSS_REL_FLOOR,
            "noise_factor": SOAK_NOISE_FACTOR,
            "throughput_relative": SOAK_THROUGHPUT_TOL,
            "why": "bf16 keeps 8 significant bits (one ulp = 2**-8 relative): with the same weights and "
                   "batch, two backends that only round differently give first-iteration losses within ~1-2 "
                   "ulps. Afterwards the rounding differences compound through Adam, and where the loss "
                   "spikes from step to step they decorrelate the per-iteration losses of two correct runs "
                   "entirely; so the curves are compared as window means, against the gap that rounding "
                   "alone opens in the same recipe: the noise controls, each backend trained again with only "
                   "the router's float precision changed (fp32 <-> fp64). A backend passes when its worst "
                   "window is within twice the worst window of any control from its own backend (each control "
                   "run is one sample of that noise, hence the margin), and always within 2 %; a real error (a "
                   "wrong gradient, a lost token, a mis-scaled expert) shifts the curve beyond what rounding does",
        },
        "backends": per_backend,
        "checks": checks,
        "ok": bool(checks) and all(c["ok"] for c in checks.values()),
    }


def log_fields(log) -> dict:
    """field name -> {iteration: value} for the numeric fields of the iteration lines, and LOG_TIME:
    each iteration line's time stamp (epoch seconds)."""
    out = {}
    for r in log.unique_iterations():
        for k, v in r.fields.items():
            if isinstance(v, (int, float)):
                out.setdefault(k, {})[r.iteration] = float(v)
        if r.time is not None:
            out.setdefault(LOG_TIME, {})[r.iteration] = r.time
    return out


def classify(rc: int | None, log: logparse.RunLog, summary: dict) -> tuple[str, str | None]:
    """(status, reason) of one backend run."""
    if rc == 0 and summary["iterations_logged"] > 0:
        if not summary["loss_finite"]:
            return "failed", "loss is not finite"
        return "ok", None
    why = logparse.unavailable_reason(log)
    if why is not None:
        return "skipped", why
    if rc == 0:
        return "failed", "exited 0 but logged no iteration"
    err = log.errors[-1] if log.errors else None
    return "failed", err or f"exit code {rc}"


def rerun_check(first: dict, again: dict) -> dict:
    """Is a rerun bitwise identical to the first run? (loss curve as logged, parameter digests)"""
    d1, d2 = first.get("param_digests") or {}, again.get("param_digests") or {}
    common = sorted(set(d1) & set(d2), key=int)
    return {
        "loss_curve_identical": bool(first.get("loss_curve")) and first.get("loss_curve") == again.get("loss_curve"),
        "param_digest_iterations": [int(i) for i in common],
        "param_digests_identical": all(d1[i] == d2[i] for i in common) if common else None,
    }


def rerun_identical(check: dict) -> bool:
    return check["loss_curve_identical"] and check["param_digests_identical"] is not False


def build_report(results: dict, meta: dict) -> dict:
    for b, r in results.items():
        base = results.get(b[: -len("_rerun")]) if b.endswith("_rerun") else None
        if base is not None and base["status"] == r["status"] == "ok":
            r["bitwise_vs_first_run"] = rerun_check(base, r)
    ref = next((b for b, r in results.items() if r["status"] == "ok"), None)
    if ref is not None:
        ref_curve = dict((i, l) for i, l in results[ref]["loss_curve"])
        for b, r in results.items():
            if r["status"] != "ok" or b == ref:
                continue
            diffs = [abs(l - ref_curve[i]) for i, l in r["loss_curve"] if i in ref_curve]
            r["loss_max_abs_diff_vs_" + ref] = max(diffs) if diffs else None
    base = results.get("alltoall")
    if base is not None and base["status"] == "ok" and base.get("tokens_per_s_per_gpu"):
        for b, r in results.items():
            if r["status"] == "ok" and r.get("tokens_per_s_per_gpu"):
                r["speedup_vs_alltoall"] = r["tokens_per_s_per_gpu"] / base["tokens_per_s_per_gpu"]
    for r in results.values():
        prof = r.get("profile")
        if prof and prof.get("moe_share") is not None:
            r["moe_share"] = prof["moe_share"]
            r["moe_kernel_share"] = prof.get("moe_kernel_share")
            # MoE kernel time (GPU-side, not slowed by the profiler) over the unprofiled median step:
            # a lower bound of the MoE share (it leaves out the gaps inside the MoE layers)
            if r.get("median_step_ms") and prof.get("mode") == "gpu":
                r["moe_kernel_share_of_step"] = prof["kernel_us"]["moe"] / 1e3 / r["median_step_ms"]
    return {**meta, "reference_backend": ref, "backends": results}


def _fmt(v, spec):
    return "–" if v is None else format(v, spec)


def _pct(v):
    return "–" if v is None else f"{100 * v:.1f} %"


def write_markdown(report: dict, path: Path, png_name: str | None) -> None:
    ref = report.get("reference_backend")
    backends = report["backends"]
    has_speedup = any(r.get("speedup_vs_alltoall") for r in backends.values())
    has_share = any(r.get("profile") for r in backends.values())
    lines = [
        f"# Backend comparison: {report.get('config_name', '?')}",
        "",
        f"{report.get('world_size', '?')} ranks"
        + (f" ({report['nodes']} node(s) x {report['ranks_per_node']}, {report.get('device', '?')})"
           if report.get("ranks_per_node") else "")
        + f", {report.get('iters', '?')} iterations, first {report.get('warmup', '?')} excluded from timing"
        + (f" (and the profiled iterations {report['profile_excluded']})" if report.get("profile_excluded") else "")
        + f"; created {report.get('created', '?')}."
        + (f" Megatron flags over the config: `{' '.join(report['extra_args'])}`." if report.get("extra_args") else ""),
        "",
        "| backend | status | tokens/s/GPU | "
        + ("vs alltoall | " if has_speedup else "")
        + "median step (ms) | "
        + ("MoE share (profile) | " if has_share else "")
        + "final loss | "
        + (f"max abs loss diff vs {ref} | " if ref else "")
        + "peak memory (MiB) | note |",
        "|---|---|---:|" + ("---:|" if has_speedup else "") + "---:|" + ("---:|" if has_share else "")
        + "---:|" + ("---:|" if ref else "") + "---:|---|",
    ]
    for b, r in backends.items():
        diff = r.get(f"loss_max_abs_diff_vs_{ref}") if ref else None
        note = (r.get("reason") or "").replace("|", "\\|")
        if len(note) > 400:
            note = note[:397] + "..."
        row = [b, r["status"], _fmt(r.get("tokens_per_s_per_gpu"), ",.1f")]
        if has_speedup:
            row.append(_fmt(r.get("speedup_vs_alltoall"), ".2f") + ("x" if r.get("speedup_vs_alltoall") else ""))
        row.append(_fmt(r.get("median_step_ms"), ".1f"))
        if has_share:
            share = _pct(r.get("moe_share"))
            if r.get("moe_kernel_share_of_step") is not None:
                share += f" (kernels >= {_pct(r['moe_kernel_share_of_step'])})"
            row.append(share)
        row.append(_fmt(r.get("final_loss"), ".4f"))
        if ref:
            row.append("ref" if b == ref else _fmt(diff, ".3g"))
        rerun = r.get("bitwise_vs_first_run")
        if rerun:
            digests = {None: "not logged", True: "=", False: "!="}[rerun["param_digests_identical"]]
            note = (f"bitwise {'identical' if rerun_identical(rerun) else 'DIFFERENT'} to the first run (loss "
                    f"curve {'=' if rerun['loss_curve_identical'] else '!='}, parameter digests at "
                    f"{len(rerun['param_digest_iterations'])} iterations {digests})") + (f"; {note}" if note else "")
        row += [_fmt(r.get("peak_memory_mib") if r["status"] == "ok" else None, ",.0f"), note]
        lines.append("| " + " | ".join(row) + " |")
    srcs = {r.get("peak_memory_source") for r in backends.values() if r.get("peak_memory_source")}
    lines += ["", "Peak memory: " + ("; ".join(sorted(srcs)) if srcs else "not measured") + "."]
    tel = {b: r["gpu_telemetry"] for b, r in backends.items() if r.get("gpu_telemetry")}
    if tel:
        lines += ["", "GPU while the timed steps ran (nvidia-smi each second, medians): " + "; ".join(
            f"{b} SM {t['sm_mhz']:.0f} MHz, {t['power_w']:.0f} W, {t['temp_c']:.0f} C" for b, t in tel.items()) + "."]

    profiled = {b: r["profile"] for b, r in backends.items() if r.get("profile")}
    if profiled:
        lines += ["", "## Step breakdown (torch profiler, rank 0, GPU time per profiled step)", "",
                  "MoE = inside MoE-layer windows (forward module calls and their backward nodes, first to last "
                  "kernel, gaps included); attention likewise; dense = the rest of forward/backward; optimizer = "
                  "Megatron's optimizer step; idle = no device work. Shares of the profiled step, which the "
                  "profiler's Python tracer makes slower than the median step above; \"kernels >=\" in the "
                  "table above is the MoE kernel time over the unprofiled median step (a lower bound).", "",
                  "| backend | profiled step (ms) | MoE | attention | dense | optimizer | other | idle | "
                  "MoE kernel share | note |",
                  "|---|---:|---:|---:|---:|---:|---:|---:|---:|---|"]
        for b, pr in profiled.items():
            if pr.get("error"):
                lines.append(f"| {b} | – | – | – | – | – | – | – | – | {pr['error']} |")
                continue
            cells = [f"{pr['breakdown_us'][k] / 1e3:.1f} ({_pct(pr['breakdown_share'][k])})"
                     for k in ("moe", "attention", "dense", "optimizer", "other", "idle")]
            note = "; ".join(pr.get("notes") or []) + (f" [{pr['mode']} trace]" if pr.get("mode") == "cpu" else "")
            lines.append(f"| {b} | {pr['step_us'] / 1e3:.1f} | " + " | ".join(cells)
                         + f" | {_pct(pr.get('moe_kernel_share'))} | {note} |")
        gaps = {b: pr["idle_gaps"] for b, pr in profiled.items() if pr.get("idle_gaps")}
        if gaps:
            lines += ["", f"GPU idle in stretches of at least {IDLE_GAP_US:g} us, by the host op at each "
                      "(trace_summary.py --gaps; a sync means the GPU waited for the host to catch up after it), "
                      "ms per profiled step:", ""]
            for b, g in gaps.items():
                top = ", ".join(f"{k} {v / 1e3:.1f}" for k, v in g["by_host_op_us"].items())
                lines.append(f"- {b}: {g['idle_us'] / 1e3:.1f} ({top})")
    soak = report.get("soak")
    if soak:
        lines += ["", f"## Soak: {soak['iters']} iterations, {'PASS' if soak['ok'] else 'FAIL'}", "",
                  f"Tolerances: {soak['tolerances']['why']}.", "", "| check | result | detail |", "|---|---|---|"]
        for name, c in soak["checks"].items():
            lines.append(f"| {name} | {'ok' if c['ok'] else 'FAIL'} | {(c.get('detail') or '').replace('|', '/')} |")
        lines += _window_table(soak, ref)
    if png_name:
        lines += ["", f"![loss and throughput]({png_name})"]
    elif report.get("png_error"):
        lines += ["", f"No plot: {report['png_error']}"]
    lines += ["", "Logs: " + ", ".join(f"`{r['log']}`" for r in backends.values() if r.get("log")), ""]
    path.write_text("\n".join(lines))


def _loss_window_pairs(soak: dict, ref: str | None) -> list[tuple[str, str, list]]:
    """(run, the run it is compared with, window gaps) of the soak's loss comparison: each backend
    against the reference, then each noise control against its own backend."""
    pairs = [(b, ref, pb["loss_window_gaps"]) for b, pb in soak["backends"].items() if pb.get("loss_window_gaps")]
    pairs += [(c["control"], c["of"], c["window_gaps"]) for c in soak.get("noise_controls", [])]
    return pairs


def _window_table(soak: dict, ref: str | None) -> list[str]:
    """The soak's loss window means: the first pair's base's, and each pair's relative gap."""
    pairs = _loss_window_pairs(soak, ref)
    if not pairs:
        return []
    base = pairs[0][1]
    cols = [run if of == base else f"{run} vs {of}" for run, of, _ in pairs]
    lines = ["", f"Loss: {base}'s window means and the relative gaps from them (the noise controls' from their own "
             "backend):", "", f"| iterations | {base} | " + " | ".join(cols) + " |",
             "|---|---:|" + "---:|" * len(cols)]
    for row in pairs[0][2]:
        cells = []
        for _, _, gaps in pairs:
            g = next((g for g in gaps if g["window"] == row["window"]), None)
            cells.append("–" if g is None else f"{100 * g['rel_gap']:.1f} %")
        lines.append(f"| {row['window'][0] + 1}-{row['window'][1]} | {row['ref_mean']:.4g} | " + " | ".join(cells)
                     + " |")
    return lines


def _soak_window_means(report: dict) -> dict:
    """run -> [(window end, mean loss)] of the soak's loss windows (reference and noise control too)."""
    out = {}
    for run, of, gaps in _loss_window_pairs(report.get("soak") or {"backends": {}}, report.get("reference_backend")):
        out.setdefault(of, [(g["window"][1], g["ref_mean"]) for g in gaps])
        out[run] = [(g["window"][1], g["mean"]) for g in gaps]
    return out


def write_png(report: dict, path: Path) -> str | None:
    """Returns an error string when the plot cannot be made."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except Exception as e:  # pragma: no cover - depends on the environment
        return f"matplotlib is not available ({e}); pip install matplotlib"
    fig, (ax1, ax2, ax3, ax4) = plt.subplots(1, 4, figsize=(21, 4.8))
    names = list(report["backends"])
    for b in names:
        curve = report["backends"][b].get("loss_curve") or []
        if curve:
            ax1.plot([c[0] for c in curve], [c[1] for c in curve], marker="." if len(curve) < 60 else None,
                     linewidth=1, label=b)
    ax1.set_xlabel("iteration")
    ax1.set_ylabel("lm loss")
    ax1.set_title("loss")
    if all(c[1] > 0 for b in names for c in report["backends"][b].get("loss_curve") or []):
        ax1.set_yscale("log")  # a long run's late loss is orders of magnitude below its start
    if any(report["backends"][b].get("loss_curve") for b in names):
        ax1.legend()
    vals = [report["backends"][b].get("tokens_per_s_per_gpu") or 0.0 for b in names]
    bars = ax2.bar(names, vals, color=["C%d" % i for i in range(len(names))])
    for bar, b in zip(bars, names):
        r = report["backends"][b]
        label = f"{bar.get_height():,.0f}" if r["status"] == "ok" else r["status"]
        if r.get("speedup_vs_alltoall") and b != "alltoall":
            label += f"\n{r['speedup_vs_alltoall']:.2f}x"
        ax2.annotate(label, (bar.get_x() + bar.get_width() / 2, bar.get_height()), ha="center", va="bottom")
    if any(vals):
        ax2.set_ylim(top=1.2 * max(vals))  # room for the labels below the title
    ax2.set_ylabel("tokens / s / GPU")
    ax2.set_title(f"throughput (median step, first {report.get('warmup', '?')} iters excluded)")
    mem = [(report["backends"][b].get("peak_memory_mib") or 0.0) if report["backends"][b]["status"] == "ok" else 0.0
           for b in names]
    ax3.bar(names, mem, color=["C%d" % i for i in range(len(names))])
    srcs = {report["backends"][b].get("peak_memory_source") for b in names if report["backends"][b]["status"] == "ok"}
    ax3.set_ylabel("MiB")
    ax3.set_title("peak memory per rank" + (f"\n({'; '.join(sorted(s for s in srcs if s))})" if srcs else ""),
                  fontsize=9)
    for tick in (*ax2.get_xticklabels(), *ax3.get_xticklabels()):
        tick.set_rotation(20)
    prof = {b: report["backends"][b]["profile"] for b in names
            if (report["backends"][b].get("profile") or {}).get("breakdown_us")}
    soak_means = _soak_window_means(report)
    if prof:
        bottoms = [0.0] * len(prof)
        keys = ("moe", "attention", "dense", "optimizer", "other", "idle")
        for n, k in enumerate(keys):
            v = [p["breakdown_us"][k] / 1e3 for p in prof.values()]
            ax4.bar(list(prof), v, bottom=bottoms, label=k, color=f"C{n}")
            bottoms = [a + b for a, b in zip(bottoms, v)]
        for x, (b, p) in enumerate(prof.items()):
            ax4.annotate(f"MoE {_pct(p.get('moe_share'))}", (x, bottoms[x]), ha="center", va="bottom", fontsize=8)
        ax4.set_ylabel("ms per profiled step")
        ax4.legend(fontsize=8)
        ax4.set_title("step breakdown (torch profiler)")
    elif soak_means:
        for b, pts in soak_means.items():
            ax4.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", linewidth=1, label=b)
        ax4.set_yscale("log")
        ax4.set_xlabel("iteration (window end)")
        ax4.set_ylabel("mean lm loss")
        ax4.legend(fontsize=8)
        ax4.set_title(f"soak: {report['soak']['tolerances']['loss_window_iterations']}-iteration loss means")
    else:
        ax4.text(0.5, 0.5, "not profiled\n(--profile-iters S:E)", ha="center", va="center")
        ax4.set_axis_off()
    fig.suptitle(f"{report.get('config_name', '')}: {report.get('world_size', '?')} ranks"
                 + (f", {report['device']}" if report.get("device") else ""))
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return None


def finish(results: dict, meta: dict, out: Path, soak: dict | None = None) -> dict:
    report = build_report(results, meta)
    if soak is not None:
        report["soak"] = soak_checks(report["backends"], soak["fields"], soak["iters"], soak["digest_every"])
    png = out / "compare.png"
    err = write_png(report, png)
    if err:
        report["png_error"] = err
        print(f"[compare] no PNG: {err}", file=sys.stderr)
    (out / "compare.json").write_text(json.dumps(report, indent=2, default=str) + "\n")
    write_markdown(report, out / "compare.md", None if err else png.name)
    return report


def result_from_log(log_path: Path, rc, wall, warmup, world_size=None, exclude=None, fields_out=None, name=None):
    log = logparse.parse_log_file(log_path)
    summary = logparse.summarize(log, warmup=warmup, world_size=world_size)
    if exclude:
        summary = retime(log, summary, warmup, exclude)
    fields = log_fields(log)
    # the GPU telemetry sampled beside a local run (start_gpu_sampler), if there is one
    fields[GPU_SAMPLES] = read_gpu_samples(Path(log_path).with_suffix(".gpu.csv"))
    if fields_out is not None and name is not None:
        fields_out[name] = fields
    status, reason = classify(rc, log, summary)
    r = {"status": status, "reason": reason, "exit_code": rc, "wall_s": wall, "log": str(log_path), **summary}
    its = sorted(fields.get(LOG_TIME, {}))
    if len(its) > warmup + 1:  # medians over the iterations after the warm-up: (last warm-up one, last]
        r["gpu_telemetry"] = window_gpu(fields, (its[max(warmup - 1, 0)], its[-1]))
    return r


def skipped_result(reason: str) -> dict:
    return {"status": "skipped", "reason": reason, "exit_code": None, "wall_s": 0.0, "log": None,
            "loss_curve": [], "iterations_logged": 0}


def transformer_engine_probe(python: str) -> bool | None:
    """Can the ranks' interpreter import transformer_engine? (find_spec only; None if unknown)"""
    code = "import importlib.util,sys; sys.exit(0 if importlib.util.find_spec('transformer_engine') else 3)"
    try:
        rc = subprocess.run([python, "-c", code], capture_output=True, timeout=60).returncode
    except (OSError, subprocess.SubprocessError):
        return None
    return {0: True, 3: False}.get(rc)


def not_runnable_reason(name: str, cfg_args: list[str], python: str) -> str:
    if name == "alltoall_fp8":
        impl = cfg_args[cfg_args.index("--transformer-impl") + 1] if "--transformer-impl" in cfg_args[:-1] else None
        impl_text = ("this recipe uses --transformer-impl local, which has no FP8 path" if impl == "local"
                     else f"this recipe's --transformer-impl is {impl or 'unset'}")
        te = transformer_engine_probe(python)
        probe = {True: "; transformer_engine is importable by the ranks' interpreter, but the comparison is "
                       "defined without it",
                 False: "; transformer_engine is not importable by the ranks' interpreter",
                 None: ""}[te]
        return MEGATRON_FP8_REASON.format(impl=impl_text) + probe
    return f"{name} is not runnable"


def parse_args(argv):
    argv = list(argv)
    extra: list[str] = []
    if "--" in argv:
        i = argv.index("--")
        argv, extra = argv[:i], argv[i + 1:]
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    p.add_argument("--config", help="Megatron argument file, e.g. configs/deepseek-v3-tiny.args")
    p.add_argument("--backends", default=None,
                   help=f"comma-separated, of {','.join(KNOWN_BACKENDS)} (default mok,alltoall,hybridep; "
                        "with --soak mok,alltoall)")
    p.add_argument("--nproc-per-node", type=int, default=None,
                   help="ranks per node (default: GPUs on this node, or 2 on CPU)")
    p.add_argument("--nnodes", type=int, default=None, help="nodes (srun launcher only; default: the allocation)")
    p.add_argument("--iters", type=int, default=None,
                   help="--train-iters for every backend (default 20; with --soak 500)")
    p.add_argument("--warmup", type=int, default=3, help="logged iterations excluded from timing (default %(default)s)")
    p.add_argument("--launcher", choices=("auto", "local", "srun"), default="auto",
                   help="auto: srun inside a multi-node Slurm allocation, else local")
    p.add_argument("--timeout", type=float, default=3600, help="seconds per backend (default %(default)s)")
    p.add_argument("--python", default=None, help="interpreter for the ranks (default: $MOK_PYTHON, .venv, this one)")
    p.add_argument("--entry", default=os.environ.get("MOK_ENTRY", "megatron_mok.pretrain_gpt"),
                   help="module run with -m on every rank (default %(default)s)")
    p.add_argument("--no-rank-stats", action="store_true", help="do not wrap ranks in rank_stats.py")
    p.add_argument("--out", default=None, help="output folder (default bench/results/compare-<config>-<time>)")
    p.add_argument("--rerun", default="", help="comma-separated backends to train a second time (bitwise check)")
    p.add_argument("--param-digest-every", type=int, default=None,
                   help="ranks print a digest of their parameters' bits every N iterations, through Megatron's "
                        "--mok-param-digest-every N (0: off; default 0, with --soak 100)")
    p.add_argument("--profile-iters", default=None, metavar="S:E",
                   help="torch-profile rank 0 over Megatron steps S..E-1 (--profile-step-start S --profile-step-end E) "
                        "and report the step breakdown and the MoE share")
    p.add_argument("--no-strict", action="store_true",
                   help="on GPUs, do not pass --mok-strict to the mok variants (a fallback to the reference only warns)")
    p.add_argument("--soak", action="store_true",
                   help="soak checks (loss agreement, NaN/inf, bitwise reruns, throughput drift); adds Megatron's "
                        "--deterministic-mode")
    p.add_argument("--noise-control", default=None, metavar="B1,B2",
                   help="with --soak: train each of these backends once more with the router in the other float "
                        "precision (reported as B_control); the worst gap of a control from its backend is the "
                        "loss tolerance's noise (default: every backend of --backends; none: no control)")
    p.add_argument("--from-logs", nargs="+", metavar="BACKEND=LOG",
                   help="no training: report these existing logs")
    p.add_argument("--traces", nargs="+", metavar="BACKEND=TRACE", default=[],
                   help="with --from-logs: torch profiler traces to break down")
    a = p.parse_args(argv)
    a.extra = extra
    if a.backends is None:
        a.backends = "mok,alltoall" if a.soak else "mok,alltoall,hybridep"
    if a.iters is None:
        a.iters = 500 if a.soak else 20
    if a.param_digest_every is None:
        a.param_digest_every = 100 if a.soak else 0
    if a.noise_control is None and a.soak:
        a.noise_control = a.backends
    return a, p


def _pairs(items, parser, what):
    pairs = []
    for item in items:
        if "=" not in item:
            parser.error(f"{what} wants BACKEND=PATH, got {item!r}")
        b, lp = item.split("=", 1)
        if not Path(lp).is_file():
            parser.error(f"file not found: {lp}")
        pairs.append((b, Path(lp)))
    return pairs


def _names(text: str) -> list[str]:
    """The names of a comma-separated backend list (--backends, --rerun, --noise-control)."""
    return [b.strip() for b in text.split(",") if b.strip()]


def main(argv=None) -> int:
    a, parser = parse_args(sys.argv[1:] if argv is None else argv)
    command = " ".join([Path(sys.executable).name, *sys.argv])
    stamp = _dt.datetime.now().strftime("%Y%m%d-%H%M%S")
    if a.param_digest_every < 0:
        parser.error("--param-digest-every must be >= 0")
    profile = None
    if a.profile_iters:
        try:
            profile = parse_profile_iters(a.profile_iters)
        except ValueError as err:
            parser.error(str(err))

    if a.from_logs:
        pairs = _pairs(a.from_logs, parser, "--from-logs")
        traces = dict(_pairs(a.traces, parser, "--traces"))
        out = Path(a.out or REPO / "bench" / "results" / f"compare-logs-{stamp}")
        out.mkdir(parents=True, exist_ok=True)
        exclude = profile_excluded_iterations(*profile) if profile else set()
        fields = {}
        results = {b: result_from_log(lp, 0, None, a.warmup, exclude=exclude, fields_out=fields, name=b)
                   for b, lp in pairs}
        for b, tp in traces.items():
            if b in results:
                results[b]["profile"] = analyze_trace(tp)
        any_r = next(iter(results.values()))
        iters = any_r.get("train_iters")
        meta = {"config_name": a.config and Path(a.config).stem or "from-logs", "world_size": any_r.get("world_size"),
                "iters": iters, "warmup": a.warmup, "created": stamp,
                "logs": {b: str(lp) for b, lp in pairs}, "extra_args": a.extra,
                "command": command}
        if exclude:
            meta["profile_excluded"] = sorted(exclude)
        soak = {"fields": fields, "iters": iters or a.iters, "digest_every": a.param_digest_every} if a.soak else None
        report = finish(results, meta, out, soak)
        print(f"[compare] wrote {out}/compare.json, compare.md"
              + (", compare.png" if (out / "compare.png").exists() else ""), file=sys.stderr)
        print(str(out))
        if soak is not None:
            _print_soak(report["soak"])
            return 0 if report["soak"]["ok"] else 1
        return 0

    if not a.config:
        parser.error("--config is required (or --from-logs)")
    cfg = Path(a.config)
    if not cfg.is_file() and (REPO / a.config).is_file():
        cfg = REPO / a.config
    if not cfg.is_file():
        parser.error(f"config file not found: {a.config}")
    backends = _names(a.backends)
    bad = [b for b in backends if b not in KNOWN_BACKENDS]
    if bad or not backends:
        parser.error(f"unknown backend(s) {bad}: expected a comma-separated subset of {','.join(KNOWN_BACKENDS)}")
    reruns = _names(a.rerun)
    if any(b not in backends for b in reruns):
        parser.error(f"--rerun {a.rerun}: every rerun backend must also be in --backends ({a.backends})")
    controls = [b for b in _names(a.noise_control or "") if b != "none"]
    if controls and (not a.soak or any(b not in backends for b in controls)):
        parser.error(f"--noise-control {a.noise_control}: needs --soak and backends of --backends ({a.backends})")
    python = a.python or default_python()
    if not shutil.which(python) and not Path(python).exists():
        parser.error(f"python interpreter not found: {python}")

    gpus = count_gpus()
    in_slurm = bool(os.environ.get("SLURM_JOB_ID"))
    alloc_nodes = int(os.environ.get("SLURM_JOB_NUM_NODES", "1") or 1)
    launcher = a.launcher
    if launcher == "auto":
        launcher = "srun" if in_slurm and shutil.which("srun") and (a.nnodes or alloc_nodes) > 1 else "local"
    if launcher == "srun" and not in_slurm:
        parser.error("--launcher srun needs a Slurm allocation (salloc/sbatch)")
    nnodes = 1 if launcher == "local" else (a.nnodes or alloc_nodes)
    if launcher == "srun" and nnodes > alloc_nodes:
        parser.error(f"--nnodes {nnodes} but the allocation has {alloc_nodes} node(s)")
    nproc = a.nproc_per_node or (gpus if gpus > 0 else 2)
    if gpus > 0 and nproc > gpus:
        parser.error(f"--nproc-per-node {nproc} but only {gpus} GPU(s) are visible")
    world = nnodes * nproc

    out = Path(a.out or REPO / "bench" / "results" / f"compare-{cfg.stem}-{stamp}")
    log_dir = out / "logs"
    log_dir.mkdir(parents=True, exist_ok=True)
    cfg_args = read_config_args(cfg)
    meta = {
        "config": str(cfg), "config_name": cfg.stem, "backends_requested": backends, "launcher": launcher,
        "nodes": nnodes, "ranks_per_node": nproc, "world_size": world, "device": "gpu" if gpus else "cpu",
        "iters": a.iters, "warmup": a.warmup, "extra_args": a.extra, "created": stamp, "python": python,
        "entry": a.entry, "host": socket.gethostname(),
        "command": command,
    }
    common = ["--train-iters", str(a.iters), "--log-interval", "1"]
    # Megatron asserts warmup < decay iterations: a run shorter than the recipe's warmup warms up
    # over half of its iterations instead (the learning rate schedule only, not the measurement)
    warmup_iters = _flag_value(cfg_args + a.extra, "--lr-warmup-iters")
    if warmup_iters is not None and int(warmup_iters) >= a.iters:
        common += ["--lr-warmup-iters", str(a.iters // 2)]
    if a.param_digest_every:
        common += ["--mok-param-digest-every", str(a.param_digest_every)]
    if a.soak and "--deterministic-mode" not in cfg_args + a.extra:
        common.append("--deterministic-mode")
    exclude = set()
    if profile:
        exclude = profile_excluded_iterations(*profile)
        meta["profile_iters"] = list(profile)
        meta["profile_excluded"] = sorted(exclude)
    meta["reruns"] = reruns
    meta["param_digest_every"] = a.param_digest_every
    meta["soak"] = a.soak
    results, fields = {}, {}
    runs = [(b, b) for b in backends] + [(f"{b}_rerun", b) for b in reruns]
    runs += [(b + NOISE_CONTROL_SUFFIX, b) for b in controls]
    meta["noise_controls"] = controls
    for name, b in runs:
        spec = backend_args(b, gpu=gpus > 0, strict=not a.no_strict)
        moe_backend, variant_args = spec if spec is not None else (BACKEND_VARIANTS[b][0], None)
        if variant_args is None:
            reason = not_runnable_reason(b, cfg_args, python)
            results[name] = skipped_result(reason)
            print(f"[compare] {name}: skipped: {reason}", file=sys.stderr, flush=True)
            continue
        tail = [*cfg_args, "--moe-backend", moe_backend, *variant_args, *common]
        if profile:
            tail += profile_megatron_args(*profile, out / "profile" / name / "tb")
        tail += a.extra
        if name.endswith(NOISE_CONTROL_SUFFIX):
            tail += noise_control_args(cfg_args + a.extra)
        print(f"[compare] {name}: {world} ranks ({launcher}) ...", file=sys.stderr, flush=True)
        if launcher == "local":
            sampler = start_gpu_sampler(log_dir / f"{name}.gpu.csv") if gpus > 0 else None
            try:
                rc, wall, lp = run_local(tail, nproc, python, a.entry, log_dir, name, a.timeout, {},
                                         not a.no_rank_stats)
            finally:
                stop_gpu_sampler(sampler)
        else:
            rc, wall, lp = run_srun(tail, nnodes, nproc, python, a.entry, log_dir, name, a.timeout, {},
                                    not a.no_rank_stats)
        r = result_from_log(lp, rc, round(wall, 1), a.warmup, world_size=world, exclude=exclude,
                            fields_out=fields, name=name)
        r["log"] = str(lp.relative_to(out))
        r["moe_backend"], r["variant_args"] = moe_backend, variant_args
        if profile and r["status"] == "ok":
            trace = out / "profile" / name / "torch_profile" / "rank-0.json.gz"
            r["profile"] = analyze_trace(trace) if trace.is_file() else {"trace": str(trace), "error": "no trace written"}
        results[name] = r
        msg = f"{r['status']}"
        if r["status"] == "ok":
            msg += f": {r['tokens_per_s_per_gpu']:.1f} tokens/s/GPU, median step {r['median_step_ms']:.1f} ms"
            prof = r.get("profile") or {}
            if prof.get("moe_share") is not None:
                msg += f", MoE share {100 * prof['moe_share']:.1f} % of the profiled step"
            elif prof.get("error"):
                msg += f", profile: {prof['error']}"
        else:
            msg += f": {r['reason']}"
        print(f"[compare] {name}: {msg} ({wall:.0f} s)", file=sys.stderr, flush=True)
    ran = sorted({r["train_iters"] for r in results.values() if r.get("train_iters")})
    if ran:  # the extra Megatron args may override --iters
        meta["iters"] = ran[0] if len(ran) == 1 else ran
    soak = None
    if a.soak:
        soak = {"fields": fields, "iters": ran[0] if len(ran) == 1 else a.iters, "digest_every": a.param_digest_every}
    report = finish(results, meta, out, soak)
    print(f"[compare] wrote {out}/compare.json, compare.md, compare.png", file=sys.stderr)
    for b, r in report["backends"].items():
        if r.get("speedup_vs_alltoall") and b != "alltoall":
            print(f"[compare] {b}: {r['speedup_vs_alltoall']:.2f}x alltoall tokens/s/GPU", file=sys.stderr)
    print(str(out))
    differ = [b for b, r in report["backends"].items()
              if r.get("bitwise_vs_first_run") and not rerun_identical(r["bitwise_vs_first_run"])]
    if differ:
        print(f"[compare] NOT bitwise reproducible: {', '.join(differ)}", file=sys.stderr)
    soak_failed = False
    if soak is not None:
        _print_soak(report["soak"])
        soak_failed = not report["soak"]["ok"]
    return 1 if differ or soak_failed or any(r["status"] == "failed" for r in results.values()) else 0


def _print_soak(soak: dict) -> None:
    print(f"[compare] soak: {'PASS' if soak['ok'] else 'FAIL'}", file=sys.stderr)
    for name, c in soak["checks"].items():
        print(f"[compare]   {'ok  ' if c['ok'] else 'FAIL'} {name}: {c.get('detail')}", file=sys.stderr)


if __name__ == "__main__":
    sys.exit(main())
