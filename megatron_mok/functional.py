"""Public functional API: schedule, forward, backward, recompute.

CUDA inputs run the compiled kernels (``megatron_mok.cuda``) when the extension is built and the
inputs suit them (``cuda.unsupported_reason``); everything else runs the pure-PyTorch reference
(``megatron_mok.reference``). Both follow the same contracts (docs/DESIGN.md). Set
``MOK_FORCE_REFERENCE=1`` to use the reference on CUDA.

Slow paths are never silent: a CUDA call that would run the reference (fp16/fp32 activations, sizes
the kernels do not take, no extension) warns once per reason, naming it and what to change, and
raises ``MoKInputError`` instead with ``MoKConfig(strict=True)``.

Failure semantics: every call checks its own inputs on the host before its first collective. On the
reference path that verdict travels in the call's first collective (the agreement packet of
``workspace.exchange``), so one rank's bad input makes every rank raise the same ``MoKInputError``,
naming the field and the failing rank, instead of leaving its peers waiting. On the kernel path a
rank whose check fails still takes part in the call's first device barrier, the one its peers wait
in (``_reject``: one small launch, no wait), with a verdict word saying which check failed, then
raises its own error; its peers' barriers flag it and their next ``ws.check_errors()`` raises
``MoKInputError`` naming that rank and the reason (megatron_mok/header.py). Before that launch it
makes the call's symmetric buffers as its peers do (``_symmetric_buffers``: on a workspace's first
call of a kind, a host collective). Calls whose checks pass launch nothing more and sync nothing.
"""

from __future__ import annotations

import os
import warnings

import torch

from . import fp8, reference
from .config import ROW_ALIGN, MoKConfig
from .grads import MoKGrads, accumulate
from .header import tag, tag_shape, verdict_dtype, verdict_of
from .schedule import (
    MoKSchedule,
    build_schedule_reference,
    check_schedule,
    stamp_schedule,
    validate_top_experts,
)
from .workspace import (
    Agreed,
    ErrorCode,
    MoKInputError,
    MoKWorkspace,
    exchange,
    shape_values,
)

_FLOAT_DTYPES = (torch.bfloat16, torch.float16, torch.float32, torch.float64)  # fp64: reference only

__all__ = ["MoKGrads", "backward", "build_schedule", "check_inputs", "flush_wgrads", "forward", "held_wgrads",
           "quantize_expert_weights", "recompute_forward_context", "report_slow_path", "slow_path_reason"]


def _forced_reference() -> bool:
    return os.environ.get("MOK_FORCE_REFERENCE") == "1"


def _cuda():
    from . import cuda

    return cuda


def slow_path_reason(ws: MoKWorkspace, x, fc1, shared_fc1=None) -> str | None:
    """Why a call with CUDA inputs would run the slow pure-PyTorch reference instead of the kernels,
    or None (CPU inputs: the reference is the CPU path; ``MOK_FORCE_REFERENCE=1``: asked for)."""
    if not isinstance(x, torch.Tensor) or x.device.type != "cuda" or _forced_reference():
        return None
    from . import ops

    if not ops.is_available():
        return (f"the mok CUDA extension is not available ({ops.load_error() or 'not built'}); build it "
                "(MOK_BUILD_EXT=1, see README)")
    return _cuda().unsupported_reason(ws, x, fc1, shared_fc1)


def layer_slow_path_reason(dtype: torch.dtype, hidden: int, ffn: int, shared_ffn: int | None, num_experts: int,
                           ep_size: int, topk: int) -> str | None:
    """``slow_path_reason`` of a layer with these sizes on CUDA, known when the layer is built (before
    any call: no tensor or workspace exists yet; meta stand-ins carry the shapes)."""
    if not torch.cuda.is_available() or _forced_reference():
        return None
    from . import ops

    if not ops.is_available():
        return (f"the mok CUDA extension is not available ({ops.load_error() or 'not built'}); build it "
                "(MOK_BUILD_EXT=1, see README)")
    meta = torch.device("meta")
    ws = MoKWorkspace(group=None, rank=0, ep_size=ep_size, device=meta, num_tokens=1, hidden=hidden, topk=topk,
                      num_experts=num_experts, capacity_factor=1.0, capacity=ROW_ALIGN,
                      errors=torch.zeros(ErrorCode.NUM_CODES, dtype=torch.int32, device=meta), dtype=dtype)
    x = torch.empty((1, hidden), dtype=dtype, device=meta)
    fc1 = torch.empty((max(num_experts // max(ep_size, 1), 1), 2 * ffn, hidden), dtype=dtype, device=meta)
    shared = torch.empty((2 * shared_ffn, hidden), dtype=dtype, device=meta) if shared_ffn else None
    return _cuda().unsupported_reason(ws, x, fc1, shared)


_SLOW_WARNED: set = set()


def report_slow_path(cfg: MoKConfig, reason: str | None, where: str = "the mok layer", hint: str = "") -> None:
    """Warn once per reason that ``where`` runs the pure-PyTorch reference on CUDA, or raise
    ``MoKInputError`` with ``cfg.strict``. Nothing to do for ``reason`` None."""
    if reason is None:
        return
    text = (f"megatron_mok: {where} runs the pure-PyTorch reference on CUDA, many times slower than the "
            f"mok kernels, because {reason}. Change that to run the kernels{hint}")
    if cfg.strict:
        raise tag(MoKInputError(f"{text} (MoKConfig.strict / --mok-strict makes this an error instead of a warning)"),
                  "x", "slow_path")
    if reason not in _SLOW_WARNED:
        _SLOW_WARNED.add(reason)
        warnings.warn(f"{text}; MoKConfig(strict=True) / --mok-strict makes this an error. (Warned once.)",
                      stacklevel=3)


def _route(cfg: MoKConfig, ws: MoKWorkspace, x, fc1, shared_fc1, where: str) -> bool:
    """True: the kernel path. Warns (or, strict, raises) when CUDA inputs fall back."""
    if not isinstance(x, torch.Tensor) or x.device.type != "cuda" or _forced_reference():
        return False
    reason = slow_path_reason(ws, x, fc1, shared_fc1)
    report_slow_path(cfg, reason, where)
    return reason is None


def _kernels_on(device) -> bool:
    if not isinstance(device, torch.device) or device.type != "cuda" or _forced_reference():
        return False
    from . import ops

    return ops.is_available()


def _use_kernels(t) -> bool:
    """True when ``t`` is a CUDA tensor and the built kernels are to run on it."""
    return isinstance(t, torch.Tensor) and _kernels_on(t.device)


def _kernel_side(t, ws) -> bool:
    """Whether a call whose checks failed belongs to the kernel path: ``t`` (x, top_experts) is a CUDA
    tensor the kernels take, or it is no CUDA tensor at all while the workspace is on a GPU with the
    kernels built (a bad argument on one rank: its peers run the kernels)."""
    if isinstance(t, torch.Tensor) and t.device.type == "cuda":
        return _use_kernels(t)
    return _kernels_on(getattr(ws, "device", None))


def _buffer_cfg(cfg, ws) -> MoKConfig:
    """The config that picks a call's symmetric buffers (its precision): the call's, or where that
    is no MoKConfig (the check that failed), the one the ranks agreed on at workspace creation."""
    if isinstance(cfg, MoKConfig):
        return cfg
    return ws.cfg if isinstance(ws.cfg, MoKConfig) else MoKConfig()


def _reject(ws, call: str, err: MoKInputError, cfg=None) -> None:
    """Kernel path, this rank's check failed: take part in the call's first device barrier, the one
    the peers wait in, with the verdict word instead of data (``ops.barrier_reject``: no wait), so
    the peers raise a ``MoKInputError`` naming this rank and the reason instead of timing out.
    First it makes (or finds) the call's symmetric buffers, as the peers do before that barrier: on a
    workspace's first call of this kind their creation is a collective the peers wait in.
    Alone, or while a CUDA graph is captured, there is no one to tell."""
    if not isinstance(ws, MoKWorkspace) or ws.ep_size == 1 or ws.device.type != "cuda":
        return
    try:
        if torch.cuda.is_current_stream_capturing():
            return
        from . import ops
        from .cuda.comm import comm

        c = comm(ws)
        try:
            c.call_buffers(call, _buffer_cfg(cfg, ws))
        except Exception as make_err:  # noqa: BLE001 - the barrier buffer exists: the verdict still goes out
            err.add_note(f"megatron_mok: this rank could not make the call's symmetric buffers ({make_err}); "
                         "peers making them wait for it")
        ops.barrier_reject(c.state, ws.errors, c.flag_ptrs, ws.rank, verdict_of(err, call),
                           bump_gather=call == "build_schedule")
    except Exception as launch_err:  # noqa: BLE001 - the input error is what this rank raises
        err.add_note(f"megatron_mok: the verdict could not reach the peers ({launch_err}); they will time out")


def _verdict(x, ws, call: str, checks, cfg=None) -> tuple[MoKInputError | None, bool]:
    """Run a call's host checks; ``checks()`` returns whether the kernels run the call. Returns
    (this rank's error or None, kernels). On the kernel path a failed check is sent to the peers in
    the call's first device barrier (``_reject``) and raised here. On the reference path the error
    is returned for the call's first collective to share with every rank."""
    try:
        return None, checks()
    except MoKInputError as err:
        if _kernel_side(x, ws):
            _reject(ws, call, err, cfg)
            raise
        return err, False


def _symmetric_buffers(cfg: MoKConfig, ws: MoKWorkspace, call: str) -> None:
    """Kernel path, checks passed: the call's symmetric buffers, all made before its first device
    barrier in one fixed order (cuda/comm.py: CALL_BUFFERS), the same function ``_reject`` runs.
    Making them is a host collective, on a workspace's first call of each kind only. A rank that a
    peer's verdict (or a header mismatch) stopped raises that first: the peer has raised and will
    not join. Every rank stops at the same barrier, so they all raise here alike; the device sync
    this takes comes once per workspace and call kind."""
    from .cuda import comm as cuda_comm

    if ws.ep_size > 1 and not cuda_comm.has_call_buffers(ws, call, cfg) \
            and not torch.cuda.is_current_stream_capturing():
        _raise_if_stopped(ws, cuda_comm.workspaces_with_buffers())
    cuda_comm.comm(ws).call_buffers(call, cfg)


def _raise_if_stopped(ws: MoKWorkspace, others) -> None:
    """Raise the verdict or header mismatch that stopped this rank, on ``ws`` or on another
    workspace of its group (``others``; the peer that rejected may have done so in another layer's)."""
    if ws.errors.is_cuda:
        torch.cuda.synchronize(ws.device)  # every barrier launched so far has seen what it will
    for w in [ws, *(o for o in others if o is not ws and o.group is ws.group and o.device == ws.device)]:
        if int(w.errors[ErrorCode.HEADER_MISMATCH]):
            w.check_errors(blocking=True)


def _check_tensor(name, t, shape, dtypes, device):
    if not isinstance(t, torch.Tensor):
        raise tag(MoKInputError(f"{name} must be a tensor, got {type(t).__name__}"), name, "type")
    if t.dtype not in dtypes:
        allowed = ", ".join(str(d).replace("torch.", "") for d in dtypes)
        raise tag(MoKInputError(f"{name} has dtype {str(t.dtype).replace('torch.', '')}; expected {allowed}"),
                  name, "dtype", 0, verdict_dtype(t.dtype))
    if tuple(t.shape) != tuple(shape):
        raise tag_shape(MoKInputError(f"{name} must have shape {list(shape)}, got {list(t.shape)}"), name, t.shape,
                        shape)
    if t.device != device:
        raise tag(MoKInputError(f"{name} is on {t.device}, the workspace on {device}"), name, "device")


def check_inputs(ws: MoKWorkspace, x, probs, fc1, fc2, shared_fc1=None, shared_fc2=None) -> None:
    """Validate shapes, dtypes and devices on the host (no device data is read)."""
    T, H, k, nle = ws.num_tokens, ws.hidden, ws.topk, ws.num_local_experts
    if not isinstance(x, torch.Tensor) or x.dtype not in _FLOAT_DTYPES:
        err = MoKInputError(f"x must be a bf16, fp16, fp32 or fp64 tensor, got {getattr(x, 'dtype', type(x))}")
        if isinstance(x, torch.Tensor):
            raise tag(err, "x", "dtype", 0, verdict_dtype(x.dtype))
        raise tag(err, "x", "type")
    _check_tensor("x", x, (T, H), _FLOAT_DTYPES, ws.device)
    weights = [w for w in (fc1, fc2) if isinstance(w, torch.Tensor)]
    if len(weights) == 2 and fc1.dtype == fc2.dtype != x.dtype:  # the weights agree: x is the odd one out
        name = lambda d: str(d).replace("torch.", "")  # noqa: E731
        raise tag(MoKInputError(f"x has dtype {name(x.dtype)}; the expert weights (fc1, fc2) have "
                                f"{name(fc1.dtype)}, and x must have theirs"), "x", "dtype", 0, verdict_dtype(x.dtype))
    _check_tensor("probs", probs, (T, k), (torch.float32, torch.float64) if x.dtype == torch.float64 else (torch.float32,), ws.device)
    if not isinstance(fc1, torch.Tensor) or fc1.dim() != 3:
        raise tag(MoKInputError(f"fc1 must be a [num_local_experts, 2*I, H] tensor, got {getattr(fc1, 'shape', fc1)}"),
                  "fc1", "type")
    two_i = fc1.shape[1]
    if two_i % 2:
        raise tag(MoKInputError(f"fc1 rows hold [gate; up] and must be even, got {two_i}"), "fc1", "shape", 1, two_i)
    _check_tensor("fc1", fc1, (nle, two_i, H), (x.dtype,), ws.device)
    _check_tensor("fc2", fc2, (nle, H, two_i // 2), (x.dtype,), ws.device)
    if (shared_fc1 is None) != (shared_fc2 is None):
        raise tag(MoKInputError("shared_fc1 and shared_fc2 must be given together (or both None)"),
                  "shared_fc1" if shared_fc1 is None else "shared_fc2", "type")
    if shared_fc1 is not None:
        if not isinstance(shared_fc1, torch.Tensor) or shared_fc1.dim() != 2 or shared_fc1.shape[0] % 2:
            raise tag(MoKInputError(f"shared_fc1 must be a [2*Is, H] tensor, got "
                                    f"{getattr(shared_fc1, 'shape', shared_fc1)}"), "shared_fc1", "type")
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
    """All-gather the routing of the EP group and build this rank's routed-row schedule.

    The schedule carries its identity (this workspace, which of its schedules it is, the routing):
    a forward must use the newest schedule of its workspace, a backward the one its context's
    forward used."""
    if _kernel_side(top_experts, ws):
        try:
            _check_cfg(cfg)
            validate_top_experts(ws, top_experts)
        except MoKInputError as err:
            _reject(ws, "build_schedule", err, cfg)  # the peers wait in the routing all-gather's barrier
            raise
        _symmetric_buffers(cfg, ws, "build_schedule")
        return stamp_schedule(ws, _cuda().build_schedule(cfg, ws, top_experts))
    return build_schedule_reference(ws, top_experts, cfg)


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
        return _cuda().quantize_expert_weights(fc1, fc2, transposed, shared_fc1, shared_fc2)
    return fp8.quantize_expert_weights(fc1, fc2, transposed, shared_fc1, shared_fc2)


def _check_fp8(cfg: MoKConfig, ws: MoKWorkspace, fc1, fc2, fp8_weights) -> None:
    if cfg.precision != "fp8":
        if fp8_weights is not None:
            raise tag(MoKInputError("fp8_weights were given, but MoKConfig.precision is not 'fp8'"), "fp8_weights",
                      "config")
        return
    for name, k in (("H", ws.hidden), ("I", fc1.shape[1] // 2)):
        if k % fp8.BLOCK:
            raise tag(MoKInputError(f"MoKConfig.precision 'fp8' needs {name} to be a multiple of {fp8.BLOCK} "
                                    f"(the scale blocks), got {k}"), "cfg", "config")
    if fp8_weights is not None and not (isinstance(fp8_weights, fp8.FP8ExpertWeights)
                                        and fp8_weights.matches(fc1, fc2)):
        raise tag(MoKInputError("fp8_weights must come from quantize_expert_weights(fc1, fc2) of these weights' "
                                "shapes"), "fp8_weights", "config")


def _check_cfg(cfg) -> None:
    if not isinstance(cfg, MoKConfig):
        raise tag(MoKInputError(f"cfg must be a MoKConfig, got {type(cfg).__name__}"), "cfg", "type")


def _call_values(cfg, ws: MoKWorkspace, x, fc1, shared_fc1, fp8_weights, *extra: Agreed) -> list[Agreed]:
    """What every rank of one forward / backward / recompute call must agree on."""
    dtype = x.dtype if isinstance(x, torch.Tensor) else None
    two_i = fc1.shape[1] if isinstance(fc1, torch.Tensor) and fc1.dim() == 3 else None
    two_is = shared_fc1.shape[0] if isinstance(shared_fc1, torch.Tensor) and shared_fc1.dim() == 2 else 0
    return [*shape_values(ws.num_tokens, ws.hidden, ws.topk, ws.num_experts, dtype, cfg),
            Agreed("expert intermediate size 2*I (fc1 rows)", "int", two_i),
            Agreed("shared expert size 2*Is (shared_fc1 rows; 0: none)", "int", two_is),
            Agreed("fp8_weights given", "bool", fp8_weights is not None), *extra]


def _tag_context(ctx, sched: MoKSchedule):
    """Record in the forward context which schedule it was made with (for the backward's check)."""
    if ctx is not None and sched.identity is not None:
        try:
            ctx.schedule_id = sched.identity
        except AttributeError:  # a context type that takes no attributes: not checked
            pass
    return ctx


def _check_context(ctx, sched: MoKSchedule, call: str) -> None:
    made_with = getattr(ctx, "schedule_id", None)
    if ctx is None or made_with is None or sched.identity is None:
        return
    if made_with != sched.identity:
        raise tag(MoKInputError(
            f"{call}: ctx and sched do not belong together: ctx comes from the forward that ran schedule "
            f"{made_with[1]} of workspace #{made_with[0]}, sched is schedule {sched.step} of workspace "
            f"#{sched.workspace_uid}; pass the schedule that forward used"
        ), "ctx", "context")


def forward(cfg: MoKConfig, ws: MoKWorkspace, sched: MoKSchedule, x, probs, fc1, fc2,
            shared_fc1=None, shared_fc2=None, fp8_weights: fp8.FP8ExpertWeights | None = None):
    """One MoE layer forward. Returns ``(out [T, H], ctx)``; ctx feeds ``backward``.

    ``sched`` must be the newest schedule built on ``ws`` (``build_schedule`` with this call's routing).
    ``MoKConfig(precision="fp8")``: the routed experts' GEMMs run on block-scaled e4m3 operands
    (megatron_mok/fp8.py); ``fp8_weights`` (``quantize_expert_weights``) saves quantizing the
    weights in every call. The backward's routed dgrads follow ``cfg.fp8_dgrad``.
    """
    def checks() -> bool:
        _check_cfg(cfg)
        check_schedule(ws, sched, "forward", latest=True)
        check_inputs(ws, x, probs, fc1, fc2, shared_fc1, shared_fc2)
        _check_fp8(cfg, ws, fc1, fc2, fp8_weights)
        return _route(cfg, ws, x, fc1, shared_fc1, "forward")

    error, use_kernels = _verdict(x, ws, "forward", checks, cfg)
    if use_kernels:
        if not torch.cuda.is_current_stream_capturing():
            ws.check_errors()  # sync-free: raises errors of earlier calls once their copy landed
        _symmetric_buffers(cfg, ws, "forward")
        out, ctx = _cuda().forward(cfg, ws, sched, x, probs, fc1, fc2, shared_fc1, shared_fc2,
                                          fp8_weights=fp8_weights)
        return out, _tag_context(ctx, sched)
    if error is None:
        flag_nonfinite_probs(ws, probs)  # this rank's router weights; the exchange merges every rank's
    # The call's first collective: this rank's verdict, the values every rank must agree on, and the
    # error flags (so a NaN router weight on one rank raises on all).
    exchange(ws.group, ws.device, "forward", _call_values(cfg, ws, x, fc1, shared_fc1, fp8_weights), error,
             errors=ws.errors, timeout_s=ws.peer_timeout_s)
    ws.check_errors(blocking=True)
    out, ctx = reference.forward(ws, sched, x, probs, fc1, fc2, shared_fc1, shared_fc2, cfg.precision,
                                 cfg.shared_precision)
    return out, _tag_context(ctx, sched)


def recompute_forward_context(cfg: MoKConfig, ws: MoKWorkspace, sched: MoKSchedule, x, fc1, fc2,
                              shared_fc1=None, fp8_weights: fp8.FP8ExpertWeights | None = None):
    """Rebuild the forward context (activation checkpointing): dispatch up to the expert outputs."""
    def checks() -> bool:
        _check_cfg(cfg)
        check_schedule(ws, sched, "recompute_forward_context", latest=False)
        _check_tensor("x", x, (ws.num_tokens, ws.hidden), _FLOAT_DTYPES, ws.device)
        _check_fp8(cfg, ws, fc1, fc2, fp8_weights)
        return _route(cfg, ws, x, fc1, shared_fc1, "recompute_forward_context")

    error, use_kernels = _verdict(x, ws, "recompute_forward_context", checks, cfg)
    if use_kernels:
        _symmetric_buffers(cfg, ws, "recompute_forward_context")
        ctx = _cuda().recompute_forward_context(cfg, ws, sched, x, fc1, fc2, shared_fc1,
                                                       fp8_weights=fp8_weights)
        return _tag_context(ctx, sched)
    exchange(ws.group, ws.device, "recompute", _call_values(cfg, ws, x, fc1, shared_fc1, fp8_weights), error,
             timeout_s=ws.peer_timeout_s)
    ctx = reference.recompute_forward_context(ws, sched, x, fc1, fc2, shared_fc1, cfg.precision,
                                              cfg.shared_precision)
    return _tag_context(ctx, sched)


def backward(cfg: MoKConfig, ws: MoKWorkspace, sched: MoKSchedule, ctx, grad_out, x, probs, fc1, fc2,
             shared_fc1=None, shared_fc2=None, main_grads=None,
             fp8_weights: fp8.FP8ExpertWeights | None = None, hold_wgrads: bool = False) -> MoKGrads:
    """Gradients of one MoE layer.

    ``sched`` must be the schedule the forward that made ``ctx`` ran (ctx None: recomputed here).
    ``main_grads``: optional fp32 tensors ``(fc1, fc2, shared_fc1, shared_fc2)`` (entries may be
    None) that the weight gradients are accumulated into (Megatron's gradient-accumulation
    fusion); the matching fields of the result are then None. ``fp8_weights``: with
    ``cfg.dgrad_precision == "fp8"``, ``quantize_expert_weights(fc1, fc2, transposed=True)`` of these
    weights (else the dgrads' e4m3 copies are made in this call). ``hold_wgrads``: more backwards on
    these main grads follow in this step, so with ``cfg.wgrad_microbatches`` > 1 the routed weight
    gradients may wait and be added with theirs (kernel path, fused fp32 main grads, bf16 weight
    gradients; ``flush_wgrads`` adds what waits). The reference path adds every call's at once.
    """
    def checks() -> bool:
        _check_cfg(cfg)
        check_schedule(ws, sched, "backward", latest=False)
        _check_context(ctx, sched, "backward")
        check_inputs(ws, x, probs, fc1, fc2, shared_fc1, shared_fc2)
        _check_tensor("grad_out", grad_out, (ws.num_tokens, ws.hidden), (x.dtype,), ws.device)
        _check_fp8(cfg, ws, fc1, fc2, fp8_weights)
        return _route(cfg, ws, x, fc1, shared_fc1, "backward") and not isinstance(ctx, reference.ReferenceContext)

    error, use_kernels = _verdict(x, ws, "backward", checks, cfg)
    if use_kernels:
        # all of them before the recompute's (ctx None) or the regather's first barrier
        _symmetric_buffers(cfg, ws, "backward")
        return _cuda().backward(cfg, ws, sched, ctx, grad_out, x, probs, fc1, fc2,
                                       shared_fc1, shared_fc2, main_grads, fp8_weights=fp8_weights,
                                       hold_wgrads=bool(hold_wgrads))
    given = "reference" if isinstance(ctx, reference.ReferenceContext) else "none (recomputed)"
    exchange(ws.group, ws.device, "backward",
             _call_values(cfg, ws, x, fc1, shared_fc1, fp8_weights, Agreed("forward context", "str", given)),
             error, timeout_s=ws.peer_timeout_s)
    if not isinstance(ctx, reference.ReferenceContext):
        ctx = reference.recompute_forward_context(ws, sched, x, fc1, fc2, shared_fc1, cfg.precision,
                                                  cfg.shared_precision)
    dx, dprobs, *wgrads = reference.backward(ws, sched, ctx, grad_out, x, probs, fc1, fc2, shared_fc1, shared_fc2,
                                             dgrad_precision=cfg.dgrad_precision,
                                             wgrad_precision=cfg.wgrad_precision)
    return MoKGrads(dx.to(x.dtype), dprobs, *accumulate(wgrads, main_grads))


def held_wgrads(main_grads=None) -> int:
    """How many layers' routed weight gradients wait for a later backward (``hold_wgrads``); with a
    layer's ``main_grads``, 1 if its do, else 0."""
    if not _kernels_on(torch.device("cuda")):
        return 0
    if main_grads is not None and (main_grads[0] is None or main_grads[1] is None):
        return 0
    return _cuda().wgrad_groups.held(*(main_grads[:2] if main_grads is not None else ()))


def flush_wgrads() -> int:
    """Add every waiting routed weight gradient into its main grad now; returns how many layers'."""
    if not _kernels_on(torch.device("cuda")):
        return 0
    return _cuda().wgrad_groups.flush()
