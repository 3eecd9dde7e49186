#!/usr/bin/env python3
"""Train one config with several MoE backends, one after another, and compare them.

    # one node, torchrun-style local launch (N processes; GPUs when present, else gloo on CPU)
    python scripts/compare_backends.py --config configs/deepseek-v3-proxy.args \
        --backends mok,alltoall,hybridep --nproc-per-node 2 --iters 50 --warmup 5

    # inside a Slurm allocation (salloc / sbatch scripts/slurm/compare.sbatch): one srun per backend
    python scripts/compare_backends.py --launcher srun --config configs/deepseek-v3.args ...

    # 200 steps, mok twice (bitwise run-to-run check through parameter digests) and alltoall
    python scripts/compare_backends.py --config configs/deepseek-v3-proxy.args --backends mok,alltoall \
        --rerun mok --param-digest-every 50 --iters 200

    # only re-report existing logs (e.g. of scripts/slurm/train.sbatch runs)
    python scripts/compare_backends.py --from-logs mok=runs/a/logs/train.0.log alltoall=runs/b/logs/train.0.log

Anything after ``--`` is passed to Megatron (after the config, so it overrides it).

Writes into --out (default bench/results/compare-<config>-<time>):
  compare.json   per backend: status (ok | failed | skipped), reason, tokens/s/GPU, median step time,
                 loss curve, peak memory, ...
  compare.png    loss curves and tokens/s/GPU bars (needs matplotlib; skipped with a note if absent)
  compare.md     a markdown summary table
  logs/<backend>.log   every rank's output

--rerun B trains backend B a second time (reported as ``B_rerun``) and checks that the two runs
are bitwise identical: the same logged loss curve and, with --param-digest-every N, the same
per-rank digest of every parameter's bits every N iterations (megatron_mok.adapter.pretrain).

tokens/s/GPU = global batch size * seq length / median step time / world size, where the step time is
Megatron's "elapsed time per iteration" of the iterations after the first --warmup ones. Peak memory is
torch.cuda.max_memory_allocated of the worst rank on GPU, the max RSS of the worst rank on CPU (both
from scripts/slurm/rank_stats.py). A backend that cannot run at all (no iteration logged and an error
such as "No module named 'deep_ep'") is reported as ``skipped`` with that error as the reason.
Exit code: 0 when no backend failed (skipped is fine), 1 otherwise, 2 on bad arguments.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
from megatron_mok import logparse  # noqa: E402  (pure python, no torch import)

KNOWN_BACKENDS = ("mok", "alltoall", "allgather", "hybridep", "deepep")

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
            _kill_all([p])
            try:
                p.wait(timeout=30)
            except subprocess.TimeoutExpired:
                _kill_all([p], signal.SIGKILL)
                p.wait()
            rc = 124
    if rc == 124:
        with open(combined, "a") as out:
            out.write(f"\nTimeoutError: {backend} did not finish within {timeout:.0f} s\n")
    return rc, time.time() - t0, combined


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
    return {**meta, "reference_backend": ref, "backends": results}


def _fmt(v, spec):
    return "–" if v is None else format(v, spec)


def write_markdown(report: dict, path: Path, png_name: str | None) -> None:
    ref = report.get("reference_backend")
    lines = [
        f"# Backend comparison: {report.get('config_name', '?')}",
        "",
        f"{report.get('world_size', '?')} ranks"
        + (f" ({report['nodes']} node(s) x {report['ranks_per_node']}, {report.get('device', '?')})"
           if report.get("ranks_per_node") else "")
        + f", {report.get('iters', '?')} iterations, first {report.get('warmup', '?')} excluded from timing; "
        f"created {report.get('created', '?')}.",
        "",
        "| backend | status | tokens/s/GPU | median step (ms) | final loss | "
        + (f"max abs loss diff vs {ref} | " if ref else "")
        + "peak memory (MiB) | note |",
        "|---|---|---:|---:|---:|" + ("---:|" if ref else "") + "---:|---|",
    ]
    for b, r in report["backends"].items():
        diff = r.get(f"loss_max_abs_diff_vs_{ref}") if ref else None
        note = (r.get("reason") or "").replace("|", "\\|")
        if len(note) > 160:
            note = note[:157] + "..."
        row = [
            b, r["status"], _fmt(r.get("tokens_per_s_per_gpu"), ",.1f"), _fmt(r.get("median_step_ms"), ".1f"),
            _fmt(r.get("final_loss"), ".4f"),
        ]
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
    srcs = {r.get("peak_memory_source") for r in report["backends"].values() if r.get("peak_memory_source")}
    lines += ["", "Peak memory: " + ("; ".join(sorted(srcs)) if srcs else "not measured") + "."]
    if png_name:
        lines += ["", f"![loss and throughput]({png_name})"]
    elif report.get("png_error"):
        lines += ["", f"No plot: {report['png_error']}"]
    lines += ["", "Logs: " + ", ".join(f"`{r['log']}`" for r in report["backends"].values() if r.get("log")), ""]
    path.write_text("\n".join(lines))


def write_png(report: dict, path: Path) -> str | None:
    """Returns an error string when the plot cannot be made."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except Exception as e:  # pragma: no cover - depends on the environment
        return f"matplotlib is not available ({e}); pip install matplotlib"
    fig, (ax1, ax2, ax3) = plt.subplots(1, 3, figsize=(16, 4.5))
    names = list(report["backends"])
    for b in names:
        curve = report["backends"][b].get("loss_curve") or []
        if curve:
            ax1.plot([c[0] for c in curve], [c[1] for c in curve], marker=".", label=b)
    ax1.set_xlabel("iteration")
    ax1.set_ylabel("lm loss")
    ax1.set_title("loss")
    if any(report["backends"][b].get("loss_curve") for b in names):
        ax1.legend()
    vals = [report["backends"][b].get("tokens_per_s_per_gpu") or 0.0 for b in names]
    bars = ax2.bar(names, vals, color=["C%d" % i for i in range(len(names))])
    for bar, b in zip(bars, names):
        st = report["backends"][b]["status"]
        label = f"{bar.get_height():,.0f}" if st == "ok" else st
        ax2.annotate(label, (bar.get_x() + bar.get_width() / 2, bar.get_height()), ha="center", va="bottom")
    ax2.set_ylabel("tokens / s / GPU")
    ax2.set_title(f"throughput (median step, first {report.get('warmup', '?')} iters excluded)")
    mem = [(report["backends"][b].get("peak_memory_mib") or 0.0) if report["backends"][b]["status"] == "ok" else 0.0
           for b in names]
    ax3.bar(names, mem, color=["C%d" % i for i in range(len(names))])
    srcs = {report["backends"][b].get("peak_memory_source") for b in names if report["backends"][b]["status"] == "ok"}
    ax3.set_ylabel("MiB")
    ax3.set_title("peak memory per rank" + (f"\n({'; '.join(sorted(s for s in srcs if s))})" if srcs else ""),
                  fontsize=9)
    fig.suptitle(f"{report.get('config_name', '')}: {report.get('world_size', '?')} ranks"
                 + (f", {report['device']}" if report.get("device") else ""))
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return None


def finish(results: dict, meta: dict, out: Path) -> dict:
    report = build_report(results, meta)
    png = out / "compare.png"
    err = write_png(report, png)
    if err:
        report["png_error"] = err
        print(f"[compare] no PNG: {err}", file=sys.stderr)
    (out / "compare.json").write_text(json.dumps(report, indent=2, default=str) + "\n")
    write_markdown(report, out / "compare.md", None if err else png.name)
    return report


def result_from_log(log_path: Path, rc, wall, warmup, world_size=None):
    log = logparse.parse_log_file(log_path)
    summary = logparse.summarize(log, warmup=warmup, world_size=world_size)
    status, reason = classify(rc, log, summary)
    return {"status": status, "reason": reason, "exit_code": rc, "wall_s": wall, "log": str(log_path), **summary}


def parse_args(argv):
    argv = list(argv)
    extra: list[str] = []
    if "--" in argv:
        i = argv.index("--")
        argv, extra = argv[:i], argv[i + 1:]
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", help="Megatron argument file, e.g. configs/deepseek-v3-tiny.args")
    p.add_argument("--backends", default="mok,alltoall,hybridep", help="comma-separated (default %(default)s)")
    p.add_argument("--nproc-per-node", type=int, default=None,
                   help="ranks per node (default: GPUs on this node, or 2 on CPU)")
    p.add_argument("--nnodes", type=int, default=None, help="nodes (srun launcher only; default: the allocation)")
    p.add_argument("--iters", type=int, default=20, help="--train-iters for every backend (default %(default)s)")
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
    p.add_argument("--param-digest-every", type=int, default=0,
                   help="ranks print a digest of their parameters' bits every N iterations (0: off)")
    p.add_argument("--from-logs", nargs="+", metavar="BACKEND=LOG",
                   help="no training: report these existing logs")
    a = p.parse_args(argv)
    a.extra = extra
    return a, p


def main(argv=None) -> int:
    a, parser = parse_args(sys.argv[1:] if argv is None else argv)
    stamp = _dt.datetime.now().strftime("%Y%m%d-%H%M%S")

    if a.from_logs:
        pairs = []
        for item in a.from_logs:
            if "=" not in item:
                parser.error(f"--from-logs wants BACKEND=LOG, got {item!r}")
            b, lp = item.split("=", 1)
            if not Path(lp).is_file():
                parser.error(f"log not found: {lp}")
            pairs.append((b, Path(lp)))
        out = Path(a.out or REPO / "bench" / "results" / f"compare-logs-{stamp}")
        out.mkdir(parents=True, exist_ok=True)
        results = {b: result_from_log(lp, 0, None, a.warmup) for b, lp in pairs}
        any_r = next(iter(results.values()))
        meta = {"config_name": a.config and Path(a.config).stem or "from-logs", "world_size": any_r.get("world_size"),
                "iters": any_r.get("train_iters"), "warmup": a.warmup, "created": stamp,
                "logs": {b: str(lp) for b, lp in pairs}}
        finish(results, meta, out)
        print(f"[compare] wrote {out}/compare.json, compare.md"
              + (", compare.png" if (out / "compare.png").exists() else ""), file=sys.stderr)
        print(str(out))
        return 0

    if not a.config:
        parser.error("--config is required (or --from-logs)")
    cfg = Path(a.config)
    if not cfg.is_file() and (REPO / a.config).is_file():
        cfg = REPO / a.config
    if not cfg.is_file():
        parser.error(f"config file not found: {a.config}")
    backends = [b.strip() for b in a.backends.split(",") if b.strip()]
    bad = [b for b in backends if b not in KNOWN_BACKENDS]
    if bad or not backends:
        parser.error(f"unknown backend(s) {bad}: expected a comma-separated subset of {','.join(KNOWN_BACKENDS)}")
    reruns = [b.strip() for b in a.rerun.split(",") if b.strip()]
    if any(b not in backends for b in reruns):
        parser.error(f"--rerun {a.rerun}: every rerun backend must also be in --backends ({a.backends})")
    if a.param_digest_every < 0:
        parser.error("--param-digest-every must be >= 0")
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
        "command": " ".join([Path(sys.executable).name, *sys.argv]),
    }
    env_extra = {"MOK_PARAM_DIGEST_EVERY": str(a.param_digest_every)} if a.param_digest_every else {}
    meta["reruns"] = reruns
    meta["param_digest_every"] = a.param_digest_every
    results = {}
    for name, b in [(b, b) for b in backends] + [(f"{b}_rerun", b) for b in reruns]:
        tail = [*cfg_args, "--moe-backend", b, "--train-iters", str(a.iters), "--log-interval", "1", *a.extra]
        print(f"[compare] {name}: {world} ranks ({launcher}) ...", file=sys.stderr, flush=True)
        if launcher == "local":
            rc, wall, lp = run_local(tail, nproc, python, a.entry, log_dir, name, a.timeout, env_extra,
                                     not a.no_rank_stats)
        else:
            rc, wall, lp = run_srun(tail, nnodes, nproc, python, a.entry, log_dir, name, a.timeout, env_extra,
                                    not a.no_rank_stats)
        r = result_from_log(lp, rc, round(wall, 1), a.warmup, world_size=world)
        r["log"] = str(lp.relative_to(out))
        results[name] = r
        msg = f"{r['status']}"
        if r["status"] == "ok":
            msg += f": {r['tokens_per_s_per_gpu']:.1f} tokens/s/GPU, median step {r['median_step_ms']:.1f} ms"
        else:
            msg += f": {r['reason']}"
        print(f"[compare] {name}: {msg} ({wall:.0f} s)", file=sys.stderr, flush=True)
    ran = sorted({r["train_iters"] for r in results.values() if r.get("train_iters")})
    if ran:  # the extra Megatron args may override --iters
        meta["iters"] = ran[0] if len(ran) == 1 else ran
    report = finish(results, meta, out)
    print(f"[compare] wrote {out}/compare.json, compare.md, compare.png", file=sys.stderr)
    print(str(out))
    differ = [b for b, r in report["backends"].items()
              if r.get("bitwise_vs_first_run") and not rerun_identical(r["bitwise_vs_first_run"])]
    if differ:
        print(f"[compare] NOT bitwise reproducible: {', '.join(differ)}", file=sys.stderr)
    return 1 if differ or any(r["status"] == "failed" for r in results.values()) else 0


if __name__ == "__main__":
    sys.exit(main())
