"""The routed-row schedule: which (source rank, token, slot) each local routed row holds.

The schedule is a pure function of the routing of all ranks (see docs/ARCHITECTURE.md), so the
row order, and with it every reduction order downstream, never depends on timing. This module
holds the data type and the pure-PyTorch construction used by the reference path (static shapes,
no host sync); the CUDA path builds the same tensors on the device.
"""

from __future__ import annotations

import dataclasses

import torch

from .config import ROW_ALIGN
from .workspace import ErrorCode, MoKInputError, MoKWorkspace, _check_ranks_agree, all_gather_stacked


@dataclasses.dataclass
class MoKSchedule:
    top_experts_all: torch.Tensor  # int32 [ep, T, k]: every rank's routing
    row_src_rank: torch.Tensor  # int32 [capacity]; -1 = padding / unused
    row_src_slot: torch.Tensor  # int32 [capacity]; t * k + s on the source rank; -1 = padding
    expert_counts: torch.Tensor  # int32 [nle]: real rows per local expert
    expert_offsets: torch.Tensor  # int32 [nle + 1]: padded segment starts

    @property
    def capacity(self) -> int:
        return self.row_src_rank.numel()


def validate_top_experts(ws: MoKWorkspace, top_experts: torch.Tensor) -> None:
    """Host-side checks that need no device data: type, shape, device."""
    if not isinstance(top_experts, torch.Tensor):
        raise MoKInputError(f"top_experts must be a tensor, got {type(top_experts).__name__}")
    if top_experts.dtype not in (torch.int32, torch.int64):
        raise MoKInputError(f"top_experts must be int32 or int64, got {top_experts.dtype}")
    if tuple(top_experts.shape) != (ws.num_tokens, ws.topk):
        raise MoKInputError(
            f"top_experts must have shape [T={ws.num_tokens}, k={ws.topk}], got {list(top_experts.shape)}"
        )
    if top_experts.device != ws.device:
        raise MoKInputError(f"top_experts is on {top_experts.device}, the workspace on {ws.device}")


def flag_bad_routing(ws: MoKWorkspace, top_experts_all: torch.Tensor) -> None:
    """Record out-of-range and duplicate expert ids in ``ws.errors`` (device ops only)."""
    te = top_experts_all.reshape(-1, ws.topk).long()
    num_tokens = ws.num_tokens
    token_idx = torch.arange(te.shape[0], device=te.device) % num_tokens
    out_of_range = ((te < 0) | (te >= ws.num_experts)).any(1)
    sorted_te = te.sort(dim=1).values
    duplicate = (sorted_te[:, 1:] == sorted_te[:, :-1]).any(1) if ws.topk > 1 else torch.zeros_like(out_of_range)
    for code, bad in ((ErrorCode.EXPERT_ID_OUT_OF_RANGE, out_of_range), (ErrorCode.DUPLICATE_EXPERT, duplicate)):
        first = torch.where(bad, token_idx + 1, torch.zeros_like(token_idx)).max().to(torch.int32)
        ws.errors[code] = torch.maximum(ws.errors[code], first)


def flag_overflow(ws: MoKWorkspace, top_experts_all: torch.Tensor) -> None:
    """Record the largest padded row count of any rank that exceeds the capacity.

    Every rank computes this for every rank from the gathered routing, so all ranks see the same
    error and none is left waiting in a later collective.
    """
    ids = top_experts_all.reshape(-1).long().clamp(0, ws.num_experts - 1)
    counts = torch.bincount(ids, minlength=ws.num_experts).reshape(ws.ep_size, ws.num_local_experts)
    rows = ((counts + ROW_ALIGN - 1) // ROW_ALIGN * ROW_ALIGN).sum(1).max()
    over = torch.where(rows > ws.capacity, rows, torch.zeros_like(rows)).to(torch.int32)
    ws.errors[ErrorCode.CAPACITY_OVERFLOW] = torch.maximum(ws.errors[ErrorCode.CAPACITY_OVERFLOW], over)


def all_gather_routing(ws: MoKWorkspace, top_experts: torch.Tensor) -> torch.Tensor:
    # Saturate before narrowing: an int64 id such as 2**32 must stay out of range, not wrap to 0.
    return all_gather_stacked(ws, top_experts.clamp(-1, ws.num_experts).to(torch.int32))


def schedule_from_routing(ws: MoKWorkspace, top_experts_all: torch.Tensor) -> MoKSchedule:
    """Build this rank's schedule from every rank's routing (static shapes, no host sync)."""
    nle, k, cap = ws.num_local_experts, ws.topk, ws.capacity
    device = top_experts_all.device
    local_e = top_experts_all.long() - ws.local_expert_start  # [ep, T, k]
    valid = (local_e >= 0) & (local_e < nle)
    key = torch.where(valid, local_e, torch.full_like(local_e, nle)).reshape(-1)
    # Flattened (rank, token, slot) order; a stable sort by expert keeps (rank, token) order inside
    # each expert, because a token holds a given expert in at most one slot.
    order = torch.argsort(key, stable=True)
    sorted_key = key[order]
    counts = torch.bincount(key, minlength=nle + 1)[:nle]
    padded = (counts + ROW_ALIGN - 1) // ROW_ALIGN * ROW_ALIGN
    offsets = torch.zeros(nle + 1, dtype=torch.long, device=device)
    offsets[1:] = torch.cumsum(padded, 0)
    first_sorted = torch.cumsum(counts, 0) - counts  # index in `order` of each expert's first row
    is_routed = sorted_key < nle
    e_clamped = sorted_key.clamp(max=nle - 1)
    j = torch.arange(order.numel(), device=device)
    row = offsets[e_clamped] + (j - first_sorted[e_clamped])
    fits = is_routed & (row < cap)
    # Rows that are not routed here (or would overflow) go to a dump slot past the end.
    row = torch.where(fits, row, torch.full_like(row, cap))
    flat = order
    src_rank = (flat // (ws.num_tokens * k)).to(torch.int32)
    src_slot = (flat % (ws.num_tokens * k)).to(torch.int32)
    row_src_rank = torch.full((cap + 1,), -1, dtype=torch.int32, device=device)
    row_src_slot = torch.full((cap + 1,), -1, dtype=torch.int32, device=device)
    row_src_rank.scatter_(0, row, src_rank)
    row_src_slot.scatter_(0, row, src_slot)
    return MoKSchedule(
        top_experts_all=top_experts_all,
        row_src_rank=row_src_rank[:cap].clone(),
        row_src_slot=row_src_slot[:cap].clone(),
        expert_counts=counts.to(torch.int32),
        expert_offsets=offsets.clamp(max=cap).to(torch.int32),
    )


def build_schedule_reference(ws: MoKWorkspace, top_experts: torch.Tensor) -> MoKSchedule:
    validate_top_experts(ws, top_experts)
    # A rank whose workspace came from the cache skipped the creation-time agreement check, so a
    # rank calling with other shapes would exchange mismatched buffers: check on every call.
    _check_ranks_agree(
        ws.group, ws.device, [ws.num_tokens, ws.hidden, ws.topk, ws.num_experts],
        ["num_tokens (T)", "hidden size (H)", "top-k", "num_experts"],
    )
    top_all = all_gather_routing(ws, top_experts)
    flag_bad_routing(ws, top_all)
    # Every rank sees every rank's routing, so every rank raises the same error here: no rank is
    # left waiting in a later collective.
    ws.check_errors(blocking=True)
    flag_overflow(ws, top_all)
    ws.check_errors(blocking=True)
    return schedule_from_routing(ws, top_all)
