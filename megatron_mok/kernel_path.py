"""The CUDA path of the mok layer: the compiled kernels of csrc/ behind the functional API.

``build_schedule`` and ``forward`` have the semantics and return types of the reference ones
(``megatron_mok.schedule.build_schedule_reference``, ``megatron_mok.reference.forward``) and
follow docs/ARCHITECTURE.md. They never synchronise with the host (no ``.item()``, ``.tolist()``,
``.cpu()``, no data-dependent shapes), so a whole layer forward can be captured in a CUDA graph
once the workspace's symmetric buffers exist (the first call on a workspace creates them; that
first call is collective and host-blocking, like ``symm_mem.rendezvous``).

Schedule (1 launch): routing all-gather by peer stores, its barrier, count, scan and fill, phases
separated by in-kernel releases (csrc/kernels/schedule.cu).

Forward, per rank, two implementations with the same bits (``path=`` or ``MOK_FORWARD``):

* ``"mega"`` (default, stage 4), 3 launches:
  1. ``publish_barrier``: copy ``x`` into this rank's symmetric ``x`` buffer, device barrier;
  2. ``megakernel``: the first ``fwd_comm_sms`` CTAs pull-dispatch the scheduled rows from the
     peers' ``x`` buffers (then compute); all CTAs run one fixed task list (shared gate/up, shared
     down, then per minibatch routed gate/up and down tiles) behind local ready counters; the
     down-GEMM epilogue pushes each routed output row into its slot of the source rank's
     symmetric ``[T * k, H]`` buffer; the last CTA opens the closing barrier;
  3. ``moe_epilogue_wait``: closes the barrier, then ``out[t] = sum_s probs[t, s] * slot[t, s]``
     in fp32 in slot order, plus the shared expert output, cast once; it flags non-finite
     ``probs`` (``ErrorCode.NONFINITE_PROBS``), as the staged path's epilogue does.
* ``"staged"`` (stage 2), one launch per step: copy x, barrier, dispatch, 4 grouped GEMMs,
  combine, barrier, epilogue.

fp8 (``MoKConfig.precision``), either path: x is quantized into symmetric e4m3 rows and scale
rows (then a barrier), the dispatch moves those, and the routed GEMMs run block-scaled e4m3; the
megakernel quantizes the SwiGLU output per 128-column block as its gate/up tasks finish, the
staged path in a launch of its own. The default for fp8 is the staged path (faster at 8 of 10
measured shapes).

Device barriers are epoch counters in a symmetric int32 buffer of this module (not torch's
signal pad); a peer that does not arrive within ``MoKConfig.peer_timeout_s`` sets
``ws.errors[PEER_TIMEOUT] = 1 + peer`` and the kernels go on instead of hanging (results are then
garbage; ``ws.check_errors`` raises ``MoKPeerTimeoutError``). After a timeout the workspace's
barrier epochs no longer agree across ranks: create a new workspace.

Supported by the kernels: bf16 ``x`` and weights, fp32 ``probs``, ``H``, ``I`` and ``Is``
multiples of 8, ``T <= 65535``, EP size <= 72. Other inputs run the reference path.
"""

from __future__ import annotations

import dataclasses
import os
import warnings
import weakref

import torch
import torch.distributed as dist

from . import fp8, ops, reference
from .config import MoKConfig
from .schedule import MoKSchedule, validate_top_experts
from .workspace import MoKWorkspace

STATE_INTS = 16  # csrc/kernels/launch.h: StateSlot
FORWARD_PATHS = ("mega", "staged")
# Default forward implementation (MOK_FORWARD=mega or staged; the same bits either way). Unset: the
# megakernel for bf16, the staged launches for fp8, the faster path of each (docs/KERNELS.md, ninth
# session: the fp8 megakernel measured 1-13% slower at 8 of 10 shapes).
FORWARD_PATH = os.environ.get("MOK_FORWARD") or None


def forward_path(path: str | None, precision: str = "bf16") -> str:
    """The forward path a call runs: ``path``, else ``FORWARD_PATH``, else the precision's default."""
    path = path or FORWARD_PATH or ("staged" if precision == "fp8" else "mega")
    if path not in FORWARD_PATHS:
        raise ValueError(f"megatron_mok: forward path must be one of {FORWARD_PATHS}, got {path!r}")
    return path


# Waits inside the megakernel depend on no peer: they give up after at most this long (a bug, not
# a slow peer), so a stall ends the kernel with an error instead of hanging the GPU.
MEGA_WATCHDOG_S = 10.0


@dataclasses.dataclass
class KernelContext:
    """What the forward keeps for the backward (bf16; freshly allocated per call).

    Rows at or past ``sched.expert_offsets[nle]`` are never written (undefined); padding rows
    inside an expert segment hold zeros in ``x_routed`` (and the matching GEMM outputs).
    ``h`` / ``shared_h``: the gate/up pre-activations, written by the same GEMM epilogue that
    activates them (``MoKConfig.save_gate_up``); None: the backward recomputes them with that GEMM
    (same bits, one gate/up GEMM more, 2 I (2 Is) bf16 less per routed row (token)).
    fp8 (``MoKConfig.precision``): the rows were dispatched in e4m3 (``x_e4m3``, ``x_scale``: half
    the bytes); the backward dequantizes them (``routed_rows``) into a tensor of its own. ``h`` is always kept (a bf16
    recompute would not give the e4m3 GEMM's values).
    """

    x_routed: torch.Tensor | None  # [cap, H] dispatched rows (fp8: None until the backward dequantizes)
    act: torch.Tensor  # [cap, I] silu(x_routed @ gate^T) * (x_routed @ up^T)
    y_routed: torch.Tensor  # [cap, H] unweighted expert outputs (router-weight gradient)
    shared_act: torch.Tensor | None  # [T, Is] SwiGLU output of the shared expert
    h: torch.Tensor | None = None  # [cap, 2I] [x_routed @ gate^T | x_routed @ up^T]
    shared_h: torch.Tensor | None = None  # [T, 2Is]
    x_e4m3: torch.Tensor | None = None  # fp8: [cap, H] the dispatched rows in e4m3
    # fp8: [>= cap, H / 128] their scales, a row per routed row: the transposed view of the GEMMs'
    # [H / 128, ld] layout
    x_scale: torch.Tensor | None = None

    def nbytes(self) -> int:
        """Bytes this context holds (the activation memory the layer keeps for its backward)."""
        return sum(t.numel() * t.element_size() for t in dataclasses.astuple(self) if isinstance(t, torch.Tensor))


class _Comm:
    """Symmetric buffers and device state of one workspace (created on first use, collectively)."""

    def __init__(self, ws: MoKWorkspace):
        self.ws = ws
        self.buffers: dict = {}
        self.state = torch.zeros(STATE_INTS, dtype=torch.int32, device=ws.device)
        flags, self.flag_ptrs = self.buffer("barrier_flags", (ws.ep_size,), torch.int32, init_zero=True)
        self.route_buf, self.route_ptrs = self.buffer(
            "routing", (2, ws.ep_size, ws.num_tokens, ws.topk), torch.int32)
        self._counters: dict = {}
        # the shared expert as one segment of the expert-major backward GEMMs: offsets [0, T], count [T]
        self.shared_seg = torch.tensor([0, ws.num_tokens, ws.num_tokens], dtype=torch.int32, device=ws.device)

    def counters(self, n: int, kernel: str = "fwd") -> torch.Tensor:
        """Local int32 ready counters of a megakernel ("fwd" or "bwd", one buffer each): zero at
        creation, zeroed again by the last CTA of every launch (so graph replays start from zero)."""
        key = (kernel, n)
        if key not in self._counters:
            self._counters[key] = torch.zeros((n,), dtype=torch.int32, device=self.ws.device)
        return self._counters[key]

    def buffer(self, name: str, shape: tuple[int, ...], dtype: torch.dtype, init_zero: bool = False):
        key = (name, tuple(shape), dtype)
        if key not in self.buffers:
            ws = self.ws
            if ws.ep_size == 1 and not dist.is_initialized():
                buf = torch.empty(shape, dtype=dtype, device=ws.device)
                ptrs = [buf.data_ptr()]
            else:
                buf, handle = ws.symmetric(f"mok.{name}", shape, dtype)
                ptrs = [int(p) for p in handle.buffer_ptrs]
            if init_zero:
                buf.zero_()
                if dist.is_initialized() and ws.ep_size > 1:
                    # No peer may store into this buffer before every rank has zeroed its own.
                    torch.cuda.synchronize(ws.device)
                    dist.barrier(group=ws.group)
            self.buffers[key] = (buf, ptrs)
        return self.buffers[key]


_COMMS: "weakref.WeakKeyDictionary[MoKWorkspace, _Comm]" = weakref.WeakKeyDictionary()


def _comm(ws: MoKWorkspace) -> _Comm:
    c = _COMMS.get(ws)
    if c is None:
        c = _COMMS[ws] = _Comm(ws)
    return c


def _unsupported_reason(ws: MoKWorkspace, x, fc1, shared_fc1) -> str | None:
    if x.dtype != torch.bfloat16:
        return f"x is {x.dtype} (kernels: bf16)"
    if ws.hidden % 8 or fc1.shape[1] % 16:
        return "H and I must be multiples of 8"
    if shared_fc1 is not None and shared_fc1.shape[0] % 16:
        return "Is must be a multiple of 8"
    if ws.num_tokens > 65535:
        return "T > 65535"
    if ws.ep_size > 72:
        return "EP size > 72"
    return None


_WARNED: set = set()


def _fallback(reason: str) -> None:
    if reason not in _WARNED:
        _WARNED.add(reason)
        warnings.warn(f"megatron_mok: running the reference path on CUDA: {reason}", stacklevel=3)


# ---- schedule -----------------------------------------------------------------------------------


def build_schedule(cfg: MoKConfig, ws: MoKWorkspace, top_experts: torch.Tensor) -> MoKSchedule:
    """All-gather the routing by peer stores and build this rank's schedule on the device.

    Bad expert ids, duplicates and capacity overflow (of any rank) are flagged in ``ws.errors``
    and raised by a later ``ws.check_errors()`` (no sync here).
    """
    validate_top_experts(ws, top_experts)
    c = _comm(ws)
    dev, ep, T, k, nle, cap = ws.device, ws.ep_size, ws.num_tokens, ws.topk, ws.num_local_experts, ws.capacity
    i32 = dict(dtype=torch.int32, device=dev)
    top_all = torch.empty((ep, T, k), **i32)
    row_src_rank = torch.empty((cap,), **i32)
    row_src_slot = torch.empty((cap,), **i32)
    counts = torch.empty((nle,), **i32)
    offsets = torch.empty((nle + 1,), **i32)
    scratch = torch.empty((ops.schedule_scratch_ints(ep, T, nle, ws.num_experts),), **i32)
    ops.build_schedule(top_experts.contiguous(), c.route_buf, c.state, ws.errors, top_all, row_src_rank, row_src_slot,
                       counts, offsets, scratch, c.route_ptrs, c.flag_ptrs, ws.rank, ws.num_experts,
                       cfg.peer_timeout_s)
    return MoKSchedule(top_all, row_src_rank, row_src_slot, counts, offsets)


# ---- forward ------------------------------------------------------------------------------------


def _x_e4m3_buffers(ws):
    """This rank's rows quantized by ``_publish_fp8``: the symmetric e4m3 row and scale-row buffers
    ((tensor, peer pointers) each) and the scale pitch in floats."""
    c = _comm(ws)
    T, H = ws.num_tokens, ws.hidden
    pitch = -(-(H // fp8.BLOCK) // 4) * 4  # whole 16-byte row pieces for the row copies
    # the row copies move bf16 pairs: e4m3 bytes and fp32 scales ride as bf16-typed rows
    return c.buffer("x_e4m3", (T, H // 2), torch.bfloat16), c.buffer("x_scale", (T, 2 * pitch), torch.bfloat16), pitch


def _scales_by_block(scale_rows: torch.Tensor, nkb: int) -> torch.Tensor:
    """Row scales [rows, >= nkb] (one row per token, as the dispatch moves them) -> [nkb, ld] (ld =
    rows rounded up to 4), the layout ``expert_gemm_fp8`` reads (a stage's row scales as one box)."""
    rows = scale_rows.shape[0]
    out = torch.empty((nkb, -(-rows // 4) * 4), dtype=torch.float32, device=scale_rows.device)
    out[:, :rows].copy_(scale_rows[:, :nkb].t())
    return out


def _published_x_e4m3(ws):
    """(x e4m3 [T, H], scales [H / 128, ld]) for ``expert_gemm_fp8`` from ``_publish_fp8``'s buffers
    (the bits of ``quantize_rows_e4m3(x)``; valid until the forward's closing barrier)."""
    (q_sym, _), (s_sym, _), _ = _x_e4m3_buffers(ws)
    return q_sym.view(torch.float8_e4m3fn), _scales_by_block(s_sym.view(torch.float32), ws.hidden // fp8.BLOCK)


def _publish_fp8(cfg, ws, x):
    """Quantize this rank's rows into symmetric buffers (one scale per row and 128 columns), then a
    barrier. Returns ``_x_e4m3_buffers``' answer: (e4m3 rows, their peer pointers), (scale rows, their
    peer pointers), scale pitch in floats."""
    c = _comm(ws)
    rows, scales, pitch = _x_e4m3_buffers(ws)
    ops.quantize_rows_e4m3_into(x.contiguous(), rows[0].view(torch.float8_e4m3fn), scales[0].view(torch.float32),
                                scale_rows=True)
    ops.barrier(c.state, ws.errors, c.flag_ptrs, ws.rank, cfg.peer_timeout_s)
    return rows, scales, pitch


def _token_dedup_enabled(ws) -> bool:
    """MOK_TOKEN_DEDUP=1 (at ep > 1): each remote token crosses NVLink once (``ops.pull_tokens``)
    and the routed rows copy it locally; same bits. Off by default: at DeepSeek-V3 EP=2 it measured
    no faster (docs/KERNELS.md, nineteenth session). Read per call."""
    return ws.ep_size > 1 and os.environ.get("MOK_TOKEN_DEDUP", "0") == "1"


def _pulled_once(ws, sched, sources, comm_ctas):
    """``sources``: per buffer (its symmetric tensor, its peer pointers). With token dedup, the remote
    tokens routed here are first pulled once into local copies (``ops.pull_tokens``). Returns the
    peer-pointer tables the dispatch then reads (own buffer, local copies; else the tables as given)
    and the copies, which the caller holds until its dispatch is enqueued: the tables are raw
    pointers, and a copy freed earlier can be handed to the dispatch's own output (a CUDA graph's
    capture did so: replay differed from eager)."""
    if not _token_dedup_enabled(ws):
        return [ptrs for _, ptrs in sources], []
    copies = [torch.empty((ws.ep_size, *buf.shape), dtype=buf.dtype, device=ws.device) for buf, _ in sources]
    (_, rows), *rest = sources
    ops.pull_tokens(sched.top_experts_all, ws.rank, ws.num_local_experts, rows, copies[0],
                    rest[0][1] if rest else None, copies[1] if rest else None, comm_ctas)
    return [ops.local_sources(ptrs, ws.rank, copy) for (_, ptrs), copy in zip(sources, copies)], copies


def _dispatch_fp8(cfg, ws, sched, x, comm_ctas, during_dispatch=None):
    """Quantized rows published (``_publish_fp8``), then pull the e4m3 rows and their scale rows:
    half the bytes of the bf16 dispatch, and T rows to quantize instead of the routed ones. Returns
    (x_e4m3 [cap, H], x_scale [H / 128, ld] fp32: the layout ``expert_gemm_fp8`` reads, written by
    the dispatch itself)."""
    H, k, cap = ws.hidden, ws.topk, sched.capacity
    rows, scales, pitch = _publish_fp8(cfg, ws, x)
    started = _mark(during_dispatch)
    (q_ptrs, s_ptrs), copies = _pulled_once(ws, sched, [rows, scales], comm_ctas)
    q_routed, s_routed = ops.empty_rows_e4m3(cap, H, ws.device)
    ops.dispatch_e4m3(sched.row_src_rank, sched.row_src_slot, sched.expert_offsets, q_routed, s_routed, q_ptrs, s_ptrs,
                      pitch, k, comm_ctas)
    del copies  # read by the dispatch (enqueued): freed in stream order
    if during_dispatch is not None:
        during_dispatch(started)
    return q_routed, s_routed


def quantize_expert_weights(fc1, fc2, transposed: bool = False, shared_fc1=None,
                            shared_fc2=None) -> fp8.FP8ExpertWeights:
    """``fp8.quantize_expert_weights`` on the device (the same bits; DeepSeek-V3's 128 local experts:
    4.3 ms, 6.1 ms with the transposed copies, ~113 ms in PyTorch); transposed: the dgrads' copies
    from the same pass; shared_fc1/shared_fc2: the shared expert's too (``_shared_weights_e4m3``)."""
    with torch.no_grad():
        w1 = ops.quantize_weight_e4m3(fc1.contiguous(), True, transposed)
        w2 = ops.quantize_weight_e4m3(fc2.contiguous(), False, transposed)
    if not transposed:
        out = fp8.FP8ExpertWeights(fp8.E4M3Weight(*w1, swiglu=True), fp8.E4M3Weight(*w2, swiglu=False))
    else:
        out = fp8.FP8ExpertWeights(fp8.E4M3Weight(*w1[:2], swiglu=True), fp8.E4M3Weight(*w2[:2], swiglu=False),
                                   fp8.E4M3Weight(*w1[2:], swiglu=False), fp8.E4M3Weight(*w2[2:], swiglu=False))
    if fp8.shared_in_e4m3(shared_fc1) and shared_fc2 is not None:
        out.shared = fp8.FP8ExpertWeights(*_shared_weights_e4m3(shared_fc1, shared_fc2))
    return out


def _shared_weights_e4m3(shared_fc1, shared_fc2=None) -> tuple[fp8.E4M3Weight, fp8.E4M3Weight | None]:
    """The shared expert's fc1 and fc2 (None: not quantized) in e4m3, as one-expert stacks."""
    with torch.no_grad():
        w1 = fp8.E4M3Weight(*ops.quantize_weight_e4m3(shared_fc1.contiguous().unsqueeze(0), True), swiglu=True)
        if shared_fc2 is None:
            return w1, None
        w2 = ops.quantize_weight_e4m3(shared_fc2.contiguous().unsqueeze(0), False)
    return w1, fp8.E4M3Weight(*w2, swiglu=False)


def _routed_dgrads_fp8(w8, dyq, dys, h, offsets, counts, dh, dx_rows, push=None, dh_done=None) -> None:
    """The routed dgrads on block-scaled e4m3 operands: dh = swiglu_backward(h, dy @ fc2[e]) from dy
    in e4m3 along H (dyq, dys: quantized by the pull) against fc2's transposed copy, then
    dx_rows = dh @ fc1[e] from dh quantized in gate/up pair blocks against fc1's transposed copy
    (rows up to the last segment's end). push = (row_src_rank, row_src_slot, peer slot buffers): the
    second GEMM's epilogue also stores the dx rows into their source slots (``bwd_push``'s stores).
    dh_done: called once dh is written (before the second GEMM's launch). dh's e4m3 copy comes from
    the first GEMM's epilogue (no quantizing pass between the two on the critical path)."""
    dhq, dhs = ops.empty_rows_e4m3(*dh.shape, dh.device)
    ops.expert_gemm_fp8(dyq, dys, w8.fc2_t.q, w8.fc2_t.scale, offsets, counts, dh, False, h=h, dh_e4m3=(dhq, dhs))
    if dh_done is not None:
        dh_done()
    ops.expert_gemm_fp8(dhq, dhs, w8.fc1_t.q, w8.fc1_t.scale, offsets, counts, dx_rows, False, push=push)


def _mark(wanted) -> torch.cuda.Event | None:
    """An event at this point of the current stream, if a side-stream launch will wait on it."""
    if wanted is None:
        return None
    ev = torch.cuda.Event()
    ev.record()
    return ev


def _routed_experts_fp8(sched, x_e4m3, x_scale, w8, act, h, y_routed, gemm_ctas, push=None) -> None:
    """The routed gate/up and down GEMMs on block-scaled e4m3 operands (the dispatched e4m3 rows and
    their [H / 128, ld] scales; the SwiGLU output quantized up to the last segment's end); outputs bf16. push (the peers'
    combine buffers): the down GEMM's epilogue also does the combine's stores."""
    ops.expert_gemm_fp8(x_e4m3, x_scale, w8.fc1.q, w8.fc1.scale, sched.expert_offsets, sched.expert_counts, act, True,
                        pre_out=h, num_ctas=gemm_ctas)
    aq, as_ = ops.quantize_rows_e4m3(act, sched.expert_offsets[-1:])
    ops.expert_gemm_fp8(aq, as_, w8.fc2.q, w8.fc2.scale, sched.expert_offsets, sched.expert_counts, y_routed, False,
                        num_ctas=gemm_ctas,
                        push=None if push is None else (sched.row_src_rank, sched.row_src_slot, push))


def routed_rows(ctx: KernelContext, sched: MoKSchedule) -> torch.Tensor:
    """ctx.x_routed; fp8: the e4m3 rows dequantized to bf16 (a new tensor per call; the context
    keeps only the e4m3 rows)."""
    if ctx.x_routed is not None:
        return ctx.x_routed
    x = torch.empty(ctx.x_e4m3.shape, dtype=torch.bfloat16, device=ctx.x_e4m3.device)
    scale, by_rows = _routed_scales(ctx)
    ops.dequantize_rows_e4m3(ctx.x_e4m3, scale, x, sched.expert_offsets[-1:], scale_rows=by_rows)
    return x


def _routed_scales(ctx: KernelContext) -> tuple[torch.Tensor, bool]:
    """The dispatched e4m3 rows' scales as the row quantizers take them: (scale, scale_rows) for the
    staged dispatch's scale rows, or the megakernel's columns."""
    by_rows = ctx.x_scale.stride(1) == 1
    return (ctx.x_scale if by_rows else ctx.x_scale.t()), by_rows


def _early_wgrad_operands_e4m3(ctx: KernelContext, sched: MoKSchedule) -> tuple:
    """The fp8 weight gradients' operands that the forward left: act and the dispatched rows (from
    their e4m3 copy when the context keeps no bf16 rows), transposed into e4m3 with one scale per
    (expert, column): (act_t, act_scale, x_t, x_scale)."""
    offsets, counts = sched.expert_offsets, sched.expert_counts
    act_t, act_s = ops.quantize_columns_e4m3(ctx.act, offsets, counts)
    if ctx.x_routed is not None:
        x_t, x_s = ops.quantize_columns_e4m3(ctx.x_routed, offsets, counts)
    else:
        scale, by_rows = _routed_scales(ctx)
        x_t, x_s = ops.quantize_columns_e4m3(ctx.x_e4m3, offsets, counts, x_scale=scale, scale_rows=by_rows)
    return act_t, act_s, x_t, x_s


def _shared_gate_up(ws, x, shared_fc1, keep_gate_up: bool, gemm_ctas: int, seg=None, w8=None):
    """The shared expert's gate/up GEMM with SwiGLU: (shared_act [T, Is], shared_h [T, 2 Is] or None).
    seg (the fp8 forward, ``fp8.shared_in_e4m3``; ``_Comm.shared_seg``): on e4m3 operands (x as
    ``_publish_fp8`` quantized it, the weights ``w8``, an ``fp8.E4M3Weight``), the shared expert one
    segment of T rows; h is always kept."""
    T = x.shape[0]
    bf16 = dict(dtype=torch.bfloat16, device=x.device)
    shared_act = torch.empty((T, shared_fc1.shape[0] // 2), **bf16)
    shared_h = torch.empty((T, shared_fc1.shape[0]), **bf16) if keep_gate_up or seg is not None else None
    if seg is not None:
        xq, xs = _published_x_e4m3(ws)
        ops.expert_gemm_fp8(xq, xs, w8.q, w8.scale, seg[:2], seg[2:], shared_act, True, pre_out=shared_h,
                            num_ctas=gemm_ctas)
        return shared_act, shared_h
    ops.grouped_gemm(x.contiguous(), shared_fc1.contiguous(), None, shared_act, True, gemm_ctas, pre_out=shared_h)
    return shared_act, shared_h


def _shared_down(shared_act, shared_fc2, gemm_ctas: int, seg=None, w8=None) -> torch.Tensor:
    """The shared expert's down GEMM: shared_y [T, H]; seg: on e4m3 operands (``_shared_gate_up``)."""
    shared_fc2 = shared_fc2.contiguous()
    shared_y = torch.empty((shared_act.shape[0], shared_fc2.shape[0]), dtype=torch.bfloat16,
                           device=shared_act.device)
    if seg is not None:
        aq, as_ = ops.quantize_rows_e4m3(shared_act)
        ops.expert_gemm_fp8(aq, as_, w8.q, w8.scale, seg[:2], seg[2:], shared_y, False, num_ctas=gemm_ctas)
    else:
        ops.grouped_gemm(shared_act, shared_fc2, None, shared_y, False, gemm_ctas)
    return shared_y


def _shared_e4m3(cfg: MoKConfig, ws: MoKWorkspace, shared_fc1, shared_fc2=None, fp8_weights=None):
    """(segment, e4m3 fc1, e4m3 fc2) of the shared expert when the fp8 forward runs it on e4m3
    operands (weights from ``fp8_weights`` when it holds them, else quantized here; shared_fc2 None:
    fc1's only), else Nones."""
    if cfg.shared_precision != "fp8" or not fp8.shared_in_e4m3(shared_fc1):
        return None, None, None
    w = fp8_weights.shared_for(shared_fc1, shared_fc2) if fp8_weights is not None else None
    return (_comm(ws).shared_seg, *((w.fc1, w.fc2) if w is not None else _shared_weights_e4m3(shared_fc1, shared_fc2)))


def _fp8_push_enabled() -> bool:
    """MOK_FP8_PUSH=0: the staged fp8 forward combines in a launch of its own after the down GEMM
    instead of in its epilogue, and the fp8 backward pushes its dx rows in ``bwd_push`` after the fc1
    dgrad instead of in that GEMM's epilogue (same bits; read per call, so a benchmark can A/B it)."""
    return os.environ.get("MOK_FP8_PUSH", "1") != "0"


def _fwd_overlap_enabled() -> bool:
    """MOK_FWD_OVERLAP=0 keeps the staged forward's shared expert on the caller's stream (same bits;
    read per call, so a benchmark can A/B it)."""
    return os.environ.get("MOK_FWD_OVERLAP", "1") != "0"


def _dispatch_and_experts(cfg, ws, sched, x, fc1, fc2, shared_fc1, *, keep_gate_up: bool, gemm_ctas=0,
                          comm_ctas=0, fp8_weights=None, during_dispatch=None, push=None,
                          shared_e4m3=None) -> KernelContext:
    """Steps 1-4 of the forward. Peers may still read this rank's x buffer afterwards: the caller
    ends with a barrier before any rank rewrites it (``forward``: before the epilogue).
    during_dispatch(event): called once the dispatch is launched, with an event recorded just
    before it (side-stream work that waits on the event can run beside the dispatch). push (fp8:
    the peers' combine buffers): the down GEMM also pushes the rows into their source slots.
    shared_e4m3: ``_shared_e4m3``'s answer when the caller has it."""
    T, H, cap = ws.num_tokens, ws.hidden, sched.capacity
    I = fc1.shape[1] // 2
    bf16 = dict(dtype=torch.bfloat16, device=ws.device)
    quant = cfg.precision == "fp8"
    x_routed = x_e4m3 = x_scale = None
    if quant:
        x_e4m3, x_scale = _dispatch_fp8(cfg, ws, sched, x, comm_ctas, during_dispatch)
        keep_gate_up = True
    else:
        c = _comm(ws)
        xs, x_ptrs = c.buffer("x", (T, H), torch.bfloat16)
        xs.copy_(x)
        ops.barrier(c.state, ws.errors, c.flag_ptrs, ws.rank, cfg.peer_timeout_s)
        started = _mark(during_dispatch)
        (x_ptrs,), copies = _pulled_once(ws, sched, [(xs, x_ptrs)], comm_ctas)
        x_routed = torch.empty((cap, H), **bf16)
        ops.dispatch(sched.row_src_rank, sched.row_src_slot, sched.expert_offsets, x_routed, x_ptrs, ws.topk,
                     comm_ctas)
        del copies  # read by the dispatch (enqueued): freed in stream order
        if during_dispatch is not None:
            during_dispatch(started)
    shared_act = shared_h = None
    if shared_fc1 is not None:
        seg, sw1, _ = shared_e4m3 or _shared_e4m3(cfg, ws, shared_fc1, fp8_weights=fp8_weights)
        shared_act, shared_h = _shared_gate_up(ws, x, shared_fc1, keep_gate_up, gemm_ctas, seg, sw1)
    act = torch.empty((cap, I), **bf16)
    h = torch.empty((cap, 2 * I), **bf16) if keep_gate_up else None
    y_routed = torch.empty((cap, H), **bf16)
    if quant:
        _routed_experts_fp8(sched, x_e4m3, x_scale, fp8_weights or quantize_expert_weights(fc1, fc2), act, h,
                            y_routed, gemm_ctas, push)
        return KernelContext(None, act, y_routed, shared_act, h, shared_h, x_e4m3, x_scale.t())
    ops.grouped_gemm(x_routed, fc1.contiguous(), sched.expert_offsets, act, True, gemm_ctas, sched.expert_counts,
                     pre_out=h)
    ops.grouped_gemm(act, fc2.contiguous(), sched.expert_offsets, y_routed, False, gemm_ctas, sched.expert_counts)
    return KernelContext(x_routed, act, y_routed, shared_act, h, shared_h)


def _forward_mega(cfg, ws, sched, x, probs, fc1, fc2, shared_fc1, shared_fc2, out, gemm_ctas, comm_ctas,
                  fp8_weights=None):
    c = _comm(ws)
    T, H, k, cap = ws.num_tokens, ws.hidden, ws.topk, sched.capacity
    I = fc1.shape[1] // 2
    bf16 = dict(dtype=torch.bfloat16, device=ws.device)
    comb, comb_ptrs = c.buffer("comb", (T * k, H), torch.bfloat16)
    x = x.contiguous()
    if x.data_ptr() % 16:
        x = x.clone()
    quant = None
    if cfg.precision == "fp8":  # e4m3 rows published; the kernel pulls and quantizes the rest
        w8 = fp8_weights or quantize_expert_weights(fc1, fc2)
        (_, x_ptrs), (_, s_ptrs), pitch = _publish_fp8(cfg, ws, x)
        e4m3, f32 = dict(dtype=torch.float8_e4m3fn, device=ws.device), dict(dtype=torch.float32, device=ws.device)
        quant = ops.MegaFP8(w8.fc1.q, w8.fc1.scale, w8.fc2.q, w8.fc2.scale, torch.empty((cap, H), **e4m3),
                            torch.empty((H // fp8.BLOCK, cap), **f32), torch.empty((cap, I), **e4m3),
                            torch.empty((I // fp8.BLOCK, cap), **f32), s_ptrs, pitch, c.shared_seg)
        x_routed = torch.empty((0,), **bf16)
    else:
        xs, x_ptrs = c.buffer("x", (T, H), torch.bfloat16)
        ops.publish_barrier(x, xs, c.state, ws.errors, c.flag_ptrs, ws.rank, cfg.peer_timeout_s)
        x_routed = torch.empty((cap, H), **bf16)
    act = torch.empty((cap, I), **bf16)
    h = torch.empty((cap, 2 * I), **bf16) if cfg.save_gate_up or quant is not None else None
    y_routed = torch.empty((cap, H), **bf16)
    shared_h = None
    seg, sw1, sw2 = _shared_e4m3(cfg, ws, shared_fc1, shared_fc2, fp8_weights)
    if seg is not None:
        # the e4m3 shared expert runs as the staged path's launches (the same bits), on a side stream
        # beside the kernel; the epilogue adds its output
        side, main = _side_stream(ws.device), torch.cuda.current_stream(ws.device)
        side.wait_stream(main)
        with torch.cuda.stream(side):
            shared_act, shared_h = _shared_gate_up(ws, x, shared_fc1, True, gemm_ctas, seg, sw1)
            shared_y = _shared_down(shared_act, shared_fc2, gemm_ctas, seg, sw2)
        kernel_shared = (None, None, torch.empty((0,), **bf16), None, torch.empty((0,), **bf16))
    elif shared_fc1 is not None:
        shared_fc1, shared_fc2 = shared_fc1.contiguous(), shared_fc2.contiguous()
        shared_act = torch.empty((T, shared_fc1.shape[0] // 2), **bf16)
        shared_h = torch.empty((T, shared_fc1.shape[0]), **bf16) if cfg.save_gate_up else None
        shared_y = torch.empty((T, H), **bf16)
        kernel_shared = (shared_fc1, shared_fc2, shared_act, shared_h, shared_y)
    else:
        shared_act = shared_y = torch.empty((0,), **bf16)
        kernel_shared = (None, None, shared_act, None, shared_y)
    counters = c.counters(ops.megakernel_counter_ints(cap, T, I // fp8.BLOCK if quant is not None else 0))
    k_sfc1, k_sfc2, k_sact, k_sh, k_sy = kernel_shared
    ops.megakernel(x, fc1.contiguous(), fc2.contiguous(), k_sfc1, k_sfc2, sched.row_src_rank,
                   sched.row_src_slot, sched.expert_counts, sched.expert_offsets, x_routed, act, h, y_routed,
                   k_sact, k_sh, k_sy, counters, c.state, ws.errors, x_ptrs, comb_ptrs, c.flag_ptrs,
                   ws.rank, k,
                   comm_ctas if comm_ctas > 0 else cfg.fwd_comm_sms, gemm_ctas, cfg.minibatch_rows,
                   min(cfg.peer_timeout_s, MEGA_WATCHDOG_S), quant)
    if seg is not None:  # join; the side stream's tensors are used on this stream from here on
        main.wait_stream(side)
        for t in (shared_act, shared_h, shared_y):
            t.record_stream(main)
    if out is None:
        out = torch.empty((T, H), **bf16)
    ops.moe_epilogue_wait(comb, probs.contiguous(), shared_y if shared_fc1 is not None else None, out, c.state,
                          ws.errors, c.flag_ptrs, ws.rank, cfg.peer_timeout_s)
    shared_act = shared_act if shared_fc1 is not None else None
    if quant is not None:  # the e4m3 rows and their scales [cap, H / 128] (a transposed view)
        return out, KernelContext(None, act, y_routed, shared_act, h, shared_h, quant.x8, quant.x8_scale.t())
    return out, KernelContext(x_routed, act, y_routed, shared_act, h, shared_h)


def checks_probs_on_device(ws: MoKWorkspace, x, fc1, shared_fc1=None) -> bool:
    """True when ``forward`` with these arguments flags non-finite ``probs`` itself: every kernel path
    (either path, either precision) does, in its epilogue launch (``moe_epilogue`` /
    ``moe_epilogue_wait`` with ``ws.errors``), which reads the weights anyway; the reference
    fallback leaves it to the caller (``functional.flag_nonfinite_probs``)."""
    return _unsupported_reason(ws, x, fc1, shared_fc1) is None


def forward(cfg: MoKConfig, ws: MoKWorkspace, sched: MoKSchedule, x, probs, fc1, fc2, shared_fc1=None,
            shared_fc2=None, *, out: torch.Tensor | None = None, gemm_ctas: int = 0, comm_ctas: int = 0,
            path: str | None = None, fp8_weights=None):
    """One layer forward on the device. Returns ``(out [T, H] bf16, KernelContext)``.

    ``out``: optional preallocated output (tests poison it). ``path``: ``"mega"`` or ``"staged"``
    (default ``forward_path``: ``MOK_FORWARD``, else mega for bf16 and staged for fp8); every rank
    of the group must use the same.
    ``gemm_ctas`` / ``comm_ctas``: staged: CTA counts of the GEMMs and of dispatch/combine;
    mega: CTAs besides the dispatching ones, and dispatching CTAs (default
    ``cfg.fwd_comm_sms``); 0: derived from the SM count. No knob changes a result bit.
    ``cfg.precision == "fp8"``: the routed GEMMs run block-scaled e4m3 (``fp8_weights`` from
    ``fp8.quantize_expert_weights``, else quantized in this call), on either path with the same
    bits; the shared expert, the context and the output stay bf16.
    """
    path = forward_path(path, cfg.precision)
    reason = _unsupported_reason(ws, x, fc1, shared_fc1)
    if reason is not None:
        _fallback(reason)
        return reference.forward(ws, sched, x, probs, fc1, fc2, shared_fc1, shared_fc2, cfg.precision,
                                 cfg.shared_precision)
    if path == "mega":
        return _forward_mega(cfg, ws, sched, x, probs, fc1, fc2, shared_fc1, shared_fc2, out, gemm_ctas, comm_ctas,
                             fp8_weights)
    c = _comm(ws)
    T, H, k = ws.num_tokens, ws.hidden, ws.topk
    comb, comb_ptrs = c.buffer("comb", (T * k, H), torch.bfloat16)
    keep = cfg.save_gate_up or cfg.precision == "fp8"
    # MOK_FWD_OVERLAP (default on): the shared expert runs on a side stream, its gate/up beside the
    # dispatch and its down GEMM beside the combine, on the SMs those NVLink-bound launches leave
    # idle. The communication kernels are launched first, the side-stream GEMMs right after, waiting
    # on an event from just before them: the GPU gives the communication its CTAs first.
    # fp8 (MOK_FP8_PUSH, default on): the routed down GEMM's epilogue does the combine's stores; the
    # shared down GEMM then follows its gate/up on the side stream directly.
    push = comb_ptrs if cfg.precision == "fp8" and _fp8_push_enabled() else None
    side = _side_stream(ws.device) if shared_fc1 is not None and _fwd_overlap_enabled() else None
    main = torch.cuda.current_stream(ws.device)
    shared = []

    # fp8: the shared expert's segment and e4m3 weights (quantized, if fp8_weights lacks them, on the
    # stream that runs the shared expert)
    shared_e4m3 = []

    def shared_gate_up(started):
        side.wait_event(started)
        with torch.cuda.stream(side):
            shared_e4m3.extend(_shared_e4m3(cfg, ws, shared_fc1, shared_fc2, fp8_weights))
            shared.extend(_shared_gate_up(ws, x, shared_fc1, keep, gemm_ctas, *shared_e4m3[:2]))

    if side is None and shared_fc1 is not None:
        shared_e4m3.extend(_shared_e4m3(cfg, ws, shared_fc1, shared_fc2, fp8_weights))

    ctx = _dispatch_and_experts(cfg, ws, sched, x, fc1, fc2, shared_fc1 if side is None else None,
                                keep_gate_up=cfg.save_gate_up, gemm_ctas=gemm_ctas, comm_ctas=comm_ctas,
                                fp8_weights=fp8_weights, during_dispatch=shared_gate_up if side else None,
                                push=push, shared_e4m3=tuple(shared_e4m3))
    routed_done = _mark(side if push is None else None)
    if push is None:
        ops.combine(ctx.y_routed, sched.row_src_rank, sched.row_src_slot, sched.expert_offsets, c.state, comb_ptrs,
                    comm_ctas)
    shared_y = None
    if shared_fc1 is not None:
        if side is not None:
            if routed_done is not None:
                side.wait_event(routed_done)
            with torch.cuda.stream(side):
                shared_y = _shared_down(shared[0], shared_fc2, gemm_ctas, shared_e4m3[0], shared_e4m3[2])
            ctx.shared_act, ctx.shared_h = shared
        else:
            shared_y = _shared_down(ctx.shared_act, shared_fc2, gemm_ctas, shared_e4m3[0], shared_e4m3[2])
    ops.barrier(c.state, ws.errors, c.flag_ptrs, ws.rank, cfg.peer_timeout_s)
    if side is not None:  # join; the side stream's tensors are used on this stream from here on
        main.wait_stream(side)
        for t in (*shared, shared_y):
            if t is not None:
                t.record_stream(main)
    if out is None:
        out = torch.empty((T, H), dtype=torch.bfloat16, device=ws.device)
    ops.moe_epilogue(comb, probs.contiguous(), shared_y, out, ws.errors)
    return out, ctx


def recompute_forward_context(cfg: MoKConfig, ws: MoKWorkspace, sched: MoKSchedule, x, fc1, fc2, shared_fc1=None,
                              *, fp8_weights=None):
    """Dispatch and expert GEMMs again (activation checkpointing); no combine. The context keeps
    the gate/up pre-activations: it is made for the backward that follows."""
    reason = _unsupported_reason(ws, x, fc1, shared_fc1)
    if reason is not None:
        _fallback(reason)
        return reference.recompute_forward_context(ws, sched, x, fc1, fc2, shared_fc1, cfg.precision,
                                                   cfg.shared_precision)
    ctx = _dispatch_and_experts(cfg, ws, sched, x, fc1, fc2, shared_fc1, keep_gate_up=True, fp8_weights=fp8_weights)
    c = _comm(ws)
    # Peers may still read this rank's x buffer: no rank rewrites its buffer before all are done.
    ops.barrier(c.state, ws.errors, c.flag_ptrs, ws.rank, cfg.peer_timeout_s)
    return ctx


# ---- backward -------------------------------------------------------------------------------------

BACKWARD_PATHS = ("cuda", "reference")
# Default backward; MOK_BACKWARD=reference runs the fp32 pure-PyTorch reference on CUDA too.
BACKWARD_PATH = os.environ.get("MOK_BACKWARD", "cuda")


def _backward_unsupported_reason(ws: MoKWorkspace, x, fc1, shared_fc1) -> str | None:
    reason = _unsupported_reason(ws, x, fc1, shared_fc1)
    if reason is not None:
        return reason
    if not hasattr(torch, "_grouped_mm"):
        return "torch._grouped_mm is missing (torch >= 2.8 needed by the CUDA backward)"
    if ws.num_local_experts >= 1024:
        return "more than 1023 local experts (torch._grouped_mm groups)"
    return None


def _reference_backward(cfg, ws, sched, ctx, grad_out, x, probs, fc1, fc2, shared_fc1, shared_fc2, main_grads):
    from .functional import MoKGrads

    if not isinstance(ctx, reference.ReferenceContext):
        ctx = reference.recompute_forward_context(ws, sched, x, fc1, fc2, shared_fc1, cfg.precision,
                                                   cfg.shared_precision)
    dx, dprobs, *wgrads = reference.backward(ws, sched, ctx, grad_out, x, probs, fc1, fc2, shared_fc1, shared_fc2,
                                             dgrad_precision=cfg.dgrad_precision,
                                             wgrad_precision=cfg.wgrad_precision)
    return MoKGrads(dx.to(x.dtype), dprobs, *_accumulate(wgrads, main_grads))


def _accumulate(wgrads: list, main_grads) -> list:
    """Add the weight gradients into the given fp32 ``main_grads`` entries; those fields become None."""
    if main_grads is not None:
        for i, main in enumerate(main_grads):
            if main is not None and wgrads[i] is not None:
                main.add_(wgrads[i])
                wgrads[i] = None
    return wgrads


def _aligned(t: torch.Tensor) -> torch.Tensor:
    t = t.contiguous()
    return t if t.data_ptr() % 16 == 0 else t.clone()


def _recompute_gate_up(a: torch.Tensor, fc1: torch.Tensor, sched: MoKSchedule | None) -> torch.Tensor:
    """The gate/up pre-activations a forward did not keep, from the forward's own SwiGLU GEMM (its
    tile layout and K order, so they carry the forward's bits); the activation is discarded."""
    two_i = fc1.shape[-2]
    h = torch.empty((a.shape[0], two_i), dtype=torch.bfloat16, device=a.device)
    act = torch.empty((a.shape[0], two_i // 2), dtype=torch.bfloat16, device=a.device)
    if sched is None:
        ops.grouped_gemm(a, fc1, None, act, True, pre_out=h)
    else:
        ops.grouped_gemm(a, fc1, sched.expert_offsets, act, True, 0, sched.expert_counts, pre_out=h)
    return h


def _bwd_overlap_enabled() -> bool:
    """MOK_BWD_OVERLAP=0 runs the shared expert's backward on the caller's stream (same bits; read per
    call, so a benchmark can A/B it)."""
    return os.environ.get("MOK_BWD_OVERLAP", "1") != "0"


def _bwd_side_early() -> bool:
    """MOK_BWD_SIDE_EARLY=0: the backward's side-stream work waits for the pull to finish instead of
    starting beside it (same bits; read per call, so a benchmark can A/B it)."""
    return os.environ.get("MOK_BWD_SIDE_EARLY", "1") != "0"


def _wgrad8_side() -> bool:
    """MOK_WGRAD8_SIDE=0: the fp8 weight gradients' dy and dh transposes run on the caller's stream
    right before their GEMMs instead of on the side stream as soon as dy and dh exist (same bits;
    read per call, so a benchmark can A/B it)."""
    return os.environ.get("MOK_WGRAD8_SIDE", "1") != "0"


def _bwd_gemms_on_torch() -> bool:
    """MOK_BWD_GEMM=torch runs the routed backward GEMMs as ``torch._grouped_mm`` (with
    ``swiglu_backward`` and gathers into the tight layout) instead of mok's expert-major GEMMs
    (read per call: the A/B switch; both accumulate K in ascending order)."""
    v = os.environ.get("MOK_BWD_GEMM", "mok")
    if v not in ("mok", "torch"):
        raise ValueError(f"megatron_mok: MOK_BWD_GEMM must be 'mok' or 'torch', got {v!r}")
    return v == "torch"


_SIDE_STREAMS: dict = {}


def _side_stream(device: torch.device) -> torch.cuda.Stream:
    """One side stream per device for the shared expert of the staged forward and the backward
    (created once, reused)."""
    key = torch.device(device).index
    key = torch.cuda.current_device() if key is None else key
    if key not in _SIDE_STREAMS:
        _SIDE_STREAMS[key] = torch.cuda.Stream(device=key)
    return _SIDE_STREAMS[key]


def _bwd_kernel() -> str:
    """MOK_BWD_KERNEL: "staged" (default) runs the backward as one launch per step, "mega" as one
    persistent kernel (``ops.bwd_megakernel``); the same bits (read per call: the A/B switch).
    Staged is the default because it measured faster (docs/KERNELS.md, sixth session)."""
    v = os.environ.get("MOK_BWD_KERNEL", "staged")
    if v not in ("mega", "staged"):
        raise ValueError(f"megatron_mok: MOK_BWD_KERNEL must be 'mega' or 'staged', got {v!r}")
    return v


def _shared_backward_mok(c: _Comm, ctx, g, x, shared_fc1, shared_fc2):
    """(dsfc1, dsfc2, shared_dx) of the shared expert on mok's expert-major GEMMs, the shared expert
    being one segment of T rows: the kernels and bits of the backward megakernel's shared tasks."""
    shared_fc1, shared_fc2 = shared_fc1.contiguous(), shared_fc2.contiguous()
    T, H, Is = g.shape[0], g.shape[1], shared_fc1.shape[0] // 2
    offs, count = c.shared_seg[:2], c.shared_seg[2:]
    bf16 = dict(dtype=torch.bfloat16, device=g.device)
    hs = ctx.shared_h if ctx.shared_h is not None else _recompute_gate_up(x, shared_fc1, None)
    dhs = torch.empty((T, 2 * Is), **bf16)
    ops.expert_dgrad(g, shared_fc2.view(1, H, Is), offs, count, dhs, h=hs)
    del hs
    shared_dx = torch.empty((T, H), **bf16)
    ops.expert_dgrad(dhs, shared_fc1.view(1, 2 * Is, H), offs, count, shared_dx)
    dsfc2 = torch.empty((1, H, Is), **bf16)
    ops.expert_wgrad(g, offs, ctx.shared_act, offs, count, dsfc2)
    dsfc1 = torch.empty((1, 2 * Is, H), **bf16)
    ops.expert_wgrad(dhs, offs, x, offs, count, dsfc1)
    return dsfc1[0], dsfc2[0], shared_dx


def _shared_backward(ctx, g, x, shared_fc1, shared_fc2):
    """(dsfc1, dsfc2, shared_dx) of the shared expert (cuBLAS, bf16 in, fp32 accumulate): the path
    of MOK_BWD_GEMM=torch."""
    shared_fc1, shared_fc2 = shared_fc1.contiguous(), shared_fc2.contiguous()
    T, Is = g.shape[0], shared_fc1.shape[0] // 2
    hs = ctx.shared_h if ctx.shared_h is not None else _recompute_gate_up(x, shared_fc1, None)
    das = g @ shared_fc2  # [T, Is]
    dhs = torch.empty((T, 2 * Is), dtype=torch.bfloat16, device=g.device)
    ops.swiglu_backward(hs, das, dhs, None)
    del hs, das
    dsfc2 = g.t() @ ctx.shared_act  # [H, Is]
    dsfc1 = dhs.t() @ x  # [2Is, H]
    shared_dx = dhs @ shared_fc1  # [T, H]
    return dsfc1, dsfc2, shared_dx


def backward(cfg: MoKConfig, ws: MoKWorkspace, sched: MoKSchedule, ctx, grad_out, x, probs, fc1, fc2,
             shared_fc1=None, shared_fc2=None, main_grads=None, *, comm_ctas: int = 0, path: str | None = None,
             fp8_weights=None):
    """Gradients of one layer on the device. Returns ``functional.MoKGrads``.

    No host sync and no data-dependent shapes (CUDA-graph capturable once the workspace's buffers
    exist). Two implementations with the same bits (``MOK_BWD_KERNEL``, read per call):

    * ``"mega"``, 3 launches: ``bwd_publish`` (step 1), ``bwd_megakernel`` (steps 2-5 as
      one persistent kernel: its first ``comm_ctas`` CTAs (0: ``cfg.bwd_comm_sms``) pull while the
      others run the shared expert's tasks, then everything runs as tasks behind device counters,
      the dx rows pushed by pusher warps; csrc/kernels/bwd_megakernel.cu), ``bwd_epilogue_wait``
      (step 6); plus the gate/up recompute when the forward did not keep it. More than 511 local
      experts run the staged launches;
    * ``"staged"`` (default: measured faster), one launch per step, per rank, on the current stream:

    1. ``bwd_publish``: grad_out and probs into this rank's symmetric buffers, device barrier;
    2. ``bwd_pull``: every routed row pulls its grad_out row and router weight from the source rank,
       ``dy = w * g`` (bf16, the forward's padded rows; padding rows 0), and pushes ``<g, y_routed>``
       (the router-weight gradient, fp32, fixed order) into the source's symmetric ``[T * k]`` buffer;
    3. shared expert (mok's expert-major GEMMs, one segment of T rows) and, fp8, the dispatched
       e4m3 rows dequantized for the fc1 weight gradient: on a side stream beside the pull (launched
       after it, waiting on an event from before it; ``MOK_BWD_SIDE_EARLY=0``: from after it),
       joined before step 6 (``MOK_BWD_OVERLAP=0``: on the caller's stream after step 4);
    4. routed dgrad, the critical path to the push: ``h = x_routed @ fc1[e]^T`` from the context (or,
       when the forward did not keep it, recomputed by the forward's SwiGLU GEMM: the same bits),
       ``dh = swiglu_backward(h, dy @ fc2[e])`` and ``dx_rows = dh @ fc1[e]`` (``expert_dgrad``, the
       expert-major GEMM reading the weights MN-major, the SwiGLU backward fused into the first);
       ``bwd_push``: dx rows into the source ranks' symmetric ``[T * k, H]`` slots, opening the
       closing barrier (fp8, ``MOK_FP8_PUSH`` on by default: the fc1 dgrad's epilogue stores them
       and ``barrier_open`` opens the barrier);
    5. routed wgrad while the peers finish pushing (``expert_wgrad``, reading the padded rows):
       ``dfc2[e] = dy^T @ act``, ``dfc1[e] = dh^T @ x_routed``; experts without rows get exact zeros
       (``cfg.wgrad_precision == "fp8"``: ``expert_wgrad_fp8`` on the operands' e4m3 transposes,
       ``quantize_columns_e4m3``; act and the dispatched e4m3 rows on the side stream in step 3,
       dy and dh there too once they exist, ``MOK_WGRAD8_SIDE=0``: here);
    6. ``bwd_epilogue_wait``: closes the barrier, ``dx[t] = sum_s slot[t, s]`` in slot order in fp32
       ``+`` shared dx, cast once; ``dprobs`` copied out of the symmetric buffer.

    Which stream or kernel runs what changes no bit: every task's inputs and reduction order are
    the same. ``MOK_BWD_GEMM=torch`` (and more than 512 local experts) runs the staged steps, 4-5 on
    ``torch._grouped_mm`` and the shared expert on cuBLAS, in a tight row layout instead
    (``bwd_tight_map``: each expert's rows padded to ``ops.TIGHT_ALIGN``, not 128;
    ``swiglu_backward``; ``gather_rows`` of act and x_routed; ``zero_empty_segments``).

    ``cfg.dgrad_precision == "fp8"``: step 4's two dgrads run on block-scaled e4m3 operands
    (``_routed_dgrads_fp8``; the weights' transposed copies from ``fp8_weights`` or quantized here)
    on the staged launches, whatever ``MOK_BWD_KERNEL`` says; with ``cfg.wgrad_precision == "fp8"``
    the routed weight gradients too (step 5); the shared expert's backward stays bf16.

    Weight gradients come back in bf16 (fp32 accumulation inside each GEMM, one rounding; autograd
    casts them to the weights' dtype anyway); with ``main_grads`` they are added into those fp32
    tensors and the matching fields are None. ``ctx``: the forward's ``KernelContext`` (None:
    recomputed here; a ``ReferenceContext``: the reference backward runs). ``comm_ctas``: mega: the
    pulling CTAs (0: ``cfg.bwd_comm_sms``); staged: CTAs of the pull, push and gather kernels (0:
    ``4 * cfg.bwd_comm_sms``); it changes no bit. ``path``
    (default ``MOK_BACKWARD``): ``"cuda"`` or ``"reference"``.
    """
    from .functional import MoKGrads

    path = path or BACKWARD_PATH
    if path not in BACKWARD_PATHS:
        raise ValueError(f"megatron_mok: backward path must be one of {BACKWARD_PATHS}, got {path!r}")
    reason = _backward_unsupported_reason(ws, x, fc1, shared_fc1)
    if reason is not None:
        _fallback(reason)
    if reason is not None or path == "reference" or isinstance(ctx, reference.ReferenceContext):
        return _reference_backward(cfg, ws, sched, ctx, grad_out, x, probs, fc1, fc2, shared_fc1, shared_fc2,
                                   main_grads)
    if ctx is None:
        ctx = recompute_forward_context(cfg, ws, sched, x, fc1, fc2, shared_fc1)

    c = _comm(ws)
    T, H, k, cap = ws.num_tokens, ws.hidden, ws.topk, sched.capacity
    I = fc1.shape[1] // 2
    nle = sched.expert_counts.numel()
    kernel = _bwd_kernel()
    on_torch = _bwd_gemms_on_torch() or nle > ops.EXPERT_GEMM_MAX_SEGMENTS
    w8 = None
    # fp8 weight gradients: their operands transposed into e4m3, the dispatched rows straight from
    # the forward's e4m3 copy
    wgrad8 = cfg.wgrad_precision == "fp8"
    for on, field in ((cfg.dgrad_precision == "fp8", "fp8_dgrad"), (wgrad8, "fp8_wgrad")):
        if on and on_torch:
            raise RuntimeError(f"megatron_mok: MoKConfig.{field} runs on mok's GEMMs only: at most "
                               f"{ops.EXPERT_GEMM_MAX_SEGMENTS} local experts and no MOK_BWD_GEMM=torch "
                               f"(got {nle} local experts); or set {field}=False")
        if on:
            kernel = "staged"
    if cfg.dgrad_precision == "fp8":
        w8 = fp8_weights if fp8_weights is not None and fp8_weights.has_transposed else \
            quantize_expert_weights(fc1, fc2, transposed=True)
    mega = kernel == "mega" and not on_torch and nle <= ops.BWD_MEGAKERNEL_MAX_EXPERTS
    # fp8: the dispatched e4m3 rows as bf16, the fc1 weight gradient's operand. The staged launches
    # need them only then (the gate/up products are kept), so they dequantize on the side stream.
    defer_x = ctx.x_routed is None and ctx.h is not None and not mega and not wgrad8
    if ctx.x_routed is None and not defer_x and not (wgrad8 and ctx.h is not None):
        ctx = dataclasses.replace(ctx, x_routed=routed_rows(ctx, sched))
    bf16 = dict(dtype=torch.bfloat16, device=ws.device)
    fc1, fc2 = fc1.contiguous(), fc2.contiguous()
    g = _aligned(grad_out)
    x = _aligned(x)

    # 1. publish grad_out and probs, barrier
    gbuf, g_ptrs = c.buffer("bwd_grad", (T, H), torch.bfloat16)
    pbuf, p_ptrs = c.buffer("bwd_probs", (T, k), torch.float32)
    slots, slot_ptrs = c.buffer("bwd_dx_slots", (T * k, H), torch.bfloat16)
    dwbuf, dw_ptrs = c.buffer("bwd_dprobs_slots", (T * k,), torch.float32)
    ops.bwd_publish(g, gbuf, probs.contiguous(), pbuf, c.state, ws.errors, c.flag_ptrs, ws.rank, cfg.peer_timeout_s)
    dx = torch.empty((T, H), **bf16)
    dprobs = torch.empty((T, k), dtype=torch.float32, device=ws.device)

    # steps 2-5 in one persistent launch (more local experts than its prefix holds: the staged
    # launches, with the same bits)
    if mega:
        h = ctx.h if ctx.h is not None else _recompute_gate_up(ctx.x_routed, fc1, sched)
        dy, dh, dx_rows = (torch.empty((cap, n), **bf16) for n in (H, 2 * I, H))
        dfc1, dfc2 = torch.empty_like(fc1), torch.empty_like(fc2)
        dsfc1 = dsfc2 = shared_dx = shared_h = dhs = seg = None
        if shared_fc1 is not None:
            shared_fc1, shared_fc2 = shared_fc1.contiguous(), shared_fc2.contiguous()
            shared_h = ctx.shared_h if ctx.shared_h is not None else _recompute_gate_up(x, shared_fc1, None)
            dhs = torch.empty((T, shared_fc1.shape[0]), **bf16)
            shared_dx = torch.empty((T, H), **bf16)
            dsfc1, dsfc2 = torch.empty_like(shared_fc1), torch.empty_like(shared_fc2)
            seg = c.shared_seg
        ops.bwd_megakernel(g, x, fc1, fc2, shared_fc1, shared_fc2, sched.row_src_rank, sched.row_src_slot,
                           sched.expert_counts, sched.expert_offsets, seg, ctx.x_routed, ctx.act, h, ctx.y_routed,
                           ctx.shared_act if shared_fc1 is not None else None, shared_h, dy, dh, dx_rows, dfc1, dfc2,
                           dhs, shared_dx, dsfc1, dsfc2, c.counters(ops.megakernel_counter_ints(cap, T), "bwd"),
                           c.state, ws.errors, g_ptrs, p_ptrs, dw_ptrs, slot_ptrs, c.flag_ptrs, ws.rank, k,
                           comm_ctas if comm_ctas > 0 else cfg.bwd_comm_sms, 0, cfg.minibatch_rows,
                           min(cfg.peer_timeout_s, MEGA_WATCHDOG_S))
        del h, shared_h, dy, dh, dx_rows, dhs
        ops.bwd_epilogue_wait(slots, dwbuf, shared_dx, dx, dprobs, c.state, ws.errors, c.flag_ptrs, ws.rank,
                              cfg.peer_timeout_s)
        wgrads = _accumulate([dfc1, dfc2, dsfc1, dsfc2], main_grads)
        return MoKGrads(dx.to(x.dtype), dprobs, *wgrads)

    # 2. pull dy = w * g into the routed rows; the router-weight gradient is pushed to its source
    # slot. mok's GEMMs skip padding rows, so they keep the forward's padded layout (no gathers);
    # torch._grouped_mm computes every row of a group, so it gets the tight layout (groups padded to
    # TIGHT_ALIGN rows, not 128)
    comm_ctas = comm_ctas or 4 * cfg.bwd_comm_sms
    counts, offsets = sched.expert_counts, sched.expert_offsets
    row_offs, trow = offsets, None
    if on_torch:
        row_offs = torch.empty((nle + 1,), dtype=torch.int32, device=ws.device)
        trow = torch.empty((cap,), dtype=torch.int32, device=ws.device)
        ops.bwd_tight_map(counts, offsets, row_offs, trow)
    dy = torch.empty((cap, H), **bf16)
    dyq = dys = None
    if w8 is not None:  # the fp8 dgrad's operand, quantized by the pull on the way
        dyq, dys = ops.empty_rows_e4m3(cap, H, ws.device)
    main = torch.cuda.current_stream(ws.device)
    side = _side_stream(ws.device) if (shared_fc1 is not None or defer_x or wgrad8) and _bwd_overlap_enabled() else None
    before_pull = _mark(side if _bwd_side_early() else None)
    (g_src,), copies = _pulled_once(ws, sched, [(gbuf, g_ptrs)], comm_ctas)
    ops.bwd_pull(sched.row_src_rank, sched.row_src_slot, row_offs, ctx.y_routed, dy, g_src, p_ptrs, dw_ptrs, k,
                 comm_ctas, trow=trow, q=dyq, q_scale=dys)
    del copies  # read by the pull (enqueued): freed in stream order

    # 3. the shared expert needs only g and x, the deferred dequantization only the context: with
    # MOK_BWD_OVERLAP (default on) they run on a side stream launched after the pull, waiting on an
    # event from just before it (MOK_BWD_SIDE_EARLY=0: from after it), so the NVLink-bound pull gets
    # its CTAs first and the side work fills the SMs it and the routed chain leave idle
    def shared_backward():
        if on_torch:
            return _shared_backward(ctx, g, x, shared_fc1, shared_fc2)
        return _shared_backward_mok(c, ctx, g, x, shared_fc1, shared_fc2)

    shared, x_routed, x_ready, early8 = None, ctx.x_routed, None, None
    if side is not None:
        side.wait_event(before_pull if before_pull is not None else _mark(True))
        with torch.cuda.stream(side):
            if defer_x:
                x_routed = routed_rows(ctx, sched)
                x_ready = _mark(True)
            if wgrad8:  # the operands that exist before the pull
                early8 = _early_wgrad_operands_e4m3(ctx, sched)
                x_ready = _mark(True)
            if shared_fc1 is not None:
                shared = shared_backward()

    # fp8 weight gradients: dy and dh transposed on the side stream once they exist (late8[name]:
    # the transpose, its scales and an event; absent: on this stream before their GEMMs)
    late8 = {}

    def transpose_late(name, t):
        if side is None or not _wgrad8_side():
            return
        side.wait_event(_mark(True))
        with torch.cuda.stream(side):
            late8[name] = (*ops.quantize_columns_e4m3(t, offsets, counts), _mark(True))
        t.record_stream(side)

    def late_operand(name, t):
        if name not in late8:
            return ops.quantize_columns_e4m3(t, offsets, counts)
        q_t, scale, ready = late8.pop(name)
        main.wait_event(ready)
        q_t.record_stream(main)
        scale.record_stream(main)
        return q_t, scale

    if wgrad8:
        transpose_late("dy", dy)
    dh_done = (lambda: transpose_late("dh", dh)) if wgrad8 else None

    # 4. routed dgrad first (the critical path to the push): h = x_routed @ fc1[e]^T from the context
    # (or recomputed by the forward's SwiGLU GEMM: the same bits), da = dy @ fc2[e],
    # dh = swiglu_backward(h, da), dx_rows = dh @ fc1[e] (cap rows allocated: the row count is a
    # device value; padding rows are zero and add nothing)
    h = ctx.h if ctx.h is not None else _recompute_gate_up(ctx.x_routed, fc1, sched)  # padded rows
    dh = torch.empty((cap, 2 * I), **bf16)
    pushed = False
    if on_torch:
        da = torch._grouped_mm(dy, fc2, offs=row_offs[1:])  # [cap, I]
        ops.swiglu_backward(h, da, dh, row_offs, trow=trow)
        del h, da
        dx_rows = torch._grouped_mm(dh, fc1, offs=row_offs[1:])  # [cap, H]
    elif w8 is not None:  # e4m3 operands, the weights' transposed copies (K-major)
        dx_rows = torch.empty((cap, H), **bf16)
        # MOK_FP8_PUSH (default on): the fc1 dgrad's epilogue pushes the dx rows (no bwd_push launch)
        pushed = _fp8_push_enabled()
        _routed_dgrads_fp8(w8, dyq, dys, h, offsets, counts, dh, dx_rows,
                           push=(sched.row_src_rank, sched.row_src_slot, slot_ptrs) if pushed else None,
                           dh_done=dh_done)
        del h, dyq, dys
    else:  # expert-major GEMMs (weights MN-major); the SwiGLU backward in the first one's epilogue
        ops.expert_dgrad(dy, fc2, offsets, counts, dh, h=h)
        if dh_done is not None:
            dh_done()
        del h
        dx_rows = torch.empty((cap, H), **bf16)
        ops.expert_dgrad(dh, fc1, offsets, counts, dx_rows)

    # push dx rows into the source ranks' slots (opens the closing barrier); 5. the weight gradients
    # then run while the peers finish pushing: dfc2[e] = dy^T @ act, dfc1[e] = dh^T @ x_routed;
    # experts without rows get exact zeros
    if pushed:
        ops.barrier_open(c.state, c.flag_ptrs, ws.rank)
    else:
        ops.bwd_push(dx_rows, sched.row_src_rank, sched.row_src_slot, row_offs, c.state, slot_ptrs, c.flag_ptrs,
                     ws.rank, comm_ctas, trow=trow)
    del dx_rows
    if defer_x or wgrad8:  # the dequantized rows or e4m3 operands: from the side stream, or here
        if x_ready is not None:
            main.wait_event(x_ready)
            for t in [x_routed] if defer_x else early8:
                t.record_stream(main)
        elif defer_x:
            x_routed = routed_rows(ctx, sched)
        else:
            early8 = _early_wgrad_operands_e4m3(ctx, sched)
    if shared_fc1 is not None and shared is None:
        shared = shared_backward()
    if on_torch:  # act and x_routed gathered into the tight layout first
        act_t = torch.empty((cap, I), **bf16)
        ops.gather_rows(ctx.act, act_t, trow, row_offs, comm_ctas)
        dfc2 = torch._grouped_mm(dy.t(), act_t, offs=row_offs[1:])  # [nle, H, I]
        del act_t, dy
        ops.zero_empty_segments(dfc2, counts)
        x_t = torch.empty((cap, H), **bf16)
        ops.gather_rows(x_routed, x_t, trow, row_offs, comm_ctas)
        dfc1 = torch._grouped_mm(dh.t(), x_t, offs=row_offs[1:])  # [nle, 2I, H]
        del x_t, dh
        ops.zero_empty_segments(dfc1, counts)
    elif wgrad8:  # e4m3 transposes, one scale per (expert, column)
        act_t, act_s, x_t, x_s = early8
        del early8
        dfc2 = torch.empty((nle, H, I), **bf16)
        dy_t, dy_s = late_operand("dy", dy)
        del dy
        ops.expert_wgrad_fp8(dy_t, dy_s, act_t, act_s, offsets, counts, dfc2)
        del dy_t, act_t
        dfc1 = torch.empty((nle, 2 * I, H), **bf16)
        dh_t, dh_s = late_operand("dh", dh)
        del dh
        ops.expert_wgrad_fp8(dh_t, dh_s, x_t, x_s, offsets, counts, dfc1)
        del dh_t, x_t
    else:
        dfc2 = torch.empty((nle, H, I), **bf16)
        ops.expert_wgrad(dy, offsets, ctx.act, offsets, counts, dfc2)
        del dy
        dfc1 = torch.empty((nle, 2 * I, H), **bf16)
        ops.expert_wgrad(dh, offsets, x_routed, offsets, counts, dfc1)
        del dh

    dsfc1 = dsfc2 = shared_dx = None
    if side is not None:  # join; the side stream's results are used on this stream from here on
        main.wait_stream(side)
    if shared_fc1 is not None:
        if side is not None:
            for t in shared:
                t.record_stream(main)
        dsfc1, dsfc2, shared_dx = shared

    # 6. close the barrier; fixed-order slot sum + shared dx; dprobs out of the symmetric buffer
    ops.bwd_epilogue_wait(slots, dwbuf, shared_dx, dx, dprobs, c.state, ws.errors, c.flag_ptrs, ws.rank,
                          cfg.peer_timeout_s)
    wgrads = _accumulate([dfc1, dfc2, dsfc1, dsfc2], main_grads)
    return MoKGrads(dx.to(x.dtype), dprobs, *wgrads)
