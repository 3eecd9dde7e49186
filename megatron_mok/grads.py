"""The gradients one MoE layer backward returns (both paths)."""

from __future__ import annotations

import dataclasses

import torch


@dataclasses.dataclass
class MoKGrads:
    dx: torch.Tensor  # [T, H], dtype of x
    dprobs: torch.Tensor  # [T, k] fp32
    # Weight gradients: fp32 on the reference path, bf16 on the CUDA path (fp32 accumulation inside
    # each GEMM, one rounding); None when accumulated into main_grads.
    dfc1: torch.Tensor | None
    dfc2: torch.Tensor | None
    dshared_fc1: torch.Tensor | None
    dshared_fc2: torch.Tensor | None


def accumulate(wgrads: list, main_grads) -> list:
    """Add the weight gradients into the given fp32 ``main_grads`` entries (Megatron's
    gradient-accumulation fusion); those entries of the returned list become None."""
    if main_grads is not None:
        for i, main in enumerate(main_grads):
            if main is not None and wgrads[i] is not None:
                main.add_(wgrads[i])
                wgrads[i] = None
    return wgrads
