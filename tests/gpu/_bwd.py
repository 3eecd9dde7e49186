"""Helpers of the backward GPU tests: fp32 reference gradients, poisoning, bitwise comparison."""

from __future__ import annotations

import torch

GRAD_NAMES = ("dx", "dprobs", "dfc1", "dfc2", "dshared_fc1", "dshared_fc2")


def grads_list(g) -> list:
    return [g.dx, g.dprobs, g.dfc1, g.dfc2, g.dshared_fc1, g.dshared_fc2]


def reference_grads(ws, sched_ref, x, probs, fc1, fc2, sfc1, sfc2, grad_out) -> list:
    """fp32 reference gradients on the same (bf16-valued) inputs, in GRAD_NAMES order."""
    from megatron_mok import reference

    f = lambda t: None if t is None else t.float()  # noqa: E731
    ctx = reference.recompute_forward_context(ws, sched_ref, f(x), f(fc1), f(fc2), f(sfc1))
    return list(reference.backward(ws, sched_ref, ctx, f(grad_out), f(x), probs, f(fc1), f(fc2), f(sfc1), f(sfc2)))


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return float((out.float() - ref.float()).norm() / ref.float().norm().clamp_min(1e-30))


def check_close(got: list, ref: list, tol: float = 1e-2) -> dict:
    """Every gradient finite and within ``tol`` (relative, Frobenius) of the reference."""
    errs = {}
    for name, a, b in zip(GRAD_NAMES, got, ref):
        assert (a is None) == (b is None), f"{name}: {a is None} vs reference {b is None}"
        if a is None:
            continue
        assert a.shape == b.shape, f"{name}: shape {tuple(a.shape)} vs {tuple(b.shape)}"
        assert torch.isfinite(a.float()).all(), f"{name}: non-finite elements"
        errs[name] = rel_err(a, b)
        assert errs[name] <= tol, f"{name}: rel err {errs[name]:.3e} > {tol}"
    return errs


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.int16 if t.element_size() == 2 else torch.int32)


def assert_bitwise(a: list, b: list, what: str = "") -> None:
    for name, x, y in zip(GRAD_NAMES, a, b):
        assert (x is None) == (y is None), f"{what} {name}: None mismatch"
        if x is not None:
            assert x.dtype == y.dtype and x.shape == y.shape, f"{what} {name}: dtype/shape differ"
            assert torch.equal(_bits(x), _bits(y)), f"{what} {name}: bits differ"


def clone_all(lst: list) -> list:
    return [None if t is None else t.clone() for t in lst]


def assert_empty_experts_zero(grads, sched) -> int:
    """Experts without rows have exactly zero weight gradients; returns how many were checked."""
    counts = sched.expert_counts.cpu()
    n = 0
    for e in range(counts.numel()):
        if int(counts[e]) == 0:
            n += 1
            assert bool((grads.dfc1[e] == 0).all()), f"dfc1[{e}] of an expert without rows is not exactly zero"
            assert bool((grads.dfc2[e] == 0).all()), f"dfc2[{e}] of an expert without rows is not exactly zero"
    return n


def poison_all(ws) -> None:
    """NaN-fill every float symmetric buffer of the kernel path (forward and backward ones)."""
    from megatron_mok import kernel_path

    c = kernel_path._COMMS.get(ws)
    if c is None:
        return
    for (_name, _shape, dtype), (buf, _ptrs) in c.buffers.items():
        if dtype in (torch.bfloat16, torch.float32):
            buf.fill_(float("nan"))


def poison_ctx_tail(ctx, sched) -> None:
    """NaN-fill the rows of the forward context past the last segment (the backward must not read them)."""
    total = int(sched.expert_offsets[-1])
    for t in (ctx.x_routed, ctx.act, ctx.y_routed, ctx.h):
        if t is not None:
            t[total:] = float("nan")
