"""The routed-row schedule: which (source rank, token, slot) each local routed row holds.

The schedule is a pure function of the routing of all ranks (see docs/DESIGN.md), so the
row order, and with it every reduction order downstream, never depends on timing. This module
holds the data type and the pure-PyTorch construction used by the reference path (static shapes,
no host sync); the CUDA path builds the same tensors on the device.
"""

from __future__ import annotations

import dataclasses

import torch

from .config import ROW_ALIGN, MoKConfig
from .workspace import (
    ErrorCode,
    MoKInputError,
    MoKWorkspace,
    all_gather_stacked,
    exchange,
    shape_values,
)


@dataclasses.dataclass
class MoKSchedule:
    top_experts_all: torch.Tensor  # int32 [ep, T, k]: every rank's routing
    row_src_rank: torch.Tensor  # int32 [capacity]; -1 = padding / unused
    row_src_slot: torch.Tensor  # int32 [capacity]; t * k + s on the source rank; -1 = padding
    expert_counts: torch.Tensor  # int32 [nle]: real rows per local expert
    expert_offsets: torch.Tensor  # int32 [nle + 1]: padded segment starts
    # Identity (stamp_schedule): the workspace it was built on (MoKWorkspace.uid) and which of that
    # workspace's schedules it is (1, 2, ...); the routing it encodes is top_experts_all. None: made
    # outside build_schedule, not checked.
    workspace_uid: int | None = None
    step: int | None = None

    @property
    def capacity(self) -> int:
        return self.row_src_rank.numel()

    @property
    def identity(self) -> tuple[int, int] | None:
        return None if self.workspace_uid is None else (self.workspace_uid, self.step)


def stamp_schedule(ws: MoKWorkspace, sched: MoKSchedule) -> MoKSchedule:
    """Mark ``sched`` as the newest schedule of ``ws`` (host counters only, no device work)."""
    ws.schedule_step += 1
    sched.workspace_uid, sched.step = ws.uid, ws.schedule_step
    return sched


def check_schedule(ws: MoKWorkspace, sched, call: str, latest: bool) -> None:
    """A schedule from another workspace, or (``latest``: a forward) not the newest one built on
    this workspace, raises ``MoKInputError`` saying so (host values only)."""
    if not isinstance(sched, MoKSchedule):
        raise MoKInputError(f"{call}: sched must be the MoKSchedule of build_schedule, got {type(sched).__name__}")
    if sched.workspace_uid is None:
        return
    if sched.workspace_uid != ws.uid:
        raise MoKInputError(
            f"{call}: sched is foreign: it was built on workspace #{sched.workspace_uid}, not on this call's "
            f"{ws.describe()}; build the schedule with this workspace"
        )
    if latest and sched.step != ws.schedule_step:
        raise MoKInputError(
            f"{call}: sched is stale: it is schedule {sched.step} of {ws.describe()}, but schedule "
            f"{ws.schedule_step} was built since; run build_schedule with this call's routing before each forward"
        )


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


def build_schedule_reference(ws: MoKWorkspace, top_experts: torch.Tensor, cfg: MoKConfig | None = None) -> MoKSchedule:
    """The schedule on the reference path (collectives of the EP group). The first collective is the
    agreement packet (``workspace.exchange``): this rank's check of ``top_experts``, the shapes and
    ``cfg`` (default: the workspace's), so a rank that fails or disagrees makes every rank raise."""
    error = None
    try:
        validate_top_experts(ws, top_experts)
    except MoKInputError as err:
        error = err
    cfg = cfg if cfg is not None else ws.cfg
    # A rank whose workspace came from the cache skipped the creation-time agreement, so a rank
    # calling with other shapes would exchange mismatched buffers: agree on every call.
    exchange(ws.group, ws.device, "schedule",
             shape_values(ws.num_tokens, ws.hidden, ws.topk, ws.num_experts, ws.dtype, cfg), error,
             timeout_s=ws.peer_timeout_s)
    top_all = all_gather_routing(ws, top_experts)
    flag_bad_routing(ws, top_all)
    # Every rank sees every rank's routing, so every rank raises the same error here: no rank is
    # left waiting in a later collective.
    ws.check_errors(blocking=True)
    flag_overflow(ws, top_all)
    ws.check_errors(blocking=True)
    return stamp_schedule(ws, schedule_from_routing(ws, top_all))
