"""Public functional API: schedule, forward, backward, recompute.

CUDA inputs run the compiled kernels (``megatron_mok.kernel_path``) when the extension is built;
everything else runs the pure-PyTorch reference (``megatron_mok.reference``). Both follow the
same contracts (docs/ARCHITECTURE.md). Set ``MOK_FORCE_REFERENCE=1`` to use the reference on CUDA.
"""

from __future__ import annotations

import dataclasses
import os

import torch
import torch.distributed as dist

from . import fp8, reference
from .config import MoKConfig
from .schedule import MoKSchedule, build_schedule_reference
from .workspace import ErrorCode, MoKInputError, MoKWorkspace

_FLOAT_DTYPES = (torch.bfloat16, torch.float16, torch.float32, torch.float64)  # fp64: reference only


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


def _use_kernels(t: torch.Tensor) -> bool:
    if t.device.type != "cuda" or os.environ.get("MOK_FORCE_REFERENCE") == "1":
        return False
    from . import ops

    return ops.is_available()


def _kernel_path():
    from . import kernel_path

    return kernel_path


def _check_tensor(name, t, shape, dtypes, device):
    if not isinstance(t, torch.Tensor):
        raise MoKInputError(f"{name} must be a tensor, got {type(t).__name__}")
    if t.dtype not in dtypes:
        allowed = ", ".join(str(d).replace("torch.", "") for d in dtypes)
        raise MoKInputError(f"{name} has dtype {str(t.dtype).replace('torch.', '')}; expected {allowed}")
    if tuple(t.shape) != tuple(shape):
        raise MoKInputError(f"{name} must have shape {list(shape)}, got {list(t.shape)}")
    if t.device != device:
        raise MoKInputError(f"{name} is on {t.device}, the workspace on {device}")


def check_inputs(ws: MoKWorkspace, x, probs, fc1, fc2, shared_fc1=None, shared_fc2=None) -> None:
    """Validate shapes, dtypes and devices on the host (no device data is read)."""
    T, H, k, nle = ws.num_tokens, ws.hidden, ws.topk, ws.num_local_experts
    if not isinstance(x, torch.Tensor) or x.dtype not in _FLOAT_DTYPES:
        raise MoKInputError(f"x must be a bf16, fp16, fp32 or fp64 tensor, got {getattr(x, 'dtype', type(x))}")
    _check_tensor("x", x, (T, H), _FLOAT_DTYPES, ws.device)
    _check_tensor("probs", probs, (T, k), (torch.float32, torch.float64) if x.dtype == torch.float64 else (torch.float32,), ws.device)
    if not isinstance(fc1, torch.Tensor) or fc1.dim() != 3:
        raise MoKInputError(f"fc1 must be a [num_local_experts, 2*I, H] tensor, got {getattr(fc1, 'shape', fc1)}")
    two_i = fc1.shape[1]
    if two_i % 2:
        raise MoKInputError(f"fc1 rows hold [gate; up] and must be even, got {two_i}")
    _check_tensor("fc1", fc1, (nle, two_i, H), (x.dtype,), ws.device)
    _check_tensor("fc2", fc2, (nle, H, two_i // 2), (x.dtype,), ws.device)
    if (shared_fc1 is None) != (shared_fc2 is None):
        raise MoKInputError("shared_fc1 and shared_fc2 must be given together (or both None)")
    if shared_fc1 is not None:
        if not isinstance(shared_fc1, torch.Tensor) or shared_fc1.dim() != 2 or shared_fc1.shape[0] % 2:
            raise MoKInputError(f"shared_fc1 must be a [2*Is, H] tensor, got {getattr(shared_fc1, 'shape', shared_fc1)}")
        two_is = shared_fc1.shape[0]
        _check_tensor("shared_fc1", shared_fc1, (two_is, H), (x.dtype,), ws.device)
        _check_tensor("shared_fc2", shared_fc2, (H, two_is // 2), (x.dtype,), ws.device)


def flag_nonfinite_probs(ws: MoKWorkspace, probs: torch.Tensor) -> None:
    """Record the first token whose router weights are NaN/inf in ``ws.errors`` (device ops)."""
    bad = ~torch.isfinite(probs).all(dim=1)
    idx = torch.arange(1, probs.shape[0] + 1, device=probs.device, dtype=torch.int32)
    first = torch.where(bad, idx, torch.zeros_like(idx)).max()
    ws.errors[ErrorCode.NONFINITE_PROBS] = torch.maximum(ws.errors[ErrorCode.NONFINITE_PROBS], first)


def build_schedule(cfg: MoKConfig, ws: MoKWorkspace, top_experts: torch.Tensor) -> MoKSchedule:
    """All-gather the routing of the EP group and build this rank's routed-row schedule."""
    if _use_kernels(top_experts):
        return _kernel_path().build_schedule(cfg, ws, top_experts)
    return build_schedule_reference(ws, top_experts)


def quantize_expert_weights(fc1: torch.Tensor, fc2: torch.Tensor, transposed: bool = False, shared_fc1=None,
                            shared_fc2=None) -> fp8.FP8ExpertWeights:
    """The routed experts' weights in block-scaled e4m3 for ``forward(..., fp8_weights=)`` (and
    ``backward``) with ``MoKConfig(precision="fp8")``. Quantize once per weight version (e.g. per
    optimizer step). transposed: also the copies the backward's fp8 dgrads read
    (``MoKConfig.fp8_dgrad``); shared_fc1/shared_fc2: also the shared expert's weights, which the
    forward otherwise quantizes in every call (``MoKConfig.fp8_shared``)."""
    fp8.check_k("fc1 (H)", fc1.shape[-1])
    fp8.check_k("fc2 (I)", fc2.shape[-1])
    if (shared_fc1 is None) != (shared_fc2 is None):
        raise MoKInputError("quantize_expert_weights: shared_fc1 and shared_fc2 go together")
    ws = [w for w in (fc1, fc2, shared_fc1, shared_fc2) if w is not None]
    if all(w.dtype == torch.bfloat16 for w in ws) and _use_kernels(fc1):
        return _kernel_path().quantize_expert_weights(fc1, fc2, transposed, shared_fc1, shared_fc2)
    return fp8.quantize_expert_weights(fc1, fc2, transposed, shared_fc1, shared_fc2)


def _check_fp8(cfg: MoKConfig, ws: MoKWorkspace, fc1, fc2, fp8_weights) -> None:
    if cfg.precision != "fp8":
        if fp8_weights is not None:
            raise MoKInputError("fp8_weights were given, but MoKConfig.precision is not 'fp8'")
        return
    for name, k in (("H", ws.hidden), ("I", fc1.shape[1] // 2)):
        if k % fp8.BLOCK:
            raise MoKInputError(f"MoKConfig.precision 'fp8' needs {name} to be a multiple of {fp8.BLOCK} "
                                f"(the scale blocks), got {k}")
    if fp8_weights is not None and not (isinstance(fp8_weights, fp8.FP8ExpertWeights)
                                        and fp8_weights.matches(fc1, fc2)):
        raise MoKInputError("fp8_weights must come from quantize_expert_weights(fc1, fc2) of these weights' shapes")


def forward(cfg: MoKConfig, ws: MoKWorkspace, sched: MoKSchedule, x, probs, fc1, fc2,
            shared_fc1=None, shared_fc2=None, fp8_weights: fp8.FP8ExpertWeights | None = None):
    """One MoE layer forward. Returns ``(out [T, H], ctx)``; ctx feeds ``backward``.

    ``MoKConfig(precision="fp8")``: the routed experts' GEMMs run on block-scaled e4m3 operands
    (megatron_mok/fp8.py); ``fp8_weights`` (``quantize_expert_weights``) saves quantizing the
    weights in every call. The backward's routed dgrads follow ``cfg.fp8_dgrad``.
    """
    check_inputs(ws, x, probs, fc1, fc2, shared_fc1, shared_fc2)
    _check_fp8(cfg, ws, fc1, fc2, fp8_weights)
    use_kernels = _use_kernels(x)
    if not (use_kernels and _kernel_path().checks_probs_on_device(ws, x, fc1, shared_fc1)):
        flag_nonfinite_probs(ws, probs)  # the kernel paths check probs in their epilogue launch
    if use_kernels:
        if not torch.cuda.is_current_stream_capturing():
            ws.check_errors()  # sync-free: raises errors of earlier calls once their copy landed
        return _kernel_path().forward(cfg, ws, sched, x, probs, fc1, fc2, shared_fc1, shared_fc2,
                                      fp8_weights=fp8_weights)
    if ws.ep_size > 1:
        # The probs check above only saw this rank's router weights; the reference forward's next
        # step is a collective, so every rank must raise together or the healthy ones would hang.
        dist.all_reduce(ws.errors, op=dist.ReduceOp.MAX, group=ws.group)
    ws.check_errors(blocking=True)
    return reference.forward(ws, sched, x, probs, fc1, fc2, shared_fc1, shared_fc2, cfg.precision,
                             cfg.shared_precision)


def recompute_forward_context(cfg: MoKConfig, ws: MoKWorkspace, sched: MoKSchedule, x, fc1, fc2,
                              shared_fc1=None, fp8_weights: fp8.FP8ExpertWeights | None = None):
    """Rebuild the forward context (activation checkpointing): dispatch up to the expert outputs."""
    _check_fp8(cfg, ws, fc1, fc2, fp8_weights)
    if _use_kernels(x):
        return _kernel_path().recompute_forward_context(cfg, ws, sched, x, fc1, fc2, shared_fc1,
                                                        fp8_weights=fp8_weights)
    return reference.recompute_forward_context(ws, sched, x, fc1, fc2, shared_fc1, cfg.precision,
                                               cfg.shared_precision)


def backward(cfg: MoKConfig, ws: MoKWorkspace, sched: MoKSchedule, ctx, grad_out, x, probs, fc1, fc2,
             shared_fc1=None, shared_fc2=None, main_grads=None,
             fp8_weights: fp8.FP8ExpertWeights | None = None) -> MoKGrads:
    """Gradients of one MoE layer.

    ``main_grads``: optional fp32 tensors ``(fc1, fc2, shared_fc1, shared_fc2)`` (entries may be
    None) that the weight gradients are accumulated into (Megatron's gradient-accumulation
    fusion); the matching fields of the result are then None. ``fp8_weights``: with
    ``cfg.dgrad_precision == "fp8"``, ``quantize_expert_weights(fc1, fc2, transposed=True)`` of these
    weights (else the dgrads' e4m3 copies are made in this call).
    """
    check_inputs(ws, x, probs, fc1, fc2, shared_fc1, shared_fc2)
    _check_tensor("grad_out", grad_out, (ws.num_tokens, ws.hidden), (x.dtype,), ws.device)
    _check_fp8(cfg, ws, fc1, fc2, fp8_weights)
    if _use_kernels(x) and hasattr(_kernel_path(), "backward"):
        return _kernel_path().backward(cfg, ws, sched, ctx, grad_out, x, probs, fc1, fc2,
                                       shared_fc1, shared_fc2, main_grads, fp8_weights=fp8_weights)
    if not isinstance(ctx, reference.ReferenceContext):
        ctx = reference.recompute_forward_context(ws, sched, x, fc1, fc2, shared_fc1, cfg.precision)
    dx, dprobs, *wgrads = reference.backward(ws, sched, ctx, grad_out, x, probs, fc1, fc2, shared_fc1, shared_fc2,
                                             dgrad_precision=cfg.dgrad_precision,
                                             wgrad_precision=cfg.wgrad_precision)
    if main_grads is not None:
        for i, main in enumerate(main_grads):
            if main is not None and wgrads[i] is not None:
                main.add_(wgrads[i])
                wgrads[i] = None
    return MoKGrads(dx.to(x.dtype), dprobs, *wgrads)
