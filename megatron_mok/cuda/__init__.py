"""The CUDA path of the mok layer: the compiled kernels of csrc/ behind the functional API.

One module per stage of the data path: ``comm`` (symmetric buffers, barriers, streams),
``schedule``, ``dispatch``, ``experts`` (the GEMMs of both passes), ``combine``, and the passes that
compose them, ``forward`` and ``backward``. ``megatron_mok.functional`` calls in here when the
extension is built and ``unsupported_reason`` is None; everything else runs the reference.

Nothing here synchronises with the host (no ``.item()``, ``.tolist()``, ``.cpu()``, no
data-dependent shapes), so a layer pass can be captured in a CUDA graph once the workspace's
symmetric buffers exist.
"""

from __future__ import annotations

import torch

from .. import ops
from ..workspace import MoKWorkspace
from .backward import backward
from .context import KernelContext
from .experts import quantize_expert_weights
from .forward import forward, recompute_forward_context
from .schedule import build_schedule

MAX_TOKENS = 65535
MAX_EP = 72


def unsupported_reason(ws: MoKWorkspace, x: torch.Tensor, fc1: torch.Tensor, shared_fc1=None) -> str | None:
    """Why these inputs cannot run on the kernels (and what to change), or None when they can."""
    if x.dtype != torch.bfloat16:
        return f"x is {str(x.dtype).replace('torch.', '')}; the kernels take bf16 activations and weights"
    if ws.hidden % 8 or fc1.shape[1] % 16:
        return f"H ({ws.hidden}) and I ({fc1.shape[1] // 2}) must be multiples of 8"
    if shared_fc1 is not None and shared_fc1.shape[0] % 16:
        return f"the shared expert's size ({shared_fc1.shape[0] // 2}) must be a multiple of 8"
    if ws.num_tokens > MAX_TOKENS:
        return f"T = {ws.num_tokens} tokens per rank exceeds {MAX_TOKENS}"
    if ws.ep_size > MAX_EP:
        return f"EP size {ws.ep_size} exceeds {MAX_EP}"
    if ws.num_local_experts > ops.EXPERT_GEMM_MAX_SEGMENTS:
        return (f"{ws.num_local_experts} local experts exceed the expert GEMMs' {ops.EXPERT_GEMM_MAX_SEGMENTS}; "
                "raise the EP size")
    return None


__all__ = ["KernelContext", "backward", "build_schedule", "forward", "quantize_expert_weights",
           "recompute_forward_context", "unsupported_reason"]
