"""The expert GEMMs of both passes on the one GEMM core (csrc/kernels/gemm/).

Routed experts run expert-major (the weights on wgmma's M side, up to 256 of an expert's token rows
on its N side); the shared expert runs as token-major tiles in bf16, or in e4m3 as one segment of
T rows on the routed kernels. SwiGLU is fused into the gate/up GEMM's epilogue, the SwiGLU backward
into the down projection's dgrad. Every output element is owned by one task and reduced in
ascending K order, so no launch geometry changes a bit.
"""

from __future__ import annotations

import torch

from .. import fp8, ops
from ..config import MoKConfig
from ..schedule import MoKSchedule
from ..workspace import MoKWorkspace
from .comm import comm
from .context import KernelContext
from .dispatch import published_x_e4m3

# ---- weights ------------------------------------------------------------------------------------


def quantize_expert_weights(fc1, fc2, transposed: bool = False, shared_fc1=None,
                            shared_fc2=None) -> fp8.FP8ExpertWeights:
    """``fp8.quantize_expert_weights`` on the device (the same bits). transposed: also the copies the
    backward's e4m3 dgrads read, from the same pass; shared_fc1/shared_fc2: the shared expert's too."""
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


def shared_e4m3(cfg: MoKConfig, ws: MoKWorkspace, shared_fc1, shared_fc2=None, fp8_weights=None):
    """(segment, e4m3 fc1, e4m3 fc2) of the shared expert when the forward runs it on e4m3 operands
    (weights from ``fp8_weights`` when it holds them, else quantized here; shared_fc2 None: fc1's
    only), else Nones."""
    if shared_fc1 is None or cfg.shared_precision != "fp8" or not fp8.shared_in_e4m3(shared_fc1):
        return None, None, None
    w = fp8_weights.shared_for(shared_fc1, shared_fc2) if fp8_weights is not None else None
    return (comm(ws).shared_seg,
            *((w.fc1, w.fc2) if w is not None else _shared_weights_e4m3(shared_fc1, shared_fc2)))


# ---- forward ------------------------------------------------------------------------------------


def shared_gate_up_out(x, shared_fc1, keep_gate_up: bool):
    """Uninitialised (shared_act, shared_h or None) for ``shared_gate_up``."""
    T, bf16 = x.shape[0], dict(dtype=torch.bfloat16, device=x.device)
    return (torch.empty((T, shared_fc1.shape[0] // 2), **bf16),
            torch.empty((T, shared_fc1.shape[0]), **bf16) if keep_gate_up else None)


def shared_gate_up(ws: MoKWorkspace, x, shared_fc1, keep_gate_up: bool, gemm_ctas: int = 0, seg=None, w8=None,
                   out=None):
    """The shared expert's gate/up GEMM with SwiGLU: (shared_act [T, Is], shared_h [T, 2 Is] or None).
    seg (``shared_e4m3``): on e4m3 operands (x as ``publish_e4m3`` quantized it), one segment of T
    rows; h is then always kept. ``out``: ``shared_gate_up_out``'s pair to write (the caller's stream
    owns them when this runs on the side stream)."""
    shared_act, shared_h = out if out is not None else shared_gate_up_out(x, shared_fc1, keep_gate_up or seg is not None)
    if seg is not None and shared_h is None:
        raise ValueError("shared_gate_up on e4m3 operands keeps h: out needs shared_h")
    if seg is not None:
        xq, xs = published_x_e4m3(ws)
        ops.expert_gemm_fp8(xq, xs, w8.q, w8.scale, seg[:2], seg[2:], shared_act, True, pre_out=shared_h,
                            num_ctas=gemm_ctas)
    else:
        ops.grouped_gemm(x.contiguous(), shared_fc1.contiguous(), None, shared_act, True, gemm_ctas, pre_out=shared_h)
    return shared_act, shared_h


def shared_down(shared_act, shared_fc2, gemm_ctas: int = 0, seg=None, w8=None, out=None) -> torch.Tensor:
    """The shared expert's down GEMM: shared_y [T, H] (into ``out`` if given); seg: on e4m3 operands
    (``shared_gate_up``)."""
    shared_fc2 = shared_fc2.contiguous()
    shared_y = out if out is not None else torch.empty((shared_act.shape[0], shared_fc2.shape[0]),
                                                       dtype=torch.bfloat16, device=shared_act.device)
    if seg is not None:
        aq, as_ = ops.quantize_rows_e4m3(shared_act)
        ops.expert_gemm_fp8(aq, as_, w8.q, w8.scale, seg[:2], seg[2:], shared_y, False, num_ctas=gemm_ctas)
    else:
        ops.grouped_gemm(shared_act, shared_fc2, None, shared_y, False, gemm_ctas)
    return shared_y


def routed_bf16(sched: MoKSchedule, x_routed, fc1, fc2, act, h, y_routed, gemm_ctas: int = 0) -> None:
    """act = SwiGLU(x_routed @ fc1[e]^T) (h: also the pre-activations), y_routed = act @ fc2[e]^T
    (y_routed None: no down GEMM)."""
    ops.grouped_gemm(x_routed, fc1.contiguous(), sched.expert_offsets, act, True, gemm_ctas, sched.expert_counts,
                     pre_out=h)
    if y_routed is not None:
        ops.grouped_gemm(act, fc2.contiguous(), sched.expert_offsets, y_routed, False, gemm_ctas, sched.expert_counts)


def routed_fp8(sched: MoKSchedule, x_e4m3, x_scale, w8, act, h, y_routed, gemm_ctas: int = 0, push=None) -> None:
    """The routed gate/up and down GEMMs on block-scaled e4m3 operands (the SwiGLU output quantized
    per row and 128 columns up to the last segment's end); outputs bf16 (y_routed None: no down
    GEMM). push (the peers' combine buffers): the down GEMM's epilogue also does the combine's stores."""
    ops.expert_gemm_fp8(x_e4m3, x_scale, w8.fc1.q, w8.fc1.scale, sched.expert_offsets, sched.expert_counts, act, True,
                        pre_out=h, num_ctas=gemm_ctas)
    if y_routed is None:
        return
    aq, as_ = ops.quantize_rows_e4m3(act, sched.expert_offsets[-1:])
    ops.expert_gemm_fp8(aq, as_, w8.fc2.q, w8.fc2.scale, sched.expert_offsets, sched.expert_counts, y_routed, False,
                        num_ctas=gemm_ctas,
                        push=None if push is None else (sched.row_src_rank, sched.row_src_slot, push))


def recompute_gate_up(a: torch.Tensor, fc1: torch.Tensor, sched: MoKSchedule | None) -> torch.Tensor:
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


# ---- backward -----------------------------------------------------------------------------------


def down_dgrad_bf16(g_rows, fc2, offsets, counts, h, row_w, dh, act_w, dot) -> None:
    """dh = SwiGLU'(h, w * (g @ fc2[e])) with the router weights ``row_w``; act_w = bf16(w * act)
    (act recomputed from h) and the router-weight gradient's pieces ``dot`` from the same epilogue
    (``ops.expert_dgrad``); the expert-major GEMM reads the weights MN-major."""
    ops.expert_dgrad(g_rows, fc2, offsets, counts, dh, h=h, row_w=row_w, act=act_w, dot=dot)


def down_dgrad_fp8(w8, gq, gs, h, offsets, counts, row_w, dh, act_w, dot):
    """``down_dgrad_bf16`` on block-scaled e4m3 operands: the grad_out rows in e4m3 (quantized by
    the pull) against fc2's transposed copy. Also writes dh's e4m3 copy (gate/up pair blocks), the
    fc1 dgrad's operand: returns it (q, scale)."""
    dhq, dhs = ops.empty_rows_e4m3(*dh.shape, dh.device)
    ops.expert_gemm_fp8(gq, gs, w8.fc2_t.q, w8.fc2_t.scale, offsets, counts, dh, False, h=h, dh_e4m3=(dhq, dhs),
                        row_w=row_w, act=act_w, dot=dot)
    return dhq, dhs


def fc1_dgrad_fp8(w8, dhq, dhs, offsets, counts, dx_rows, push) -> None:
    """dx_rows = dh @ fc1[e] from dh's e4m3 copy against fc1's transposed copy; push = (row_src_rank,
    row_src_slot, peer slot buffers): the epilogue also stores the rows into their source slots."""
    ops.expert_gemm_fp8(dhq, dhs, w8.fc1_t.q, w8.fc1_t.scale, offsets, counts, dx_rows, False, push=push)


def shared_backward_out(g, shared_fc1, main_fc1=None, main_fc2=None):
    """Uninitialised (dsfc1 or None, dsfc2 or None, shared_dx) for ``shared_backward``: a weight
    gradient added into its main grad has no buffer."""
    T, H, Is = g.shape[0], g.shape[1], shared_fc1.shape[0] // 2
    bf16 = dict(dtype=torch.bfloat16, device=g.device)
    return (None if main_fc1 is not None else torch.empty((2 * Is, H), **bf16),
            None if main_fc2 is not None else torch.empty((H, Is), **bf16),
            torch.empty((T, H), **bf16))


def shared_backward(ws: MoKWorkspace, ctx: KernelContext, g, x, shared_fc1, shared_fc2, main_fc1=None,
                    main_fc2=None, out=None):
    """(dsfc1, dsfc2, shared_dx) of the shared expert on the expert-major GEMMs, the shared expert
    being one segment of T rows; its SwiGLU output comes back from the down dgrad's epilogue.
    ``main_fc1`` / ``main_fc2``: fp32 contiguous main grads of the weights' shapes that the weight
    gradients are added into (that entry comes back None), or None. ``out``: ``shared_backward_out``'s
    buffers to write (the caller's stream owns them when this runs on the side stream)."""
    shared_fc1, shared_fc2 = shared_fc1.contiguous(), shared_fc2.contiguous()
    T, H, Is = g.shape[0], g.shape[1], shared_fc1.shape[0] // 2
    seg = comm(ws).shared_seg
    offs, count = seg[:2], seg[2:]
    bf16 = dict(dtype=torch.bfloat16, device=g.device)
    dsfc1, dsfc2, shared_dx = out if out is not None else shared_backward_out(g, shared_fc1, main_fc1, main_fc2)
    hs = ctx.shared_h if ctx.shared_h is not None else recompute_gate_up(x, shared_fc1, None)
    dhs = torch.empty((T, 2 * Is), **bf16)
    shared_act = torch.empty((T, Is), **bf16)
    ops.expert_dgrad(g, shared_fc2.view(1, H, Is), offs, count, dhs, h=hs, act=shared_act)
    del hs
    ops.expert_dgrad(dhs, shared_fc1.view(1, 2 * Is, H), offs, count, shared_dx)
    ops.expert_wgrad(g, offs, shared_act, offs, count, (main_fc2 if dsfc2 is None else dsfc2).view(1, H, Is))
    del shared_act
    ops.expert_wgrad(dhs, offs, x, offs, count, (main_fc1 if dsfc1 is None else dsfc1).view(1, 2 * Is, H))
    return dsfc1, dsfc2, shared_dx
