"""What the forward keeps for the backward (``KernelContext``) and how the backward reads it."""

from __future__ import annotations

import dataclasses

import torch

from .. import ops
from ..schedule import MoKSchedule


@dataclasses.dataclass
class KernelContext:
    """What the forward keeps for the backward (bf16; freshly allocated per call).

    Rows at or past ``sched.expert_offsets[nle]`` are never written (undefined); padding rows
    inside an expert segment hold zeros in ``x_routed`` (and the matching GEMM outputs).
    ``h`` / ``shared_h``: the gate/up pre-activations, written by the same GEMM epilogue that
    activates them (``MoKConfig.save_gate_up``); None: the backward recomputes them with that GEMM
    (same bits, one gate/up GEMM more, 2 I (2 Is) bf16 less per routed row (token)).
    fp8 (``MoKConfig.precision``): the rows were dispatched in e4m3 (``x_e4m3``, ``x_scale``: half
    the bytes); the backward dequantizes them (``routed_rows``) into a tensor of its own. ``h`` is
    always kept (a bf16 recompute would not give the e4m3 GEMM's values).
    """

    x_routed: torch.Tensor | None  # [cap, H] dispatched rows (fp8: None until the backward dequantizes)
    act: torch.Tensor  # [cap, I] silu(x_routed @ gate^T) * (x_routed @ up^T)
    y_routed: torch.Tensor  # [cap, H] unweighted expert outputs (router-weight gradient)
    shared_act: torch.Tensor | None  # [T, Is] SwiGLU output of the shared expert
    h: torch.Tensor | None = None  # [cap, 2I] [x_routed @ gate^T | x_routed @ up^T]
    shared_h: torch.Tensor | None = None  # [T, 2Is]
    x_e4m3: torch.Tensor | None = None  # fp8: [cap, H] the dispatched rows in e4m3
    # fp8: their scales [H / 128, ld] (the layout the e4m3 GEMMs read)
    x_scale: torch.Tensor | None = None

    def nbytes(self) -> int:
        """Bytes this context holds (the activation memory the layer keeps for its backward)."""
        return sum(t.numel() * t.element_size() for t in dataclasses.astuple(self) if isinstance(t, torch.Tensor))


def routed_rows(ctx: KernelContext, sched: MoKSchedule) -> torch.Tensor:
    """ctx.x_routed; fp8: the e4m3 rows dequantized to bf16 (a new tensor per call)."""
    if ctx.x_routed is not None:
        return ctx.x_routed
    x = torch.empty(ctx.x_e4m3.shape, dtype=torch.bfloat16, device=ctx.x_e4m3.device)
    ops.dequantize_rows_e4m3(ctx.x_e4m3, ctx.x_scale, x, sched.expert_offsets[-1:])
    return x
