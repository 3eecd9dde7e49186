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
