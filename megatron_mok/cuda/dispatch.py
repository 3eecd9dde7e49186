"""Dispatch: every routed row pulls its token row from the source rank's symmetric buffer.

bf16: x is copied into this rank's symmetric x buffer, a device barrier, then the pull
(csrc/kernels/comm/dispatch.cu). fp8: x is quantized into symmetric e4m3 rows and scale rows
(one scale per row and 128 columns), a barrier, then the pull moves half the bytes and writes the
scales straight into the layout the e4m3 GEMMs read.

The backward dispatches once more (``regather``): the forward keeps no routed rows.
"""

from __future__ import annotations

import torch

from .. import fp8, ops
from ..config import MoKConfig
from ..schedule import MoKSchedule
from ..workspace import MoKWorkspace
from .comm import comm, x_scale_pitch


def publish_bf16(cfg: MoKConfig, ws: MoKWorkspace, x: torch.Tensor, sched: MoKSchedule | None = None) -> list[int]:
    """x into this rank's symmetric buffer, then a device barrier; returns the peers' addresses.
    sched: the call's schedule, which the barrier empties if this rank is stopped (a peer rejected
    its input, or a header mismatch): then no later kernel moves a row."""
    c = comm(ws)
    xs, x_ptrs = c.buffer("x")
    xs.copy_(x)
    ops.barrier(c.state, ws.errors, c.flag_ptrs, ws.rank, cfg.peer_timeout_s, schedule=sched)
    return x_ptrs


def dispatch_bf16(ws: MoKWorkspace, sched: MoKSchedule, x_ptrs: list[int], comm_ctas: int = 0,
                  out: torch.Tensor | None = None) -> torch.Tensor:
    """x_routed [cap, H] bf16 pulled from the peers (padding rows zero), into ``out`` if given."""
    x_routed = torch.empty((sched.capacity, ws.hidden), dtype=torch.bfloat16, device=ws.device) if out is None else out
    ops.dispatch(sched.row_src_rank, sched.row_src_slot, sched.expert_offsets, x_routed, x_ptrs, ws.topk, comm_ctas)
    return x_routed


def _x_e4m3_buffers(ws: MoKWorkspace):
    """This rank's rows as ``publish_e4m3`` quantizes them: the symmetric e4m3 row and scale-row
    buffers ((tensor, peer addresses) each; comm.py: buffer_spec) and the scale pitch in floats."""
    c = comm(ws)
    return c.buffer("x_e4m3"), c.buffer("x_scale"), x_scale_pitch(ws.hidden)


def publish_e4m3(cfg: MoKConfig, ws: MoKWorkspace, x: torch.Tensor, sched: MoKSchedule | None = None):
    """Quantize this rank's rows into its symmetric buffers, then a device barrier (sched: as
    ``publish_bf16``'s). Returns
    ((e4m3 rows, peer addresses), (scale rows, peer addresses), scale pitch in floats)."""
    c = comm(ws)
    rows, scales, pitch = _x_e4m3_buffers(ws)
    ops.quantize_rows_e4m3_into(x.contiguous(), rows[0].view(torch.float8_e4m3fn), scales[0].view(torch.float32),
                                scale_rows=True)
    ops.barrier(c.state, ws.errors, c.flag_ptrs, ws.rank, cfg.peer_timeout_s, schedule=sched)
    return rows, scales, pitch


def published_x_e4m3(ws: MoKWorkspace) -> tuple[torch.Tensor, torch.Tensor]:
    """(x e4m3 [T, H], scales [H / 128, ld]) of this rank from ``publish_e4m3``'s buffers, for the
    shared expert's e4m3 GEMM (valid until the forward's closing barrier)."""
    (q_sym, _), (s_sym, _), _ = _x_e4m3_buffers(ws)
    scale_rows = s_sym.view(torch.float32)
    nkb, rows = ws.hidden // fp8.BLOCK, scale_rows.shape[0]
    scales = torch.empty((nkb, -(-rows // 4) * 4), dtype=torch.float32, device=scale_rows.device)
    scales[:, :rows].copy_(scale_rows[:, :nkb].t())
    return q_sym.view(torch.float8_e4m3fn), scales


def dispatch_e4m3(ws: MoKWorkspace, sched: MoKSchedule, published, comm_ctas: int = 0):
    """Pull the e4m3 rows and their scales (``publish_e4m3``'s answer). Returns (x_e4m3 [cap, H],
    x_scale [H / 128, ld] fp32, the layout ``expert_gemm_fp8`` reads)."""
    (_, q_ptrs), (_, s_ptrs), pitch = published
    q_routed, s_routed = ops.empty_rows_e4m3(sched.capacity, ws.hidden, ws.device)
    ops.dispatch_e4m3(sched.row_src_rank, sched.row_src_slot, sched.expert_offsets, q_routed, s_routed, q_ptrs, s_ptrs,
                      pitch, ws.topk, comm_ctas)
    return q_routed, s_routed


def regather(cfg: MoKConfig, ws: MoKWorkspace, sched: MoKSchedule, x: torch.Tensor, comm_ctas: int = 0,
             out: torch.Tensor | None = None):
    """The routed rows once more, for the backward: the forward's own dispatch of the layer input
    (the same bits: bf16 rows [cap, H], into ``out`` if given, or fp8 (e4m3 rows, scales) as
    ``dispatch_e4m3`` gives them), then a barrier after which no peer reads this rank's published rows."""
    if cfg.precision == "fp8":
        rows = dispatch_e4m3(ws, sched, publish_e4m3(cfg, ws, x, sched), comm_ctas)
    else:
        rows = dispatch_bf16(ws, sched, publish_bf16(cfg, ws, x, sched), comm_ctas, out=out)
    c = comm(ws)
    ops.barrier(c.state, ws.errors, c.flag_ptrs, ws.rank, cfg.peer_timeout_s, schedule=sched)
    return rows


def rows_bf16(rows, sched: MoKSchedule, out: torch.Tensor | None = None) -> torch.Tensor:
    """``regather``'s rows in bf16: as they are (copied into ``out`` if given and not already
    there), or the e4m3 rows dequantized (into ``out``, else a new tensor)."""
    if isinstance(rows, torch.Tensor):
        if out is not None and rows.data_ptr() != out.data_ptr():
            out.copy_(rows)
            return out
        return rows
    q, scale = rows
    x = torch.empty(q.shape, dtype=torch.bfloat16, device=q.device) if out is None else out
    ops.dequantize_rows_e4m3(q, scale, x, sched.expert_offsets[-1:])
    return x
