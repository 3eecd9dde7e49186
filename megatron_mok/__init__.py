"""megatron-mok: a deterministic fused MoE layer (dispatch, experts, combine) for Megatron-Core.

The library works without Megatron; the Megatron adapter lives in ``megatron_mok.adapter``.
"""

from .autograd import mok_moe
from .config import ROW_ALIGN, MoKConfig, MoKConfigError
from .functional import (
    MoKGrads,
    backward,
    build_schedule,
    flush_wgrads,
    forward,
    held_wgrads,
    recompute_forward_context,
)
from .schedule import MoKSchedule
from .workspace import (
    MoKCapacityError,
    MoKInputError,
    MoKKernelStallError,
    MoKPeerTimeoutError,
    MoKWorkspace,
    check_workspace_errors,
    clear_workspace_cache,
    create_workspace,
    get_workspace,
)

__version__ = "0.1.0"

__all__ = [
    "ROW_ALIGN", "MoKCapacityError", "MoKConfig", "MoKConfigError", "MoKGrads", "MoKInputError",
    "MoKKernelStallError", "MoKPeerTimeoutError", "MoKSchedule", "MoKWorkspace", "backward", "build_schedule",
    "check_workspace_errors", "clear_workspace_cache", "create_workspace", "flush_wgrads", "forward",
    "get_workspace", "held_wgrads", "mok_moe", "recompute_forward_context",
]
