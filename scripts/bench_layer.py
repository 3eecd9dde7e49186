#!/usr/bin/env python3
"""One MoE layer, forward or backward: mok against PyTorch baselines, with the roofline of each row.

Launch with torchrun, one process per GPU; EP = world size (1 works without torchrun):

    torchrun --nproc-per-node=1 scripts/bench_layer.py --shape deepseek-v3 --tokens 4096,8192 \\
        --backends mok,mok@precision=fp8,alltoall,alltoall_fp8 --routing random,skewed --pass fwd

Backends (same inputs, same bf16 weights, one shared expert of size Is = I):
  mok          megatron_mok.build_schedule + megatron_mok.forward (or .backward) with MoKConfig()
  mok@F=V+F=V  the same with MoKConfig fields set, e.g. mok@precision=fp8, mok@forward_kernel=staged,
               mok@save_gate_up=False (the backward recomputes the gate/up GEMM),
               mok@precision=fp8+fp8_wgrad=False. Every variant is a MoKConfig; nothing is selected
               through the environment. The bench sets strict=True (a call that would fall back to the
               pure-PyTorch reference raises) unless the name sets strict=False.
  alltoall     Megatron-Core MoEAlltoAllTokenDispatcher (NCCL all-to-all) + torch._grouped_mm experts (bf16)
  alltoall_fp8 the same dispatcher, experts on torch._scaled_grouped_mm (e4m3, see FP8GroupedExperts):
               weights quantized once per weight version (outside the timed step, as mok's are),
               activations per row, every expert's rows padded to FP8_GROUP_ALIGN. Runs only where
               that op exists and the GPU is sm90 or newer; elsewhere its rows say "not_runnable".
  symm_a2a     torch.ops.symm_mem.all_to_all_vdev_2d dispatch, all_to_all_vdev_2d_offset combine,
               torch._grouped_mm experts (bf16). That all-to-all takes at most 16 splits per rank, so
               the splits are groups of local experts; each row carries its expert id and the receiver
               sorts its rows by expert on the device. Needs the NVSHMEM symmetric-memory backend,
               selected before the first symmetric allocation, so it runs in a child process per rank.

--pass bwd times the backward alone (the forward runs once, outside the timing): mok =
megatron_mok.backward on the forward's context; the baselines = torch.autograd.grad through their
forward (retain_graph, so every iteration replays the same backward; gradients are returned, not
accumulated). Backward FLOPs = 2x the forward FLOPs (a recomputing variant's extra gate/up GEMM is
not counted). Memory (--pass bwd): saved_bytes_per_token = what the forward keeps for the backward
(mok: its context's tensors; baselines: the growth of allocated memory across the forward, minus its
output) and bwd_peak_bytes_per_token = the allocation peak of one backward above what was allocated
before it, both divided by T. mok rows also store workspace_bytes_per_gpu: its symmetric buffers, a
per-GPU constant shared by every layer of the shape (not activation memory; docs/DESIGN.md 7.2).

--main-grads (with --pass bwd): the weight gradients go into fp32 main grads, as Megatron's
gradient-accumulation fusion wants them: mok passes them as ``main_grads`` (its weight-gradient GEMMs
add into them), the baselines add their bf16 weight gradients into them after the backward (as
Megatron's DDP hook does). The rows' pass is "bwd+main_grad"; its roofline counts the main grads
read and written in fp32 (8 bytes a weight) instead of bf16 gradients written (2).

Timing: CUDA events around every iteration on every rank, warm-up first; the reported time is the
median over iterations of the per-iteration maximum over ranks. Forward FLOPs per rank =
6 T k H I + 6 T H Is (tflops in the JSON). Each row also stores its roofline (``pass_cost`` and
``roofline``): max(FLOPs / R_mm, HBM bytes / HBM rate, NVLink bytes / NVLink rate), with R_mm the
dense matmul rate of the row's precision measured in the same run (bf16: an 8192^3 torch.matmul;
fp8: an 8192^3 e4m3 torch._scaled_mm), and roofline_fraction = roofline_ms / ms. Each mok row
stores its speedup over the fastest baseline of its precision and over the fastest baseline of any
precision (``annotate_speedups``).
--timeline (mok variants whose forward runs the persistent megakernel, --pass fwd) runs one more
step with the megakernel's per-task stamps on and stores megatron_mok.tools.timeline.summarize of
every rank. --kernels runs 5 more iterations of every backend under the torch profiler and stores
rank 0's GPU time per iteration by kernel name and category (scripts/trace_summary.py's categories),
and, for a kernel launched more than once an iteration, each launch's time in launch order.
Correctness gate first: mok against an fp32 reference of the layer computed here
(``reference_moe``) at T=256 with the real H, I, E, k; every backend's output against mok's
(relative error) and every mok variant's against the first variant of the same precision (bits).
Results: bench/results/<gpu>_ep<N>_<pass>.json, e.g. h200_ep1_fwd.json (--out to choose); the file
stores the command that produced it, and --merge adds rows to an existing file (each row keeps its
own command). scripts/plot_bench.py builds the README table from these files.
Memory: every (shape, T, backend) row starts from a clean slate (the previous row's closures,
outputs, fp8 weight copies and autograd graphs dropped, the allocator's cache emptied, a token
count's inputs built only after the previous one's are freed; the arithmetic of what each row needs
is above ``resident_weight_bytes``), and each row stores ``memory_at_start``. Unless the caller set
PYTORCH_ALLOC_CONF or PYTORCH_CUDA_ALLOC_CONF, the script sets
PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True (the JSON's ``env`` and ``allocator`` record it).
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import gc
import json
import os
import shlex
import socket
import statistics
import subprocess
import sys
import time
import traceback

NO_MULTICAST_ENV = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}
os.environ.update(NO_MULTICAST_ENV)

# The caching allocator's settings: torch reads PYTORCH_ALLOC_CONF, else PYTORCH_CUDA_ALLOC_CONF, once,
# when it initializes CUDA. Expandable segments let a freed 14 GiB block be reused by tensors of
# another size (the DeepSeek-V3 weights and their gradients are 7 and 14 GiB blocks) instead of
# leaving split segments that empty_cache cannot return: the fp8 backward rows at EP=1 failed with
# 10-14 GiB "reserved but unallocated" without it. Set only when the caller has set neither variable.
ALLOC_CONF_VARS = ("PYTORCH_ALLOC_CONF", "PYTORCH_CUDA_ALLOC_CONF")
BENCH_ALLOC_CONF = {"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"}


def allocator_env(environ) -> dict:
    """The allocator variables this script adds to ``environ`` ({} when the caller set one)."""
    return {} if any(environ.get(k) for k in ALLOC_CONF_VARS) else dict(BENCH_ALLOC_CONF)


ALLOC_CONF_SET_BY_BENCH: dict = {}
if __name__ == "__main__":  # not when a test imports this file
    ALLOC_CONF_SET_BY_BENCH = allocator_env(os.environ)
    os.environ.update(ALLOC_CONF_SET_BY_BENCH)

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.nn.functional as F  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from megatron_mok.tools.shapes import MOE_SHAPES, PROXY_SHAPES  # noqa: E402

# model or proxy: (experts, hidden H, expert I, top-k); one shared expert with Is = I (docs: DESIGN.md).
# 'all' is the models.
SHAPES = {name: (s.num_experts, s.hidden, s.ffn, s.topk) for name, s in {**MOE_SHAPES, **PROXY_SHAPES}.items()}
BASELINES = {"alltoall": "bf16", "alltoall_fp8": "fp8", "symm_a2a": "bf16"}  # baseline -> its precision
BACKENDS = ("mok", *BASELINES)
ROUTINGS = ("random", "skewed")

# Roofline rates that are not measured in the run (docs: /work/shared/reference/hardware.md has the
# measurements these come from). The HBM figure is the device-to-device copy rate (read + write)
# measured on H200, 4.18 TB/s, rounded as issue #35 states it; the NVLink figure is the measured
# one-direction peer copy (copy engine) between two H200 GPUs (NV18, datasheet 450 GB/s a direction).
HBM_BYTES_PER_S = 4.2e12
HBM_SOURCE = "H200 device-to-device copy (read + write), measured 4.18 TB/s, taken as 4.2 TB/s"
NVLINK_BYTES_PER_S = 390e9
NVLINK_SOURCE = "H200 peer copy (copy engine), one direction, measured 390 GB/s (NV18; datasheet 450 GB/s)"

E4M3_BLOCK = 128  # mok's e4m3 operands: one fp32 scale per 128 values of a token row, per 128x128 weight tile
FP8_GROUP_ALIGN = 16  # alltoall_fp8: rows of every expert padded to this multiple (see FP8GroupedExperts)
E4M3_MAX = 448.0
MIN_AMAX = 1e-4

_T0 = time.time()


def log(msg: str, all_ranks: bool = False) -> None:
    if all_ranks or not dist.is_initialized() or dist.get_rank() == 0:
        who = f"r{dist.get_rank()} " if all_ranks and dist.is_initialized() else ""
        print(f"[{time.time() - _T0:6.1f}s] {who}{msg}", flush=True)


# ---- backend names ----------------------------------------------------------------------------------


def config_overrides(backend: str) -> dict:
    """'mok@fwd_comm_sms=8+minibatch_rows=2048' -> {'fwd_comm_sms': 8, 'minibatch_rows': 2048};
    'mok@save_gate_up=False' -> {'save_gate_up': False} (True/False in any case); 'mok' -> {}."""
    head, _, spec = backend.partition("@")
    if head != "mok" or "%" in backend:
        raise ValueError(f"backend {backend!r}: mok variants are mok@FIELD=VALUE[+FIELD=VALUE...] (MoKConfig "
                         "fields); environment kernel switches (mok%NAME=VALUE) no longer exist")
    out = {}
    for item in filter(None, spec.split("+")):
        key, eq, value = item.partition("=")
        if not key or not eq or not value:
            raise ValueError(f"backend {backend!r}: {item!r} is not FIELD=VALUE")
        if value.lower() in ("true", "false"):
            out[key] = value.lower() == "true"
            continue
        for cast in (int, float, str):  # str: e.g. precision=fp8
            try:
                out[key] = cast(value)
                break
            except ValueError:
                pass
    return out


# Names this script used to take, and what replaced them (a clear error instead of a silent change).
RENAMED = {"mok_staged": "mok@forward_kernel=staged", "mok_recompute": "mok@save_gate_up=False",
           "mok_ab": "mok@FIELD=VALUE (MoKConfig fields)"}


def check_backend(backend: str) -> None:
    """Raise ValueError unless ``backend`` is a baseline, mok, or a valid mok@... MoKConfig variant."""
    if backend in BASELINES:
        return
    if backend in RENAMED:
        raise ValueError(f"backend {backend!r} is now {RENAMED[backend]}")
    if backend != "mok" and not backend.startswith(("mok@", "mok%")):
        raise ValueError(f"unknown backend {backend!r}; choose from {BACKENDS} or mok@FIELD=VALUE[+FIELD=VALUE...]")
    mok_config(config_overrides(backend))


def mok_config(overrides: dict):
    """The MoKConfig of a mok backend: strict (no silent fallback to the reference) unless overridden.
    Unknown fields and bad values raise ValueError (MoKConfigError is one) naming the field."""
    from megatron_mok import MoKConfig

    try:
        return MoKConfig(**{"strict": True, **overrides})
    except TypeError as exc:  # an unknown field
        fields = [f.name for f in dataclasses.fields(MoKConfig)]
        raise ValueError(f"{exc}; MoKConfig fields: {fields}") from None


def backend_precision(backend: str) -> str:
    """The precision a backend's expert GEMMs run in: 'bf16' or 'fp8'."""
    if backend in BASELINES:
        return BASELINES[backend]
    return config_overrides(backend).get("precision", "bf16")


def is_mok(backend: str) -> bool:
    return backend == "mok" or backend.startswith("mok@")


def command_line(argv: list[str], env: dict) -> str:
    """The command that produced a result file: MOK_BENCH_CMD if the launcher set it, else this
    script's arguments behind ``torchrun --nproc-per-node=N`` (under torchrun) or ``python``."""
    if env.get("MOK_BENCH_CMD"):
        return env["MOK_BENCH_CMD"]
    script = os.path.relpath(os.path.abspath(argv[0]), ROOT) if argv else "scripts/bench_layer.py"
    args = shlex.join([script, *argv[1:]])
    if env.get("TORCHELASTIC_RUN_ID") is not None or env.get("LOCAL_WORLD_SIZE") is not None:
        nnodes = env.get("GROUP_WORLD_SIZE")
        lead = f"torchrun --nproc-per-node={env.get('LOCAL_WORLD_SIZE', '1')}"
        if nnodes and nnodes != "1":
            lead += f" --nnodes={nnodes}"
        return f"{lead} {args}"
    return f"python {args}"


# ---- roofline ----------------------------------------------------------------------------------------


def routing_stats(top_all: torch.Tensor, num_experts: int) -> list[dict]:
    """Per rank r of an EP group, from every rank's routing ``top_all`` [ep, T, k] (global expert ids):

    routed_rows: (token, slot) pairs of all ranks routed to r's experts (the rows r's GEMMs run);
    active_experts: r's experts that receive at least one row (their weights must be read);
    rows_out: r's own pairs routed to another rank's experts;
    rows_in: other ranks' pairs routed to r's experts.
    """
    ep = top_all.shape[0]
    nle = num_experts // ep
    dest = top_all.reshape(ep, -1).long() // nle  # [ep (source), T k] -> destination rank
    per_expert = torch.bincount(top_all.reshape(-1).long(), minlength=num_experts).view(ep, nle)
    out = []
    for r in range(ep):
        to_r = (dest == r).sum(dim=1)  # [ep]: pairs of each source rank routed to r
        out.append(dict(routed_rows=int(to_r.sum()), active_experts=int((per_expert[r] > 0).sum()),
                        rows_out=int((dest[r] != r).sum()), rows_in=int(to_r.sum() - to_r[r])))
    return out


def pass_cost(*, hidden: int, ffn: int, shared_ffn: int, topk: int, tokens: int, pass_: str, precision: str,
              routed_rows: int, active_experts: int, rows_out: int = 0, rows_in: int = 0) -> dict:
    """FLOPs and the minimum HBM and NVLink bytes of one layer pass on one rank.

    FLOPs: 2 * 3 * H * I per routed row (gate/up 2I x H and down H x I GEMMs) plus 2 * 3 * H * Is per
    token for the shared expert; the backward twice that (dgrad and wgrad of every GEMM).

    HBM bytes, the least any implementation must move:
      * weights read once: the routed experts that receive a row (3 H I values each) and the shared
        expert (3 H Is). bf16: 2 bytes a value. fp8: the routed experts in e4m3, 1 byte a value plus
        one fp32 scale per 128 x 128 tile (mok's stored form; the backward's dgrads read the same
        amount in their transposed copies); the shared expert in e4m3 in the forward and bf16 in the
        backward (mok's shared backward runs bf16).
      * backward: the weight gradients written once, bf16 (2 bytes a value), for the same weights;
        bwd+main_grad: added into fp32 main grads instead (read and written, 8 bytes a value).
      * activations: forward x read (bf16), the router weights read (fp32, T k), out written (bf16);
        backward grad_out and x read (bf16), the router weights read (fp32), dx written (bf16), the
        router-weight gradient written (fp32, T k).
      Not counted: the routed rows, gate/up outputs and activations between the GEMMs (a fused pass
      could keep them on chip), the saved forward context, routing metadata.

    NVLink bytes (0 at EP=1): routed rows whose expert lives on another rank, in the dtype they travel,
    both exchanges of the pass. Forward: the dispatch of token rows (bf16: 2 H bytes; fp8: e4m3 rows
    with one fp32 scale per 128 values, H + 4 H / 128 bytes) and the combine of the expert outputs
    (bf16). Backward: the pull of grad_out rows (bf16, or e4m3 + scales with fp8 dgrads) and the push
    of the dx rows (bf16). A rank receives the rows_in dispatch rows and its rows_out combine rows,
    and sends the opposite; links are full duplex, so the bytes of the busier direction count.
    """
    if pass_ not in ("fwd", "bwd", "bwd+main_grad") or precision not in ("bf16", "fp8"):
        raise ValueError(f"pass_cost: pass {pass_!r}, precision {precision!r}")
    H, I, Is, k, T = hidden, ffn, shared_ffn, topk, tokens
    mult = 1 if pass_ == "fwd" else 2
    flops = mult * (6 * routed_rows * H * I + 6 * T * H * Is)
    e4m3 = 1 + 4 / (E4M3_BLOCK * E4M3_BLOCK)
    routed_w = active_experts * 3 * H * I
    shared_w = 3 * H * Is
    routed_wb = e4m3 if precision == "fp8" else 2
    shared_wb = e4m3 if precision == "fp8" and pass_ == "fwd" else 2
    hbm = {"weights_read": routed_w * routed_wb + shared_w * shared_wb}
    if pass_ == "fwd":
        hbm["activations"] = 2 * T * H + 4 * T * k + 2 * T * H
    elif pass_ == "bwd":
        hbm["weight_grads_written"] = 2 * (routed_w + shared_w)
    else:  # fp32 main grads read and written
        hbm["weight_grads_into_main_grad"] = 8 * (routed_w + shared_w)
    if pass_ != "fwd":
        hbm["activations"] = 2 * T * H * 2 + 4 * T * k + 2 * T * H + 4 * T * k
    row_e4m3 = H + 4 * H / E4M3_BLOCK
    first = row_e4m3 if precision == "fp8" else 2 * H  # dispatch (fwd) / grad_out pull (bwd) row
    second = 2 * H  # combine (fwd) / dx push (bwd) row: bf16
    ingress = rows_in * first + rows_out * second
    egress = rows_out * first + rows_in * second
    return dict(flops=flops, hbm_bytes=sum(hbm.values()), hbm_bytes_detail=hbm,
                nvlink_bytes=max(ingress, egress), nvlink_bytes_in=ingress, nvlink_bytes_out=egress)


def roofline(cost: dict, matmul_tflops: float, hbm_bytes_per_s: float = HBM_BYTES_PER_S,
             nvlink_bytes_per_s: float = NVLINK_BYTES_PER_S) -> dict:
    """max(FLOPs / R_mm, HBM bytes / HBM rate, NVLink bytes / NVLink rate) in ms, which term bounds
    it, and every input."""
    terms = {"compute": cost["flops"] / (matmul_tflops * 1e12) * 1e3,
             "hbm": cost["hbm_bytes"] / hbm_bytes_per_s * 1e3,
             "nvlink": cost["nvlink_bytes"] / nvlink_bytes_per_s * 1e3}
    bound = max(terms, key=terms.get)
    return dict(cost, matmul_tflops=matmul_tflops, hbm_bytes_per_s=hbm_bytes_per_s,
                nvlink_bytes_per_s=nvlink_bytes_per_s, compute_ms=terms["compute"], hbm_ms=terms["hbm"],
                nvlink_ms=terms["nvlink"], roofline_ms=terms[bound], bound=bound)


def layer_roofline(shape: str, tokens: int, pass_: str, precision: str, stats: list[dict], rates: dict) -> dict:
    """The roofline of one row: the slowest rank's (``routing_stats`` per rank); rates: the run's
    ``matmul_tflops`` per precision and the HBM and NVLink rates. Raises KeyError when the run has no
    matmul rate of that precision."""
    E, H, I, k = SHAPES[shape]
    r_mm = rates["matmul_tflops"][precision]
    if not r_mm:
        raise KeyError(f"no {precision} matmul rate was measured in this run")
    best = None
    for rank, s in enumerate(stats):
        cost = pass_cost(hidden=H, ffn=I, shared_ffn=I, topk=k, tokens=tokens, pass_=pass_, precision=precision, **s)
        r = roofline(cost, r_mm, rates["hbm_bytes_per_s"], rates["nvlink_bytes_per_s"])
        if best is None or r["roofline_ms"] > best["roofline_ms"]:
            best = dict(r, rank=rank)
    return best


def annotate_rows(rows: list[dict], rates: dict, stats_for) -> None:
    """Add roofline inputs, roofline_ms and roofline_fraction (roofline_ms / ms) to every ok row;
    stats_for(shape, tokens, routing) -> routing_stats of that case."""
    for r in rows:
        if r.get("status") != "ok":
            continue
        prec = r.get("precision") or backend_precision(r["backend"])
        try:
            roof = layer_roofline(r["shape"], r["tokens"], r.get("pass_", "fwd"), prec,
                                  stats_for(r["shape"], r["tokens"], r.get("routing", "random")), rates)
        except KeyError as exc:
            r["roofline_error"] = str(exc)
            continue
        r["roofline"] = roof
        r["roofline_ms"] = roof["roofline_ms"]
        r["roofline_fraction"] = roof["roofline_ms"] / r["ms"]
        if rates.get("hbm_copy_bytes_per_s"):  # the same roofline at this GPU's measured copy rate
            here = roofline(roof, roof["matmul_tflops"], rates["hbm_copy_bytes_per_s"], roof["nvlink_bytes_per_s"])
            r["roofline_this_gpu_ms"] = here["roofline_ms"]
            r["roofline_this_gpu_bound"] = here["bound"]
            r["roofline_this_gpu_fraction"] = here["roofline_ms"] / r["ms"]


def annotate_speedups(rows: list[dict]) -> None:
    """For every ok mok row: speedup (baseline ms / mok ms) over the fastest ok baseline of the same
    precision and over the fastest ok baseline of any precision, in the same (shape, tokens,
    routing, pass, ep) case. Fields absent where no such baseline ran."""
    cases: dict = {}
    for r in rows:
        key = (r["shape"], r["tokens"], r.get("routing", "random"), r.get("pass_", "fwd"), r.get("ep", 1))
        cases.setdefault(key, []).append(r)
    for group in cases.values():
        base = [r for r in group if r["backend"] in BASELINES and r.get("status") == "ok"]
        for r in group:
            if not is_mok(r["backend"]) or r.get("status") != "ok":
                continue
            prec = r.get("precision") or backend_precision(r["backend"])
            same = [b for b in base if BASELINES[b["backend"]] == prec]
            for label, pool in (("same_precision", same), ("any_precision", base)):
                if pool:
                    fastest = min(pool, key=lambda b: b["ms"])
                    r[f"fastest_baseline_{label}"] = fastest["backend"]
                    r[f"speedup_vs_{label}"] = fastest["ms"] / r["ms"]


# ---- inputs -------------------------------------------------------------------------------------------


def _draw_routing(shape: str, T: int, routing: str, seed: int, dev, rank: int):
    """(generator, x, top) of one rank: the same draws in make_case and make_routing."""
    E, H, I, k = SHAPES[shape]
    g = torch.Generator(device=dev).manual_seed(seed * 1000 + rank)
    x = torch.randn(T, H, device=dev, generator=g).to(torch.bfloat16)
    if routing == "random":
        top = torch.rand(T, E, device=dev, generator=g).argsort(dim=1)[:, :k]
    elif routing == "skewed":  # Zipf(1.2) expert popularity, same permutation on every rank
        gp = torch.Generator(device=dev).manual_seed(seed)
        w = 1.0 / torch.arange(1, E + 1, device=dev, dtype=torch.float64) ** 1.2
        w = w[torch.randperm(E, device=dev, generator=gp)]
        top = torch.multinomial(w.expand(T, E), k, replacement=False, generator=g)
    else:
        raise ValueError(f"routing must be one of {ROUTINGS}, got {routing!r}")
    return g, x, top.contiguous()


def make_routing(shape: str, T: int, routing: str, seed: int, dev, rank: int = 0) -> torch.Tensor:
    """The routing [T, k] that make_case draws for ``rank`` (without the weights)."""
    return _draw_routing(shape, T, routing, seed, dev, rank)[2]


def make_case(shape: str, T: int, routing: str, seed: int, dev):
    E, H, I, k = SHAPES[shape]
    ep = dist.get_world_size() if dist.is_initialized() else 1
    rank = dist.get_rank() if dist.is_initialized() else 0
    nle = E // ep
    g, x, top = _draw_routing(shape, T, routing, seed, dev, rank)
    probs = torch.softmax(torch.randn(T, k, device=dev, generator=g), dim=1).float()
    bf = torch.bfloat16

    def w_(*s, fan):
        # (randn / fan**0.5) in bf16, drawn a slice of the first dim at a time, so that no fp32 draw
        # holds more than 2 GiB beside the bf16 weights (DeepSeek-V4-Pro's fc1 at EP=1 is 63 GiB in
        # fp32, which with its 31.5 GiB bf16 copy does not fit an 80 GB GPU)
        w = torch.empty(*s, dtype=bf, device=dev)
        per = max(1, (1 << 29) // w[0].numel())
        for i in range(0, s[0], per):
            w[i:i + per] = torch.randn(min(per, s[0] - i), *s[1:], device=dev, generator=g).div_(fan**0.5)
        return w

    fc1, fc2 = w_(nle, 2 * I, H, fan=H), w_(nle, H, I, fan=I)
    sfc1, sfc2 = w_(2 * I, H, fan=H), w_(H, I, fan=I)
    return dict(E=E, H=H, I=I, k=k, Is=I, T=T, nle=nle, x=x, top=top, probs=probs,
                fc1=fc1, fc2=fc2, sfc1=sfc1, sfc2=sfc2)


def shared_expert(c):
    h = c["x"] @ c["sfc1"].t()
    return (F.silu(h[:, : c["Is"]]) * h[:, c["Is"]:]) @ c["sfc2"].t()


def reference_moe(x, top, probs, fc1, fc2, expert_start: int = 0):
    """The routed experts in fp32, for the correctness gate: out[t] = sum over the slots s whose expert
    e = top[t, s] - expert_start is local (0 <= e < len(fc1)) of probs[t, s] * fc2[e] (silu(g) * u),
    [g; u] = fc1[e] x[t]; the other slots' experts live on another rank and add nothing here.
    Weights are widened one expert at a time."""
    T, H = x.shape
    I = fc2.shape[2]
    xf = x.float()
    out = torch.zeros(T, H, dtype=torch.float32, device=x.device)
    local = top.long() - expert_start
    for e in torch.unique(local[(local >= 0) & (local < fc1.shape[0])]).tolist():
        tok, slot = torch.nonzero(local == e, as_tuple=True)
        h = xf[tok] @ fc1[e].float().t()
        y = (F.silu(h[:, :I]) * h[:, I:]) @ fc2[e].float().t()
        out.index_add_(0, tok, y * probs[tok, slot].float().unsqueeze(1))
    return out


def reference_shared(x, shared_fc1, shared_fc2):
    """The shared expert in fp32: shared_fc2 (silu(g) * u), [g; u] = shared_fc1 x."""
    Is = shared_fc2.shape[1]
    h = x.float() @ shared_fc1.float().t()
    return (F.silu(h[:, :Is]) * h[:, Is:]) @ shared_fc2.float().t()


# ---- the FP8 baseline's experts ------------------------------------------------------------------------


def quantize_rowwise(t: torch.Tensor, chunk: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """e4m3 copy of t [..., K] with one fp32 scale per row (over its last dim): s = max(amax, 1e-4) / 448,
    q = e4m3(t * 448 / max(amax, 1e-4)) (round to nearest even, saturating). The result is contiguous
    whatever t's strides (t may be a transposed view). chunk > 0 (t 3-D): that many slices along dim 0
    at a time, written into the preallocated outputs, so that the fp32 temporaries and, for a
    transposed view, the contiguous copy are one chunk's, never the whole stack's (the same values)."""
    if chunk and t.dim() == 3:
        q = torch.empty(t.shape, dtype=torch.float8_e4m3fn, device=t.device)
        s = torch.empty(t.shape[:-1], dtype=torch.float32, device=t.device)
        for i in range(0, t.shape[0], chunk):
            qi, si = quantize_rowwise(t[i:i + chunk])
            q[i:i + chunk].copy_(qi)
            s[i:i + chunk].copy_(si)
            del qi, si
        return q, s
    t = t.contiguous()  # a chunk of a transposed view: this chunk's copy only (contiguous t: itself)
    amax = t.abs().amax(dim=-1).float().clamp(min=MIN_AMAX)
    q = (t.float() * (E4M3_MAX / amax).unsqueeze(-1)).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)
    return q, (amax / E4M3_MAX).contiguous()


@dataclasses.dataclass
class FP8RowwiseWeights:
    """The routed weights for torch._scaled_grouped_mm's row-wise scaling: each stored [G, N, K] with
    one scale per (expert, output row N) over the contraction K (the op's scale_b: [G, N]). The
    transposed copies (None in the forward-only benchmark) serve the backward's dgrads."""

    fc1: tuple  # (e4m3 [G, 2I, H], scales [G, 2I])
    fc2: tuple  # (e4m3 [G, H, I], scales [G, H])
    fc1_t: tuple | None = None  # fc1^T: (e4m3 [G, H, 2I], scales [G, H]): dx = dh @ fc1[e]
    fc2_t: tuple | None = None  # fc2^T: (e4m3 [G, I, H], scales [G, I]): da = dy @ fc2[e]


def quantize_expert_weights_rowwise(fc1, fc2, transposed: bool, chunk: int = 8) -> FP8RowwiseWeights:
    """The e4m3 weights of the alltoall_fp8 baseline, ``chunk`` experts at a time: what stays
    resident is the e4m3 copies and their scales (DeepSeek-V3 at EP=1: 10.5 GiB, 21 GiB with the
    transposes); the transposes are made a chunk at a time (8 experts of fc1: 448 MiB in bf16) from
    views, never as a whole-stack bf16 copy (14 GiB for fc1)."""
    with torch.no_grad():
        w = FP8RowwiseWeights(quantize_rowwise(fc1, chunk), quantize_rowwise(fc2, chunk))
        if transposed:
            w.fc1_t = quantize_rowwise(fc1.transpose(1, 2), chunk)
            w.fc2_t = quantize_rowwise(fc2.transpose(1, 2), chunk)
        return w


def pad_plan(counts: torch.Tensor, rows: int, align: int) -> tuple[torch.Tensor, torch.Tensor, int]:
    """Rows sorted by group (counts [G] rows each, ``rows`` in all) -> (dst [rows] int64: each row's
    index in the padded layout, offs [G] int32: the padded groups' ends, capacity: a host-side bound on
    the padded rows, rows + G (align - 1) rounded up to align). Every group starts at a multiple of
    align; no host sync."""
    dev = counts.device
    G = counts.numel()
    counts = counts.to(torch.int64)
    padded = (counts + align - 1) // align * align
    ends_p = torch.cumsum(padded, 0)
    starts_p = ends_p - padded
    starts = torch.cumsum(counts, 0) - counts
    gid = torch.repeat_interleave(torch.arange(G, device=dev), counts, output_size=rows)
    dst = starts_p[gid] + torch.arange(rows, device=dev) - starts[gid]
    capacity = -(-(rows + G * (align - 1)) // align) * align
    return dst, ends_p.to(torch.int32), capacity


@dataclasses.dataclass
class GroupedOps:
    """The two GEMMs FP8GroupedExperts calls (swappable, so that a CPU test can check the layouts)."""

    scaled_grouped_mm: object = None  # (a e4m3 [M, K], b e4m3 [G, K, N] column-major, sa [M], sb [G, N], offs) -> bf16
    grouped_mm: object = None  # (a [N, M], b [M, K], offs) -> [G, N, K]: the wgrads, bf16

    @staticmethod
    def torch_ops() -> "GroupedOps":
        return GroupedOps(
            lambda a, b, sa, sb, offs: torch._scaled_grouped_mm(a, b, sa, sb, offs=offs, out_dtype=torch.bfloat16),
            lambda a, b, offs: torch._grouped_mm(a, b, offs=offs))


class FP8GroupedExperts(torch.autograd.Function):
    """The routed experts of the alltoall_fp8 baseline on torch._scaled_grouped_mm.

    Scaling (what torch._scaled_grouped_mm takes with fp32 scales: row-wise only, no 128-block
    scales): activations one scale per row (``quantize_rowwise``, quantized in every call), weights
    one scale per (expert, output row) over the contraction (quantized once per weight version:
    ``quantize_expert_weights_rowwise``). Outputs bf16, fp32 accumulation inside the op.

    Forward: x [M, H] bf16 (rows sorted by expert, ``counts`` [G] each) and probs [M] (Megatron
    applies them in the activation, as the bf16 baseline does): rows scattered into a layout where
    every expert starts at a multiple of FP8_GROUP_ALIGN rows (padding rows zero: ``pad_plan``), h =
    x_q @ fc1_q^T, a = probs * silu(g) * u (bf16), y = a_q @ fc2_q^T, back to the unpadded rows.
    The padding keeps every group's start 16-byte aligned along the token axis, which the wgrad's 2D x 2D
    grouped GEMM (groups along K) needs; the e4m3 GEMMs take it as well.

    Backward (torch._scaled_grouped_mm has no autograd): the dgrads in e4m3 on the same op, dy and dh
    quantized per row, against the weights' transposed copies quantized per (expert, row) of the
    transpose; the weight gradients in bf16 on torch._grouped_mm (its 2D x 2D form, dW = dy^T a and
    dh^T x per expert): the fp32-scale op only scales per row of each operand, which cannot hold
    scales that vary along the token axis of a wgrad. The router-weight gradient in fp32.
    """

    @staticmethod
    def forward(ctx, x, probs, fc1, fc2, w8: FP8RowwiseWeights, counts, ops: GroupedOps):
        M, H = x.shape
        I = fc2.shape[2]
        dst, offs, cap = pad_plan(counts, M, FP8_GROUP_ALIGN)
        x_pad = x.new_zeros(cap, H).index_copy_(0, dst, x)
        p_pad = torch.zeros(cap, dtype=torch.float32, device=x.device).index_copy_(0, dst, probs.float())
        xq, xs = quantize_rowwise(x_pad)
        h = ops.scaled_grouped_mm(xq, w8.fc1[0].transpose(1, 2), xs, w8.fc1[1], offs)
        hf = h.float()
        a = (F.silu(hf[:, :I]) * hf[:, I:] * p_pad.unsqueeze(1)).to(torch.bfloat16)
        aq, as_ = quantize_rowwise(a)
        y = ops.scaled_grouped_mm(aq, w8.fc2[0].transpose(1, 2), as_, w8.fc2[1], offs)
        ctx.save_for_backward(x_pad, h, a, p_pad, dst, offs)
        ctx.w8, ctx.ops, ctx.probs_dtype = w8, ops, probs.dtype
        return y.index_select(0, dst)

    @staticmethod
    def backward(ctx, grad_y):
        x_pad, h, a, p_pad, dst, offs = ctx.saved_tensors
        w8, ops = ctx.w8, ctx.ops
        if w8.fc1_t is None or w8.fc2_t is None:
            raise RuntimeError("FP8GroupedExperts: the backward needs the weights' transposed copies")
        I = h.shape[1] // 2
        dy = torch.zeros(x_pad.shape[0], grad_y.shape[1], dtype=torch.bfloat16, device=grad_y.device)
        dy.index_copy_(0, dst, grad_y.to(torch.bfloat16))
        dyq, dys = quantize_rowwise(dy)
        da = ops.scaled_grouped_mm(dyq, w8.fc2_t[0].transpose(1, 2), dys, w8.fc2_t[1], offs).float()
        g, u = h[:, :I].float(), h[:, I:].float()
        sig = torch.sigmoid(g)
        silu = g * sig
        dprobs = (da * silu * u).sum(dim=1)
        dact = da * p_pad.unsqueeze(1)
        dh = torch.cat([dact * u * sig * (1 + g * (1 - sig)), dact * silu], dim=1).to(torch.bfloat16)
        dhq, dhs = quantize_rowwise(dh)
        dx = ops.scaled_grouped_mm(dhq, w8.fc1_t[0].transpose(1, 2), dhs, w8.fc1_t[1], offs)
        dfc2 = ops.grouped_mm(dy.t(), a, offs)
        dfc1 = ops.grouped_mm(dh.t(), x_pad, offs)
        return (dx.index_select(0, dst), dprobs.index_select(0, dst).to(ctx.probs_dtype), dfc1, dfc2,
                None, None, None)


def fp8_grouped_mm_unsupported(dev) -> str | None:
    """Why alltoall_fp8 cannot run here (None: it can)."""
    if not hasattr(torch, "_scaled_grouped_mm"):
        return f"torch {torch.__version__} has no torch._scaled_grouped_mm"
    if dev.type != "cuda":
        return "torch._scaled_grouped_mm runs on CUDA only"
    cap = torch.cuda.get_device_capability(dev)
    if cap < (9, 0):
        return f"torch._scaled_grouped_mm needs sm90 or newer, this GPU is sm{cap[0]}{cap[1]}"
    return None


# ---- backends: each returns a step() -> out [T, H] (--pass bwd: dx [T, H]) --------------------------------


PASS = "fwd"  # set by main(): "fwd" or "bwd"
MAIN_GRADS = False  # set by main(): --main-grads
SAVED_BYTES: dict = {}  # backend -> bytes its forward keeps for the backward (--pass bwd)
MOK_WORKSPACES: dict = {}  # mok backend -> its workspace (its symmetric buffers are reported per row)
WEIGHT_QUANT_MS: dict = {}  # fp8 backend -> median ms of quantizing its weights (outside the timed step)


def row_pass() -> str:
    """The rows' pass: PASS, or "bwd+main_grad" with --main-grads."""
    return "bwd+main_grad" if MAIN_GRADS else PASS


def _main_grads(c, dev) -> tuple | None:
    """--main-grads: fp32 zeros of the weights' shapes (fc1, fc2, shared fc1, shared fc2), else None."""
    if not MAIN_GRADS:
        return None
    return tuple(torch.zeros(c[n].shape, dtype=torch.float32, device=dev) for n in ("fc1", "fc2", "sfc1", "sfc2"))


def _autograd_bwd_step(c, dev, out, inputs):
    """A baseline's timed backward: autograd from ``out`` to ``inputs`` (x, probs, fc1, fc2, sfc1,
    sfc2) under a fixed grad_out; with --main-grads the weight gradients are then added into fp32
    main grads (Megatron's DDP hook: main_grad.add_). Returns dx."""
    grad = _grad_out(c, dev)
    mains = _main_grads(c, dev)

    def bwd_step():
        grads = torch.autograd.grad(out, inputs, grad_outputs=grad, retain_graph=True)
        if mains is not None:
            for m, gw in zip(mains, grads[2:]):
                m.add_(gw)
        return grads[0]

    return bwd_step


def _grad_out(c, dev):
    g = torch.Generator(device=dev).manual_seed(4321 + (dist.get_rank() if dist.is_initialized() else 0))
    return torch.randn(c["T"], c["H"], device=dev, generator=g).to(torch.bfloat16)


def _mok_kernels_missing() -> str | None:
    """Why mok would not run its CUDA kernels here (None: it would). Reads megatron_mok.ops, an
    internal module (the extension's loader); strict=True (mok_config) is the public guard."""
    if os.environ.get("MOK_FORCE_REFERENCE") == "1":
        return "MOK_FORCE_REFERENCE=1 forces the pure-PyTorch reference; unset it to benchmark the kernels"
    try:
        from megatron_mok import ops
    except ImportError as exc:
        return f"megatron_mok.ops: {exc}"
    if hasattr(ops, "is_available") and not ops.is_available():
        return f"megatron_mok._C not available: {ops.load_error() if hasattr(ops, 'load_error') else '?'}"
    return None


def _nbytes(ctx) -> int:
    """Bytes of the tensors a forward context holds (its nbytes() where it has one)."""
    if hasattr(ctx, "nbytes"):
        return int(ctx.nbytes())
    items = dataclasses.astuple(ctx) if dataclasses.is_dataclass(ctx) else tuple(vars(ctx).values())
    return sum(t.numel() * t.element_size() for t in items if isinstance(t, torch.Tensor))


def backend_mok(c, dev, cfg, name="mok"):
    """mok through the public API (megatron_mok.build_schedule / forward / backward)."""
    import megatron_mok
    from megatron_mok import functional

    missing = _mok_kernels_missing()
    if missing:
        raise RuntimeError(missing)
    ws = megatron_mok.get_workspace(None, dev, c["T"], c["H"], c["k"], c["E"], cfg)
    MOK_WORKSPACES[name] = ws
    fp8_weights = None
    if cfg.precision == "fp8":
        # quantized once per weight version, as a training step would (its time is logged apart):
        # the dgrads' transposed copies for the backward, the shared expert's when it runs in e4m3
        transposed = PASS == "bwd" and cfg.dgrad_precision == "fp8"
        shared = (c["sfc1"], c["sfc2"]) if cfg.shared_precision == "fp8" else (None, None)

        def quantize():
            return functional.quantize_expert_weights(c["fc1"], c["fc2"], transposed, *shared)

        # timed before the copy that is kept is made: one e4m3 set alive at a time (21 GiB with the
        # transposes at DeepSeek-V3 EP=1), never two
        ms = time_iters(quantize, 5, 1)
        WEIGHT_QUANT_MS[name] = sorted(ms)[len(ms) // 2]
        fp8_weights = quantize()
        log(f"{name}: quantizing the weights to e4m3 takes {WEIGHT_QUANT_MS[name]:.3f} ms "
            f"(once per weight version, outside the timed step)")
    args = (c["x"], c["probs"], c["fc1"], c["fc2"], c["sfc1"], c["sfc2"])

    if PASS == "bwd":
        sched = megatron_mok.build_schedule(cfg, ws, c["top"])
        _, ctx = megatron_mok.forward(cfg, ws, sched, *args, fp8_weights=fp8_weights)
        SAVED_BYTES[name] = _nbytes(ctx)
        grad = _grad_out(c, dev)
        mains = _main_grads(c, dev)

        def bwd_step():
            return megatron_mok.backward(cfg, ws, sched, ctx, grad, *args, main_grads=mains,
                                         fp8_weights=fp8_weights).dx

        return bwd_step

    def step():
        sched = megatron_mok.build_schedule(cfg, ws, c["top"])
        out, _ = megatron_mok.forward(cfg, ws, sched, *args, fp8_weights=fp8_weights)
        return out

    return step


def busy_time(spans: list[tuple[float, float]]) -> tuple[float, float]:
    """(time covered by at least one of the [start, end) spans, first start to last end)."""
    busy, cur_s, cur_e = 0.0, None, None
    for s, e in sorted(spans):
        if cur_e is None or s > cur_e:
            if cur_e is not None:
                busy += cur_e - cur_s
            cur_s, cur_e = s, e
        else:
            cur_e = max(cur_e, e)
    if cur_e is not None:
        busy += cur_e - cur_s
    return busy, (max(e for _, e in spans) - min(s for s, _ in spans)) if spans else 0.0


def kernel_table(events: list, iters: int, top: int = 12) -> dict:
    """kernel_times' table from (name, start_us, end_us) kernel events of `iters` identical
    iterations. A kernel launched n times an iteration also gets launches_ms: the median time of its
    j-th launch of an iteration, in launch order (two GEMMs of one kernel, e.g. the down and the fc1
    dgrad, stay apart); a count that is not a multiple of iters gets none."""
    sys.path.insert(0, os.path.join(ROOT, "scripts"))
    from trace_summary import categorize

    by_name: dict[str, list] = {}
    spans = []
    for name, start, end in sorted(events, key=lambda e: e[1]):
        by_name.setdefault(name, []).append((end - start) / 1e3)
        spans.append((start, end))
    busy_us, span_us = busy_time(spans)
    per_iter = {n: sum(d) / iters for n, d in by_name.items()}
    by_cat: dict[str, float] = {}
    for name, ms in per_iter.items():
        cat = categorize(name)
        by_cat[cat] = by_cat.get(cat, 0.0) + ms
    rows = []
    for name, ms in sorted(per_iter.items(), key=lambda kv: -kv[1])[:top]:
        row = {"name": name[:120], "ms": round(ms, 4)}
        d = by_name[name]
        if len(d) % iters == 0 and len(d) > iters:
            n = len(d) // iters
            row["launches_ms"] = [round(statistics.median(d[i * n + j] for i in range(iters)), 4) for j in range(n)]
        rows.append(row)
    return {"ms_per_iter": round(sum(per_iter.values()), 4),
            "busy_ms": round(busy_us / 1e3 / iters, 4), "idle_ms": round((span_us - busy_us) / 1e3 / iters, 4),
            "by_category": {k: round(v, 4) for k, v in sorted(by_cat.items(), key=lambda kv: -kv[1])},
            "top": rows}


def kernel_times(step, iters: int = 5, top: int = 12) -> dict:
    """GPU time per iteration by kernel (the `top` largest) and by category, rank 0's view
    (kernel_table). busy_ms: time with at least one kernel running (kernels of two streams overlap:
    busy < the sum); idle_ms: from the first kernel's start to the last one's end, the time with
    none running."""
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    dist.barrier()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(iters):
            step()
        torch.cuda.synchronize()
    events = [(e.name, e.time_range.start, e.time_range.end) for e in prof.events()
              if e.device_type == torch.autograd.DeviceType.CUDA and e.device_time_total > 0]
    return kernel_table(events, iters, top)


def mok_timeline(step) -> list[dict]:
    """One more forward step with the persistent megakernel's per-task stamps on; the summary of
    every rank. Uses megatron_mok.ops.megakernel_timeline (internal: the stamps are a kernel debug
    feature with no public API)."""
    from megatron_mok import ops
    from megatron_mok.tools import timeline

    records = timeline.new_records(1 << 17, torch.device("cuda", torch.cuda.current_device()))
    torch.cuda.synchronize()
    ops.megakernel_timeline(records)
    try:
        step()
        torch.cuda.synchronize()
    finally:
        ops.megakernel_timeline(None)
    summaries = [None] * dist.get_world_size()
    dist.all_gather_object(summaries, timeline.summarize(records))
    return summaries


def _megatron_groups():
    from megatron.core.process_groups_config import ProcessGroupCollection

    world, rank = dist.get_world_size(), dist.get_rank()
    singles = [dist.new_group([r]) for r in range(world)]
    pgs = ProcessGroupCollection()
    pgs.ep = dist.group.WORLD
    pgs.tp_ep = dist.group.WORLD
    pgs.expt_tp = singles[rank]
    return pgs


_PGS = None


def _megatron_dispatcher(c, dev):
    """Megatron-Core's MoEAlltoAllTokenDispatcher for this case, its routing map and dense probs."""
    global _PGS
    from megatron.core.transformer.moe.token_dispatcher import MoEAlltoAllTokenDispatcher
    from megatron.core.transformer.transformer_config import TransformerConfig

    if _PGS is None:
        _PGS = _megatron_groups()
    ep, rank = dist.get_world_size(), dist.get_rank()
    cfg = TransformerConfig(
        num_layers=1, hidden_size=c["H"], num_attention_heads=8, num_moe_experts=c["E"], moe_router_topk=c["k"],
        moe_token_dispatcher_type="alltoall", expert_model_parallel_size=ep, moe_ffn_hidden_size=c["I"],
        ffn_hidden_size=c["I"], bf16=True, params_dtype=torch.bfloat16, add_bias_linear=False,
        moe_permute_fusion=False, gated_linear_unit=True)
    nle = c["nle"]
    disp = MoEAlltoAllTokenDispatcher(nle, list(range(rank * nle, (rank + 1) * nle)), cfg, pg_collection=_PGS)
    routing_map = torch.zeros(c["T"], c["E"], dtype=torch.bool, device=dev).scatter_(1, c["top"], True)
    probs_dense = torch.zeros(c["T"], c["E"], dtype=torch.float32, device=dev).scatter_(1, c["top"], c["probs"])
    return disp, routing_map, probs_dense


def _alltoall_backend(c, dev, name: str, experts):
    """A baseline on Megatron's alltoall dispatcher: experts(c, tokens, tokens_per_expert, probs) ->
    the routed rows' outputs; plus the shared expert. --pass bwd: the forward once (differentiable)
    and a step that runs its backward."""
    disp, routing_map, probs_dense = _megatron_dispatcher(c, dev)
    leaves = None
    if PASS == "bwd":  # new leaves on the same storage (no copies of the weights)
        leaves = {n: c[n].detach().requires_grad_(True) for n in ("x", "fc1", "fc2", "sfc1", "sfc2")}
        probs_dense = probs_dense.requires_grad_(True)
        c = dict(c, **leaves)

    def step():
        tok, pp = disp.dispatch_preprocess(c["x"], routing_map, probs_dense)
        tok, pp = disp.token_dispatch(tok, pp)
        tok, tpe, pp = disp.dispatch_postprocess(tok, pp)
        y = experts(c, tok, tpe, pp)
        y = disp.combine_preprocess(y)
        y = disp.token_combine(y)
        return disp.combine_postprocess(y) + shared_expert(c)

    if PASS == "bwd":
        torch.cuda.synchronize()
        before = torch.cuda.memory_allocated(dev)
        out = step()
        torch.cuda.synchronize()
        SAVED_BYTES[name] = torch.cuda.memory_allocated(dev) - before - out.numel() * out.element_size()
        inputs = [leaves["x"], probs_dense, leaves["fc1"], leaves["fc2"], leaves["sfc1"], leaves["sfc2"]]
        return _autograd_bwd_step(c, dev, out, inputs)
    return step


def backend_alltoall(c, dev):
    I = c["I"]

    def experts(c, tok, tpe, pp):
        offs = torch.cumsum(tpe, 0).to(device=dev, dtype=torch.int32)
        h = torch._grouped_mm(tok, c["fc1"].transpose(1, 2), offs=offs)
        a = (F.silu(h[:, :I]) * h[:, I:] * pp.unsqueeze(1)).to(torch.bfloat16)  # Megatron: probs in the activation
        return torch._grouped_mm(a, c["fc2"].transpose(1, 2), offs=offs)

    return _alltoall_backend(c, dev, "alltoall", experts)


class NotRunnable(RuntimeError):
    """This backend cannot run on this machine (its rows say status 'not_runnable')."""


class DoesNotFit(RuntimeError):
    """The weights this row keeps resident exceed the GPU at this EP (status 'does_not_fit')."""


def backend_alltoall_fp8(c, dev):
    why = fp8_grouped_mm_unsupported(dev)
    if why:
        raise NotRunnable(why)
    ops = GroupedOps.torch_ops()

    def quantize():
        return quantize_expert_weights_rowwise(c["fc1"], c["fc2"], transposed=PASS == "bwd")

    ms = time_iters(quantize, 5, 1)  # before the kept copy exists (one e4m3 set alive at a time)
    WEIGHT_QUANT_MS["alltoall_fp8"] = sorted(ms)[len(ms) // 2]
    w8 = quantize()
    log(f"alltoall_fp8: quantizing the weights (row-wise e4m3) takes {WEIGHT_QUANT_MS['alltoall_fp8']:.3f} ms "
        f"(once per weight version, outside the timed step)")

    def experts(c, tok, tpe, pp):
        return FP8GroupedExperts.apply(tok, pp, c["fc1"], c["fc2"], w8, tpe.to(dev), ops)

    return _alltoall_backend(c, dev, "alltoall_fp8", experts)


class _SymmA2A:
    """Buffers of the symm-mem all-to-all baseline (NVSHMEM backend), sized for the worst case.

    torch's all_to_all_vdev_2d takes at most 16 splits per rank (``NUM_TILES``), fewer than the
    local experts of every shape here, so the splits are groups of ``per_group`` consecutive local
    experts. Each row carries its local expert id in an extra column (bf16 holds integers up to 256
    exactly), and the receiver sorts its rows by expert on the device before the grouped GEMMs.
    """

    ALIGN = 16
    MAX_SPLITS = 16
    ID_COLS = 8  # the id column, padded so that a row stays a multiple of 16 bytes

    def __init__(self, c, dev, backward: bool = False):
        import torch.distributed._symmetric_memory as symm_mem

        ep = dist.get_world_size()
        T, H, k, nle = c["T"], c["H"], c["k"], c["nle"]
        if nle > 256:
            raise ValueError(f"symm_a2a: {nle} local experts; the bf16 id column holds at most 256")
        self.groups = min(nle, self.MAX_SPLITS)
        self.per_group = (nle + self.groups - 1) // self.groups
        self.groups = (nle + self.per_group - 1) // self.per_group
        self.group_name = dist.group.WORLD.group_name
        self.cap_out = ep * T * min(k, nle) + self.groups * self.ALIGN  # every row of every rank, plus alignment
        W = H + self.ID_COLS
        bf = torch.bfloat16
        self.inp = symm_mem.empty(T * k, W, dtype=bf, device=dev)
        self.out = symm_mem.empty(self.cap_out, W, dtype=bf, device=dev)
        self.y = symm_mem.empty(self.cap_out, H, dtype=bf, device=dev)
        self.back = symm_mem.empty(T * k, H, dtype=bf, device=dev)
        n = ep * self.groups
        self.in_splits = symm_mem.empty(n, dtype=torch.int64, device=dev)
        self.out_so = symm_mem.empty(2, n, dtype=torch.int64, device=dev)
        self.back_so = symm_mem.empty(2, n, dtype=torch.int64, device=dev)
        rows = [self.inp, self.out, self.y, self.back]
        tables = [self.in_splits, self.out_so, self.back_so]
        if backward:  # the reverse exchanges of the backward: their own buffers and split tables
            self.g_out = symm_mem.empty(self.cap_out, H, dtype=bf, device=dev)  # d(received rows)
            self.g_in = symm_mem.empty(T * k, H, dtype=bf, device=dev)  # ... sent back to the sources
            self.g_back = symm_mem.empty(T * k, H, dtype=bf, device=dev)  # d(returned rows)
            self.g_y = symm_mem.empty(self.cap_out, H, dtype=bf, device=dev)  # ... sent to the experts
            self.g_y_so = symm_mem.empty(2, n, dtype=torch.int64, device=dev)
            self.g_in_so = symm_mem.empty(2, n, dtype=torch.int64, device=dev)
            rows += [self.g_out, self.g_in, self.g_back, self.g_y]
            tables += [self.g_y_so, self.g_in_so]
        for t in rows + tables:
            symm_mem.rendezvous(t, dist.group.WORLD)
        for t in rows:  # rows nobody writes (alignment gaps) stay finite zeros
            t.zero_()
        torch.cuda.synchronize()
        dist.barrier()

    def dispatch(self, ids, splits, nle):
        """inp[:, :H] (filled by the caller) plus the id column -> out, by (rank, expert group) splits."""
        H = self.out.shape[1] - self.ID_COLS
        self.inp[:, H] = ids
        self.in_splits.copy_(splits)
        self.out[:, H].fill_(nle)  # rows no peer writes (alignment, unused) sort last
        torch.ops.symm_mem.all_to_all_vdev_2d(self.inp, self.out, self.in_splits, self.out_so, self.group_name,
                                              major_align=self.ALIGN)

    def combine(self):
        """y (arrival order) -> back, each row to the slot of its source rank it came from."""
        torch.ops.symm_mem.all_to_all_vdev_2d_offset(self.y, self.back, self.out_so, self.back_so, self.group_name)


def sort_rows_by_expert(id_col: torch.Tensor, nle: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(perm, offs) for rows whose local expert id is ``id_col`` (ids outside [0, nle): no expert):
    ``rows[perm]`` holds each expert's rows contiguously in arrival order, experts in order, rows of
    no expert last; ``offs`` (int32 [nle]) are the group ends that torch._grouped_mm takes. No host sync."""
    n = id_col.shape[0]
    rid = id_col.to(torch.int64)
    rid = torch.where((rid >= 0) & (rid < nle), rid, torch.full_like(rid, nle))
    perm = torch.argsort(rid * n + torch.arange(n, dtype=torch.int64, device=id_col.device))
    counts = torch.zeros(nle + 1, dtype=torch.int32, device=id_col.device)
    counts.index_add_(0, rid, torch.ones(n, dtype=torch.int32, device=id_col.device))
    return perm, torch.cumsum(counts[:nle], 0, dtype=torch.int32)


class _SymmDispatch(torch.autograd.Function):
    """Rows [T k, H] in (destination rank, expert group) order -> the rows every rank sends here
    [cap_out, H] (all_to_all_vdev_2d; the id column rides along for the sort). Backward: the reverse
    exchange (all_to_all_vdev_2d_offset with the forward's received splits/offsets)."""

    @staticmethod
    def forward(ctx, rows, bufs, ids, splits, nle):
        H = rows.shape[1]
        ctx.bufs = bufs
        bufs.inp[:, :H] = rows
        bufs.dispatch(ids, splits, nle)
        return bufs.out[:, :H].clone()

    @staticmethod
    def backward(ctx, grad):
        b = ctx.bufs
        b.g_out.copy_(grad)
        torch.ops.symm_mem.all_to_all_vdev_2d_offset(b.g_out, b.g_in, b.out_so, b.g_in_so, b.group_name)
        return b.g_in.clone(), None, None, None, None


class _SymmCombine(torch.autograd.Function):
    """Expert outputs [cap_out, H] in arrival order -> back to their source ranks [T k, H]
    (all_to_all_vdev_2d_offset). Backward: the dispatch-direction exchange with the same splits,
    which lands every row where the forward's dispatch put it."""

    @staticmethod
    def forward(ctx, y, bufs):
        ctx.bufs = bufs
        bufs.y.copy_(y)
        bufs.combine()
        return bufs.back.clone()

    @staticmethod
    def backward(ctx, grad):
        b = ctx.bufs
        b.g_back.copy_(grad)
        torch.ops.symm_mem.all_to_all_vdev_2d(b.g_back, b.g_y, b.in_splits, b.g_y_so, b.group_name,
                                              major_align=_SymmA2A.ALIGN)
        return b.g_y.clone(), None


class _GatherRows(torch.autograd.Function):
    """src.index_select(0, idx) whose backward is a gather too: idx a permutation with inverse
    `inv`, or (inv None) idx = token of each of the k rows, with `back` the row of each (token, slot):
    d src[t] = sum over slots. index_select's own backward is an index_add (float atomics, and 11 ms
    at DeepSeek-V3 T=4096), which would make this baseline look slower than it has to be."""

    @staticmethod
    def forward(ctx, src, idx, inv, back, k):
        ctx.inv, ctx.back, ctx.k, ctx.n = inv, back, k, src.shape[0]
        return src.index_select(0, idx)

    @staticmethod
    def backward(ctx, grad):
        if ctx.inv is not None:
            return grad.index_select(0, ctx.inv), None, None, None, None
        rows = grad.index_select(0, ctx.back).view(ctx.n, ctx.k, -1)
        return rows.to(torch.promote_types(grad.dtype, torch.float32)).sum(1).to(grad.dtype), None, None, None, None


def backend_symm_a2a(c, dev):
    log(f"symm_a2a: allocating NVSHMEM buffers (T={c['T']}, H={c['H']})", all_ranks=True)
    bufs = _SymmA2A(c, dev, backward=PASS == "bwd")
    log(f"symm_a2a: buffers ready ({bufs.groups} splits per rank of {bufs.per_group} experts)", all_ranks=True)
    ep, T, H, k, nle, I = dist.get_world_size(), c["T"], c["H"], c["k"], c["nle"], c["I"]
    fc1t, fc2t = c["fc1"].transpose(1, 2), c["fc2"].transpose(1, 2)
    flat = c["top"].reshape(-1)
    order = torch.argsort(flat, stable=True)  # rank-major, then local expert, then (token, slot)
    src_tok = order // k
    # per (destination rank, expert group) row counts; each row carries its local expert id
    splits = torch.zeros(ep * bufs.groups, dtype=torch.int64, device=dev)
    splits.index_add_(0, (flat // nle) * bufs.groups + (flat % nle) // bufs.per_group, torch.ones_like(flat))
    ids = (flat[order] % nle).to(torch.bfloat16)
    back_order = torch.argsort(order)  # slot -> row of the returned buffer
    arange_out = torch.arange(bufs.cap_out, dtype=torch.int64, device=dev)
    if PASS == "bwd":
        return _symm_a2a_backward(c, dev, bufs, order, ids, splits, back_order, arange_out)
    probs_bf = c["probs"].to(torch.bfloat16).view(T, 1, k)
    x_ext = torch.zeros(T, H + _SymmA2A.ID_COLS, dtype=torch.bfloat16, device=dev)

    def step():
        x_ext[:, :H] = c["x"]  # rows with room for the id column: one contiguous gather below
        torch.index_select(x_ext, 0, src_tok, out=bufs.inp)
        bufs.dispatch(ids, splits, nle)
        # rows of one expert group arrive per source rank; sort them by expert (on the device)
        perm, offs = sort_rows_by_expert(bufs.out[:, H], nle)
        a_in = bufs.out[:, :H].index_select(0, perm)
        h = torch._grouped_mm(a_in, fc1t, offs=offs)
        a = F.silu(h[:, :I]) * h[:, I:]
        y = torch._grouped_mm(a, fc2t, offs=offs)
        inv = torch.empty_like(perm).index_copy_(0, perm, arange_out)
        torch.index_select(y, 0, inv, out=bufs.y)  # back to the arrival order (a gather)
        bufs.combine()
        slots = bufs.back.index_select(0, back_order).view(T, k, H)
        routed = torch.bmm(probs_bf, slots).view(T, H)  # fp32 accumulation inside, one rounding
        return routed + shared_expert(c)

    return step


def _symm_a2a_backward(c, dev, bufs, order, ids, splits, back_order, arange_out):
    """The symm_a2a forward once, differentiable (the exchanges as autograd functions), and a step
    that runs its backward, as the alltoall baseline does (retain_graph; returns dx)."""
    T, H, k, nle, I = c["T"], c["H"], c["k"], c["nle"], c["I"]
    leaves = {n: c[n].detach().requires_grad_(True) for n in ("x", "probs", "fc1", "fc2", "sfc1", "sfc2")}
    c = dict(c, **leaves)
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated(dev)
    recv = _SymmDispatch.apply(_GatherRows.apply(c["x"], order // k, None, back_order, k), bufs, ids, splits, nle)
    with torch.no_grad():
        perm, offs = sort_rows_by_expert(bufs.out[:, H], nle)
        inv = torch.empty_like(perm).index_copy_(0, perm, arange_out)
    h = torch._grouped_mm(_GatherRows.apply(recv, perm, inv, None, 0), c["fc1"].transpose(1, 2), offs=offs)
    a = F.silu(h[:, :I]) * h[:, I:]
    y = torch._grouped_mm(a, c["fc2"].transpose(1, 2), offs=offs)
    back = _SymmCombine.apply(_GatherRows.apply(y, inv, perm, None, 0), bufs)
    slots = _GatherRows.apply(back, back_order, order, None, 0).view(T, k, H)
    out = torch.bmm(c["probs"].to(torch.bfloat16).view(T, 1, k), slots).view(T, H) + shared_expert(c)
    torch.cuda.synchronize()
    SAVED_BYTES["symm_a2a"] = torch.cuda.memory_allocated(dev) - before - out.numel() * out.element_size()
    inputs = [leaves[n] for n in ("x", "probs", "fc1", "fc2", "sfc1", "sfc2")]
    return _autograd_bwd_step(c, dev, out, inputs)



BACKEND_FNS = {"alltoall": backend_alltoall, "alltoall_fp8": backend_alltoall_fp8, "symm_a2a": backend_symm_a2a}


# ---- timing -----------------------------------------------------------------------------------------


def time_iters(step, iters: int, warmup: int) -> list[float]:
    for _ in range(warmup):
        step()
    torch.cuda.synchronize()
    dist.barrier()
    ev = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(iters)]
    for s, e in ev:
        s.record()
        step()
        e.record()
    torch.cuda.synchronize()
    mine = torch.tensor([s.elapsed_time(e) for s, e in ev], dtype=torch.float64, device="cuda")
    allr = [torch.empty_like(mine) for _ in range(dist.get_world_size())]
    dist.all_gather(allr, mine)
    return torch.stack(allr).max(dim=0).values.tolist()


def _median_ms(fn, iters: int = 20, warmup: int = 3) -> float:
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(iters):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        fn()
        e.record()
        torch.cuda.synchronize()
        times.append(s.elapsed_time(e))
    times.sort()
    return times[len(times) // 2]


MATMUL_N = 8192
FP8_MATMUL_RECIPE = ("torch._scaled_mm, e4m3 x e4m3 -> bf16, one fp32 scale per tensor, A row-major, B column-major, "
                     "use_fast_accum=False (fp32 accumulation, as mok's e4m3 GEMMs); the fast-accumulation rate "
                     "is stored beside it")


def matmul_rates(dev) -> dict:
    """The dense matmul rates of this run (TFLOP/s, median of 20 after 3 warm-ups): bf16 = an
    8192^3 torch.matmul; fp8 = an 8192^3 e4m3 torch._scaled_mm (FP8_MATMUL_RECIPE), None where the op
    or the GPU (sm89 or newer) is missing."""
    n = MATMUL_N
    flops = 2 * n**3
    a = torch.randn(n, n, device=dev, dtype=torch.bfloat16)
    b = torch.randn(n, n, device=dev, dtype=torch.bfloat16)
    out = {"matmul_tflops": {"bf16": flops / (_median_ms(lambda: a @ b) * 1e-3) / 1e12, "fp8": None},
           "matmul_fp8_fast_accum_tflops": None, "matmul_n": n, "matmul_fp8_recipe": FP8_MATMUL_RECIPE}
    if hasattr(torch, "_scaled_mm") and torch.cuda.get_device_capability(dev) >= (8, 9):
        try:
            a8 = a.to(torch.float8_e4m3fn)
            b8 = b.to(torch.float8_e4m3fn).t()  # column-major, as _scaled_mm wants its second operand
            one = torch.ones((), device=dev, dtype=torch.float32)
            for key, fast in (("fp8", False), ("fast", True)):
                ms = _median_ms(lambda fast=fast: torch._scaled_mm(a8, b8, one, one, out_dtype=torch.bfloat16,
                                                                   use_fast_accum=fast))
                rate = flops / (ms * 1e-3) / 1e12
                if key == "fp8":
                    out["matmul_tflops"]["fp8"] = rate
                else:
                    out["matmul_fp8_fast_accum_tflops"] = rate
        except RuntimeError as exc:
            out["matmul_fp8_error"] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:200]}"
    return out


def hbm_copy_rate(dev) -> float:
    """This GPU's device-to-device copy rate in bytes/s (read + write, 1 GiB, median of 20): the HBM
    rate a kernel can reach here, stored beside the fixed roofline rate (an H100 copies ~3.0 TB/s,
    an H200 ~4.2)."""
    a = torch.empty(1 << 30, dtype=torch.uint8, device=dev)
    b = torch.empty_like(a)
    return 2 * a.numel() / (_median_ms(lambda: b.copy_(a)) * 1e-3)


def mok_gate(shape: str, dev, seed: int) -> float:
    """mok (MoKConfig() defaults) against reference_moe in fp32 at T=256 with the shape's real H, I,
    E, k; at EP > 1 every rank computes its experts' part for all ranks' tokens and the parts are summed."""
    import megatron_mok

    c = make_case(shape, 256, "random", seed + 17, dev)
    cfg = mok_config({})
    ws = megatron_mok.get_workspace(None, dev, c["T"], c["H"], c["k"], c["E"], cfg)
    sched = megatron_mok.build_schedule(cfg, ws, c["top"])
    out, _ = megatron_mok.forward(cfg, ws, sched, c["x"], c["probs"], c["fc1"], c["fc2"], c["sfc1"], c["sfc2"])
    ep, rank, T = dist.get_world_size(), dist.get_rank(), c["T"]
    gathered = []
    for t in (c["x"], c["top"], c["probs"]):
        parts = [torch.empty_like(t) for _ in range(ep)]
        dist.all_gather(parts, t.contiguous())
        gathered.append(torch.cat(parts))
    routed = reference_moe(*gathered, c["fc1"], c["fc2"], expert_start=rank * c["nle"])
    dist.all_reduce(routed)
    ref = routed[rank * T:(rank + 1) * T] + reference_shared(c["x"], c["sfc1"], c["sfc2"])
    err = torch.tensor([float((out.float() - ref).norm() / ref.norm())], device=dev)
    dist.all_reduce(err, op=dist.ReduceOp.MAX)
    return float(err)


def collect_routing_stats(shapes, tokens, routings, seed: int, dev) -> dict:
    """{(shape, T, routing): routing_stats} of every case of the run, from every rank's routing (collective)."""
    out = {}
    ep = dist.get_world_size()
    for shape in shapes:
        for routing in routings:
            for T in tokens:
                top = make_routing(shape, T, routing, seed, dev, dist.get_rank())
                parts = [torch.empty_like(top) for _ in range(ep)]
                dist.all_gather(parts, top)
                out[(shape, T, routing)] = routing_stats(torch.stack(parts).cpu(), SHAPES[shape][0])
    return out


# ---- driver -----------------------------------------------------------------------------------------

# ---- memory hygiene ---------------------------------------------------------------------------------
#
# What must be resident for one row, DeepSeek-V3 (E=256, H=7168, I=Is=2048, k=8) at EP=1 on one
# GPU (GiB = 2^30 bytes). An H100 80GB has 79.2 GiB; about 2.3 GiB of it at T=4096 is not PyTorch's
# (CUDA context, cuBLAS/NCCL, mok's symmetric buffers; more at T=8192).
#
#   inputs (every row):  fc1 256 x 4096 x 7168 bf16 = 14.0 GiB, fc2 256 x 7168 x 2048 = 7.0 GiB:
#                        21.0 GiB (22.5 GB); shared expert 84 MiB; x 56 MiB (T=4096) / 112 MiB (8192).
#                        The weights are drawn in fp32 2 GiB at a time into their bf16 tensors, and a
#                        token count's inputs are built only after the previous one's are freed.
#   weight gradients:    --pass bwd: dfc1 14.0 + dfc2 7.0 = 21.0 GiB bf16, alive during each backward.
#   e4m3 weight copies:  fp8 rows: fc1 7.0 + fc2 3.5 = 10.5 GiB; --pass bwd adds the transposes the
#                        e4m3 dgrads read: 21.0 GiB (scales < 10 MiB). Made once; the quantization is
#                        timed before the kept copy is made, so one set is alive at a time, and the
#                        alltoall_fp8 transposes are made 8 experts at a time (no 14 GiB bf16 copy).
#   activations:         measured (H100, T=4096 / 8192): mok bf16 saves 2.5 / 3.8 GiB and its backward
#                        peaks 1.5 / 1.0 GiB above the gradients; alltoall saves 1.1 GiB and peaks ~1.0
#                        GiB above the gradients at T=4096 (about twice both at 8192); the fp8 rows
#                        hold similar amounts (mok fp8 at T=4096: 54.4 GiB allocated when it asks for
#                        dfc1's 14 GiB, i.e. a ~69 GiB peak).
#
#   backward at T=4096:  mok bf16 21.1 + 2.5 + 22.6          = ~46 GiB   alltoall     21.1 + 1.1 + 22.0 = ~44
#                        mok fp8  21.1 + 21.0 + 21.0 + ~6    = ~69 GiB   alltoall_fp8 21.1 + 21.0 + 21.0 + ~5 = ~68
#                        (+ ~2.3 GiB outside PyTorch: ~71 of 79.2 GiB, fits with nothing else left over)
#   backward at T=8192:  mok bf16 21.2 + 3.8 + 22.1 = ~47 GiB, alltoall ~47 GiB; mok fp8 and
#                        alltoall_fp8 ~70-72 GiB + ~3-4 outside PyTorch: at the limit of an 80 GB GPU
#                        (a failure is one error row; the next row starts clean again).
#
# Before this hygiene the T=4096 fp8 rows failed with 10-14 GiB "reserved but unallocated" (split
# 14 GiB blocks) and T=8192 could not even build its inputs (the T=4096 inputs' freed blocks were
# still cached and pinned by the new x). Now every row drops its closures (forward context or
# autograd graph, fp8 copies), output and traceback; release_memory collects, synchronizes and
# returns the allocator's free blocks (and mok's workspaces) before the next row and the next T;
# the reference outputs for the error columns live in host memory; and expandable segments
# (ALLOC_CONF_VARS) keep a 14 GiB request from failing on split blocks.


def resident_weight_bytes(shape: str, backend: str, pass_: str, ep: int = 1) -> dict:
    """Bytes per rank of the weights a row keeps resident (the arithmetic above, scales left out):
    bf16 weights (routed + shared), --pass bwd their bf16 gradients, fp8 backends their e4m3 routed
    copies (the transposed copies too when the backward's dgrads run in e4m3)."""
    E, H, I, _ = SHAPES[shape]
    routed = E // ep * 3 * H * I
    shared = 3 * H * I
    out = {"bf16_weights": 2 * (routed + shared)}
    if backend_precision(backend) == "fp8":
        transposed = pass_ == "bwd" and (not is_mok(backend)
                                         or mok_config(config_overrides(backend)).dgrad_precision == "fp8")
        out["e4m3_weights"] = routed * (2 if transposed else 1)
    if pass_ == "bwd":
        out["weight_grads"] = 2 * (routed + shared)
        if MAIN_GRADS:
            out["fp32_main_grads"] = 4 * (routed + shared)
    return out


def _gib(nbytes: float) -> str:
    return f"{nbytes / 2**30:.2f}"


def weights_do_not_fit(shape: str, backend: str, pass_: str, ep: int, total: int) -> str | None:
    """Why a row cannot run on a GPU of `total` bytes whatever its T (None: its resident weights fit):
    the weights it keeps resident (resident_weight_bytes) alone exceed the GPU, so no token count
    fits at this EP; said before anything is allocated, instead of an out-of-memory error."""
    need = resident_weight_bytes(shape, backend, pass_, ep)
    resident = sum(need.values())
    if resident <= total:
        return None
    return (f"no T fits at EP={ep}: resident weights {_gib(resident)} GiB > the GPU's {_gib(total)} GiB ("
            + ", ".join(f"{k} {_gib(v)}" for k, v in need.items()) + ")")


def memory_state(dev) -> dict:
    """Bytes allocated and reserved by PyTorch's caching allocator, free and total on the device."""
    free, total = torch.cuda.mem_get_info(dev)
    return {"allocated": torch.cuda.memory_allocated(dev), "reserved": torch.cuda.memory_reserved(dev),
            "free": free, "total": total}


def release_memory(dev, workspaces: bool = True) -> None:
    """Free what finished work held: unreachable objects collected (autograd graphs and closures in
    cycles), pending work done (blocks used on side streams become free), the allocator's free
    blocks returned to the driver, and (workspaces) mok's cached workspaces dropped."""
    if workspaces and "megatron_mok" in sys.modules:
        sys.modules["megatron_mok"].clear_workspace_cache()
    gc.collect()
    torch.cuda.synchronize(dev)
    torch.cuda.empty_cache()



def _result_key(cfg) -> tuple:
    """The MoKConfig fields that change the bits of the timed output (dx in the backward)."""
    return (cfg.precision, cfg.shared_precision, cfg.dgrad_precision if PASS == "bwd" else None)


def run_cases(args, backends, dev) -> list[dict]:
    ep = dist.get_world_size()
    rows = []
    mok_names = [b for b in backends if is_mok(b)]
    for shape in args.shapes:
        gate = gate_error = None
        if mok_names and not args.skip_gate:
            try:
                gate = mok_gate(shape, dev, args.seed)
                log(f"[gate] {shape}: mok vs fp32 reference rel err {gate:.3e} ({'ok' if gate <= 1e-2 else 'FAIL'})")
            except Exception as exc:  # noqa: BLE001
                gate = float("nan")
                gate_error = f"{type(exc).__name__}: {str(exc).splitlines()[0][:160] if str(exc) else ''}"
                log(f"[gate] {shape}: ERROR {gate_error}")
            release_memory(dev)  # the gate's T=256 case and workspace
        for routing in args.routings:
            for T in args.token_list:
                # the previous token count's inputs, outputs and workspaces are gone before this one's
                # are built (_run_case's locals die with its return)
                release_memory(dev)
                rows += _run_case(args, backends, dev, shape, routing, T, gate, gate_error, ep)
                release_memory(dev)
                dist.barrier()
    return rows


def _run_case(args, backends, dev, shape, routing, T, gate, gate_error, ep) -> list[dict]:
    rows = []
    err = None
    mem = memory_state(dev)

    def row_of(be, **fields) -> dict:  # what every row of this case says about itself, and `fields`
        return dict(shape=shape, tokens=T, backend=be, ep=ep, routing=routing, pass_=row_pass(),
                    precision=backend_precision(be), **fields)

    unfit = {be: why for be in backends if (why := weights_do_not_fit(shape, be, PASS, ep, mem["total"]))}
    if len(unfit) == len(backends):  # no row can run: the inputs are not even built
        for be in backends:
            log(f"{shape:16s} T={T:5d} {routing:7s} {be:24s} DOES_NOT_FIT {unfit[be]}")
        return [row_of(be, status="does_not_fit", error=unfit[be]) for be in backends]
    try:
        c = make_case(shape, T, routing, args.seed, dev)
    except torch.OutOfMemoryError as exc:  # e.g. all experts of a large model on one GPU (EP=1)
        err = (f"inputs do not fit on one GPU at EP={ep}: {str(exc).splitlines()[0][:120]} (before they were "
               f"built: {_gib(mem['free'])} GiB free, {_gib(mem['allocated'])} GiB allocated)")
    if err is not None:  # outside the except block: its traceback held make_case's partial tensors
        log(f"{shape:16s} T={T:5d} ERROR {err}")
        release_memory(dev)
        dist.barrier()
        return [row_of(be, status="error", error=err) for be in backends]
    flops = 6 * T * c["k"] * c["H"] * c["I"] + 6 * T * c["H"] * c["Is"]
    if PASS == "bwd":
        flops *= 2
    # kept in host memory, so that no row leaves a tensor on the GPU for the next one:
    ref_out = None  # the first bf16 mok output, fp32 (every other backend's rel_err_vs_mok)
    ref_bits: dict = {}  # _result_key -> (backend, output): the first mok variant of those bits
    saved = os.path.join(args.tmp_dir, f"mok_out_{PASS}_{shape}_{T}_{routing}_rank{dist.get_rank()}.pt")
    for i, be in enumerate(backends):
        row = row_of(be, flops_per_rank=flops)
        step = out = cfg = None
        SAVED_BYTES.pop(be, None)  # nothing of an earlier token count's row is read for this one
        WEIGHT_QUANT_MS.pop(be, None)
        row["memory_at_start"] = mem = memory_state(dev)
        try:
            log(f"{shape} T={T} {routing} {be}: start: {_gib(mem['allocated'])} GiB allocated, "
                f"{_gib(mem['reserved'])} GiB reserved, {_gib(mem['free'])} of {_gib(mem['total'])} GiB free; "
                "weights resident in this row: "
                + ", ".join(f"{k} {_gib(v)} GiB" for k, v in resident_weight_bytes(shape, be, PASS, ep).items()))
            if be in unfit:
                raise DoesNotFit(unfit[be])
            if is_mok(be):
                cfg = mok_config(config_overrides(be))
                row["config"] = dataclasses.asdict(cfg)
                if PASS == "fwd":
                    row["forward_kernel"] = cfg.resolved_forward_kernel(ep)
                if gate is not None:
                    row["gate_rel_err_vs_fp32_reference"] = gate
                    if gate_error is not None:
                        raise RuntimeError(f"the correctness gate could not run ({gate_error})")
                    if not gate <= 1e-2:
                        raise RuntimeError(f"correctness gate failed (rel err {gate})")
                step = backend_mok(c, dev, cfg, name=be)
            else:
                step = BACKEND_FNS[be](c, dev)
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats(dev)
            before = torch.cuda.memory_allocated(dev)
            out = step()
            torch.cuda.synchronize()
            if PASS == "bwd":
                mem = torch.tensor([SAVED_BYTES.get(be, -1), torch.cuda.max_memory_allocated(dev) - before],
                                   dtype=torch.float64, device=dev)
                dist.all_reduce(mem, op=dist.ReduceOp.MAX)
                if mem[0] >= 0:
                    row["saved_bytes_per_token"] = float(mem[0]) / T
                row["bwd_peak_bytes_per_token"] = float(mem[1]) / T
            if be in MOK_WORKSPACES:  # the symmetric buffers exist once a step has run
                from megatron_mok.cuda.comm import comm
                row["workspace_bytes_per_gpu"] = comm(MOK_WORKSPACES.pop(be)).nbytes()
            log(f"{shape} T={T} {routing} {be}: first step done")
            is_reference = cfg is not None and cfg.precision == "bf16" and ref_out is None
            if is_reference:
                ref_out = out.float().cpu()
                torch.save(out.cpu(), saved)  # the symm_a2a child compares against it
            elif ref_out is None and os.path.exists(saved) and not is_mok(be):
                ref_out = torch.load(saved).float()
            if not is_reference and ref_out is not None:
                ref = ref_out.to(dev)
                e = torch.tensor([float((out.float() - ref).norm() / ref.norm())], device=dev)
                del ref
                dist.all_reduce(e, op=dist.ReduceOp.MAX)
                row["rel_err_vs_mok"] = float(e)
            if cfg is not None:
                key = _result_key(cfg)
                if key in ref_bits:
                    same = torch.tensor([int(torch.equal(out.view(torch.int16),
                                                         ref_bits[key][1].to(dev).view(torch.int16)))], device=dev)
                    dist.all_reduce(same, op=dist.ReduceOp.MIN)
                    row["bitwise_equal_to"] = ref_bits[key][0]
                    row["bitwise_equal"] = bool(same.item())
                else:
                    ref_bits[key] = (be, out.cpu())
            times = time_iters(step, args.iters, args.warmup)
            ts = sorted(times)
            med = ts[len(ts) // 2]
            row.update(ms=med, ms_p10=ts[len(ts) // 10], ms_p90=ts[(9 * len(ts)) // 10], iters=len(ts),
                       tflops=flops / (med * 1e-3) / 1e12, status="ok")
            if be in WEIGHT_QUANT_MS:
                row["weight_quant_ms"] = WEIGHT_QUANT_MS[be]
            if args.kernels:
                row["kernels"] = kernel_times(step)
                log(f"  kernels ({be}, rank 0, ms per iteration): busy {row['kernels']['busy_ms']:.3f}, "
                    f"idle {row['kernels']['idle_ms']:.3f}; "
                    + ", ".join(f"{k} {v:.3f}" for k, v in row["kernels"]["by_category"].items()))
                for kern in row["kernels"]["top"]:
                    each = kern.get("launches_ms")
                    log(f"    {kern['ms']:8.3f}  {kern['name'][:100]}" + (f"  (launches {each})" if each else ""))
            if args.timeline and row.get("forward_kernel") == "persistent":
                row["timeline"] = mok_timeline(step)
                t = row["timeline"][0]
                log(f"  timeline rank 0: span {t['span_us']} us, SM time {t['leader_time']}, "
                    + ", ".join(f"{k} {v['tasks']} x {v['tile_us_mean']} us" for k, v in t["per_kind"].items()))
        except DoesNotFit as exc:
            row.update(status="does_not_fit", error=str(exc))
        except NotRunnable as exc:
            row.update(status="not_runnable", error=str(exc))
        except Exception as exc:  # noqa: BLE001
            row.update(status="error", error=f"{type(exc).__name__}: {exc}")
            if dist.get_rank() == 0:
                traceback.print_exc()
        rows.append(row)
        if row["status"] == "ok":
            log(f"{shape:16s} T={T:5d} {routing:7s} {be:24s} {row['ms']:8.3f} ms  {row['tflops']:6.1f} TFLOP/s"
                + (f"  err_vs_mok={row['rel_err_vs_mok']:.2e}" if "rel_err_vs_mok" in row else "")
                + (f"  bitwise_vs_{row['bitwise_equal_to']}={row['bitwise_equal']}" if "bitwise_equal" in row else "")
                + (f"  saved={row['saved_bytes_per_token'] / 1024:.1f} KiB/token" if "saved_bytes_per_token" in row
                   else "")
                + (f"  bwd_peak={row['bwd_peak_bytes_per_token'] / 1024:.1f} KiB/token"
                   if "bwd_peak_bytes_per_token" in row else ""))
        else:
            log(f"{shape:16s} T={T:5d} {routing:7s} {be:24s} {row['status'].upper()} {row['error']}")
        # Release everything this row made before the next one starts: its step closure (forward
        # context or autograd graph, fp8 weight copies, dispatcher), its output, the exception's
        # traceback (gone with the except block), cached allocator blocks, and mok's workspaces
        # unless the next row is a mok variant too (a workspace is sized by T, not by the variant;
        # one whose call failed is never reused).
        step = out = cfg = None
        failed = torch.tensor([int(row["status"] != "ok")], device=dev)
        dist.all_reduce(failed, op=dist.ReduceOp.MAX)  # every rank drops its workspaces, or none does
        nxt = backends[i + 1] if i + 1 < len(backends) else None
        release_memory(dev, workspaces=bool(failed.item()) or nxt is None or not is_mok(nxt))
        del failed
        dist.barrier()
    return rows


def run_symm_child(args, dev) -> list[dict]:
    """Re-run this script for symm_a2a in one child process per rank (NVSHMEM backend)."""
    rank, world = dist.get_rank(), dist.get_world_size()
    port = int(os.environ.get("MASTER_PORT", "29500")) + 11
    out_path = os.path.join(args.tmp_dir, f"symm_a2a_rank{rank}.json")
    # torchrun's agent store must not be used by the children (they form their own group)
    base_env = {k: v for k, v in os.environ.items() if not k.startswith("TORCHELASTIC_")}
    env = dict(base_env, RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), MASTER_PORT=str(port),
               MASTER_ADDR=os.environ.get("MASTER_ADDR", "127.0.0.1"), NVSHMEM_REMOTE_TRANSPORT="none",
               NVSHMEM_SYMMETRIC_SIZE=os.environ.get("NVSHMEM_SYMMETRIC_SIZE", "32G"), **NO_MULTICAST_ENV)
    cmd = [sys.executable, os.path.abspath(__file__), "--shape", args.shape, "--tokens", args.tokens,
           "--backends", "symm_a2a", "--pass", args.pass_, "--iters", str(args.iters), "--warmup", str(args.warmup),
           "--routing", args.routing, "--seed", str(args.seed), "--_child-out", out_path, "--skip-gate",
           "--tmp-dir", args.tmp_dir] + (["--kernels"] if args.kernels else [])
    try:
        proc = subprocess.run(cmd, env=env, timeout=args.child_timeout)
        rc = proc.returncode
    except subprocess.TimeoutExpired:
        rc = "timeout"
    rows = []
    if rank == 0:
        if rc == 0 and os.path.exists(out_path):
            with open(out_path) as f:
                rows = json.load(f)
        else:
            rows = [dict(shape=s, tokens=t, backend="symm_a2a", ep=world, routing=r, pass_=args.pass_,
                         precision="bf16", status="error", error=f"symm_a2a child process: {rc}")
                    for s in args.shapes for r in args.routings for t in args.token_list]
    return rows


def allocator_record(environ, set_by_bench: dict) -> dict:
    """The caching allocator's settings of the run for the JSON: the variable torch read, its value,
    and whether this script set it (allocator_env) or the caller did."""
    for var in ALLOC_CONF_VARS:  # torch's order: PYTORCH_ALLOC_CONF first
        if environ.get(var):
            return {"variable": var, "value": environ[var],
                    "set_by": "scripts/bench_layer.py" if var in set_by_bench else "caller"}
    return {"variable": None, "value": None, "set_by": None}


def gpu_slug(gpu: str) -> str:
    """'NVIDIA H200' -> 'h200', 'NVIDIA H100 80GB HBM3' -> 'h100-80gb-hbm3'."""
    return gpu.lower().replace("nvidia", "").strip().replace(" ", "-") or "gpu"


def result_path(gpu: str, ep: int, pas: str) -> str:
    return os.path.join(ROOT, "bench", "results", f"{gpu_slug(gpu)}_ep{ep}_{pas}.json")


def row_key(r: dict) -> tuple:
    return (r["shape"], r["tokens"], r.get("routing", "random"), r["backend"])


def merge_results(old_rows: list[dict], new_rows: list[dict]) -> list[dict]:
    """Rows of both, a new row replacing an old one of the same (shape, tokens, routing, backend)."""
    merged = {row_key(r): r for r in old_rows}
    merged.update({row_key(r): r for r in new_rows})
    return sorted(merged.values(), key=lambda r: (r["shape"], r["tokens"], r.get("routing", "random"), r["backend"]))


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shape", default="deepseek-v3",
                   help=f"one of {list(SHAPES)}, a comma list, or 'all' (the models: {list(MOE_SHAPES)})")
    p.add_argument("--tokens", default="4096", help="tokens per GPU, comma list")
    p.add_argument("--backends", default="mok,mok@precision=fp8,alltoall,alltoall_fp8",
                   help=f"comma list of {BACKENDS} and mok@FIELD=VALUE[+FIELD=VALUE...] (MoKConfig fields)")
    p.add_argument("--pass", dest="pass_", default="fwd", choices=["fwd", "bwd"],
                   help="fwd: the layer forward; bwd: the layer backward alone (see above)")
    p.add_argument("--main-grads", action="store_true",
                   help="--pass bwd: weight gradients into fp32 main grads (Megatron's gradient-accumulation fusion)")
    p.add_argument("--iters", type=int, default=50)
    p.add_argument("--warmup", type=int, default=10)
    p.add_argument("--routing", default="random", help=f"comma list of {ROUTINGS}")
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--skip-gate", action="store_true")
    p.add_argument("--out", default=None, help="JSON path (default bench/results/<gpu>_ep<N>_<pass>.json)")
    p.add_argument("--merge", action="store_true",
                   help="add the rows to an existing --out file (a row of the same case and backend is replaced)")
    p.add_argument("--note", default=None, help="a note stored in the JSON (what the run compares)")
    p.add_argument("--hbm-tbps", type=float, default=HBM_BYTES_PER_S / 1e12,
                   help="HBM rate of the roofline, TB/s (default: the measured H200 copy rate)")
    p.add_argument("--nvlink-gbps", type=float, default=NVLINK_BYTES_PER_S / 1e9,
                   help="NVLink rate of the roofline, GB/s a direction (default: the measured H200 peer copy)")
    p.add_argument("--tmp-dir", default="/tmp")
    p.add_argument("--child-timeout", type=float, default=600, help="seconds for the symm_a2a child processes")
    p.add_argument("--kernels", action="store_true",
                   help="GPU time per kernel of each backend (torch profiler, 5 iterations, rank 0)")
    p.add_argument("--timeline", action="store_true",
                   help="--pass fwd: one more run of each mok variant whose forward is the persistent megakernel, "
                        "with its per-task timeline")
    p.add_argument("--_child-out", dest="child_out", default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    args.backends_list = [b for b in args.backends.split(",") if b]
    for b in args.backends_list:
        try:
            check_backend(b)
        except ValueError as exc:
            p.error(str(exc))
    if len(set(args.backends_list)) != len(args.backends_list):
        p.error("a backend is named twice")
    args.shapes = list(MOE_SHAPES) if args.shape == "all" else args.shape.split(",")
    for s in args.shapes:
        if s not in SHAPES:
            p.error(f"unknown shape {s!r}; choose from {list(SHAPES)} or 'all'")
    args.routings = [r for r in args.routing.split(",") if r]
    for r in args.routings:
        if r not in ROUTINGS:
            p.error(f"unknown routing {r!r}; choose from {ROUTINGS}")
    try:
        args.token_list = [int(t) for t in args.tokens.split(",") if t]
    except ValueError:
        p.error(f"--tokens wants a comma list of integers, got {args.tokens!r}")
    if args.timeline and args.pass_ != "fwd":
        p.error("--timeline stamps the forward megakernel: use it with --pass fwd")
    return args


def main() -> None:
    global PASS, MAIN_GRADS
    args = parse_args()
    PASS = args.pass_
    MAIN_GRADS = args.main_grads
    if MAIN_GRADS and PASS != "bwd":
        raise SystemExit("bench_layer: --main-grads needs --pass bwd")
    backends = args.backends_list

    if args.child_out is not None:
        import torch.distributed._symmetric_memory as symm_mem

        symm_mem.set_backend("NVSHMEM")
    local = int(os.environ.get("LOCAL_RANK", "0"))
    torch.cuda.set_device(local)
    dev = torch.device("cuda", local)
    command = command_line(sys.argv, dict(os.environ))  # before the single-process defaults below
    if "RANK" not in os.environ:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        os.environ.update(RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("nccl", device_id=dev)
    ep = dist.get_world_size()

    if args.child_out is not None:  # symm_a2a child
        rows = run_cases(args, ["symm_a2a"], dev)
        if dist.get_rank() == 0:
            with open(args.child_out, "w") as f:
                json.dump(rows, f)
        dist.barrier()
        dist.destroy_process_group()
        return

    t0 = time.time()
    rates = matmul_rates(dev)
    rates.update(hbm_copy_bytes_per_s=hbm_copy_rate(dev), hbm_bytes_per_s=args.hbm_tbps * 1e12, nvlink_bytes_per_s=args.nvlink_gbps * 1e9,
                 hbm_source=HBM_SOURCE if args.hbm_tbps * 1e12 == HBM_BYTES_PER_S else "--hbm-tbps",
                 nvlink_source=NVLINK_SOURCE if args.nvlink_gbps * 1e9 == NVLINK_BYTES_PER_S else "--nvlink-gbps")
    fp8_rate, fast = rates["matmul_tflops"]["fp8"], rates["matmul_fp8_fast_accum_tflops"]
    log(f"HBM copy {rates['hbm_copy_bytes_per_s'] / 1e12:.2f} TB/s (roofline rate {args.hbm_tbps:.2f})")
    log(f"matmul {MATMUL_N}^3: bf16 {rates['matmul_tflops']['bf16']:.1f} TFLOP/s, e4m3 "
        + (f"{fp8_rate:.1f} TFLOP/s" + (f" (fast accumulation {fast:.1f})" if fast else "")
           if fp8_rate else f"not measured ({rates.get('matmul_fp8_error', 'no torch._scaled_mm / sm89')})"))
    stats = collect_routing_stats(args.shapes, args.token_list, args.routings, args.seed, dev)
    release_memory(dev)  # the matmul operands and routing draws
    in_proc = [b for b in backends if b != "symm_a2a"]
    rows = run_cases(args, in_proc, dev) if in_proc else []
    if "symm_a2a" in backends:
        release_memory(dev)
        dist.barrier()
        rows += run_symm_child(args, dev)
    if dist.get_rank() == 0:
        for r in rows:
            r["command"] = command
        annotate_rows(rows, rates, lambda shape, T, routing: stats[(shape, T, routing)])
        annotate_speedups(rows)
        gpu = torch.cuda.get_device_name(dev)
        path = args.out or result_path(gpu, ep, args.pass_)
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        doc = {}
        if args.merge and os.path.exists(path):
            with open(path) as f:
                doc = json.load(f)
            if (doc.get("gpu"), doc.get("ep"), doc.get("pass_")) != (gpu, ep, args.pass_):
                raise SystemExit(f"--merge: {path} holds {doc.get('gpu')} EP={doc.get('ep')} {doc.get('pass_')}, "
                                 f"not {gpu} EP={ep} {args.pass_}")
        results = merge_results(doc.get("results", []), rows)
        annotate_speedups(results)  # across merged rows too (fields of a case recomputed)
        commands = list(dict.fromkeys(r["command"] for r in results if r.get("command")))
        doc.update(
            command=command, commands=commands, argv=sys.argv, torch=torch.__version__, cuda=torch.version.cuda,
            gpu=gpu, ep=ep, pass_=args.pass_, date=datetime.date.today().isoformat(), rates=rates,
            seconds=time.time() - t0, env={k: os.environ.get(k) for k in (*NO_MULTICAST_ENV, *ALLOC_CONF_VARS)},
            allocator=allocator_record(os.environ, ALLOC_CONF_SET_BY_BENCH), results=results)
        if args.note:
            doc["note"] = args.note
        with open(path, "w") as f:
            json.dump(doc, f, indent=1)
        print(f"wrote {path}")
        print(summary_table(doc["results"]))
    dist.barrier()
    dist.destroy_process_group()


def summary_table(rows: list[dict]) -> str:
    """A plain-text table of result rows (what the run printed at its end)."""
    lines = [(f"{'shape':16s} {'T':>5s} {'routing':7s} {'backend':28s} {'ms':>8s} {'TFLOP/s':>8s} "
              f"{'roof ms':>8s} {'roof%':>6s} {'bound':>7s} {'x same':>7s} {'x any':>7s}")]
    for r in rows:
        head = f"{r['shape']:16s} {r['tokens']:5d} {r.get('routing', 'random'):7s} {r['backend']:28s}"
        if r.get("status") != "ok":
            lines.append(f"{head} {r.get('status', '?').upper()} {r.get('error', '')[:60]}")
            continue
        roof = r.get("roofline") or {}
        fmt = (lambda key, r=r: f"{r[key]:7.2f}x" if key in r else f"{'':>8s}")
        lines.append(f"{head} {r['ms']:8.3f} {r.get('tflops', 0.0):8.1f} "
                     + (f"{roof['roofline_ms']:8.3f} {100 * r['roofline_fraction']:5.1f}% {roof['bound']:>7s}"
                        if roof else f"{'':>8s} {'':>6s} {'':>7s}")
                     + fmt("speedup_vs_same_precision") + fmt("speedup_vs_any_precision"))
    return "\n".join(lines)


if __name__ == "__main__":
    main()
