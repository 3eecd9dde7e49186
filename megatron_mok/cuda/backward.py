"""The layer backward on the device: the staged launches, one per step, on the caller's stream with
the shared expert and other off-critical-path work on a side stream.

1. ``bwd_publish``: grad_out and probs into this rank's symmetric buffers, device barrier (it
   carries the call's header: grad_out's T, H and dtype, the precisions; megatron_mok/header.py);
2. ``bwd_pull``: every routed row pulls its grad_out row and router weight from the source rank,
   ``dy = bf16(w * g)`` (the forward's padded rows; padding rows 0; fp8 dgrads: also dy in e4m3),
   and stores ``<g, y_routed>`` (the router-weight gradient, fp32, fixed order) into the source's
   symmetric ``[T * k]`` buffer;
3. on the side stream, launched after the pull but waiting only on an event from before it (the
   NVLink-bound pull gets its CTAs first, the side work fills the SMs it leaves idle): the shared
   expert's backward, and for fp8 the operands the weight gradients need (the dispatched rows
   dequantized, or act and the rows transposed into e4m3);
4. the routed dgrads, the critical path to the push: ``dh = SwiGLU'(h, dy @ fc2[e])`` (h from the
   context, or recomputed by the forward's own gate/up GEMM: the same bits) and
   ``dx_rows = dh @ fc1[e]``; then the dx rows go into the source ranks' symmetric ``[T * k, H]``
   slots (``bwd_push``, or the fp8 dgrad's epilogue) and the closing barrier opens;
5. the routed weight gradients while the peers finish pushing: ``dfc2[e] = dy^T @ act``,
   ``dfc1[e] = dh^T @ x_routed``, reduced over each expert's rows in ascending order (experts
   without rows get exact zeros);
6. ``bwd_epilogue_wait``: closes the barrier, ``dx[t] = sum_s slot[t, s]`` in slot order in fp32
   ``+`` shared dx, cast once; ``dprobs`` out of the symmetric buffer.

Which stream runs what changes no bit: every task's inputs and reduction order are fixed.
"""

from __future__ import annotations


import torch

from .. import ops
from ..config import MoKConfig
from ..grads import MoKGrads, accumulate
from ..header import call_header
from ..schedule import MoKSchedule
from ..workspace import MoKWorkspace
from . import experts
from .comm import comm, join, mark, side_stream
from .context import KernelContext, routed_rows
from .forward import recompute_forward_context


def _aligned(t: torch.Tensor) -> torch.Tensor:
    t = t.contiguous()
    return t if t.data_ptr() % 16 == 0 else t.clone()


class _LateTransposes:
    """The e4m3 weight gradients' dy and dh operands, transposed on the side stream as soon as each
    exists, and handed back to the caller's stream right before their GEMM."""

    def __init__(self, side, main, offsets, counts):
        self.side, self.main, self.offsets, self.counts = side, main, offsets, counts
        self.ready: dict = {}

    def start(self, name: str, t: torch.Tensor) -> None:
        if self.side is None:
            return
        self.side.wait_event(mark())
        with torch.cuda.stream(self.side):
            self.ready[name] = (*ops.quantize_columns_e4m3(t, self.offsets, self.counts), mark())
        t.record_stream(self.side)

    def take(self, name: str, t: torch.Tensor):
        if name not in self.ready:
            return ops.quantize_columns_e4m3(t, self.offsets, self.counts)
        q_t, scale, ready = self.ready.pop(name)
        self.main.wait_event(ready)
        q_t.record_stream(self.main)
        scale.record_stream(self.main)
        return q_t, scale


def backward(cfg: MoKConfig, ws: MoKWorkspace, sched: MoKSchedule, ctx: KernelContext | None, grad_out, x, probs,
             fc1, fc2, shared_fc1=None, shared_fc2=None, main_grads=None, *, comm_ctas: int = 0,
             fp8_weights=None) -> MoKGrads:
    """Gradients of one layer on the device.

    No host sync and no data-dependent shapes (CUDA-graph capturable once the workspace's buffers
    exist). ``cfg.dgrad_precision == "fp8"``: the two routed dgrads on block-scaled e4m3 operands
    (the weights' transposed copies from ``fp8_weights`` or quantized here);
    ``cfg.wgrad_precision == "fp8"``: the routed weight gradients on e4m3 transposes of their
    operands. The shared expert's backward is bf16. Weight gradients come back in bf16 (fp32
    accumulation inside each GEMM, one rounding); with ``main_grads`` they are added into those
    fp32 tensors and come back as None. ``ctx`` None: the forward context is recomputed here.
    ``comm_ctas``: CTAs of the pull and push kernels (0: ``4 * cfg.bwd_comm_sms``); no bit changes.
    """
    if ctx is None:
        ctx = recompute_forward_context(cfg, ws, sched, x, fc1, fc2, shared_fc1, fp8_weights=fp8_weights)
    c = comm(ws)
    T, H, k, cap = ws.num_tokens, ws.hidden, ws.topk, sched.capacity
    I = fc1.shape[1] // 2
    nle = sched.expert_counts.numel()
    counts, offsets = sched.expert_counts, sched.expert_offsets
    wgrad8 = cfg.wgrad_precision == "fp8"
    w8 = None
    if cfg.dgrad_precision == "fp8":
        w8 = fp8_weights if fp8_weights is not None and fp8_weights.has_transposed else \
            experts.quantize_expert_weights(fc1, fc2, transposed=True)
    # fp8 forward: the dispatched rows exist only in e4m3. The bf16 weight gradient of fc1 needs them
    # dequantized (on the side stream); the e4m3 one reads the e4m3 copy directly.
    defer_x = ctx.x_routed is None and not wgrad8
    bf16 = dict(dtype=torch.bfloat16, device=ws.device)
    fc1, fc2 = fc1.contiguous(), fc2.contiguous()
    g = _aligned(grad_out)
    x = _aligned(x)

    # 1. publish grad_out and probs, barrier
    gbuf, g_ptrs = c.buffer("bwd_grad", (T, H), torch.bfloat16)
    pbuf, p_ptrs = c.buffer("bwd_probs", (T, k), torch.float32)
    slots, slot_ptrs = c.buffer("bwd_dx_slots", (T * k, H), torch.bfloat16)
    dwbuf, dw_ptrs = c.buffer("bwd_dprobs_slots", (T * k,), torch.float32)
    header = call_header(num_tokens=grad_out.shape[0], hidden=grad_out.shape[1], topk=probs.shape[1],
                         num_experts=ws.num_experts, capacity=cap, dtype=grad_out.dtype, cfg=cfg, ep_size=ws.ep_size)
    ws.call_headers[1] = header
    ops.bwd_publish(g, gbuf, probs.contiguous(), pbuf, c.state, ws.errors, c.flag_ptrs, ws.rank, cfg.peer_timeout_s,
                    header=header)
    dx = torch.empty((T, H), **bf16)
    dprobs = torch.empty((T, k), dtype=torch.float32, device=ws.device)

    # 2. pull dy = w * g into the routed rows (fp8 dgrads: dy in e4m3 too, quantized on the way)
    comm_ctas = comm_ctas or 4 * cfg.bwd_comm_sms
    dy = torch.empty((cap, H), **bf16)
    dyq = dys = None
    if w8 is not None:
        dyq, dys = ops.empty_rows_e4m3(cap, H, ws.device)
    main = torch.cuda.current_stream(ws.device)
    side = side_stream(ws.device) if shared_fc1 is not None or defer_x or wgrad8 else None
    before_pull = mark(side)
    ops.bwd_pull(sched.row_src_rank, sched.row_src_slot, offsets, ctx.y_routed, dy, g_ptrs, p_ptrs, dw_ptrs, k,
                 comm_ctas, q=dyq, q_scale=dys)

    # 3. side stream: the shared expert, and the weight gradients' operands that exist already
    shared, x_routed, x_ready, early8 = None, ctx.x_routed, None, None
    if side is not None:
        side.wait_event(before_pull)
        with torch.cuda.stream(side):
            if defer_x:
                x_routed = routed_rows(ctx, sched)
                x_ready = mark()
            if wgrad8:
                early8 = experts.wgrad_operands_e4m3(ctx, sched)
                x_ready = mark()
            if shared_fc1 is not None:
                shared = experts.shared_backward(ws, ctx, g, x, shared_fc1, shared_fc2)
    late8 = _LateTransposes(side, main, offsets, counts)
    if wgrad8:
        late8.start("dy", dy)

    # 4. routed dgrads (cap rows allocated: the row count is a device value; padding rows are zero)
    h = ctx.h if ctx.h is not None else experts.recompute_gate_up(routed_rows(ctx, sched), fc1, sched)
    dh = torch.empty((cap, 2 * I), **bf16)
    dx_rows = torch.empty((cap, H), **bf16)
    dh_done = (lambda: late8.start("dh", dh)) if wgrad8 else None
    if w8 is not None:  # the fc1 dgrad's epilogue pushes the dx rows (no bwd_push launch)
        experts.routed_dgrads_fp8(w8, dyq, dys, h, offsets, counts, dh, dx_rows,
                                  push=(sched.row_src_rank, sched.row_src_slot, slot_ptrs), dh_done=dh_done)
        del h, dyq, dys
        ops.barrier_open(c.state, c.flag_ptrs, ws.rank)
    else:
        experts.routed_dgrads_bf16(dy, fc1, fc2, offsets, counts, h, dh, dx_rows, dh_done)
        del h
        ops.bwd_push(dx_rows, sched.row_src_rank, sched.row_src_slot, offsets, c.state, slot_ptrs, c.flag_ptrs,
                     ws.rank, comm_ctas)
    del dx_rows

    # 5. routed weight gradients while the peers finish pushing
    if x_ready is not None:
        main.wait_event(x_ready)
        for t in [x_routed] if defer_x else early8:
            t.record_stream(main)
    dfc2 = torch.empty((nle, H, I), **bf16)
    dfc1 = torch.empty((nle, 2 * I, H), **bf16)
    if wgrad8:  # e4m3 transposes, one scale per (expert, column)
        act_t, act_s, x_t, x_s = early8 if early8 is not None else experts.wgrad_operands_e4m3(ctx, sched)
        del early8
        dy_t, dy_s = late8.take("dy", dy)
        del dy
        ops.expert_wgrad_fp8(dy_t, dy_s, act_t, act_s, offsets, counts, dfc2)
        del dy_t, act_t
        dh_t, dh_s = late8.take("dh", dh)
        del dh
        ops.expert_wgrad_fp8(dh_t, dh_s, x_t, x_s, offsets, counts, dfc1)
        del dh_t, x_t
    else:
        if x_routed is None:
            x_routed = routed_rows(ctx, sched)
        ops.expert_wgrad(dy, offsets, ctx.act, offsets, counts, dfc2)
        del dy
        ops.expert_wgrad(dh, offsets, x_routed, offsets, counts, dfc1)
        del dh

    dsfc1 = dsfc2 = shared_dx = None
    if side is not None:
        join(main, side, shared or ())
    if shared_fc1 is not None:
        dsfc1, dsfc2, shared_dx = shared

    # 6. close the barrier; fixed-order slot sum + shared dx; dprobs out of the symmetric buffer
    ops.bwd_epilogue_wait(slots, dwbuf, shared_dx, dx, dprobs, c.state, ws.errors, c.flag_ptrs, ws.rank,
                          cfg.peer_timeout_s)
    return MoKGrads(dx.to(x.dtype), dprobs, *accumulate([dfc1, dfc2, dsfc1, dsfc2], main_grads))
