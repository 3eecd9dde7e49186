"""Routed weight gradients of several micro-batches in one pass (``MoKConfig.wgrad_microbatches``).

With fused accumulation a weight-gradient GEMM reads and writes its fp32 ``main_grad`` once per
call: 8 bytes a weight, against ~1024 rows of MMA an expert at the one-GPU proxy, so that traffic
and not the MMA sets the kernel's time. A backward that may hold (``hold=True``: its caller has
more micro-batches of the same step to come) writes its weight-gradient operands (dh, act_w, the
grad_out rows, the routed input rows) into the rows of its layer's group buffers and runs no weight
gradient; the backward that closes the group (the group is full, or ``hold=False``) runs the two
GEMMs once over every part (``ops.expert_wgrad``'s parts: one fp32 accumulator over the micro-batches'
rows in order), so ``main_grad`` takes their sum in one read and write.

A group belongs to the main_grad pair it adds into (one per layer). The bits depend on how the
micro-batches are grouped (the sum is formed before the add), never on anything else.
"""

from __future__ import annotations

import dataclasses

import torch

from .. import ops


@dataclasses.dataclass
class _Group:
    size: int  # parts it holds at most
    cap: int  # rows of one part
    main1: torch.Tensor
    main2: torch.Tensor
    g_rows: torch.Tensor  # [size * cap, H]; part q at rows q * cap ..
    act_w: torch.Tensor  # [size * cap, I]
    dh: torch.Tensor  # [size * cap, 2 I]
    x_rows: torch.Tensor  # [size * cap, H]
    offsets: list = dataclasses.field(default_factory=list)  # per held part: [nseg + 1] int32 (device)
    counts: list = dataclasses.field(default_factory=list)  # per held part: [nseg] int32 (device)


_GROUPS: dict[tuple[int, int], _Group] = {}


def _key(main1: torch.Tensor, main2: torch.Tensor) -> tuple[int, int]:
    return main1.data_ptr(), main2.data_ptr()


class Part:
    """One backward's rows of the weight-gradient operands: ``g_rows``, ``act_w``, ``dh`` and
    ``x_rows`` are where the backward writes them (its part of the group buffers, or tensors of its
    own when it runs alone); ``finish`` runs the weight gradients or holds them."""

    def __init__(self, size: int, cap: int, hidden: int, inter: int, device, main1, main2):
        self.group = None
        bf16 = dict(dtype=torch.bfloat16, device=device)
        if size > 1:
            group = _GROUPS.get(_key(main1, main2))
            if group is not None and (group.cap != cap or group.size != size or group.g_rows.shape[1] != hidden
                                      or group.act_w.shape[1] != inter):
                _run(_GROUPS.pop(_key(main1, main2)))  # the shapes changed: the held parts go first, alone
                group = None
            if group is None:
                group = _Group(size, cap, main1, main2, torch.empty((size * cap, hidden), **bf16),
                               torch.empty((size * cap, inter), **bf16), torch.empty((size * cap, 2 * inter), **bf16),
                               torch.empty((size * cap, hidden), **bf16))
                _GROUPS[_key(main1, main2)] = group
            self.group = group
            rows = slice(len(group.offsets) * cap, (len(group.offsets) + 1) * cap)
            self.g_rows, self.act_w = group.g_rows[rows], group.act_w[rows]
            self.dh, self.x_rows = group.dh[rows], group.x_rows[rows]
        else:
            self.g_rows = torch.empty((cap, hidden), **bf16)
            self.act_w = torch.empty((cap, inter), **bf16)
            self.dh = torch.empty((cap, 2 * inter), **bf16)
            self.x_rows = None  # regather's own tensor

    def finish(self, offsets: torch.Tensor, counts: torch.Tensor, hold: bool) -> None:
        """Add this part to its group, and run the group's weight gradients unless this part may wait
        (``hold``) and the group has room for a later backward's on the same main grads."""
        group = self.group
        group.offsets.append(offsets)
        group.counts.append(counts)
        if not hold or len(group.offsets) == group.size:
            _run(_GROUPS.pop(_key(group.main1, group.main2)))


def _run(group: _Group) -> None:
    """Both weight gradients over every held part, added into their main grads."""
    parts = len(group.offsets)
    offsets = torch.stack([o + q * group.cap for q, o in enumerate(group.offsets)])
    counts = torch.stack(group.counts)
    rows = parts * group.cap
    ops.expert_wgrad(group.dh[:rows], offsets, group.x_rows[:rows], offsets, counts, group.main1)
    ops.expert_wgrad(group.g_rows[:rows], offsets, group.act_w[:rows], offsets, counts, group.main2)


def held(main1: torch.Tensor | None = None, main2: torch.Tensor | None = None) -> int:
    """How many layers' weight gradients are held (parts waiting for a later backward); with a main
    grad pair, 1 if that layer's are, else 0."""
    if main1 is None or main2 is None:
        return len(_GROUPS)
    return int(_key(main1, main2) in _GROUPS)


def flush() -> int:
    """Run every held group's weight gradients now (their parts so far); returns how many ran."""
    groups = list(_GROUPS.values())
    _GROUPS.clear()
    for group in groups:
        _run(group)
    return len(groups)
