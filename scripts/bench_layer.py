#!/usr/bin/env python3
"""One MoE layer, forward or backward: mok vs NCCL+PyTorch (Megatron's alltoall dispatcher) vs
torch symm-mem a2a.

Launch with torchrun, one process per GPU; EP = world size (1 works without torchrun):

    torchrun --nproc-per-node=2 scripts/bench_layer.py --shape all --tokens 2048,4096 \\
        --backends mok,alltoall,symm_a2a --pass fwd --iters 50

Backends (same inputs, same weights, bf16, one shared expert of size Is = I):
  mok       megatron_mok.build_schedule + megatron_mok.forward (the CUDA kernels of csrc/; the
            forward is the persistent megakernel unless MOK_FORWARD=staged)
  mok_staged  the same with the stage-2 forward launches (kernel_path.FORWARD_PATH = "staged")
  mok@F=V+F=V  mok with MoKConfig fields set, e.g. mok@fwd_comm_sms=8+minibatch_rows=2048 (knobs: same bits)
  mok_ab    mok with the kernel environment variable of --ab-env (default MOK_GEMM_EXPERT=0: the
            staged routed GEMMs token-major); the kernels' A/B switches keep the bits, which is checked
  mok%NAME=VALUE  the same for any MOK_ kernel switches, several per backend and run (e.g.
            mok%MOK_GEMM_PAIRED=0, mok@precision=fp8%MOK_FP8_PUSH=0%MOK_BWD_SIDE_EARLY=0;
            mok@precision=fp8%MOK_FORWARD=mega: the fp8 forward megakernel, not the staged default)
  mok_recompute  mok with MoKConfig(save_gate_up=False): the forward keeps no gate/up outputs and
            the backward recomputes them (the activation-checkpointing memory mode)
  alltoall  Megatron-Core MoEAlltoAllTokenDispatcher (NCCL all-to-all) + torch._grouped_mm experts
  symm_a2a  torch.ops.symm_mem.all_to_all_vdev_2d dispatch, all_to_all_vdev_2d_offset combine,
            torch._grouped_mm experts. That all-to-all takes at most 16 splits per rank, so the
            splits are groups of local experts; each row carries its expert id and the receiver sorts
            its rows by expert on the device. Needs the NVSHMEM symmetric-memory backend, selected
            before the first symmetric allocation, so it runs in a child process per rank (after the others).

--pass bwd times the backward alone (the forward runs once, outside the timing): mok =
megatron_mok.backward on the forward's context (the stage-1 CUDA backward unless MOK_BACKWARD=reference);
alltoall = torch.autograd.grad through the dispatcher + torch._grouped_mm experts + shared expert
(retain_graph, so every iteration replays the same backward; gradients are returned, not accumulated);
symm_a2a = the same through its forward, whose two exchanges are autograd functions running the
reverse exchange in their backward (all_to_all_vdev_2d_offset for the dispatch, all_to_all_vdev_2d
for the combine).
Backward FLOPs = 2x the forward FLOPs (mok_recompute also recomputes the gate/up GEMM, not counted).
Memory (--pass bwd): saved_bytes_per_token = what the forward keeps for the backward (mok: the
KernelContext's tensors; alltoall: the growth of allocated memory across the forward, minus its
output), and bwd_peak_bytes_per_token = the allocation peak of one backward above what was allocated
before it, both divided by T.

Timing: CUDA events around every iteration on every rank, warm-up first; the reported time is the
median over iterations of the per-iteration maximum over ranks. Forward FLOPs per rank =
6 T k H I + 6 T H Is. The roofline is an 8192^3 bf16 matmul measured in the same run.
--breakdown (mok) also times each launch of the staged forward, once as is and once with --ab-env.
--timeline (mok and its megakernel variants) runs one more step with the megakernels' per-task
stamps on (ops.megakernel_timeline; forward, or the backward megakernel with --pass bwd) and stores
megatron_mok.timeline.summarize of every rank.
--kernels runs 5 more iterations of every backend under the torch profiler and stores rank 0's GPU
time per iteration by kernel name and category (scripts/trace_summary.py's categories).
Correctness gate first: mok against the fp32 reference (megatron_mok.reference) at T=256 with the
real H, I, E, k; every backend's output against mok's (relative error, reported).
Results: bench/results/<YYYY-MM-DD>_<gpu>_ep<N>_<pass>.json (merged with an existing file).
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import gc
import json
import os
import socket
import subprocess
import sys
import time
import traceback

NO_MULTICAST_ENV = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}
os.environ.update(NO_MULTICAST_ENV)

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.nn.functional as F  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from megatron_mok.shapes import MOE_SHAPES  # noqa: E402

# model: (experts, hidden H, expert I, top-k); one shared expert with Is = I (docs: DESIGN.md)
SHAPES = {name: (s.num_experts, s.hidden, s.ffn, s.topk) for name, s in MOE_SHAPES.items()}
BACKENDS = ("mok", "mok_staged", "mok_recompute", "mok_ab", "alltoall", "symm_a2a")
BWD_BACKENDS = ("mok", "mok_recompute", "mok_ab", "alltoall", "symm_a2a")
AB_ENV = ("MOK_GEMM_EXPERT", "0")  # --ab-env


_T0 = time.time()


def log(msg: str, all_ranks: bool = False) -> None:
    if all_ranks or not dist.is_initialized() or dist.get_rank() == 0:
        who = f"r{dist.get_rank()} " if all_ranks and dist.is_initialized() else ""
        print(f"[{time.time() - _T0:6.1f}s] {who}{msg}", flush=True)


# ---- inputs ---------------------------------------------------------------------------------------


def make_case(shape: str, T: int, routing: str, seed: int, dev):
    E, H, I, k = SHAPES[shape]
    ep = dist.get_world_size() if dist.is_initialized() else 1
    rank = dist.get_rank() if dist.is_initialized() else 0
    nle = E // ep
    g = torch.Generator(device=dev).manual_seed(seed * 1000 + rank)
    bf = torch.bfloat16
    x = torch.randn(T, H, device=dev, generator=g).to(bf)
    if routing == "random":
        top = torch.rand(T, E, device=dev, generator=g).argsort(dim=1)[:, :k]
    else:  # skewed: Zipf(1.2) expert popularity, same permutation on every rank
        gp = torch.Generator(device=dev).manual_seed(seed)
        w = 1.0 / torch.arange(1, E + 1, device=dev, dtype=torch.float64) ** 1.2
        w = w[torch.randperm(E, device=dev, generator=gp)]
        top = torch.multinomial(w.expand(T, E), k, replacement=False, generator=g)
    probs = torch.softmax(torch.randn(T, k, device=dev, generator=g), dim=1).float()

    def w_(*s, fan):
        return (torch.randn(*s, device=dev, generator=g) / fan**0.5).to(bf)

    fc1, fc2 = w_(nle, 2 * I, H, fan=H), w_(nle, H, I, fan=I)
    sfc1, sfc2 = w_(2 * I, H, fan=H), w_(H, I, fan=I)
    return dict(E=E, H=H, I=I, k=k, Is=I, T=T, nle=nle, x=x, top=top.contiguous(), probs=probs,
                fc1=fc1, fc2=fc2, sfc1=sfc1, sfc2=sfc2)


def shared_expert(c):
    h = c["x"] @ c["sfc1"].t()
    return (F.silu(h[:, : c["Is"]]) * h[:, c["Is"]:]) @ c["sfc2"].t()


# ---- backends: each returns a step() -> out [T, H] --------------------------------------------------


PASS = "fwd"  # set by main(): "fwd" or "bwd"
SAVED_BYTES: dict = {}  # backend -> bytes its forward keeps for the backward (--pass bwd)
WEIGHT_QUANT_MS: dict = {}  # fp8 backend -> median ms of quantizing its routed weights


def _grad_out(c, dev):
    g = torch.Generator(device=dev).manual_seed(4321 + (dist.get_rank() if dist.is_initialized() else 0))
    return torch.randn(c["T"], c["H"], device=dev, generator=g).to(torch.bfloat16)


def config_overrides(backend: str) -> dict:
    """'mok@fwd_comm_sms=8+minibatch_rows=2048' -> {'fwd_comm_sms': 8, 'minibatch_rows': 2048}
    ('mok@precision=fp8%MOK_FWD_OVERLAP=0': the fields before the kernel switch)."""
    spec = backend.split("%")[0].partition("@")[2]
    out = {}
    for item in filter(None, spec.split("+")):
        key, _, value = item.partition("=")
        if value in ("true", "false"):  # e.g. fp8_dgrad=false
            out[key] = value == "true"
            continue
        try:
            out[key] = float(value) if "." in value else int(value)
        except ValueError:
            out[key] = value  # e.g. precision=fp8
    return out


def backend_mok(c, dev, path=None, save_gate_up=True, name="mok", overrides=None):
    from megatron_mok import MoKConfig, functional, get_workspace, kernel_path, ops

    if not ops.is_available():
        raise RuntimeError(f"megatron_mok._C not available: {ops.load_error()}")
    cfg = MoKConfig(save_gate_up=save_gate_up, **(overrides or {}))
    ws = get_workspace(None, dev, c["T"], c["H"], c["k"], c["E"], cfg)
    fp8_weights = None
    if cfg.precision == "fp8":
        # quantized once per weight version, as a training step would (its time is logged apart)
        transposed = PASS == "bwd" and cfg.dgrad_precision == "fp8"  # the dgrads' copies too
        # the shared expert's weights too when its forward runs in e4m3 (fp8_shared)
        shared = (c["sfc1"], c["sfc2"]) if cfg.shared_precision == "fp8" and c["sfc1"] is not None else (None, None)

        def quantize():
            return functional.quantize_expert_weights(c["fc1"], c["fc2"], transposed, *shared)

        fp8_weights = quantize()
        ms = time_iters(quantize, 5, 1)
        WEIGHT_QUANT_MS[name] = sorted(ms)[len(ms) // 2]
        log(f"{name}: quantizing the weights to e4m3 takes {WEIGHT_QUANT_MS[name]:.3f} ms "
            f"(once per weight version, outside the timed step)")

    if PASS == "bwd":
        sched = functional.build_schedule(cfg, ws, c["top"])
        _, ctx = functional.forward(cfg, ws, sched, c["x"], c["probs"], c["fc1"], c["fc2"], c["sfc1"], c["sfc2"],
                                    fp8_weights=fp8_weights)
        SAVED_BYTES[name] = ctx.nbytes()
        grad = _grad_out(c, dev)

        def bwd_step():
            grads = functional.backward(cfg, ws, sched, ctx, grad, c["x"], c["probs"], c["fc1"], c["fc2"], c["sfc1"],
                                        c["sfc2"], fp8_weights=fp8_weights)
            return grads.dx

        return bwd_step, ws

    def step():
        sched = functional.build_schedule(cfg, ws, c["top"])
        default = kernel_path.FORWARD_PATH
        kernel_path.FORWARD_PATH = path or default
        try:
            out, _ = functional.forward(cfg, ws, sched, c["x"], c["probs"], c["fc1"], c["fc2"], c["sfc1"],
                                        c["sfc2"], fp8_weights=fp8_weights)
        finally:
            kernel_path.FORWARD_PATH = default
        return out

    return step, ws


def backend_mok_staged(c, dev):
    return backend_mok(c, dev, path="staged", name="mok_staged")


def backend_mok_recompute(c, dev):
    return backend_mok(c, dev, save_gate_up=False, name="mok_recompute")


def backend_mok_env(c, dev, name: str, env: tuple[tuple[str, str], ...], overrides=None):
    # kernel_path reads MOK_FORWARD once, at import: that switch picks the path directly
    path = dict(env).get("MOK_FORWARD")
    step, ws = backend_mok(c, dev, path=path, name=name, overrides=overrides)

    def env_step():
        with contextlib.ExitStack() as stack:
            for pair in env:
                stack.enter_context(env_var(*pair))
            return step()

    return env_step, ws


def backend_mok_ab(c, dev):
    return backend_mok_env(c, dev, "mok_ab", (AB_ENV,))


def forward_runs_megakernel(be: str) -> bool:
    """Whether mok backend ``be`` runs the forward megakernel (MOK_FORWARD, else the precision's default)."""
    from megatron_mok import kernel_path

    if be == "mok_staged":
        return False
    path = dict(parse_env_backend(be)).get("MOK_FORWARD") if "%" in be else None
    return kernel_path.forward_path(path, config_overrides(be).get("precision", "bf16")) == "mega"


def parse_env_backend(be: str) -> tuple[tuple[str, str], ...]:
    """'mok%MOK_GEMM_PAIRED=0%MOK_FP8_PUSH=0' -> (('MOK_GEMM_PAIRED', '0'), ('MOK_FP8_PUSH', '0'))."""
    pairs = []
    for item in be.split("%")[1:]:
        name, _, value = item.partition("=")
        if not name.startswith("MOK_") or not value:
            raise ValueError(f"backend {be!r}: want mok%NAME=VALUE[%NAME=VALUE...] with MOK_ kernel switches")
        pairs.append((name, value))
    if not pairs:
        raise ValueError(f"backend {be!r}: want mok%NAME=VALUE[%NAME=VALUE...] with MOK_ kernel switches")
    return tuple(pairs)


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


def kernel_times(step, iters: int = 5, top: int = 12) -> dict:
    """GPU time per iteration by kernel (the `top` largest) and by category, rank 0's view.
    busy_ms: time with at least one kernel running (kernels of two streams overlap: busy < the sum);
    idle_ms: from the first kernel's start to the last one's end, the time with none running."""
    from torch.profiler import ProfilerActivity, profile

    from trace_summary import categorize

    torch.cuda.synchronize()
    dist.barrier()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(iters):
            step()
        torch.cuda.synchronize()
    by_name: dict[str, float] = {}
    spans = []
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA and e.device_time_total > 0:
            by_name[e.name] = by_name.get(e.name, 0.0) + e.device_time_total / 1e3 / iters
            spans.append((e.time_range.start, e.time_range.end))
    busy_us, span_us = busy_time(spans)
    by_cat: dict[str, float] = {}
    for name, ms in by_name.items():
        cat = categorize(name)
        by_cat[cat] = by_cat.get(cat, 0.0) + ms
    ranked = sorted(by_name.items(), key=lambda kv: -kv[1])
    return {"ms_per_iter": round(sum(by_name.values()), 4),
            "busy_ms": round(busy_us / 1e3 / iters, 4), "idle_ms": round((span_us - busy_us) / 1e3 / iters, 4),
            "by_category": {k: round(v, 4) for k, v in sorted(by_cat.items(), key=lambda kv: -kv[1])},
            "top": [{"name": n[:120], "ms": round(ms, 4)} for n, ms in ranked[:top]]}


def mok_timeline(step) -> list[dict]:
    """One more step (forward, or backward: the step runs only the backward) with the megakernels'
    per-task stamps on; the summary of every rank."""
    from megatron_mok import ops, timeline

    records = timeline.new_records(1 << 17, torch.device("cuda", torch.cuda.current_device()))
    torch.cuda.synchronize()
    ops.megakernel_timeline(records)
    try:
        step()
        torch.cuda.synchronize()
    finally:
        ops.megakernel_timeline(None)
    summaries = [None] * dist.get_world_size()
    dist.all_gather_object(summaries, timeline.summarize(records, kinds=timeline.BWD_KINDS if PASS == "bwd"
                                                         else timeline.KINDS))
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


def backend_alltoall(c, dev):
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
    I = c["I"]
    leaves = None
    if PASS == "bwd":
        leaves = {n: c[n].detach().clone().requires_grad_(True) for n in ("x", "fc1", "fc2", "sfc1", "sfc2")}
        probs_dense = probs_dense.requires_grad_(True)
        c = dict(c, **leaves)
    fc1t, fc2t = c["fc1"].transpose(1, 2), c["fc2"].transpose(1, 2)

    def step():
        tok, pp = disp.dispatch_preprocess(c["x"], routing_map, probs_dense)
        tok, pp = disp.token_dispatch(tok, pp)
        tok, tpe, pp = disp.dispatch_postprocess(tok, pp)
        offs = torch.cumsum(tpe, 0).to(device=dev, dtype=torch.int32)
        h = torch._grouped_mm(tok, fc1t, offs=offs)
        a = (F.silu(h[:, :I]) * h[:, I:] * pp.unsqueeze(1)).to(torch.bfloat16)  # Megatron: probs in the activation
        y = torch._grouped_mm(a, fc2t, offs=offs)
        y = disp.combine_preprocess(y)
        y = disp.token_combine(y)
        return disp.combine_postprocess(y) + shared_expert(c)

    if PASS == "bwd":
        torch.cuda.synchronize()
        before = torch.cuda.memory_allocated(dev)
        out = step()
        torch.cuda.synchronize()
        SAVED_BYTES["alltoall"] = torch.cuda.memory_allocated(dev) - before - out.numel() * out.element_size()
        grad = _grad_out(c, dev)
        inputs = [leaves["x"], probs_dense, leaves["fc1"], leaves["fc2"], leaves["sfc1"], leaves["sfc2"]]

        def bwd_step():
            return torch.autograd.grad(out, inputs, grad_outputs=grad, retain_graph=True)[0]

        return bwd_step, None
    return step, None


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

    return step, None


def _symm_a2a_backward(c, dev, bufs, order, ids, splits, back_order, arange_out):
    """The symm_a2a forward once, differentiable (the exchanges as autograd functions), and a step
    that runs its backward, as the alltoall baseline does (retain_graph; returns dx)."""
    T, H, k, nle, I = c["T"], c["H"], c["k"], c["nle"], c["I"]
    leaves = {n: c[n].detach().clone().requires_grad_(True) for n in ("x", "probs", "fc1", "fc2", "sfc1", "sfc2")}
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
    grad = _grad_out(c, dev)
    inputs = [leaves[n] for n in ("x", "probs", "fc1", "fc2", "sfc1", "sfc2")]

    def bwd_step():
        return torch.autograd.grad(out, inputs, grad_outputs=grad, retain_graph=True)[0]

    return bwd_step, None


BACKEND_FNS = {"mok": backend_mok, "mok_staged": backend_mok_staged, "mok_recompute": backend_mok_recompute,
               "mok_ab": backend_mok_ab,
               "alltoall": backend_alltoall,
               "symm_a2a": backend_symm_a2a}


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


def matmul_roofline(dev) -> float:
    n = 8192
    a = torch.randn(n, n, device=dev, dtype=torch.bfloat16)
    b = torch.randn(n, n, device=dev, dtype=torch.bfloat16)
    for _ in range(3):
        a @ b
    torch.cuda.synchronize()
    times = []
    for _ in range(20):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        a @ b
        e.record()
        torch.cuda.synchronize()
        times.append(s.elapsed_time(e))
    times.sort()
    return 2 * n**3 / (times[len(times) // 2] * 1e-3) / 1e12


@contextlib.contextmanager
def env_var(name: str, value: str):
    """Set an environment variable for the block (the kernels read some per launch)."""
    old = os.environ.get(name)
    os.environ[name] = value
    try:
        yield
    finally:
        if old is None:
            os.environ.pop(name)
        else:
            os.environ[name] = old


def mok_breakdown(c, dev, iters: int) -> dict:
    """Time each launch of the stage-2 (staged) mok forward separately (same ops as
    kernel_path.forward(path="staged")); the megakernel runs as one launch and is not split."""
    from megatron_mok import MoKConfig, get_workspace, kernel_path as kp, ops

    cfg = MoKConfig()
    ws = get_workspace(None, dev, c["T"], c["H"], c["k"], c["E"], cfg)
    comm = kp._comm(ws)
    T, H, k, I = c["T"], c["H"], c["k"], c["I"]
    xs, x_ptrs = comm.buffer("x", (T, H), torch.bfloat16)
    comb, comb_ptrs = comm.buffer("comb", (T * k, H), torch.bfloat16)
    names = ["schedule", "copy_x+barrier", "dispatch", "shared_gemm1", "routed_gemm1", "routed_gemm2",
             "shared_gemm2", "combine", "barrier", "epilogue"]
    per = {n: [] for n in names}
    bf = dict(dtype=torch.bfloat16, device=dev)
    for it in range(iters + 3):
        ev = [torch.cuda.Event(enable_timing=True) for _ in range(len(names) + 1)]
        ev[0].record()
        sched = kp.build_schedule(cfg, ws, c["top"])
        ev[1].record()
        xs.copy_(c["x"])
        ops.barrier(comm.state, ws.errors, comm.flag_ptrs, ws.rank, cfg.peer_timeout_s)
        ev[2].record()
        cap = sched.capacity
        xr = torch.empty((cap, H), **bf)
        ops.dispatch(sched.row_src_rank, sched.row_src_slot, sched.expert_offsets, xr, x_ptrs, k)
        ev[3].record()
        sa = torch.empty((T, I), **bf)
        ops.grouped_gemm(c["x"], c["sfc1"], None, sa, True)
        ev[4].record()
        act = torch.empty((cap, I), **bf)
        ops.grouped_gemm(xr, c["fc1"], sched.expert_offsets, act, True, 0, sched.expert_counts)
        ev[5].record()
        y = torch.empty((cap, H), **bf)
        ops.grouped_gemm(act, c["fc2"], sched.expert_offsets, y, False, 0, sched.expert_counts)
        ev[6].record()
        sy = torch.empty((T, H), **bf)
        ops.grouped_gemm(sa, c["sfc2"], None, sy, False)
        ev[7].record()
        ops.combine(y, sched.row_src_rank, sched.row_src_slot, sched.expert_offsets, comm.state, comb_ptrs)
        ev[8].record()
        ops.barrier(comm.state, ws.errors, comm.flag_ptrs, ws.rank, cfg.peer_timeout_s)
        ev[9].record()
        out = torch.empty((T, H), **bf)
        ops.moe_epilogue(comb, c["probs"], sy, out)
        ev[10].record()
        torch.cuda.synchronize()
        if it >= 3:
            for i, n in enumerate(names):
                per[n].append(ev[i].elapsed_time(ev[i + 1]))
    mine = torch.tensor([per[n] for n in names], dtype=torch.float64, device=dev)
    allr = [torch.empty_like(mine) for _ in range(dist.get_world_size())]
    dist.all_gather(allr, mine)
    mx = torch.stack(allr).max(dim=0).values.median(dim=1).values.tolist()
    ws.check_errors(blocking=True)
    return dict(zip(names, mx))


def mok_gate(shape: str, dev, seed: int) -> float:
    """mok vs the fp32 reference at T=256 with the shape's real H, I, E, k."""
    from megatron_mok import MoKConfig, create_workspace, functional, reference
    from megatron_mok.schedule import build_schedule_reference

    c = make_case(shape, 256, "random", seed + 17, dev)
    cfg = MoKConfig()
    ws = create_workspace(None, dev, c["T"], c["H"], c["k"], c["E"], cfg)
    sched = functional.build_schedule(cfg, ws, c["top"])
    out, _ = functional.forward(cfg, ws, sched, c["x"], c["probs"], c["fc1"], c["fc2"], c["sfc1"], c["sfc2"])
    ref_sched = build_schedule_reference(ws, c["top"])
    f = lambda t: t.float()  # noqa: E731
    ref, _ = reference.forward(ws, ref_sched, f(c["x"]), c["probs"], f(c["fc1"]), f(c["fc2"]), f(c["sfc1"]),
                               f(c["sfc2"]))
    ws.check_errors(blocking=True)
    err = torch.tensor([float((out.float() - ref).norm() / ref.norm())], device=dev)
    dist.all_reduce(err, op=dist.ReduceOp.MAX)
    return float(err)


# ---- driver -----------------------------------------------------------------------------------------


def run_cases(args, backends, dev) -> list[dict]:
    ep = dist.get_world_size()
    rows = []
    shapes = list(SHAPES) if args.shape == "all" else args.shape.split(",")
    for shape in shapes:
        gate = gate_error = None
        if "mok" in backends and not args.skip_gate:
            try:
                gate = mok_gate(shape, dev, args.seed)
                log(f"[gate] {shape}: mok vs fp32 reference rel err {gate:.3e} ({'ok' if gate <= 1e-2 else 'FAIL'})")
            except Exception as exc:  # noqa: BLE001
                gate = float("nan")
                gate_error = f"{type(exc).__name__}: {str(exc).splitlines()[0][:160]}"
                log(f"[gate] {shape}: ERROR {gate_error}")
                gc.collect()
                torch.cuda.empty_cache()
        for T in [int(t) for t in args.tokens.split(",")]:
            try:
                c = make_case(shape, T, args.routing, args.seed, dev)
            except torch.OutOfMemoryError as exc:  # e.g. all experts of a large model on one GPU (EP=1)
                err = f"inputs do not fit on one GPU at EP={ep}: {str(exc).splitlines()[0][:120]}"
                log(f"{shape:16s} T={T:5d} ERROR {err}")
                rows += [dict(shape=shape, tokens=T, backend=be, ep=ep, routing=args.routing, pass_=PASS,
                              status="error", error=err) for be in backends]
                gc.collect()
                torch.cuda.empty_cache()
                dist.barrier()
                continue
            flops = 6 * T * c["k"] * c["H"] * c["I"] + 6 * T * c["H"] * c["Is"]
            if PASS == "bwd":
                flops *= 2
            ref_out = ref_bits = None
            for be in backends:
                row = dict(shape=shape, tokens=T, backend=be, ep=ep, routing=args.routing, flops_per_rank=flops,
                           pass_=PASS)
                if be == "mok_ab" or (be == "mok" and args.breakdown):
                    row["ab_env"] = "=".join(AB_ENV)
                if PASS == "bwd" and be not in BWD_BACKENDS and not be.startswith(("mok@", "mok%")):
                    row.update(status="error", error=f"--pass bwd supports {BWD_BACKENDS}, not {be}")
                    rows.append(row)
                    continue
                step = out = None
                try:
                    if be == "mok" and gate is not None:
                        row["gate_rel_err_vs_fp32_reference"] = gate
                        if gate_error is not None:
                            raise RuntimeError(f"the correctness gate could not run ({gate_error})")
                        if not gate <= 1e-2:
                            raise RuntimeError(f"correctness gate failed (rel err {gate})")
                    if "%" in be:  # mok with a kernel switch (same bits, checked), after any @fields
                        step, _ = backend_mok_env(c, dev, be, parse_env_backend(be), overrides=config_overrides(be))
                    elif "@" in be:  # mok with MoKConfig fields set (knobs: same bits, checked)
                        step, _ = backend_mok(c, dev, name=be, overrides=config_overrides(be))
                    else:
                        step, _ = BACKEND_FNS[be](c, dev)
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
                    log(f"{shape} T={T} {be}: first step done")
                    saved = os.path.join(args.tmp_dir, f"mok_out_{PASS}_{shape}_{T}_{args.routing}_rank{dist.get_rank()}.pt")
                    if be == "mok":
                        ref_out = out.float().clone()
                        ref_bits = out.clone()
                        torch.save(out.cpu(), saved)  # the symm_a2a child compares against it
                    elif ref_out is None and os.path.exists(saved):
                        ref_out = torch.load(saved).to(dev).float()
                    if be != "mok" and ref_out is not None:
                        e = torch.tensor([float((out.float() - ref_out).norm() / ref_out.norm())], device=dev)
                        dist.all_reduce(e, op=dist.ReduceOp.MAX)
                        row["rel_err_vs_mok"] = float(e)
                    if (be in ("mok_staged", "mok_recompute", "mok_ab") or be.startswith(("mok@", "mok%"))) \
                            and ref_bits is not None:
                        same = torch.tensor([int(torch.equal(out.view(torch.int16), ref_bits.view(torch.int16)))],
                                            device=dev)
                        dist.all_reduce(same, op=dist.ReduceOp.MIN)
                        row["bitwise_equal_to_mok"] = bool(same.item())
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
                            log(f"    {kern['ms']:8.3f}  {kern['name'][:100]}")
                    if args.timeline and be.startswith("mok") and "MOK_BWD_KERNEL=staged" not in be \
                            and (PASS == "bwd" or forward_runs_megakernel(be)):
                        row["timeline"] = mok_timeline(step)
                        t = row["timeline"][0]
                        log(f"  timeline rank 0: span {t['span_us']} us, SM time {t['leader_time']}, "
                            + ", ".join(f"{k} {v['tasks']} x {v['tile_us_mean']} us" for k, v in t["per_kind"].items()))
                    if be == "mok" and args.breakdown:
                        row["stages_ms"] = mok_breakdown(c, dev, args.iters)
                        with env_var(*AB_ENV):
                            row["stages_ms_ab"] = mok_breakdown(c, dev, args.iters)
                        for key, label in (("stages_ms", "default"), ("stages_ms_ab", "=".join(AB_ENV))):
                            log(f"  mok stages, {label} (ms, median of max over ranks): "
                                + ", ".join(f"{k}={v:.3f}" for k, v in row[key].items()))
                except Exception as exc:  # noqa: BLE001
                    row.update(status="error", error=f"{type(exc).__name__}: {exc}")
                    if dist.get_rank() == 0:
                        traceback.print_exc()
                rows.append(row)
                if row["status"] == "ok":
                    log(f"{shape:16s} T={T:5d} {be:10s} {row['ms']:8.3f} ms  {row['tflops']:6.1f} TFLOP/s"
                        + (f"  err_vs_mok={row['rel_err_vs_mok']:.2e}" if "rel_err_vs_mok" in row else "")
                        + (f"  bitwise_vs_mok={row['bitwise_equal_to_mok']}" if "bitwise_equal_to_mok" in row
                           else "")
                        + (f"  saved={row['saved_bytes_per_token'] / 1024:.1f} KiB/token"
                           if "saved_bytes_per_token" in row else "")
                        + (f"  bwd_peak={row['bwd_peak_bytes_per_token'] / 1024:.1f} KiB/token"
                           if "bwd_peak_bytes_per_token" in row else ""))
                else:
                    log(f"{shape:16s} T={T:5d} {be:10s} ERROR {row['error']}")
                step = out = None  # release this backend's buffers before the next one
                gc.collect()
                torch.cuda.synchronize()
                torch.cuda.empty_cache()
                dist.barrier()
            del c, ref_out, ref_bits
            torch.cuda.empty_cache()
        if "mok" in backends:
            from megatron_mok import clear_workspace_cache

            clear_workspace_cache()
            torch.cuda.empty_cache()
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
           "--backends", "symm_a2a", "--pass", args.pass_, "--iters", str(args.iters), "--warmup", str(args.warmup), "--routing",
           args.routing, "--seed", str(args.seed), "--_child-out", out_path, "--skip-gate", "--tmp-dir", args.tmp_dir] + (["--kernels"] if args.kernels else [])
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
            rows = [dict(shape=s, tokens=int(t), backend="symm_a2a", ep=world, status="error",
                         error=f"symm_a2a child process: {rc}")
                    for s in (list(SHAPES) if args.shape == "all" else args.shape.split(","))
                    for t in args.tokens.split(",")]
    return rows


def result_path(gpu: str, ep: int, pas: str) -> str:
    slug = gpu.lower().replace("nvidia", "").strip().replace(" ", "-") or "gpu"
    day = datetime.date.today().isoformat()
    return os.path.join(ROOT, "bench", "results", f"{day}_{slug}_ep{ep}_{pas}.json")


def main() -> None:
    global AB_ENV
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shape", default="deepseek-v3", help=f"one of {list(SHAPES)}, a comma list, or 'all'")
    p.add_argument("--tokens", default="2048,4096", help="tokens per GPU, comma list")
    p.add_argument("--backends", default="mok,alltoall,symm_a2a")
    p.add_argument("--pass", dest="pass_", default="fwd", choices=["fwd", "bwd"],
                   help="fwd: the layer forward; bwd: the layer backward alone (see above)")
    p.add_argument("--iters", type=int, default=50)
    p.add_argument("--warmup", type=int, default=10)
    p.add_argument("--routing", default="random", choices=["random", "skewed"])
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--skip-gate", action="store_true")
    p.add_argument("--out", default=None, help="JSON path (default bench/results/<date>_<gpu>_ep<N>_<pass>.json)")
    p.add_argument("--tmp-dir", default="/tmp")
    p.add_argument("--child-timeout", type=float, default=600, help="seconds for the symm_a2a child processes")
    p.add_argument("--breakdown", action="store_true",
                   help="also time each mok stage separately, by default and with --ab-env (stages_ms_ab)")
    p.add_argument("--kernels", action="store_true",
                   help="GPU time per kernel of each backend (torch profiler, 5 iterations, rank 0)")
    p.add_argument("--timeline", action="store_true",
                   help="one more run of each mok megakernel backend with the per-task timeline (forward or backward)")
    p.add_argument("--ab-env", default="=".join(AB_ENV),
                   help="NAME=VALUE of a kernel switch (same bits) for the mok_ab backend and --breakdown's second run")
    p.add_argument("--_child-out", dest="child_out", default=None, help=argparse.SUPPRESS)
    args = p.parse_args()
    global PASS
    PASS = args.pass_
    backends = [b for b in args.backends.split(",") if b]
    for b in backends:
        if b.startswith("mok@"):
            from megatron_mok import MoKConfig

            try:
                MoKConfig(**config_overrides(b))
            except (TypeError, ValueError) as exc:
                p.error(f"backend {b!r}: {exc}")
        elif b.startswith("mok%"):
            try:
                parse_env_backend(b)
            except ValueError as exc:
                p.error(str(exc))
        elif b not in BACKENDS:
            p.error(f"unknown backend {b!r}; choose from {BACKENDS}, mok@FIELD=VALUE+FIELD=VALUE or mok%NAME=VALUE[%NAME=VALUE]")

    if args.child_out is not None:
        import torch.distributed._symmetric_memory as symm_mem

        symm_mem.set_backend("NVSHMEM")
    local = int(os.environ.get("LOCAL_RANK", "0"))
    torch.cuda.set_device(local)
    dev = torch.device("cuda", local)
    if "RANK" not in os.environ:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        os.environ.update(RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("nccl", device_id=dev)
    ep = dist.get_world_size()
    name, _, value = args.ab_env.partition("=")
    if not name.startswith("MOK_") or not value:
        p.error(f"--ab-env wants NAME=VALUE of a MOK_ kernel switch, got {args.ab_env!r}")
    AB_ENV = (name, value)

    if args.child_out is not None:  # symm_a2a child
        rows = run_cases(args, ["symm_a2a"], dev)
        if dist.get_rank() == 0:
            with open(args.child_out, "w") as f:
                json.dump(rows, f)
        dist.barrier()
        dist.destroy_process_group()
        return

    t0 = time.time()
    roof = matmul_roofline(dev)
    log(f"bf16 matmul 8192^3: {roof:.1f} TFLOP/s (roofline of this run)")
    in_proc = [b for b in backends if b != "symm_a2a"]
    rows = run_cases(args, in_proc, dev) if in_proc else []
    if "symm_a2a" in backends:
        from megatron_mok import clear_workspace_cache

        clear_workspace_cache()
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        dist.barrier()
        rows += run_symm_child(args, dev)
    for r in rows:
        if r.get("status") == "ok":
            r["roofline_frac"] = r["tflops"] / roof
    if dist.get_rank() == 0:
        gpu = torch.cuda.get_device_name(dev)
        path = args.out or result_path(gpu, ep, args.pass_)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        doc = {}
        if os.path.exists(path):
            with open(path) as f:
                doc = json.load(f)
        old = {(r["shape"], r["tokens"], r["backend"], r.get("routing", "random")): r for r in doc.get("results", [])}
        for r in rows:
            old[(r["shape"], r["tokens"], r["backend"], r.get("routing", "random"))] = r
        doc.update(
            command=os.environ.get("MOK_BENCH_CMD", " ".join([sys.executable] + sys.argv)),
            argv=sys.argv, torch=torch.__version__, cuda=torch.version.cuda, gpu=gpu, ep=ep, pass_=args.pass_,
            date=datetime.date.today().isoformat(), matmul_8192_tflops=roof, seconds=time.time() - t0,
            env={k: os.environ.get(k) for k in (*NO_MULTICAST_ENV, "MOK_FORWARD", "MOK_BACKWARD", "MOK_GEMM_SKIP_PAD",
                                                "MOK_GEMM_PAIRED", "MOK_GEMM_EXPERT", "MOK_BWD_OVERLAP",
                                                "MOK_BWD_GEMM", "MOK_WGRAD_TMA_STORE", "MOK_TOKEN_DEDUP")},
            results=sorted(old.values(), key=lambda r: (r["shape"], r["tokens"], r["backend"])))
        if os.environ.get("MOK_BENCH_NOTE"):
            doc["note"] = os.environ["MOK_BENCH_NOTE"]
        with open(path, "w") as f:
            json.dump(doc, f, indent=1)
        print(f"wrote {path}")
        print(f"\n{'shape':16s} {'T':>5s} {'backend':10s} {'ms':>8s} {'TFLOP/s':>8s} {'roof%':>6s}")
        for r in doc["results"]:
            if r.get("status") == "ok":
                print(f"{r['shape']:16s} {r['tokens']:5d} {r['backend']:10s} {r['ms']:8.3f} {r['tflops']:8.1f} "
                      f"{100 * r.get('roofline_frac', 0):6.1f}")
            else:
                print(f"{r['shape']:16s} {r['tokens']:5d} {r['backend']:10s}    ERROR {r.get('error', '')[:60]}")
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
