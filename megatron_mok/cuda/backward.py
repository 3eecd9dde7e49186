"""The layer backward on the device: the staged launches, one per step, on the caller's stream with
the shared expert and other off-critical-path work on a side stream.

The forward keeps only the gate/up pre-activations (``KernelContext``); the backward gets the rest
back where it needs it:

1. ``bwd_publish``: grad_out and probs into this rank's symmetric buffers, device barrier (it
   carries the call's header: grad_out's T, H and dtype, the precisions; megatron_mok/header.py);
2. ``bwd_pull``: every routed row pulls its grad_out row, as it is, and its router weight from the
   source rank (fp8 dgrads: the rows in e4m3 too, quantized on the way); padding rows 0;
3. on the side stream, launched after the pull but waiting only on an event from before it (the
   NVLink-bound pull gets its CTAs first, the side work fills the SMs it leaves idle): the shared
   expert's backward;
4. the routed dgrads, the critical path to the push. The down dgrad's epilogue takes
   ``da = g @ fc2[e]`` and, with h: the router-weight gradient's pieces ``<da, act>`` (``<g, y>``
   without the expert output y), ``act_w = bf16(w * act)`` (the down weight gradient's operand),
   and ``dh = SwiGLU'(h, w * da)``; ``bwd_dprobs`` sends each row's sum to its source slot. Then
   ``dx_rows = dh @ fc1[e]`` goes into the source ranks' symmetric ``[T * k, H]`` slots (``bwd_push``,
   or the fp8 dgrad's epilogue) and the closing barrier opens;
5. ``bwd_epilogue_wait``: closes the barrier, ``dx[t] = sum_s slot[t, s]`` in slot order in fp32
   ``+`` shared dx, cast once; ``dprobs`` out of the symmetric buffer;
6. the routed rows dispatched once more from x (``dispatch.regather``: the forward's bits, its own
   barriers, which must not fall inside the push's open barrier), and ``dfc1[e] = dh^T @ x_rows``;
7. ``dfc2[e] = g^T @ act_w``. In this order the backward's peak holds one of the two weight
   gradients beside dh and the rows, or both beside g and act_w. Weight gradients reduce over each
   expert's rows in ascending order (experts without rows get exact zeros).

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
from . import dispatch, experts, wgrad_groups
from .comm import comm, join, mark, side_stream
from .context import KernelContext
from .forward import recompute_forward_context


def _aligned(t: torch.Tensor) -> torch.Tensor:
    t = t.contiguous()
    return t if t.data_ptr() % 16 == 0 else t.clone()


class _LateTransposes:
    """The e4m3 weight gradients' operands, transposed on the side stream as soon as each exists,
    and handed back to the caller's stream right before their GEMM.

    No ``record_stream``: a CUDA-graph capture defers the frees of recorded blocks to its end (the
    fp8 one-GPU proxy's full-iteration capture ran out of memory on them). Ownership stays with the
    caller's stream instead: the transposes are allocated there before the side stream, which waits
    for that point, writes them; a source stays referenced until the caller's stream has waited for
    its transpose."""

    def __init__(self, side, main, offsets, counts):
        self.side, self.main, self.offsets, self.counts = side, main, offsets, counts
        self.ready: dict = {}

    def start(self, name: str, t: torch.Tensor) -> None:
        if self.side is None:
            return
        q_t, scale = ops.empty_columns_e4m3(t, self.counts)
        self.side.wait_event(mark())
        with torch.cuda.stream(self.side):
            ops.quantize_columns_e4m3(t, self.offsets, self.counts, out=(q_t, scale))
            self.ready[name] = (q_t, scale, mark(), t)

    def take(self, name: str, t: torch.Tensor):
        if name not in self.ready:
            return ops.quantize_columns_e4m3(t, self.offsets, self.counts)
        q_t, scale, ready, _source = self.ready.pop(name)
        self.main.wait_event(ready)  # from here the caller's stream may free the source
        return q_t, scale


def backward(cfg: MoKConfig, ws: MoKWorkspace, sched: MoKSchedule, ctx: KernelContext | None, grad_out, x, probs,
             fc1, fc2, shared_fc1=None, shared_fc2=None, main_grads=None, *, comm_ctas: int = 0,
             fp8_weights=None, hold_wgrads: bool = False) -> MoKGrads:
    """Gradients of one layer on the device.

    No host sync and no data-dependent shapes (CUDA-graph capturable once the workspace's buffers
    exist). ``x``: the layer input of the forward (its rows are dispatched once more).
    ``cfg.dgrad_precision == "fp8"``: the two routed dgrads on block-scaled e4m3 operands (the
    weights' transposed copies from ``fp8_weights`` or quantized here); ``cfg.wgrad_precision ==
    "fp8"``: the routed weight gradients on e4m3 transposes of their operands. The shared expert's
    backward is bf16. Weight gradients come back in bf16 (fp32 accumulation inside each GEMM, one
    rounding); with ``main_grads`` they are added into those tensors and come back as None. The
    weight-gradient GEMMs add into an fp32 contiguous main grad of their weight's shape themselves,
    in fp32 (``fused_main_grad``: no bf16 rounding, no bf16 copy, as Megatron's gradient-accumulation
    fusion does); other main grads get the bf16 gradient added.
    ``ctx`` None: the forward context is recomputed here. ``comm_ctas``: CTAs of the pull and push
    kernels (0: ``4 * cfg.bwd_comm_sms``); no bit changes. ``hold_wgrads`` with
    ``cfg.wgrad_microbatches`` > 1 and both routed main grads fused (bf16 weight gradients): the
    routed weight gradients may wait for later backwards on the same main grads (wgrad_groups.py).
    """
    c = comm(ws)
    # the call's symmetric buffers (comm.CALL_BUFFERS), all before the recompute's first barrier
    bufs = c.call_buffers("backward", cfg)
    if ctx is None:
        ctx = recompute_forward_context(cfg, ws, sched, x, fc1, fc2, shared_fc1, fp8_weights=fp8_weights)
    T, H, k, cap = ws.num_tokens, ws.hidden, ws.topk, sched.capacity
    I = fc1.shape[1] // 2
    nle = sched.expert_counts.numel()
    counts, offsets = sched.expert_counts, sched.expert_offsets
    wgrad8 = cfg.wgrad_precision == "fp8"
    w8 = None
    if cfg.dgrad_precision == "fp8":
        w8 = fp8_weights if fp8_weights is not None and fp8_weights.has_transposed else \
            experts.quantize_expert_weights(fc1, fc2, transposed=True)
    bf16 = dict(dtype=torch.bfloat16, device=ws.device)
    fc1, fc2 = fc1.contiguous(), fc2.contiguous()
    main1 = fused_main_grad(main_grads, 0, (nle, 2 * I, H), ws.device)
    main2 = fused_main_grad(main_grads, 1, (nle, H, I), ws.device)
    # where the weight gradients' operands go: this backward's part of its layer's group (several
    # micro-batches in one weight-gradient pass), or tensors of its own
    grouped = not wgrad8 and main1 is not None and main2 is not None
    part = wgrad_groups.Part(cfg.wgrad_microbatches if grouped else 1, cap, H, I, ws.device, main1, main2)
    g = _aligned(grad_out)
    x = _aligned(x)
    comm_ctas = comm_ctas or 4 * cfg.bwd_comm_sms

    # 0. gate/up pre-activations not kept (save_gate_up off): the rows and the forward's gate/up GEMM
    rows, h = None, ctx.h
    if h is None:
        rows = dispatch.regather(cfg, ws, sched, x, out=part.x_rows)
        h = experts.recompute_gate_up(dispatch.rows_bf16(rows, sched, out=part.x_rows), fc1, sched)

    # 1. publish grad_out and probs, barrier
    (gbuf, g_ptrs), (pbuf, p_ptrs) = bufs["bwd_grad"], bufs["bwd_probs"]
    (slots, slot_ptrs), (dwbuf, dw_ptrs) = bufs["bwd_dx_slots"], bufs["bwd_dprobs_slots"]
    header = call_header(num_tokens=grad_out.shape[0], hidden=grad_out.shape[1], topk=probs.shape[1],
                         num_experts=ws.num_experts, capacity=cap, dtype=grad_out.dtype, cfg=cfg, ep_size=ws.ep_size)
    ws.call_headers[1] = header
    ops.bwd_publish(g, gbuf, probs.contiguous(), pbuf, c.state, ws.errors, c.flag_ptrs, ws.rank, cfg.peer_timeout_s,
                    header=header, schedule=sched)
    dx = torch.empty((T, H), **bf16)
    dprobs = torch.empty((T, k), dtype=torch.float32, device=ws.device)

    # 2. pull the grad_out rows as they are and their router weights (fp8 dgrads: in e4m3 too)
    g_rows = part.g_rows
    row_w = torch.empty((cap,), dtype=torch.float32, device=ws.device)
    gq = gs = None
    if w8 is not None:
        gq, gs = ops.empty_rows_e4m3(cap, H, ws.device)
    main = torch.cuda.current_stream(ws.device)
    side = side_stream(ws.device) if shared_fc1 is not None or wgrad8 else None
    shared = main_s1 = main_s2 = None
    if shared_fc1 is not None:  # the side stream's outputs belong to this stream (comm.join)
        main_s1 = fused_main_grad(main_grads, 2, shared_fc1.shape, ws.device)
        main_s2 = fused_main_grad(main_grads, 3, shared_fc2.shape, ws.device)
        shared = experts.shared_backward_out(g, shared_fc1, main_s1, main_s2)
    before_pull = mark(side)
    ops.bwd_pull(sched.row_src_rank, sched.row_src_slot, offsets, g_rows, row_w, g_ptrs, p_ptrs, k, comm_ctas,
                 q=gq, q_scale=gs)

    # 3. side stream: the shared expert
    if shared_fc1 is not None:
        side.wait_event(before_pull)
        with torch.cuda.stream(side):
            experts.shared_backward(ws, ctx, g, x, shared_fc1, shared_fc2, main_s1, main_s2, out=shared)
    late8 = _LateTransposes(side, main, offsets, counts)
    if wgrad8:
        late8.start("dy", g_rows)

    # 4. routed dgrads (cap rows allocated: the row count is a device value; padding rows are zero)
    dh, act_w = part.dh, part.act_w
    dot = ops.dot_pieces(cap, I, ws.device)
    if w8 is not None:
        dhq, dhs = experts.down_dgrad_fp8(w8, gq, gs, h, offsets, counts, row_w, dh, act_w, dot)
        del gq, gs
    else:
        experts.down_dgrad_bf16(g_rows, fc2, offsets, counts, h, row_w, dh, act_w, dot)
    del h, row_w
    ops.bwd_dprobs(dot, sched.row_src_rank, sched.row_src_slot, offsets, dw_ptrs)
    del dot
    if wgrad8:
        late8.start("act", act_w)
        late8.start("dh", dh)
    dx_rows = torch.empty((cap, H), **bf16)
    if w8 is not None:  # the fc1 dgrad's epilogue pushes the dx rows (no bwd_push launch)
        experts.fc1_dgrad_fp8(w8, dhq, dhs, offsets, counts, dx_rows,
                              push=(sched.row_src_rank, sched.row_src_slot, slot_ptrs))
        del dhq, dhs
        ops.barrier_open(c.state, c.flag_ptrs, ws.rank)
    else:
        ops.expert_dgrad(dh, fc1, offsets, counts, dx_rows)
        ops.bwd_push(dx_rows, sched.row_src_rank, sched.row_src_slot, offsets, c.state, slot_ptrs, c.flag_ptrs,
                     ws.rank, comm_ctas)
    del dx_rows

    # 5. close the barrier; fixed-order slot sum + shared dx; dprobs out of the symmetric buffer
    dsfc1 = dsfc2 = shared_dx = None
    if side is not None:
        join(main, side)
    if shared_fc1 is not None:
        dsfc1, dsfc2, shared_dx = shared
    ops.bwd_epilogue_wait(slots, dwbuf, shared_dx, dx, dprobs, c.state, ws.errors, c.flag_ptrs, ws.rank,
                          cfg.peer_timeout_s)

    # 6. the fc1 weight gradient on the routed rows, dispatched once more (first: then dh and the
    #    rows go before the down projection's gradient is allocated)
    if rows is None:
        rows = dispatch.regather(cfg, ws, sched, x, out=part.x_rows)
    if part.group is not None:  # both weight gradients with the group's other parts, now or later
        dispatch.rows_bf16(rows, sched, out=part.x_rows)
        del rows, dh, g_rows, act_w
        part.finish(offsets, counts, hold_wgrads)
        return MoKGrads(dx.to(x.dtype), dprobs, *accumulate([None, None, dsfc1, dsfc2], main_grads))
    dfc1 = main1 if main1 is not None else torch.empty((nle, 2 * I, H), **bf16)
    if wgrad8:  # e4m3 transposes, one scale per (expert, column)
        x_t, x_s = ops.quantize_columns_e4m3(rows, offsets, counts) if isinstance(rows, torch.Tensor) else \
            ops.quantize_columns_e4m3(rows[0], offsets, counts, x_scale=rows[1])
        del rows
        dh_t, dh_s = late8.take("dh", dh)
        del dh
        ops.expert_wgrad_fp8(dh_t, dh_s, x_t, x_s, offsets, counts, dfc1)
        del dh_t, x_t
    else:
        x_rows = dispatch.rows_bf16(rows, sched)
        del rows
        ops.expert_wgrad(dh, offsets, x_rows, offsets, counts, dfc1)
        del dh, x_rows

    # 7. the down projection's weight gradient
    dfc2 = main2 if main2 is not None else torch.empty((nle, H, I), **bf16)
    if wgrad8:
        dy_t, dy_s = late8.take("dy", g_rows)
        act_t, act_s = late8.take("act", act_w)
        del g_rows, act_w
        ops.expert_wgrad_fp8(dy_t, dy_s, act_t, act_s, offsets, counts, dfc2)
        del dy_t, act_t
    else:
        ops.expert_wgrad(g_rows, offsets, act_w, offsets, counts, dfc2)
        del g_rows, act_w
    if main1 is not None:
        dfc1 = None  # added into main_grads[0] by its GEMM
    if main2 is not None:
        dfc2 = None
    return MoKGrads(dx.to(x.dtype), dprobs, *accumulate([dfc1, dfc2, dsfc1, dsfc2], main_grads))


def fused_main_grad(main_grads, i: int, shape, device):
    """``main_grads[i]`` when its weight-gradient GEMM can add into it itself (fp32, contiguous,
    ``shape``, on ``device``), else None (then the bf16 gradient is added after the GEMM)."""
    main = None if main_grads is None else main_grads[i]
    if main is None or main.dtype != torch.float32 or not main.is_contiguous() or tuple(main.shape) != tuple(shape) \
            or main.device != device:
        return None
    return main
