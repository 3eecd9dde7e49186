"""Thin wrappers over the compiled ``torch.ops.megatron_mok.*`` kernels (csrc/), with fake impls.

Nothing here computes anything on the host: every wrapper enqueues device work on the current
stream. Peer buffers are passed as lists of addresses (``handle.buffer_ptrs`` of torch symmetric
memory, rank order). ``is_available()`` says whether the extension was built and loads.

Every op returns nothing and writes only the tensors its schema marks as mutated (plus, for the
communication ops, peers' symmetric buffers addressed by the int lists), so ``register_fake``
impls are no-ops and torch.compile can trace calls.
"""

from __future__ import annotations

import math

import torch

_AVAILABLE: bool | None = None
_LOAD_ERROR: str | None = None

# Must match kChunk in csrc/kernels/schedule.cu (tokens per block of the schedule passes).
SCHEDULE_CHUNK = 256


def _load() -> bool:
    global _AVAILABLE, _LOAD_ERROR
    if _AVAILABLE is None:
        try:
            from . import _C  # noqa: F401  (registers torch.ops.megatron_mok.*)

            _AVAILABLE = hasattr(torch.ops.megatron_mok, "grouped_gemm")
            if _AVAILABLE:
                _register_fakes()
        except (ImportError, OSError) as exc:  # not built, or built for another torch
            _AVAILABLE, _LOAD_ERROR = False, f"{type(exc).__name__}: {exc}"
    return _AVAILABLE


def is_available() -> bool:
    """True when the CUDA extension ``megatron_mok._C`` is built, loads, and a GPU is visible."""
    return _load() and torch.cuda.is_available()


def load_error() -> str | None:
    """Why the extension did not load (None if it did or was not tried)."""
    _load()
    return _LOAD_ERROR


def _register_fakes() -> None:
    def _noop(*args, **kwargs):
        return None

    for name in ("gather_routing", "barrier", "build_schedule", "dispatch", "grouped_gemm", "combine", "moe_epilogue"):
        torch.library.register_fake(f"megatron_mok::{name}")(_noop)


def _ops():
    if not _load():
        raise RuntimeError(f"megatron_mok CUDA extension is not available ({_LOAD_ERROR})")
    return torch.ops.megatron_mok


def schedule_scratch_ints(ep: int, num_tokens: int, nle: int, num_experts: int) -> int:
    return nle * ep * math.ceil(num_tokens / SCHEDULE_CHUNK) + num_experts


def gather_routing(top_experts, state, peer_bufs: list[int], rank: int, num_experts: int) -> None:
    _ops().gather_routing(top_experts, state, peer_bufs, rank, num_experts)


def barrier(state, errors, peer_flags: list[int], rank: int, timeout_s: float, bump_gather: bool = False) -> None:
    _ops().barrier(state, errors, peer_flags, rank, float(timeout_s), int(bump_gather))


def build_schedule(routing_buf, state, errors, top_all, row_src_rank, row_src_slot, expert_counts, expert_offsets,
                   scratch, rank: int, num_experts: int) -> None:
    _ops().build_schedule(routing_buf, state, errors, top_all, row_src_rank, row_src_slot, expert_counts,
                          expert_offsets, scratch, rank, num_experts)


def dispatch(row_src_rank, row_src_slot, expert_offsets, x_routed, peer_x: list[int], topk: int,
             num_ctas: int = 0) -> None:
    _ops().dispatch(row_src_rank, row_src_slot, expert_offsets, x_routed, peer_x, topk, num_ctas)


def grouped_gemm(a, b, seg_offsets, out, swiglu: bool, num_ctas: int = 0, seg_counts=None) -> None:
    """out = a @ b[seg]^T per 128-row segment (swiglu: b rows are [gate; up], out = silu(g) * u).

    seg_counts: real rows per segment; the remaining rows of each segment must be zero rows of
    ``a`` (their outputs are written as zeros without being computed).
    """
    _ops().grouped_gemm(a, b, seg_offsets, seg_counts, out, swiglu, num_ctas)


def combine(y, row_src_rank, row_src_slot, expert_offsets, state, peer_comb: list[int], num_ctas: int = 0) -> None:
    _ops().combine(y, row_src_rank, row_src_slot, expert_offsets, state, peer_comb, num_ctas)


def moe_epilogue(comb, probs, shared_y, out) -> None:
    _ops().moe_epilogue(comb, probs, shared_y, out)
