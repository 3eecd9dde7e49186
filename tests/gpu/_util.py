"""Shared helpers of the GPU tests: inputs, routings, the fp32 reference, poisoning, shared checks,
two-rank suites."""

from __future__ import annotations

import os
import socket
import traceback

import pytest
import torch

from megatron_mok import MoKConfig, create_workspace

NO_MULTICAST_ENV = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}
for _k, _v in NO_MULTICAST_ENV.items():  # NVLink multicast must stay off, also in spawned workers
    os.environ[_k] = _v


def extension_ready() -> tuple[bool, str]:
    if not torch.cuda.is_available():
        return False, "no CUDA device"
    from megatron_mok import ops

    if not ops.is_available():
        return False, f"megatron_mok._C not available ({ops.load_error()})"
    return True, ""


def gpu_marks() -> list:
    ok, why = extension_ready()
    return [pytest.mark.gpu, pytest.mark.skipif(not ok, reason=why)]


def two_gpu_marks() -> list:
    ok, why = extension_ready()
    return [
        pytest.mark.gpu,
        pytest.mark.multigpu,
        pytest.mark.skipif(not ok, reason=why),
        pytest.mark.skipif(ok and torch.cuda.device_count() < 2, reason="needs 2 GPUs"),
    ]


def cuda_path():
    from megatron_mok import cuda

    return cuda


SHAPES = [  # T, H, I, Is, E, k
    (256, 256, 128, 128, 8, 2),
    (300, 384, 192, 0, 16, 4),
    (517, 512, 320, 256, 32, 8),
    (128, 1024, 512, 512, 4, 1),
]

EP2_CASES = [  # kind, (T, H, I, Is, E, k)
    ("random", (256, 256, 128, 128, 8, 2)),
    ("skewed", (300, 384, 192, 0, 16, 4)),
    ("one_expert", (517, 512, 320, 256, 32, 8)),
    ("half_empty", (1024, 512, 256, 256, 16, 4)),
    ("random", (2048, 1024, 512, 512, 64, 8)),
]


def make_routing(kind: str, T: int, k: int, E: int, gen: torch.Generator) -> torch.Tensor:
    """int64 [T, k] distinct expert ids per token."""
    if kind == "random":
        return torch.rand(T, E, generator=gen).argsort(dim=1)[:, :k].contiguous()
    if kind == "skewed":  # Zipf-like expert popularity
        w = 1.0 / torch.arange(1, E + 1, dtype=torch.float64) ** 1.5
        w = w[torch.randperm(E, generator=gen)]
        return torch.multinomial(w.expand(T, E), k, replacement=False, generator=gen)
    if kind == "one_expert":  # every token holds experts 0..k-1 (slot order shuffled): the rest get none
        return torch.rand(T, k, generator=gen).argsort(dim=1)
    if kind == "half_empty":  # only even experts receive tokens
        even = torch.arange(0, E, 2)
        return even[torch.rand(T, even.numel(), generator=gen).argsort(dim=1)[:, :k]]
    raise ValueError(kind)


def make_inputs(T, H, I, Is, nle, k, gen, device, dtype=torch.bfloat16):
    x = torch.randn(T, H, generator=gen).to(dtype)
    logits = torch.randn(T, k, generator=gen)
    probs = torch.softmax(logits, dim=1).float()
    fc1 = (torch.randn(nle, 2 * I, H, generator=gen) / H**0.5).to(dtype)
    fc2 = (torch.randn(nle, H, I, generator=gen) / I**0.5).to(dtype)
    sfc1 = sfc2 = None
    if Is:
        sfc1 = (torch.randn(2 * Is, H, generator=gen) / H**0.5).to(dtype)
        sfc2 = (torch.randn(H, Is, generator=gen) / Is**0.5).to(dtype)
    to = lambda t: None if t is None else t.to(device)  # noqa: E731
    return to(x), to(probs), to(fc1), to(fc2), to(sfc1), to(sfc2)


def make_case(shape, kind: str, seed: int, dev, cfg=None, world: int = 1):
    """(cfg, ws, top, inputs, gen) of one layer of ``shape`` (T, H, I, Is, E, k), E // world local experts;
    ``gen`` continues the seeded stream the inputs and routing were drawn from."""
    T, H, I, Is, E, k = shape
    gen = torch.Generator().manual_seed(seed)
    cfg = MoKConfig() if cfg is None else cfg
    ws = create_workspace(None, dev, T, H, k, E, cfg)
    inputs = make_inputs(T, H, I, Is, E // world, k, gen, dev)
    top = make_routing(kind, T, k, E, gen).to(dev)
    return cfg, ws, top, inputs, gen


def reference_out(ws, sched_ref, x, probs, fc1, fc2, sfc1, sfc2) -> torch.Tensor:
    """fp32 reference output on the same (bf16-valued) inputs."""
    from megatron_mok import reference

    f = lambda t: None if t is None else t.float()  # noqa: E731
    out, _ = reference.forward(ws, sched_ref, f(x), probs, f(fc1), f(fc2), f(sfc1), f(sfc2))
    return out


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return float((out.float() - ref.float()).norm() / ref.float().norm().clamp_min(1e-30))


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.int16 if t.element_size() == 2 else torch.int32)


def gemm_bits_over_cta_counts(run, rows: int, N: int, swiglu: bool, cta_counts, device) -> tuple:
    """run(out, pre_out, ctas) for every CTA count on NaN-poisoned bf16 outputs (out [rows, N], and
    with swiglu pre_out [rows, 2 N], else None); every count must give the first one's bits.
    Returns the first (out, pre_out)."""
    first = None
    for ctas in cta_counts:
        out = torch.full((rows, N), float("nan"), dtype=torch.bfloat16, device=device)
        h = torch.full((rows, 2 * N), float("nan"), dtype=torch.bfloat16, device=device) if swiglu else None
        run(out, h, ctas)
        if first is None:
            first = (out, h)
            continue
        assert torch.equal(bits(out), bits(first[0])), f"bits depend on the CTA count ({ctas})"
        if swiglu:
            assert torch.equal(bits(h), bits(first[1])), f"pre_out bits depend on the CTA count ({ctas})"
    return first


def poison_buffers(ws, dtypes) -> None:
    """NaN-fill the kernel path's symmetric buffers of the given dtypes."""
    from megatron_mok.cuda.comm import _COMMS

    c = _COMMS.get(ws)
    if c is None:
        return
    for (_name, _shape, dtype), (buf, _ptrs) in c.buffers.items():
        if dtype in dtypes:
            buf.fill_(float("nan"))


def poison_internal(ws) -> None:
    """NaN-fill the kernel path's reusable symmetric data buffers (x copy, combine slots)."""
    poison_buffers(ws, (torch.bfloat16,))


def schedules_equal(a, b) -> list[str]:
    bad = []
    for name in ("top_experts_all", "row_src_rank", "row_src_slot", "expert_counts", "expert_offsets"):
        ta, tb = getattr(a, name), getattr(b, name)
        if ta.shape != tb.shape or ta.dtype != tb.dtype or not torch.equal(ta, tb):
            bad.append(name)
    return bad


def check_forward_bitwise_repeats(shape, cfgs, seed: int, dev, world: int = 1, reps: int = 20) -> None:
    """``reps`` forwards per config of ``cfgs`` (own workspace each), with varying CTA knobs: all bitwise
    equal to the first output."""
    kp = cuda_path()
    T, H, I, Is, E, k = shape
    gen = torch.Generator().manual_seed(seed)
    inputs = make_inputs(T, H, I, Is, E // world, k, gen, dev)
    top = make_routing("skewed", T, k, E, gen).to(dev)
    base = None
    for cfg in cfgs:
        ws = create_workspace(None, dev, T, H, k, E, cfg)
        sched = kp.build_schedule(cfg, ws, top)
        for rep in range(reps):
            knobs = dict(gemm_ctas=[0, 1, 7, 100][rep % 4], comm_ctas=[0, 1, 13][rep % 3])
            out, _ = kp.forward(cfg, ws, sched, *inputs, **knobs)
            base = out.clone() if base is None else base
            assert torch.equal(out, base), f"bits differ at rep {rep} {knobs} {cfg}"
        ws.check_errors(blocking=True)


def eager_before_capture(fn, before_capture=None):
    """``fn()`` on a side stream (the eager warm-up of a CUDA graph capture), waited for; then
    ``before_capture()``. Returns what ``fn`` returned."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        result = fn()
    torch.cuda.current_stream().wait_stream(s)
    torch.cuda.synchronize()
    if before_capture is not None:
        before_capture()
    return result


def check_forward_graph_equals_eager(cfg, ws, top, inputs, before_capture=None):
    """Eager forward on a side stream (creates the buffers), then schedule + forward captured in a CUDA
    graph: 3 replays on NaN-filled outputs equal the eager output. Returns (graph, its output)."""
    kp = cuda_path()
    eager = eager_before_capture(lambda: kp.forward(cfg, ws, kp.build_schedule(cfg, ws, top), *inputs)[0].clone(),
                                 before_capture)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out_g, _ = kp.forward(cfg, ws, kp.build_schedule(cfg, ws, top), *inputs)
    for _ in range(3):
        out_g.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out_g, eager), "graph replay differs from eager"
    return graph, out_g


# ---- two-rank suites ---------------------------------------------------------------------------


def check_stalled_peer_times_out(ws, run, rank: int) -> None:
    """Rank 0 calls ``run()`` alone (rank 1 skips it, as a stalled peer would): its device barriers
    must give up after the workspace's peer timeout and report rank 1, not hang. Both ranks must
    have created the buffers ``run`` uses before (a collective step)."""
    import torch.distributed as dist

    from megatron_mok.workspace import MoKPeerTimeoutError

    torch.cuda.synchronize()
    dist.barrier()
    if rank == 0:
        run()
        torch.cuda.synchronize()
        try:
            ws.check_errors(blocking=True)
        except MoKPeerTimeoutError as exc:
            assert "rank 1" in str(exc), str(exc)
        else:
            raise AssertionError("no MoKPeerTimeoutError")
    torch.cuda.synchronize()


def make_check(lines: list):
    """``check(name, fn)``: run ``fn``, append 'PASS name [what fn returned]' or 'FAIL name: why' to
    ``lines``, then synchronize the device and all ranks."""
    import torch.distributed as dist

    def check(name, fn):
        try:
            info = fn()
            lines.append(f"PASS {name}" + (f" {info}" if info else ""))
        except Exception as exc:  # noqa: BLE001 - reported per check
            lines.append(f"FAIL {name}: {type(exc).__name__}: {exc}\n{traceback.format_exc()}")
        torch.cuda.synchronize()
        dist.barrier()

    return check


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _suite_worker(rank: int, world: int, port: int, out_dir: str, suite) -> None:
    os.environ.update(NO_MULTICAST_ENV)
    import torch.distributed as dist

    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            device_id=torch.device("cuda", rank))
    try:
        lines = suite(rank, world)
    finally:
        try:
            dist.destroy_process_group()
        except Exception:  # noqa: BLE001
            pass
    with open(os.path.join(out_dir, f"rank{rank}.txt"), "w") as f:
        f.write("\n".join(lines))


def run_two_rank_suite(suite, tmp_path) -> None:
    """Run ``suite(rank, world)`` (a module-level function returning 'PASS name' / 'FAIL name: why'
    lines) on 2 GPUs over NCCL; print the PASS/FAIL lines and fail if any check failed."""
    import torch.multiprocessing as mp

    os.environ.update(NO_MULTICAST_ENV)
    mp.spawn(_suite_worker, args=(2, _free_port(), str(tmp_path), suite), nprocs=2, join=True)
    report = []
    for r in range(2):
        report += [f"rank{r} {line}" for line in (tmp_path / f"rank{r}.txt").read_text().splitlines()
                   if line.startswith(("PASS", "FAIL"))]
    full = "\n".join((tmp_path / f"rank{r}.txt").read_text() for r in range(2))
    print("\n".join(report))
    assert not any(" FAIL " in f" {line}" for line in report), full
