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

from .config import TILE_ROWS

_AVAILABLE: bool | None = None
_LOAD_ERROR: str | None = None

# Must match kChunk in csrc/kernels/comm/schedule.cu (tokens per block of the schedule passes).
SCHEDULE_CHUNK = 256
# Must match csrc/kernels/passes/persistent.cuh (kHeader ints), then (megakernel.cu) 1 per routed
# m-tile, 1 per routed token chunk (at most nle + capacity / 256), 1 per shared m-tile.
MEGA_COUNTER_HEADER = 4
CHUNK_ROWS = 256
# Must match xgemm::kMaxSeg in csrc/kernels/gemm/expert_gemm.cuh: segments (local experts) per launch.
EXPERT_GEMM_MAX_SEGMENTS = 512


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

    for name in ("barrier", "barrier_open", "publish_barrier", "build_schedule", "dispatch", "dispatch_e4m3",
                 "grouped_gemm", "combine", "moe_epilogue", "moe_epilogue_wait", "megakernel", "megakernel_timeline",
                 "bwd_publish", "bwd_pull", "bwd_dprobs", "expert_dgrad", "expert_wgrad", "bwd_push", "bwd_epilogue_wait",
                 "expert_gemm_fp8", "quantize_rows_e4m3", "dequantize_rows_e4m3", "quantize_weight_e4m3",
                 "quantize_columns_e4m3", "expert_wgrad_fp8", "barrier_reject"):
        torch.library.register_fake(f"megatron_mok::{name}")(_noop)


def _ops():
    if not _load():
        raise RuntimeError(f"megatron_mok CUDA extension is not available ({_LOAD_ERROR})")
    return torch.ops.megatron_mok


def schedule_scratch_ints(ep: int, num_tokens: int, nle: int, num_experts: int) -> int:
    """int32 scratch of ``build_schedule`` (per-chunk counts, then the histogram; no init needed)."""
    return nle * ep * math.ceil(num_tokens / SCHEDULE_CHUNK) + num_experts


def megakernel_counter_ints(capacity: int, num_tokens: int, num_local_experts: int) -> int:
    """int32 counters of the forward megakernel."""
    return (MEGA_COUNTER_HEADER + capacity // TILE_ROWS + num_local_experts + capacity // CHUNK_ROWS
            + math.ceil(num_tokens / TILE_ROWS))


def publish_barrier(src, dst, state, errors, peer_flags: list[int], rank: int, timeout_s: float,
                    schedule=None) -> None:
    """``dst`` (this rank's symmetric buffer) <- ``src``, then a device barrier (one launch). ``schedule``
    (the call's MoKSchedule, optional): emptied by the barrier once this rank is stopped (a peer's
    verdict or a header mismatch, ``errors[HEADER_MISMATCH]``), so no later kernel touches a peer's rows."""
    _ops().publish_barrier(src, dst, state, errors, peer_flags, rank, float(timeout_s),
                           *((schedule.expert_counts, schedule.expert_offsets) if schedule is not None else ()))


def barrier(state, errors, peer_flags: list[int], rank: int, timeout_s: float, bump_gather: bool = False,
            schedule=None) -> None:
    """A device barrier; ``schedule``: as ``publish_barrier``'s."""
    _ops().barrier(state, errors, peer_flags, rank, float(timeout_s), int(bump_gather),
                   *((schedule.expert_counts, schedule.expert_offsets) if schedule is not None else ()))


def barrier_open(state, peer_flags: list[int], rank: int) -> None:
    """The opening half of a device barrier: this rank's next epoch into every peer's flags, after the
    stream's earlier kernels (``bwd_epilogue_wait`` closes it)."""
    _ops().barrier_open(state, peer_flags, rank)


def barrier_reject(state, errors, peer_flags: list[int], rank: int, verdict: int, bump_gather: bool = False) -> None:
    """This rank's host checks failed: its verdict word (megatron_mok/header.py) into the barrier its
    peers wait in, without waiting (bump_gather: that barrier is the schedule's)."""
    _ops().barrier_reject(state, errors, peer_flags, rank, int(verdict), int(bump_gather))


def build_schedule(*, top_experts, routing_buf, state, errors, top_all, row_src_rank, row_src_slot, expert_counts,
                   expert_offsets, scratch, peer_bufs: list[int], peer_flags: list[int], rank: int, num_experts: int,
                   timeout_s: float, header: list[int] | None = None) -> None:
    """Routing all-gather by peer stores (into ``peer_bufs``; ``routing_buf`` is this rank's), the
    barrier that completes it, and this rank's schedule: one launch. ``header``: the call's header
    (megatron_mok/header.py; the barrier buffers then hold ``header.barrier_flag_ints(ep)`` ints),
    compared across the ranks by the barrier (``errors[HEADER_MISMATCH]``); None: no check."""
    _ops().build_schedule(top_experts, routing_buf, state, errors, top_all, row_src_rank, row_src_slot,
                          expert_counts, expert_offsets, scratch, peer_bufs, peer_flags, rank, num_experts,
                          float(timeout_s), list(header or []))


def dispatch(row_src_rank, row_src_slot, expert_offsets, x_routed, peer_x: list[int], topk: int,
             num_ctas: int = 0) -> None:
    _ops().dispatch(row_src_rank, row_src_slot, expert_offsets, x_routed, peer_x, topk, num_ctas)


def dispatch_e4m3(row_src_rank, row_src_slot, expert_offsets, q_routed, scale_t, peer_q: list[int],
                  peer_s: list[int], scale_pitch: int, topk: int, num_ctas: int = 0) -> None:
    """The e4m3 dispatch: the routed rows ``q_routed`` [cap, H] e4m3 from the peers' [T, H] rows, and
    their scales from the peers' [T, scale_pitch] fp32 rows into ``scale_t`` [H / 128, >= cap] (the
    layout ``expert_gemm_fp8`` reads). Padding rows get zero rows and zero scales."""
    _ops().dispatch_e4m3(row_src_rank, row_src_slot, expert_offsets, q_routed, scale_t, peer_q, peer_s, scale_pitch,
                         topk, num_ctas)


def grouped_gemm(a, b, seg_offsets, out, swiglu: bool, num_ctas: int = 0, seg_counts=None, pre_out=None) -> None:
    """out = a @ b[seg]^T per 128-row segment (swiglu: b rows are [gate; up], out = silu(g) * u).

    seg_counts: real rows per segment; the remaining rows of each segment must be zero rows of
    ``a`` (their outputs are written as zeros without being computed). pre_out (swiglu only,
    ``[rows, 2N]``): also receives the bf16 pre-activations ``a @ b[seg]^T``.
    """
    _ops().grouped_gemm(a, b, seg_offsets, seg_counts, out, pre_out, swiglu, num_ctas)


def quantize_rows_e4m3(x: torch.Tensor, rows_end: torch.Tensor | None = None, gate_up_pairs: bool = False):
    """x [rows, K] bf16 -> (q [rows, K] e4m3, scale [K / 128, ld] fp32), as ``fp8.quantize_rows``.

    One scale per (row, 128 columns), stored transposed (``scale[kb, row]``, pitch ``ld`` = rows
    rounded up to 4) for ``expert_gemm_fp8``. rows_end (optional int32 device scalar): only rows
    below it are quantized (the routed rows of a segment layout); the others are left as they were.
    gate_up_pairs: x holds [gate | up], q its columns in gate/up pair order (``fp8.pair_columns``).
    """
    q, scale = empty_rows_e4m3(*x.shape, x.device)
    quantize_rows_e4m3_into(x, q, scale, rows_end, gate_up_pairs=gate_up_pairs)
    return q, scale


def empty_rows_e4m3(rows: int, k: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """Uninitialized (q [rows, k] e4m3, scale [k / 128, ld] fp32, ld = rows rounded up to 4): the
    token-row operand of ``expert_gemm_fp8`` as ``quantize_rows_e4m3`` lays it out."""
    q = torch.empty((rows, k), dtype=torch.float8_e4m3fn, device=device)
    return q, torch.empty((k // 128, -(-rows // 4) * 4), dtype=torch.float32, device=device)


def quantize_rows_e4m3_into(x, q, scale, rows_end=None, scale_rows: bool = False, gate_up_pairs: bool = False) -> None:
    """``quantize_rows_e4m3`` into given tensors; scale_rows: ``scale[row, kb]`` ([>= rows, >= K / 128],
    one row per token, as the dispatch moves them) instead of ``scale[kb, row]``."""
    _ops().quantize_rows_e4m3(x, q, scale, rows_end, scale_rows, gate_up_pairs)


def dequantize_rows_e4m3(q, scale, out, rows_end=None, scale_rows: bool = False) -> None:
    """out [rows, K] bf16 = e4m3 q times its (row, 128-column) scale, rounded once (scales as in
    ``quantize_rows_e4m3_into``); rows at or past rows_end are left as they were."""
    _ops().dequantize_rows_e4m3(q, scale, out, rows_end, scale_rows)


def quantize_weight_e4m3(w: torch.Tensor, swiglu: bool, transposed: bool = False):
    """w [nseg, rows, K] bf16 -> (q e4m3, scale [nseg, tiles, K / 128] fp32), the bits of
    ``fp8.quantize_weight`` (tiles of 128 rows; swiglu: gate rows 64 t .. 64 t + 63 with the same
    up rows). transposed: also (q_t [nseg, K, tiles * 128], scale_t [nseg, K / 128, tiles]), the bits
    of ``E4M3Weight.transposed`` (whole tiles only), written by the same pass."""
    nseg, rows, k = w.shape
    n = rows // 2 if swiglu else rows
    tiles = -(-n // (64 if swiglu else 128))
    q = torch.empty((nseg, rows, k), dtype=torch.float8_e4m3fn, device=w.device)
    scale = torch.empty((nseg, tiles, k // 128), dtype=torch.float32, device=w.device)
    if not transposed:
        _ops().quantize_weight_e4m3(w, q, scale, swiglu)
        return q, scale
    q_t = torch.empty((nseg, k, tiles * 128), dtype=torch.float8_e4m3fn, device=w.device)
    scale_t = torch.empty((nseg, k // 128, tiles), dtype=torch.float32, device=w.device)
    _ops().quantize_weight_e4m3(w, q, scale, swiglu, q_t, scale_t)
    return q, scale, q_t, scale_t


def expert_gemm_fp8(x8, x_scale, w8, w_scale, seg_offsets, seg_counts, out, swiglu: bool, pre_out=None,
                    num_ctas: int = 0, h=None, push=None, dh_e4m3=None, row_w=None, act=None, dot=None) -> None:
    """The routed GEMM of ``grouped_gemm`` (segments with real-row counts) on e4m3 operands:
    x8/x_scale from ``quantize_rows_e4m3``, w8/w_scale from ``fp8.quantize_weight`` (its ``q`` and
    ``scale``). out (and pre_out) bf16, as ``grouped_gemm`` writes them. h, row_w, act, dot (the
    backward's down-projection dgrad, plain weights, e.g. fc2's transposed copy): out = dh [rows, 2 N],
    the SwiGLU backward of ``expert_dgrad``.
    push = (row_src_rank, row_src_slot, peer_comb) (plain weights): the rows also go into their
    source slots, the stores of ``combine``, from the epilogue. Tasks: the gate/up GEMM (swiglu)
    runs column tasks (the weights on wgmma's M side, up to 256 token rows) in 2-CTA clusters that
    share the token rows by multicast; the others run row tasks (<= 128 token rows on the M side
    against two 128-row weight tiles) in 2-CTA clusters whose chunk pairs share each weight tile.
    dh_e4m3 = (q [rows, 2 N] e4m3, scale [2 N / 128, ld] fp32) (with h): dh's e4m3 copy as well, the
    bits of ``quantize_rows_e4m3(dh, offsets[-1:], gate_up_pairs=True)``, written by the row tasks'
    epilogue."""
    rank_of, slot_of, peers = push if push is not None else (None, None, [])
    dh_q, dh_q_scale = dh_e4m3 if dh_e4m3 is not None else (None, None)
    _ops().expert_gemm_fp8(x8, x_scale, w8, w_scale, seg_offsets, seg_counts, out, pre_out, swiglu, num_ctas, h,
                           rank_of, slot_of, peers, dh_q, dh_q_scale, row_w, act, dot)


def combine(y, row_src_rank, row_src_slot, expert_offsets, state, peer_comb: list[int], num_ctas: int = 0) -> None:
    _ops().combine(y, row_src_rank, row_src_slot, expert_offsets, state, peer_comb, num_ctas)


def moe_epilogue(comb, probs, shared_y, out, errors=None) -> None:
    """``out[t] = sum_s probs[t, s] * comb[t * k + s]`` in slot order (fp32) ``+ shared_y[t]``, cast once;
    ``errors`` (optional): NaN/inf router weights are flagged there as ``functional.flag_nonfinite_probs``
    does."""
    _ops().moe_epilogue(comb, probs, shared_y, out, errors)


def moe_epilogue_wait(comb, probs, shared_y, out, state, errors, peer_flags: list[int], rank: int,
                      timeout_s: float) -> None:
    """The epilogue behind the closing half of the barrier that ``megakernel`` opened."""
    _ops().moe_epilogue_wait(comb, probs, shared_y, out, state, errors, peer_flags, rank, float(timeout_s))


def megakernel(*, x, fc1, fc2, shared_fc1, shared_fc2, row_src_rank, row_src_slot, expert_counts, expert_offsets,
               x_routed, act, h, y_routed, shared_act, shared_h, shared_y, counters, state, errors,
               peer_x: list[int], peer_comb: list[int], peer_flags: list[int], rank: int, topk: int, num_comm: int,
               num_compute: int, minibatch_rows: int, timeout_s: float) -> None:
    """The persistent forward megakernel (csrc/kernels/passes/megakernel.cu, bf16): dispatch, shared
    and routed expert GEMMs, push-combine, and the opening half of the closing barrier, in one
    launch. ``h`` / ``shared_h`` (optional): also keep the gate/up pre-activations for the
    backward; the shared-expert tensors are all given or all None."""
    _ops().megakernel(x, fc1, fc2, shared_fc1, shared_fc2, row_src_rank, row_src_slot, expert_counts, expert_offsets,
                      x_routed, act, h, y_routed, shared_act, shared_h, shared_y, counters, state, errors, peer_x,
                      peer_comb, peer_flags, rank, topk, num_comm, num_compute, minibatch_rows, float(timeout_s))


def megakernel_timeline(records=None) -> None:
    """Profiling: with ``records`` (CUDA int64 [n > 1024, 8], zeroed) every later megakernel launch
    stamps each task into it (``megatron_mok.tools.timeline`` reads it); None turns the stamps off. The
    tensor must stay alive while it is on."""
    if records is None:
        _ops().megakernel_timeline(torch.empty((0, 8), dtype=torch.int64, device="cuda"), False)
    else:
        _ops().megakernel_timeline(records, True)


# ---- backward (csrc/kernels/passes/backward.cu) -----------------------------------------------------


def bwd_publish(grad_out, g_dst, probs, p_dst, state, errors, peer_flags: list[int], rank: int,
                timeout_s: float, header: list[int] | None = None, schedule=None) -> None:
    """``g_dst`` <- ``grad_out`` (bf16 [T, H]) and ``p_dst`` <- ``probs`` (fp32 [T, k]): this rank's
    symmetric buffers; then a device barrier (one launch) that carries ``header`` like
    ``build_schedule``'s (None: no check); ``schedule``: as ``publish_barrier``'s."""
    _ops().bwd_publish(grad_out, g_dst, probs, p_dst, state, errors, peer_flags, rank, float(timeout_s),
                       list(header or []),
                       *((schedule.expert_counts, schedule.expert_offsets) if schedule is not None else ()))


def bwd_pull(row_src_rank, row_src_slot, expert_offsets, g_rows, row_w, peer_g: list[int], peer_p: list[int],
             topk: int, num_ctas: int = 0, q=None, q_scale=None) -> None:
    """Routed row i: ``g_rows[i]`` = the source rank's grad_out row as it is, ``row_w[i]`` = its
    router weight (padding rows: zeros). ``q``/``q_scale``: the rows also in e4m3 with their scales
    ``[H / 128, ld]``, the bits of ``quantize_rows_e4m3(g_rows)`` (the fp8 dgrad's operand)."""
    _ops().bwd_pull(row_src_rank, row_src_slot, expert_offsets, g_rows, row_w, peer_g, peer_p, topk, num_ctas, q,
                    q_scale)


def bwd_dprobs(dot, row_src_rank, row_src_slot, expert_offsets, peer_dw: list[int]) -> None:
    """Routed row i's router-weight gradient, ``sum(dot[i])`` in column order (the down dgrad's dot
    pieces), -> slot ``row_src_slot[i]`` of the source's ``peer_dw`` (padding rows: nothing)."""
    _ops().bwd_dprobs(dot, row_src_rank, row_src_slot, expert_offsets, peer_dw)


def dot_pieces(rows: int, n: int, device) -> torch.Tensor:
    """The ``dot`` buffer of a down dgrad with n output columns: [rows, ceil(n / 64)] fp32."""
    return torch.empty((rows, -(-n // 64)), dtype=torch.float32, device=device)


def expert_dgrad(dy, w, seg_offsets, seg_counts, out, h=None, num_ctas: int = 0, row_w=None, act=None,
                 dot=None) -> None:
    """``out[r] = dy[r] @ w[e]`` for the rows r of segment e (``w`` ``[nseg, K, M]``, as
    ``torch._grouped_mm(dy, w, offs=seg_offsets[1:])``), on the expert-major GEMM; rows of a segment
    past ``seg_counts[e]`` get zeros. With ``h`` (``[rows, 2M] = [gate | up]``), the SwiGLU backward
    of ``da = bf16(dy @ w[e])`` in fp32: ``out = [d_gate | d_up]`` (``[rows, 2M]``) of ``w * da``
    (``row_w`` ``[rows]``: the router weight per row; None: 1), ``d_gate = d * up * sig * (1 + gate *
    (1 - sig))``, ``d_up = d * silu(gate)``; ``act`` (``[rows, M]``): ``bf16(w * silu(gate) * up)``;
    ``dot`` (``dot_pieces``): per 64 columns ``sum da * silu(gate) * up`` (``bwd_dprobs`` sums them)."""
    _ops().expert_dgrad(dy, w, seg_offsets, seg_counts, out, h, num_ctas, row_w, act, dot)


def expert_wgrad(a, a_offsets, b, b_offsets, counts, out, num_ctas: int = 0) -> None:
    """``out[e] = a[rows of e]^T @ b[rows of e]`` (``[nseg, M, N]``; fp32 accumulation over the rows
    in ascending order, one rounding): expert e's ``counts[e]`` rows start at ``a_offsets[e]`` in
    ``a`` (``[rows, M]``) and ``b_offsets[e]`` in ``b`` (``[rows', N]``); the rows up to the next
    multiple of 16 are read too and must be zero in ``a`` or ``b``. Experts without rows get zeros.
    Parts: offsets ``[P, nseg + 1]`` and counts ``[P, nseg]`` give P row layouts inside ``a`` and
    ``b`` (e.g. P micro-batches), summed part after part into the one accumulator.
    ``out`` bf16 is written; ``out`` fp32 gets the product added (``out[e] +=``, in fp32, no bf16
    rounding; Megatron's ``main_grad``), and experts without rows add nothing."""
    _ops().expert_wgrad(a, a_offsets, b, b_offsets, counts, out, num_ctas)


def empty_columns_e4m3(x, counts):
    """Uninitialised ``(q_t, scale)`` for ``quantize_columns_e4m3(x, ..., counts)``."""
    rows, c = x.shape
    return (torch.empty((c, -(-rows // 16) * 16), dtype=torch.float8_e4m3fn, device=x.device),
            torch.empty((counts.numel(), c), dtype=torch.float32, device=x.device))


def quantize_columns_e4m3(x, offsets, counts, x_scale=None, scale_rows: bool = False, out=None):
    """Expert-segmented rows x ``[rows, C]`` (bf16, or e4m3 with its 128-column scales ``x_scale``:
    ``[C / 128, ld]``, or ``[rows, >= C / 128]`` with scale_rows) -> ``(q_t [C, ld] e4m3, scale [nseg, C]
    fp32)``, the transpose that ``expert_wgrad_fp8`` reads: per expert e and column c, ``scale[e, c] =
    max(amax, 1e-4) / 448`` over the expert's ``counts[e]`` rows from ``offsets[e]`` and ``q_t[c, r] =
    e4m3(x[r, c] / scale[e, c])`` (as ``fp8.quantize_columns``). Each expert's columns of q_t are written
    up to its row count rounded up to 128, inside its segment (rows past the count as zeros; the
    padded layout's segments, multiples of 128); ``ld`` = rows rounded up to 16. ``out``: the pair
    from ``empty_columns_e4m3`` to write (allocated on another stream than the launch's)."""
    q_t, scale = empty_columns_e4m3(x, counts) if out is None else out
    _ops().quantize_columns_e4m3(x, x_scale, scale_rows, offsets, counts, q_t, scale)
    return q_t, scale


def expert_wgrad_fp8(a_t, a_scale, b_t, b_scale, offsets, counts, out, num_ctas: int = 0) -> None:
    """``out[e] = (a_t[:, rows of e] @ b_t[:, rows of e]^T) * a_scale[e][:, None] * b_scale[e][None, :]``
    (``[nseg, M, N]`` bf16, or fp32 added into as in ``expert_wgrad``), the e4m3 twin of
    ``expert_wgrad``: ``a_t [M, ld]``, ``b_t [N, ld]`` and their scales from ``quantize_columns_e4m3``
    of one row layout; the tensor cores sum the expert's rows (rounded up to 32) and the epilogue
    applies both scales. Experts without rows get zeros."""
    _ops().expert_wgrad_fp8(a_t, a_scale, b_t, b_scale, offsets, counts, out, num_ctas)


def bwd_push(rows, row_src_rank, row_src_slot, expert_offsets, state, peer_slots: list[int],
             peer_flags: list[int], rank: int, num_ctas: int = 0) -> None:
    """Routed row i -> slot ``row_src_slot[i]`` of rank ``row_src_rank[i]``'s ``[T * k, H]`` buffer,
    then the opening half of a barrier (``bwd_epilogue_wait`` closes it)."""
    _ops().bwd_push(rows, row_src_rank, row_src_slot, expert_offsets, state, peer_slots, peer_flags, rank, num_ctas)


def bwd_epilogue_wait(slots, dw_slots, shared_dx, dx, dprobs, state, errors, peer_flags: list[int], rank: int,
                      timeout_s: float) -> None:
    """Close the barrier, ``dx[t] = sum_s slots[t, s]`` (fp32, slot order) ``+ shared_dx[t]``, cast once;
    ``dprobs = dw_slots``."""
    _ops().bwd_epilogue_wait(slots, dw_slots, shared_dx, dx, dprobs, state, errors, peer_flags, rank,
                             float(timeout_s))
