"""Shared helpers of the GPU tests: inputs, routings, the fp32 reference, poisoning."""

from __future__ import annotations

import os
import socket

import torch

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


def reference_out(ws, sched_ref, x, probs, fc1, fc2, sfc1, sfc2) -> torch.Tensor:
    """fp32 reference output on the same (bf16-valued) inputs."""
    from megatron_mok import reference

    f = lambda t: None if t is None else t.float()  # noqa: E731
    out, _ = reference.forward(ws, sched_ref, f(x), probs, f(fc1), f(fc2), f(sfc1), f(sfc2))
    return out


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return float((out.float() - ref.float()).norm() / ref.float().norm().clamp_min(1e-30))


def poison_internal(ws) -> None:
    """NaN-fill the kernel path's reusable symmetric data buffers (x copy, combine slots)."""
    from megatron_mok import kernel_path

    c = kernel_path._COMMS.get(ws)
    if c is None:
        return
    for (name, _shape, dtype), (buf, _ptrs) in c.buffers.items():
        if dtype == torch.bfloat16:
            buf.fill_(float("nan"))


def schedules_equal(a, b) -> list[str]:
    bad = []
    for name in ("top_experts_all", "row_src_rank", "row_src_slot", "expert_counts", "expert_offsets"):
        ta, tb = getattr(a, name), getattr(b, name)
        if ta.shape != tb.shape or ta.dtype != tb.dtype or not torch.equal(ta, tb):
            bad.append(name)
    return bad


# ---- two-rank suites ---------------------------------------------------------------------------


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
