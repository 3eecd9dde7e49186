"""Combine: every routed output row goes into its unique slot ``(token, k)`` of the source rank's
symmetric ``[T * k, H]`` buffer (plain stores, no atomics); after a barrier the epilogue sums each
token's k slots in slot order in fp32, weighted by the router probabilities, adds the shared
expert's output and casts once (csrc/kernels/comm/combine.cu). The epilogue also flags NaN/inf
router weights in ``ws.errors``.
"""

from __future__ import annotations

from .. import ops
from ..config import MoKConfig
from ..schedule import MoKSchedule
from ..workspace import MoKWorkspace
from .comm import comm


def combine_buffer(ws: MoKWorkspace):
    """(this rank's [T * k, H] slot buffer, every rank's address of it; made by the forward's buffer
    set, comm.CALL_BUFFERS)."""
    return comm(ws).buffer("comb")


def push_rows(ws: MoKWorkspace, sched: MoKSchedule, y_routed, comb_ptrs: list[int], comm_ctas: int = 0) -> None:
    """Routed output rows into their source slots (a launch of its own)."""
    ops.combine(y_routed, sched.row_src_rank, sched.row_src_slot, sched.expert_offsets, comm(ws).state, comb_ptrs,
                comm_ctas)


def barrier(cfg: MoKConfig, ws: MoKWorkspace) -> None:
    """Every rank's pushes have landed (and no peer reads this rank's published rows any more)."""
    c = comm(ws)
    ops.barrier(c.state, ws.errors, c.flag_ptrs, ws.rank, cfg.peer_timeout_s)


def epilogue(cfg: MoKConfig, ws: MoKWorkspace, comb, probs, shared_y, out, opened: bool) -> None:
    """The fixed-order slot sum. opened: the kernel before it (the megakernel) opened the closing
    barrier, so this launch closes it first; else ``barrier`` ran before it."""
    c = comm(ws)
    if opened:
        ops.moe_epilogue_wait(comb, probs.contiguous(), shared_y, out, c.state, ws.errors, c.flag_ptrs, ws.rank,
                              cfg.peer_timeout_s)
    else:
        ops.moe_epilogue(comb, probs.contiguous(), shared_y, out, ws.errors)
