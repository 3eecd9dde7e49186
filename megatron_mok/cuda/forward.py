"""The layer forward on the device, in one of two compositions of the GEMM core with the same bits
(``MoKConfig.forward_kernel``; ``resolved_forward_kernel`` picks for "auto"):

* ``"persistent"`` (bf16), 3 launches: ``publish_barrier`` (x into this rank's symmetric buffer,
  device barrier); ``megakernel`` (its first ``fwd_comm_sms`` CTAs pull-dispatch the routed rows,
  then every CTA runs one fixed task list, the shared expert's tiles first, then per minibatch the
  routed gate/up and down tasks, behind local ready counters; pusher warps write each finished
  output row into its source slot; the last CTA opens the closing barrier); ``moe_epilogue_wait``.
* ``"staged"``, one launch per stage: publish (bf16 copy, or e4m3 quantize), barrier, dispatch,
  the routed gate/up and down GEMMs, combine (fp8: in the down GEMM's epilogue), barrier,
  epilogue. The shared expert runs on a side stream: its gate/up beside the dispatch, its down GEMM
  beside the combine, on the SMs those NVLink-bound launches leave idle.

No host syncs and no data-dependent shapes: a forward can be captured in a CUDA graph once the
workspace's buffers exist.
"""

from __future__ import annotations

import torch

from .. import ops
from ..config import MoKConfig
from ..schedule import MoKSchedule
from ..workspace import MoKWorkspace
from . import combine, dispatch, experts
from .comm import KERNEL_WATCHDOG_S, comm, join, mark, side_stream
from .context import KernelContext


def _dispatch_and_experts(cfg: MoKConfig, ws: MoKWorkspace, sched: MoKSchedule, x, fc1, fc2, *, keep_gate_up: bool,
                          gemm_ctas: int = 0, comm_ctas: int = 0, fp8_weights=None, during_dispatch=None,
                          push=None, down: bool = True):
    """Publish, dispatch and the routed GEMMs (no shared expert). Peers may still read this rank's
    published rows afterwards: the caller ends with a barrier before any rank rewrites them.
    during_dispatch(event): called once the dispatch is launched, with an event from just before it
    (side-stream work that waits on it runs beside the dispatch). push (fp8: the peers' combine
    buffers): the down GEMM also pushes the rows into their source slots. down False: the gate/up
    GEMM only (a recompute for the backward). Returns (h or None, y_routed [cap, H] or None)."""
    cap, I, H = sched.capacity, fc1.shape[1] // 2, ws.hidden
    bf16 = dict(dtype=torch.bfloat16, device=ws.device)
    quant = cfg.precision == "fp8"
    if quant:
        published = dispatch.publish_e4m3(cfg, ws, x, sched)
        started = mark(during_dispatch)
        x_e4m3, x_scale = dispatch.dispatch_e4m3(ws, sched, published, comm_ctas)
    else:
        x_ptrs = dispatch.publish_bf16(cfg, ws, x, sched)
        started = mark(during_dispatch)
        x_routed = dispatch.dispatch_bf16(ws, sched, x_ptrs, comm_ctas)
    if during_dispatch is not None:
        during_dispatch(started)
    act = torch.empty((cap, I), **bf16)
    h = torch.empty((cap, 2 * I), **bf16) if keep_gate_up or quant else None
    y_routed = torch.empty((cap, H), **bf16) if down else None
    if quant:
        w8 = fp8_weights or experts.quantize_expert_weights(fc1, fc2)
        experts.routed_fp8(sched, x_e4m3, x_scale, w8, act, h, y_routed, gemm_ctas, push)
    else:
        experts.routed_bf16(sched, x_routed, fc1, fc2, act, h, y_routed, gemm_ctas)
    return h, y_routed


def _forward_staged(cfg, ws, sched, x, probs, fc1, fc2, shared_fc1, shared_fc2, out, gemm_ctas, comm_ctas,
                    fp8_weights):
    comb, comb_ptrs = combine.combine_buffer(ws)
    keep = cfg.save_gate_up or cfg.precision == "fp8"
    push = comb_ptrs if cfg.precision == "fp8" else None  # fp8: the down GEMM's epilogue combines
    main = torch.cuda.current_stream(ws.device)
    side = side_stream(ws.device) if shared_fc1 is not None else None
    shared, shared_w8, shared_y = [], [], None
    if side is not None:  # the side stream's outputs belong to this stream (comm.join)
        shared.extend(experts.shared_gate_up_out(x, shared_fc1, keep))
        shared_y = torch.empty((ws.num_tokens, ws.hidden), dtype=torch.bfloat16, device=ws.device)

    # The communication kernels are launched first and the side stream's GEMMs right after, waiting
    # on an event from just before them: the GPU gives the communication its CTAs first.
    def shared_gate_up(started):
        side.wait_event(started)
        with torch.cuda.stream(side):
            shared_w8.extend(experts.shared_e4m3(cfg, ws, shared_fc1, shared_fc2, fp8_weights))
            experts.shared_gate_up(ws, x, shared_fc1, keep, gemm_ctas, *shared_w8[:2], out=shared)

    h, y_routed = _dispatch_and_experts(cfg, ws, sched, x, fc1, fc2, keep_gate_up=cfg.save_gate_up,
                                        gemm_ctas=gemm_ctas, comm_ctas=comm_ctas, fp8_weights=fp8_weights,
                                        during_dispatch=shared_gate_up if side is not None else None, push=push)
    ctx = KernelContext(h)
    routed_done = mark(side if push is None else None)
    if push is None:
        combine.push_rows(ws, sched, y_routed, comb_ptrs, comm_ctas)
    if side is not None:
        if routed_done is not None:
            side.wait_event(routed_done)
        with torch.cuda.stream(side):
            experts.shared_down(shared[0], shared_fc2, gemm_ctas, shared_w8[0], shared_w8[2], out=shared_y)
        ctx.shared_h = shared[1]
    combine.barrier(cfg, ws)
    if side is not None:
        join(main, side)
    if out is None:
        out = torch.empty((ws.num_tokens, ws.hidden), dtype=torch.bfloat16, device=ws.device)
    combine.epilogue(cfg, ws, comb, probs, shared_y, out, opened=False)
    return out, ctx


def _forward_persistent(cfg, ws, sched, x, probs, fc1, fc2, shared_fc1, shared_fc2, out, gemm_ctas, comm_ctas):
    c = comm(ws)
    T, H, cap = ws.num_tokens, ws.hidden, sched.capacity
    I = fc1.shape[1] // 2
    bf16 = dict(dtype=torch.bfloat16, device=ws.device)
    comb, comb_ptrs = combine.combine_buffer(ws)
    x = x.contiguous()
    if x.data_ptr() % 16:
        x = x.clone()
    xs, x_ptrs = c.buffer("x")
    ops.publish_barrier(x, xs, c.state, ws.errors, c.flag_ptrs, ws.rank, cfg.peer_timeout_s, schedule=sched)
    x_routed = torch.empty((cap, H), **bf16)
    act = torch.empty((cap, I), **bf16)
    h = torch.empty((cap, 2 * I), **bf16) if cfg.save_gate_up else None
    y_routed = torch.empty((cap, H), **bf16)
    shared_act = shared_h = shared_y = None
    if shared_fc1 is not None:
        shared_fc1, shared_fc2 = shared_fc1.contiguous(), shared_fc2.contiguous()
        shared_act = torch.empty((T, shared_fc1.shape[0] // 2), **bf16)
        shared_h = torch.empty((T, shared_fc1.shape[0]), **bf16) if cfg.save_gate_up else None
        shared_y = torch.empty((T, H), **bf16)
    ops.megakernel(
        x=x, fc1=fc1.contiguous(), fc2=fc2.contiguous(), shared_fc1=shared_fc1, shared_fc2=shared_fc2,
        row_src_rank=sched.row_src_rank, row_src_slot=sched.row_src_slot, expert_counts=sched.expert_counts,
        expert_offsets=sched.expert_offsets, x_routed=x_routed, act=act, h=h, y_routed=y_routed,
        shared_act=shared_act, shared_h=shared_h, shared_y=shared_y,
        counters=c.counters(ops.megakernel_counter_ints(cap, T, fc1.shape[0])), state=c.state, errors=ws.errors,
        peer_x=x_ptrs, peer_comb=comb_ptrs, peer_flags=c.flag_ptrs, rank=ws.rank, topk=ws.topk,
        num_comm=comm_ctas if comm_ctas > 0 else cfg.fwd_comm_sms, num_compute=gemm_ctas,
        minibatch_rows=cfg.minibatch_rows, timeout_s=min(cfg.peer_timeout_s, KERNEL_WATCHDOG_S))
    if out is None:
        out = torch.empty((T, H), **bf16)
    combine.epilogue(cfg, ws, comb, probs, shared_y, out, opened=True)
    return out, KernelContext(h, shared_h)


def forward(cfg: MoKConfig, ws: MoKWorkspace, sched: MoKSchedule, x, probs, fc1, fc2, shared_fc1=None,
            shared_fc2=None, *, out: torch.Tensor | None = None, gemm_ctas: int = 0, comm_ctas: int = 0,
            fp8_weights=None):
    """One layer forward on the device. Returns ``(out [T, H] bf16, KernelContext)``.

    ``out``: optional preallocated output (tests poison it). ``gemm_ctas`` / ``comm_ctas``: staged:
    CTA counts of the GEMMs and of dispatch/combine; persistent: CTAs besides the dispatching ones,
    and dispatching CTAs (default ``cfg.fwd_comm_sms``); 0: derived from the SM count. No knob
    changes a result bit. ``cfg.precision == "fp8"``: the routed GEMMs run block-scaled e4m3
    (``fp8_weights`` from ``quantize_expert_weights``, else quantized in this call); the context
    and the output stay bf16. Every rank of the group must run the same composition.
    """
    comm(ws).call_buffers("forward", cfg)  # all its symmetric buffers first (created on the first forward)
    if cfg.resolved_forward_kernel(ws.ep_size) == "persistent":
        return _forward_persistent(cfg, ws, sched, x, probs, fc1, fc2, shared_fc1, shared_fc2, out, gemm_ctas,
                                   comm_ctas)
    return _forward_staged(cfg, ws, sched, x, probs, fc1, fc2, shared_fc1, shared_fc2, out, gemm_ctas, comm_ctas,
                           fp8_weights)


def recompute_forward_context(cfg: MoKConfig, ws: MoKWorkspace, sched: MoKSchedule, x, fc1, fc2, shared_fc1=None,
                              *, fp8_weights=None) -> KernelContext:
    """Dispatch and the gate/up GEMMs again (activation checkpointing): the context the forward
    would have kept (with the gate/up pre-activations: it is made for the backward that follows)."""
    comm(ws).call_buffers("recompute_forward_context", cfg)
    h, _ = _dispatch_and_experts(cfg, ws, sched, x, fc1, fc2, keep_gate_up=True, fp8_weights=fp8_weights, down=False)
    ctx = KernelContext(h)
    if shared_fc1 is not None:
        seg, w1, _ = experts.shared_e4m3(cfg, ws, shared_fc1, fp8_weights=fp8_weights)
        ctx.shared_h = experts.shared_gate_up(ws, x, shared_fc1, True, 0, seg, w1)[1]
    # Peers may still read this rank's published rows: no rank rewrites them before all are done.
    combine.barrier(cfg, ws)
    return ctx
