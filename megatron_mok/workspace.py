"""Per-group, per-shape state of the mok layer: sizes, symmetric buffers and device error flags.

A workspace is created once per (group, device, shapes, capacity factor) and reused by every layer
and step with those shapes. Creating one is a collective: it checks that all ranks of the group
agree on the token count, hidden size, top-k and expert count.
"""

from __future__ import annotations

import dataclasses
import enum
from typing import Any

import torch
import torch.distributed as dist

from .config import MoKConfig, routed_capacity


class MoKInputError(ValueError):
    """An input of the mok layer is malformed (shape, dtype, expert id, probabilities...)."""


class MoKCapacityError(RuntimeError):
    """More routed rows arrived on a rank than its buffer holds (raise capacity_factor)."""


class MoKPeerTimeoutError(RuntimeError):
    """A device-side wait on a peer rank timed out: that rank stalled or skipped the call."""


class MoKKernelStallError(MoKPeerTimeoutError):
    """A wait inside a mok kernel (the megakernel's watchdog) gave up: a kernel bug or a stalled
    dependency on this rank, not a late peer. A subclass of MoKPeerTimeoutError, so existing
    handlers still catch it."""


class ErrorCode(enum.IntEnum):
    """Slots of the workspace's device error-flag tensor."""

    CAPACITY_OVERFLOW = 0  # value: rows needed on this rank
    EXPERT_ID_OUT_OF_RANGE = 1  # value: 1 + the offending id's token index on some rank
    DUPLICATE_EXPERT = 2  # value: 1 + token index
    NONFINITE_PROBS = 3  # value: 1 + token index
    PEER_TIMEOUT = 4  # value: 1 + the peer rank that stalled
    KERNEL_STALL = 5  # value: 1 + the rank whose kernel-internal wait gave up (megakernel watchdog)
    NUM_CODES = 6


def _group_key(group: dist.ProcessGroup | None) -> Any:
    return None if group is None else id(group)


@dataclasses.dataclass(eq=False)
class MoKWorkspace:
    group: dist.ProcessGroup | None
    rank: int
    ep_size: int
    device: torch.device
    num_tokens: int
    hidden: int
    topk: int
    num_experts: int
    capacity_factor: float
    capacity: int
    # int32 [ErrorCode.NUM_CODES]: 0 = fine; set by device code, read without a sync.
    errors: torch.Tensor
    _symmetric: dict = dataclasses.field(default_factory=dict)
    _pending_error_copy: tuple | None = None

    @property
    def num_local_experts(self) -> int:
        return self.num_experts // self.ep_size

    @property
    def local_expert_start(self) -> int:
        return self.rank * self.num_local_experts

    def symmetric(self, name: str, shape: tuple[int, ...], dtype: torch.dtype):
        """A buffer that peers can read and write, cached by name.

        On CUDA: torch symmetric memory (``(tensor, handle)``; ``handle.buffer_ptrs`` are the
        peers' addresses). Elsewhere: a plain tensor and ``None``.
        """
        key = (name, tuple(shape), dtype)
        if key not in self._symmetric:
            if self.device.type == "cuda":
                import torch.distributed._symmetric_memory as symm_mem

                buf = symm_mem.empty(*shape, dtype=dtype, device=self.device)
                handle = symm_mem.rendezvous(buf, self.group if self.group is not None else dist.group.WORLD)
                self._symmetric[key] = (buf, handle)
            else:
                self._symmetric[key] = (torch.empty(shape, dtype=dtype, device=self.device), None)
        return self._symmetric[key]

    # ---- errors -----------------------------------------------------------------------------

    def raise_if_error(self, values: torch.Tensor) -> None:
        """Raise the exception that matches the first nonzero error slot of ``values`` (host)."""
        v = [int(x) for x in values.tolist()]
        if any(v):
            self.errors.zero_()  # reported once; the workspace stays usable for fixed inputs
        if v[ErrorCode.EXPERT_ID_OUT_OF_RANGE]:
            raise MoKInputError(
                f"top_experts holds an expert id outside [0, {self.num_experts}) "
                f"(token {v[ErrorCode.EXPERT_ID_OUT_OF_RANGE] - 1} of some rank)"
            )
        if v[ErrorCode.DUPLICATE_EXPERT]:
            raise MoKInputError(
                f"top_experts repeats an expert within one token's top-{self.topk} "
                f"(token {v[ErrorCode.DUPLICATE_EXPERT] - 1} of some rank)"
            )
        if v[ErrorCode.NONFINITE_PROBS]:
            raise MoKInputError(
                f"probs holds a NaN or infinite router weight (token {v[ErrorCode.NONFINITE_PROBS] - 1})"
            )
        if v[ErrorCode.CAPACITY_OVERFLOW]:
            raise MoKCapacityError(
                f"a rank of the EP group needs {v[ErrorCode.CAPACITY_OVERFLOW]} routed rows but the buffer "
                f"holds {self.capacity} (capacity_factor={self.capacity_factor}); raise "
                "MoKConfig.capacity_factor (1.0 can never overflow)"
            )
        if v[ErrorCode.PEER_TIMEOUT]:
            raise MoKPeerTimeoutError(
                f"rank {self.rank} timed out waiting for rank {v[ErrorCode.PEER_TIMEOUT] - 1}: "
                "that rank stalled or skipped the mok call"
            )
        if v[ErrorCode.KERNEL_STALL]:
            raise MoKKernelStallError(
                f"a mok kernel on rank {v[ErrorCode.KERNEL_STALL] - 1} stalled: a wait inside the kernel "
                "(megakernel watchdog) gave up and the kernel aborted, so this call's results are garbage; "
                "this is a kernel bug or a stalled dependency on that rank, not a slow peer"
            )

    def check_errors(self, blocking: bool = False) -> None:
        """Raise a pending device error.

        On CPU (or ``blocking=True``) the flags are read directly. On CUDA the flags are copied
        to pinned memory behind an event; a later call raises once the copy has landed, so the
        hot path never waits for the GPU.
        """
        if self.device.type != "cuda" or blocking:
            if blocking and self._pending_error_copy is not None:
                self._pending_error_copy[1].synchronize()
            self.raise_if_error(self.errors.cpu())
            return
        if self._pending_error_copy is not None:
            host, event = self._pending_error_copy
            if not event.query():
                return
            self._pending_error_copy = None
            self.raise_if_error(host)
        host = torch.empty(self.errors.shape, dtype=self.errors.dtype, pin_memory=True)
        host.copy_(self.errors, non_blocking=True)
        event = torch.cuda.Event()
        event.record()
        self._pending_error_copy = (host, event)


def all_gather_stacked(ws: MoKWorkspace, t: torch.Tensor) -> torch.Tensor:
    """``[ep, *t.shape]``: every rank's ``t`` in rank order (a collective over the EP group)."""
    t = t.contiguous()
    if ws.ep_size == 1:
        return t.unsqueeze(0)
    out = torch.empty((ws.ep_size * t.shape[0], *t.shape[1:]), dtype=t.dtype, device=t.device)
    dist.all_gather_into_tensor(out, t, group=ws.group)
    return out.view(ws.ep_size, *t.shape)


_CACHE: dict = {}


def _check_ranks_agree(group, device, values: list[int], names: list[str]) -> None:
    if not dist.is_initialized() or dist.get_world_size(group) == 1:
        return
    mine = torch.tensor(values, dtype=torch.int64, device=device)
    gathered = [torch.empty_like(mine) for _ in range(dist.get_world_size(group))]
    dist.all_gather(gathered, mine, group=group)
    for i, name in enumerate(names):
        seen = [int(g[i]) for g in gathered]
        if len(set(seen)) != 1:
            raise MoKInputError(f"ranks of the EP group disagree on {name}: {seen} (rank order)")


def create_workspace(
    group: dist.ProcessGroup | None,
    device: torch.device | str,
    num_tokens: int,
    hidden: int,
    topk: int,
    num_experts: int,
    cfg: MoKConfig,
) -> MoKWorkspace:
    device = torch.device(device)
    if dist.is_initialized():
        ep_size, rank = dist.get_world_size(group), dist.get_rank(group)
    else:
        if group is not None:
            raise MoKInputError("a process group was given but torch.distributed is not initialized")
        ep_size, rank = 1, 0
    for name, value in (("num_tokens", num_tokens), ("hidden", hidden), ("topk", topk), ("num_experts", num_experts)):
        if not isinstance(value, int) or value <= 0:
            raise MoKInputError(f"{name} must be a positive int, got {value!r}")
    _check_ranks_agree(
        group, device, [num_tokens, hidden, topk, num_experts],
        ["num_tokens (T)", "hidden size (H)", "top-k", "num_experts"],
    )
    if num_experts % ep_size:
        raise MoKInputError(f"num_experts ({num_experts}) must be divisible by the EP size ({ep_size})")
    if topk > num_experts:
        raise MoKInputError(f"top-k ({topk}) exceeds num_experts ({num_experts})")
    nle = num_experts // ep_size
    return MoKWorkspace(
        group=group, rank=rank, ep_size=ep_size, device=device,
        num_tokens=num_tokens, hidden=hidden, topk=topk, num_experts=num_experts,
        capacity_factor=cfg.capacity_factor,
        capacity=routed_capacity(cfg, ep_size, num_tokens, topk, nle),
        errors=torch.zeros(ErrorCode.NUM_CODES, dtype=torch.int32, device=device),
    )


def get_workspace(group, device, num_tokens, hidden, topk, num_experts, cfg: MoKConfig) -> MoKWorkspace:
    """The cached workspace for these shapes (created, collectively, on first use)."""
    device = torch.device(device)
    key = (_group_key(group), str(device), num_tokens, hidden, topk, num_experts, cfg.capacity_factor)
    ws = _CACHE.get(key)
    if ws is None:
        ws = _CACHE[key] = create_workspace(group, device, num_tokens, hidden, topk, num_experts, cfg)
    return ws


def clear_workspace_cache() -> None:
    _CACHE.clear()
