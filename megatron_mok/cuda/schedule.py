"""The routed-row schedule on the device (csrc/kernels/comm/schedule.cu): one launch, no host sync.

The routing is all-gathered by peer stores, then prefix sums give every (expert, source rank,
token, slot) a fixed row; the order is a pure function of the routing (docs/DESIGN.md).
"""

from __future__ import annotations

import torch

from .. import ops
from ..config import MoKConfig
from ..header import call_header
from ..schedule import MoKSchedule, validate_top_experts
from ..workspace import MoKWorkspace
from .comm import comm


def build_schedule(cfg: MoKConfig, ws: MoKWorkspace, top_experts: torch.Tensor) -> MoKSchedule:
    """All-gather the routing by peer stores and build this rank's schedule on the device.

    Bad expert ids, duplicates and capacity overflow (of any rank) are flagged in ``ws.errors``
    and raised by a later ``ws.check_errors()`` (no sync here); so is a peer whose call header
    (T, k, E, capacity, dtype, precision: megatron_mok/header.py) differs from this rank's.
    """
    validate_top_experts(ws, top_experts)
    c = comm(ws)
    dev, ep, T, k, nle, cap = ws.device, ws.ep_size, ws.num_tokens, ws.topk, ws.num_local_experts, ws.capacity
    i32 = dict(dtype=torch.int32, device=dev)
    top_all = torch.empty((ep, T, k), **i32)
    row_src_rank = torch.empty((cap,), **i32)
    row_src_slot = torch.empty((cap,), **i32)
    counts = torch.empty((nle,), **i32)
    offsets = torch.empty((nle + 1,), **i32)
    scratch = torch.empty((ops.schedule_scratch_ints(ep, T, nle, ws.num_experts),), **i32)
    # the per-call values the ranks must agree on, compared by the gather's barrier (no host sync)
    header = call_header(num_tokens=top_experts.shape[0], hidden=ws.hidden, topk=top_experts.shape[1],
                         num_experts=ws.num_experts, capacity=cap, dtype=ws.dtype, cfg=cfg, ep_size=ep)
    ws.call_headers[0] = header
    ops.build_schedule(top_experts=top_experts.contiguous(), routing_buf=c.route_buf, state=c.state,
                       errors=ws.errors, top_all=top_all, row_src_rank=row_src_rank, row_src_slot=row_src_slot,
                       expert_counts=counts, expert_offsets=offsets, scratch=scratch, peer_bufs=c.route_ptrs,
                       peer_flags=c.flag_ptrs, rank=ws.rank, num_experts=ws.num_experts,
                       timeout_s=cfg.peer_timeout_s, header=header)
    return MoKSchedule(top_all, row_src_rank, row_src_slot, counts, offsets)
