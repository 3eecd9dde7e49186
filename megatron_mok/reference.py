"""Pure-PyTorch implementation of every stage: the test oracle and the CPU path.

It follows the same protocol as the CUDA kernels (docs/DESIGN.md): pull-dispatch rows in
schedule order, per-(token, slot) combine slots, fixed-order fp32 sums. Communication goes through
torch.distributed collectives (gloo or NCCL): a rank "pulls" from the gathered source buffers and
"pushes" by gathering every rank's rows and keeping those addressed to it. Arithmetic is fp32
whatever the input dtype; results are cast once to the input dtype.

Deterministic by construction: no atomics, every sum has a fixed order, and every matmul has the
same shapes on every run.
"""

from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F

from . import fp8
from .schedule import MoKSchedule
from .workspace import MoKWorkspace, all_gather_stacked


@dataclasses.dataclass
class ReferenceContext:
    """What the backward needs from the forward (fp32; fp64 for fp64 inputs)."""

    x_routed: torch.Tensor  # [cap, H] dispatched rows (zeros in padding rows)
    fc1_out: torch.Tensor  # [cap, 2I] gate/up pre-activations
    y_routed: torch.Tensor  # [cap, H] unweighted expert outputs (the combine's rows)
    shared_fc1_out: torch.Tensor | None  # [T, 2Is]
    # (workspace uid, schedule step) of the schedule the forward ran (set by functional; the backward
    # checks it against its schedule)
    schedule_id: tuple | None = None


def _pull_rows(ws: MoKWorkspace, sched: MoKSchedule, per_token: torch.Tensor) -> torch.Tensor:
    """Routed rows of every source rank's per-token tensor [T, ...] (zeros in padding rows)."""
    gathered = all_gather_stacked(ws, per_token)  # [ep, T, ...]
    valid = sched.row_src_rank >= 0
    rank = sched.row_src_rank.clamp(min=0).long()
    token = (sched.row_src_slot.clamp(min=0) // ws.topk).long()
    rows = gathered[rank, token]
    mask = valid.view(-1, *([1] * (rows.dim() - 1)))
    return torch.where(mask, rows, torch.zeros_like(rows))


def _push_rows(ws: MoKWorkspace, sched: MoKSchedule, rows: torch.Tensor) -> torch.Tensor:
    """Place every rank's routed rows into their source's [T * k, ...] slots; return this rank's."""
    all_rows = all_gather_stacked(ws, rows)  # [ep, cap, ...]
    all_rank = all_gather_stacked(ws, sched.row_src_rank)  # [ep, cap]
    all_slot = all_gather_stacked(ws, sched.row_src_slot)
    mine = all_rank == ws.rank
    slots = torch.zeros((ws.num_tokens * ws.topk, *rows.shape[1:]), dtype=rows.dtype, device=rows.device)
    slots[all_slot[mine].long()] = all_rows[mine]  # slots are unique: a plain copy, no reduction
    return slots


def _segments(sched: MoKSchedule):
    """(expert, first row, real row count) of each local expert (host values)."""
    offsets = sched.expert_offsets.tolist()
    counts = sched.expert_counts.tolist()
    return [(e, offsets[e], counts[e]) for e in range(len(counts))]


def _compute_dtype(x: torch.Tensor) -> torch.dtype:
    return torch.float64 if x.dtype == torch.float64 else torch.float32


def _swiglu(h: torch.Tensor) -> torch.Tensor:
    gate, up = h.chunk(2, dim=-1)
    return F.silu(gate) * up


def _swiglu_backward(h: torch.Tensor, da: torch.Tensor) -> torch.Tensor:
    gate, up = h.chunk(2, dim=-1)
    sig = torch.sigmoid(gate)
    silu = gate * sig
    d_gate = da * up * (sig * (1 + gate * (1 - sig)))
    d_up = da * silu
    return torch.cat([d_gate, d_up], dim=-1)


def _qdq_rows(t: torch.Tensor, gate_up_pairs: bool = False) -> torch.Tensor:
    """Rows rounded to bf16 (what the kernels hold and quantize), then block-scaled e4m3 and back
    (gate_up_pairs: in gate/up pair blocks, returned in the original column order)."""
    back = fp8.dequantize_rows(*fp8.quantize_rows(t.to(torch.bfloat16), gate_up_pairs))
    return (fp8.unpair_columns(back) if gate_up_pairs else back).to(t.dtype)


def _bf16(t: torch.Tensor) -> torch.Tensor:
    return t.to(torch.bfloat16).to(t.dtype)


def _qdq_columns(t: torch.Tensor) -> torch.Tensor:
    """One expert's rows rounded to bf16, then e4m3 with one scale per column, and back (the fp8
    weight gradients' operands)."""
    return fp8.dequantize_columns(*fp8.quantize_columns(t.to(torch.bfloat16))).to(t.dtype)


def recompute_forward_context(ws, sched, x, fc1, fc2, shared_fc1=None, precision: str = "bf16",
                              shared_precision: str | None = None) -> ReferenceContext:
    """Dispatch, gate/up, SwiGLU and down projection of the routed rows (no combine).

    precision "fp8": the routed GEMMs' operands go through block-scaled e4m3 as the kernels
    quantize them (megatron_mok/fp8.py): dispatched rows, fc1, fc2 and the SwiGLU output (rounded
    to bf16 first, as the kernels hold it). The context keeps the dispatched rows as the kernels'
    backward sees them: dequantized from e4m3 to bf16. shared_precision (default: precision) "fp8":
    the shared expert's gate/up operands too (x and its fc1, when ``fp8.shared_in_e4m3``);
    ``forward`` does its down projection.
    """
    cd = _compute_dtype(x)
    xc = x.to(cd)
    x_routed = _pull_rows(ws, sched, xc)
    fc1_out = torch.zeros((sched.capacity, fc1.shape[1]), dtype=cd, device=x.device)
    y_routed = torch.zeros((sched.capacity, fc2.shape[1]), dtype=cd, device=x.device)
    quant = precision == "fp8"
    if quant:
        w1 = fp8.quantize_weight(fc1, swiglu=True).dequantize().to(cd)
        w2 = fp8.quantize_weight(fc2, swiglu=False).dequantize().to(cd)
    for e, start, count in _segments(sched):
        if count == 0:
            continue
        rows = slice(start, start + count)
        if quant:
            xq = _qdq_rows(x_routed[rows])
            # the kernels dispatch the e4m3 rows; their backward sees them dequantized to bf16
            x_routed[rows] = xq.to(torch.bfloat16).to(cd)
            fc1_out[rows] = xq @ w1[e].t()
            y_routed[rows] = _qdq_rows(_swiglu(fc1_out[rows])) @ w2[e].t()
            continue
        fc1_out[rows] = x_routed[rows] @ fc1[e].to(cd).t()
        y_routed[rows] = _swiglu(fc1_out[rows]) @ fc2[e].to(cd).t()
    shared_fc1_out = None
    if _shared_e4m3(precision, shared_precision, shared_fc1):
        shared_fc1_out = _qdq_rows(xc) @ fp8.quantize_weight(shared_fc1[None], swiglu=True).dequantize()[0].to(cd).t()
    elif shared_fc1 is not None:
        shared_fc1_out = xc @ shared_fc1.to(cd).t()
    return ReferenceContext(x_routed, fc1_out, y_routed, shared_fc1_out)


def _shared_e4m3(precision: str, shared_precision: str | None, shared_fc1) -> bool:
    return (shared_precision or precision) == "fp8" and fp8.shared_in_e4m3(shared_fc1)


def forward(ws, sched, x, probs, fc1, fc2, shared_fc1=None, shared_fc2=None, precision: str = "bf16",
            shared_precision: str | None = None):
    """Returns (out [T, H] in x.dtype, ReferenceContext); shared_precision: see
    ``recompute_forward_context``."""
    ctx = recompute_forward_context(ws, sched, x, fc1, fc2, shared_fc1, precision, shared_precision)
    slots = _push_rows(ws, sched, ctx.y_routed).view(ws.num_tokens, ws.topk, -1)
    cd = _compute_dtype(x)
    p = probs.to(cd)
    acc = torch.zeros((ws.num_tokens, ws.hidden), dtype=cd, device=x.device)
    for s in range(ws.topk):  # fixed slot order
        acc = acc + p[:, s : s + 1] * slots[:, s]
    if _shared_e4m3(precision, shared_precision, shared_fc1):  # e4m3 operands, as the kernels' shared expert
        w2 = fp8.quantize_weight(shared_fc2[None], swiglu=False).dequantize()[0].to(cd)
        acc = acc + _qdq_rows(_swiglu(ctx.shared_fc1_out)) @ w2.t()
    elif shared_fc1 is not None:
        acc = acc + _swiglu(ctx.shared_fc1_out) @ shared_fc2.to(cd).t()
    return acc.to(x.dtype), ctx


def backward(ws, sched, ctx: ReferenceContext, grad_out, x, probs, fc1, fc2, shared_fc1=None, shared_fc2=None,
             dgrad_precision: str = "bf16", wgrad_precision: str = "bf16"):
    """Returns (dx, dprobs, dfc1, dfc2, dshared_fc1, dshared_fc2); weight grads in fp32 (fp64 for fp64 x).

    The router weight w of a row is applied where the kernels apply it: after the down dgrad
    (``d = w * (g @ fc2[e])``), and on act for the down weight gradient (``g^T @ (w * act)``).

    wgrad_precision "fp8" (``MoKConfig.fp8_wgrad``): the routed weight gradients' operands (the
    grad_out rows g, ``w * act`` from the bf16 h, dh and the dispatched rows, each rounded to bf16 as
    the kernels hold them) go through e4m3 with one scale per expert and column
    (``fp8.quantize_columns``).

    dgrad_precision "fp8" (``MoKConfig.fp8_dgrad``): the routed dgrads' operands go through
    block-scaled e4m3 as the kernels quantize them: g (unweighted) along H against fc2, and dh along
    fc1's K in gate/up pair blocks against fc1, with da, h and dh rounded to bf16 where the kernels
    hold them. The weight gradients keep the unquantized g and the bf16 dh. The shared expert's
    backward stays unquantized (its h comes from the context, e4m3 when its forward was).
    """
    cd = _compute_dtype(x)
    gc = grad_out.to(cd)
    k = ws.topk
    g_rows = _pull_rows(ws, sched, gc)  # [cap, H]
    w_all = all_gather_stacked(ws, probs.to(cd))  # [ep, T, k]
    valid = sched.row_src_rank >= 0
    # One router weight per row (indexing [ep, T * k] directly: no [capacity, T * k] intermediate).
    w_rows = w_all.reshape(ws.ep_size, ws.num_tokens * k)[
        sched.row_src_rank.clamp(min=0).long(), sched.row_src_slot.clamp(min=0).long()
    ]
    w_rows = torch.where(valid, w_rows, torch.zeros_like(w_rows))
    # the router-weight gradient per row, <g, y> = <g @ fc2[e], act>, as the kernels form it from the
    # down dgrad's product (with its operands: e4m3 under fp8_dgrad), not from the forward's output
    d_w_rows = torch.zeros(g_rows.shape[0], dtype=cd, device=g_rows.device)
    dy = g_rows * w_rows.unsqueeze(1)
    dx_rows = torch.zeros_like(ctx.x_routed)
    dfc1 = torch.zeros(fc1.shape, dtype=cd, device=fc1.device)
    dfc2 = torch.zeros(fc2.shape, dtype=cd, device=fc2.device)
    quant = dgrad_precision == "fp8"
    wq = _qdq_columns if wgrad_precision == "fp8" else (lambda t: t)
    if quant:
        w1 = fp8.quantize_weight(fc1, swiglu=True).dequantize().to(cd)
        w2 = fp8.quantize_weight(fc2, swiglu=False).dequantize().to(cd)
    for e, start, count in _segments(sched):
        if count == 0:
            continue  # an expert without tokens keeps an exact zero gradient
        rows = slice(start, start + count)
        h = ctx.fc1_out[rows]
        w = w_rows[rows].unsqueeze(1)
        if wgrad_precision == "fp8":  # as the kernels hold them: g, and bf16(w * act) from the bf16 h
            dfc2[e] = wq(g_rows[rows]).t() @ wq(w * _swiglu(_bf16(h)))
        else:
            dfc2[e] = dy[rows].t() @ _swiglu(h)
        if quant:
            da = _bf16(_qdq_rows(g_rows[rows]) @ w2[e])
            d_w_rows[rows] = (da * _swiglu(_bf16(h))).sum(-1)
            dh = _bf16(_swiglu_backward(_bf16(h), w * da))
            dx_rows[rows] = _qdq_rows(dh, gate_up_pairs=True) @ w1[e]
        else:
            d_w_rows[rows] = ((g_rows[rows] @ fc2[e].to(cd)) * _swiglu(h)).sum(-1)
            dh = _swiglu_backward(h, dy[rows] @ fc2[e].to(cd))
            dx_rows[rows] = dh @ fc1[e].to(cd)
            if wgrad_precision == "fp8":  # dh as the bf16 dgrad kernel holds it: from bf16 h, g and da
                dh = _swiglu_backward(_bf16(h), w * _bf16(_bf16(g_rows[rows]) @ fc2[e].to(cd)))
        dfc1[e] = wq(dh).t() @ wq(ctx.x_routed[rows])
    dx_slots = _push_rows(ws, sched, dx_rows).view(ws.num_tokens, k, -1)
    dprobs = _push_rows(ws, sched, d_w_rows).view(ws.num_tokens, k)
    dx = torch.zeros_like(gc)
    for s in range(k):  # fixed slot order
        dx = dx + dx_slots[:, s]
    dshared_fc1 = dshared_fc2 = None
    if shared_fc1 is not None:
        h = ctx.shared_fc1_out
        a = _swiglu(h)
        dshared_fc2 = gc.t() @ a
        dh = _swiglu_backward(h, gc @ shared_fc2.to(cd))
        dshared_fc1 = dh.t() @ x.to(cd)
        dx = dx + dh @ shared_fc1.to(cd)
    return dx, dprobs, dfc1, dfc2, dshared_fc1, dshared_fc2
