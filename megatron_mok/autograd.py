"""Autograd wrapper: ``mok_moe`` runs schedule + forward, and backward through ``torch.autograd``."""

from __future__ import annotations

import torch
import torch.distributed as dist

from . import fp8, functional
from . import workspace as workspaces
from .config import MoKConfig
from .header import tag, verdict_dtype
from .workspace import MoKInputError, exchange, get_workspace, shape_values


class _MoKMoE(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, probs, fc1, fc2, shared_fc1, shared_fc2, cfg, ws, sched, main_grads, hold_wgrads):
        fp8_weights = None
        if cfg.precision == "fp8":  # quantized once per weight version (fp8.WeightCache)
            # the dgrads' transposed copies only when a backward can follow; the shared expert's
            # weights when its forward runs in e4m3
            shared = (shared_fc1, shared_fc2) if cfg.shared_precision == "fp8" and shared_fc1 is not None else (None, None)
            fp8_weights = fp8.WEIGHT_CACHE.get(fc1, fc2, functional.quantize_expert_weights,
                                               transposed=cfg.dgrad_precision == "fp8" and any(ctx.needs_input_grad),
                                               shared_fc1=shared[0], shared_fc2=shared[1])
        out, fwd_ctx = functional.forward(cfg, ws, sched, x, probs, fc1, fc2, shared_fc1, shared_fc2,
                                          fp8_weights=fp8_weights)
        ctx.cfg, ctx.ws, ctx.sched, ctx.fwd_ctx, ctx.main_grads = cfg, ws, sched, fwd_ctx, main_grads
        ctx.hold_wgrads = hold_wgrads
        ctx.fp8_weights = fp8_weights
        ctx.save_for_backward(x, probs, fc1, fc2, shared_fc1, shared_fc2)
        return out

    @staticmethod
    def backward(ctx, grad_out):
        x, probs, fc1, fc2, shared_fc1, shared_fc2 = ctx.saved_tensors
        grads = functional.backward(
            ctx.cfg, ctx.ws, ctx.sched, ctx.fwd_ctx, grad_out.contiguous(), x, probs, fc1, fc2,
            shared_fc1, shared_fc2, main_grads=ctx.main_grads, fp8_weights=ctx.fp8_weights,
            hold_wgrads=ctx.hold_wgrads() if callable(ctx.hold_wgrads) else bool(ctx.hold_wgrads),
        )
        ctx.fwd_ctx = ctx.fp8_weights = None
        mains = ctx.main_grads or (None,) * 4

        def wgrad(g, w, main):
            if w is None:
                return None
            if g is None and main is not None:  # accumulated into main_grad
                if hasattr(w, "grad_added_to_main_grad"):
                    # Megatron's DDP hook wants a grad tensor and skips adding it once this flag is
                    # set; an uninitialized dummy, as Megatron's own fused-wgrad linear layers return.
                    w.grad_added_to_main_grad = True
                    return torch.empty_like(w)
                return None
            return None if g is None else g.to(w.dtype)

        return (
            grads.dx, grads.dprobs, wgrad(grads.dfc1, fc1, mains[0]), wgrad(grads.dfc2, fc2, mains[1]),
            wgrad(grads.dshared_fc1, shared_fc1, mains[2]), wgrad(grads.dshared_fc2, shared_fc2, mains[3]),
            None, None, None, None, None,
        )


def mok_moe(x, top_experts, probs, fc1, fc2, shared_fc1=None, shared_fc2=None, *,
            cfg: MoKConfig | None = None, group: dist.ProcessGroup | None = None,
            num_experts: int | None = None, main_grads=None, hold_wgrads=False):
    """Differentiable MoE layer: ``out[t] = shared(x[t]) + sum_s probs[t, s] * expert_{top[t, s]}(x[t])``.

    x [T, H]; top_experts int [T, k] global expert ids; probs fp32 [T, k]; fc1 [nle, 2I, H];
    fc2 [nle, H, I]; shared weights optional. ``group`` is the expert-parallel group (None: the
    default group when torch.distributed is initialized, else a single rank).
    ``cfg.precision == "fp8"``: the routed weights' e4m3 copies come from ``fp8.WEIGHT_CACHE``;
    a weight changed through ``.data`` needs ``fp8.WEIGHT_CACHE.clear()`` (optimizer steps clear it
    once ``fp8.WEIGHT_CACHE.register_optimizer_hook()`` ran; the Megatron adapter does that).
    ``hold_wgrads``: a bool, or a callable the backward asks (``functional.backward``'s argument).
    """
    cfg = MoKConfig() if cfg is None else cfg
    try:
        _check_call(x, top_experts, probs, fc1, fc2, shared_fc1, shared_fc2, cfg)
    except MoKInputError as error:
        _share_verdict(error, group, cfg, x, top_experts, probs, fc1, num_experts)
        raise
    ep = dist.get_world_size(group) if dist.is_initialized() else 1
    if num_experts is None:
        num_experts = fc1.shape[0] * ep
    ws = get_workspace(group, x.device, x.shape[0], x.shape[1], top_experts.shape[1], num_experts, cfg, x.dtype)
    sched = functional.build_schedule(cfg, ws, top_experts)
    return _MoKMoE.apply(x, probs, fc1, fc2, shared_fc1, shared_fc2, cfg, ws, sched, main_grads, hold_wgrads)


def _share_verdict(error: MoKInputError, group, cfg, x, top_experts, probs, fc1, num_experts) -> None:
    """This rank's arguments failed ``_check_call``: tell the peers, which passed theirs, in this
    call's first collective, where they are now, so every rank raises and none waits for this one.
    With the workspace they use already made, on the kernel path: the schedule's first device
    barrier (``functional._reject``, as a rejected ``build_schedule``). Else a host collective
    (``exchange``, which raises the agreed error): workspace creation, or the reference schedule's
    agreement. Returns where it cannot tell which workspace's barrier the peers wait in."""
    known = _peer_workspaces(group, error, x, top_experts, probs, fc1, num_experts, cfg)
    kernels = bool(known) and functional._kernel_side(top_experts, known[0])
    if kernels and len(known) == 1:
        functional._reject(known[0], "build_schedule", error, cfg)
        return
    if kernels:  # sending the verdict into the wrong workspace's barrier would put its epochs out of step
        error.add_note(f"megatron_mok: {len(known)} workspaces fit what this rank's arguments still tell, so its "
                       "verdict could not be sent; the peers time out (MoKConfig.peer_timeout_s)")
        return
    exchange(group, _exchange_home(x, fc1), "mok_moe", shape_values(None, None, None, None, None, cfg),
             error, timeout_s=cfg.peer_timeout_s if isinstance(cfg, MoKConfig) else None)


_ANY = object()  # a workspace key field this rank cannot read from its arguments: matches any value


def _peer_workspaces(group, error: MoKInputError, x, top_experts, probs, fc1, num_experts, cfg) -> list:
    """The cached workspaces that the peers' ``get_workspace`` may return for this call: those whose
    key agrees with every value this rank can still read from its arguments, the argument its
    check blamed excepted (the peers read T, H, the device and dtype from x, k from top_experts)."""
    blamed = getattr(error, "mok_verdict", ("an input",))[0]

    def ok(name, t, dims=None) -> bool:
        return name != blamed and isinstance(t, torch.Tensor) and (dims is None or t.dim() == dims)

    def first(*values):
        return next((v for v in values if v is not None), _ANY)

    ep = dist.get_world_size(group) if dist.is_initialized() else 1
    tokens = [t.shape[0] for name, t in (("x", x), ("top_experts", top_experts), ("probs", probs))
              if ok(name, t, 2) and t.shape[0] > 0]
    device = first(x.device if ok("x", x) else None, fc1.device if ok("fc1", fc1) else None)
    if num_experts is None:
        num_experts = fc1.shape[0] * ep if ok("fc1", fc1, 3) else _ANY
    want = (workspaces._group_key(group), _ANY if device is _ANY else str(device), first(*tokens),
            first(x.shape[1] if ok("x", x, 2) else None, fc1.shape[2] if ok("fc1", fc1, 3) else None),
            first(top_experts.shape[1] if ok("top_experts", top_experts, 2) else None,
                  probs.shape[1] if ok("probs", probs, 2) else None),
            num_experts, cfg.capacity_factor if isinstance(cfg, MoKConfig) else _ANY,
            first(x.dtype if ok("x", x) else None, fc1.dtype if ok("fc1", fc1) else None))
    return [ws for key, ws in workspaces._CACHE.items() if all(w is _ANY or w == v for w, v in zip(want, key))]


def _exchange_home(x, fc1) -> torch.device:
    for t in (fc1, x):
        if isinstance(t, torch.Tensor) and t.device.type in ("cpu", "cuda"):
            return t.device
    return torch.device("cpu")


def _check_call(x, top_experts, probs, fc1, fc2, shared_fc1, shared_fc2, cfg) -> None:
    """Checks that name the argument at fault before the workspace (sized from x) exists: the
    weights are the reference for the hidden size and the device. Each error carries its verdict
    tag (header.tag: the argument, the kind of check)."""
    if not isinstance(cfg, MoKConfig):
        raise tag(MoKInputError(f"cfg must be a MoKConfig, got {type(cfg).__name__}"), "cfg", "type")
    if not isinstance(fc1, torch.Tensor) or fc1.dim() != 3:
        raise tag(MoKInputError(f"fc1 must be a [num_local_experts, 2*I, H] tensor, got "
                                f"{getattr(fc1, 'shape', fc1)}"), "fc1", "type")
    if not isinstance(x, torch.Tensor) or x.dim() != 2:
        err = MoKInputError(f"x must be a [T, H] tensor, got {getattr(x, 'shape', type(x))}")
        raise tag(err, "x", "shape", 3, x.dim()) if isinstance(x, torch.Tensor) else tag(err, "x", "type")
    if x.dtype not in (torch.bfloat16, torch.float16, torch.float32, torch.float64):
        raise tag(MoKInputError(f"x must be a bf16, fp16, fp32 or fp64 tensor, got {x.dtype}"), "x", "dtype", 0,
                  verdict_dtype(x.dtype))
    weights_agree = not (isinstance(fc2, torch.Tensor) and fc2.dim() == 3 and fc2.shape[1] != fc1.shape[2])
    if x.shape[1] != fc1.shape[2] and weights_agree:  # else fc1 is the odd one out: the shape checks name it
        raise tag(MoKInputError(f"x has hidden size {x.shape[1]} (x: {list(x.shape)}), but the expert weights have "
                                f"{fc1.shape[2]} (fc1: {list(fc1.shape)}): x must be [T, {fc1.shape[2]}]"),
                  "x", "shape", 1, x.shape[1])
    if x.device != fc1.device:
        raise tag(MoKInputError(f"x is on {x.device}, but the expert weights (fc1) are on {fc1.device}: "
                                "move x to the weights' device"), "x", "device")
    if x.shape[0] == 0:
        raise tag(MoKInputError(f"x has no tokens (T=0, x: {list(x.shape)}); every rank of the EP group needs "
                                "T > 0 tokens and the same T"), "x", "shape", 0, 0)
    if not isinstance(top_experts, torch.Tensor) or top_experts.dim() != 2:
        err = MoKInputError(f"top_experts must be a [T, k] tensor, got "
                            f"{getattr(top_experts, 'shape', type(top_experts))}")
        raise tag(err, "top_experts", "shape", 3, top_experts.dim()) if isinstance(top_experts, torch.Tensor) else \
            tag(err, "top_experts", "type")
    if top_experts.shape[0] != x.shape[0]:
        raise tag(MoKInputError(f"top_experts has {top_experts.shape[0]} rows but x has {x.shape[0]} tokens"),
                  "top_experts", "shape", 0, top_experts.shape[0])
    for name, t in (("top_experts", top_experts), ("probs", probs), ("fc2", fc2), ("shared_fc1", shared_fc1),
                    ("shared_fc2", shared_fc2)):
        if isinstance(t, torch.Tensor) and t.device != fc1.device:
            raise tag(MoKInputError(f"{name} is on {t.device}, but x and the expert weights are on {fc1.device}"),
                      name, "device")
