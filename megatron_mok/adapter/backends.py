"""``--moe-backend``: the command-line flag, its mapping onto Megatron settings, and the spec hook.

Megatron has no plugin registry for token dispatchers, so the plugin:

* adds ``--moe-backend`` and the ``--mok-*`` knobs through ``extra_args_provider``;
* maps the choice onto Megatron's own fields before Megatron validates them
  (``mok`` keeps ``moe_token_dispatcher_type="alltoall"``, a legal value, so every check of
  Megatron's that branches on the dispatcher type stays permissive);
* wraps ``get_moe_module_spec_for_backend`` (the one factory that builds every MoE layer, MTP
  layers included) so that ``mok`` builds ``MoKMoELayer`` with ``GroupedMLP`` experts, and the
  comparison backends use ``GroupedMLP`` (``torch._grouped_mm``) instead of Megatron's
  per-expert ``SequentialMLP`` loop when TransformerEngine's grouped experts are not in use.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import importlib
import warnings

from ..config import FORWARD_KERNELS, WGRAD_ACCUMULATIONS, MoKConfig, MoKConfigError

BACKENDS = ("mok", "alltoall", "allgather", "hybridep", "deepep")

_BACKEND: str | None = None  # the active --moe-backend (None: leave Megatron's settings alone)


class BackendUnavailableError(RuntimeError):
    """The chosen --moe-backend needs a package that is not installed."""


def set_backend(name: str | None) -> None:
    if name is not None and name not in BACKENDS:
        raise ValueError(f"unknown MoE backend {name!r}; choose one of {', '.join(BACKENDS)}")
    global _BACKEND
    _BACKEND = name


def get_backend() -> str | None:
    return _BACKEND


def add_mok_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    defaults = MoKConfig()
    group = parser.add_argument_group("megatron-mok")
    group.add_argument(
        "--moe-backend", choices=BACKENDS, default=None,
        help="MoE dispatch + experts implementation: mok (fused, deterministic), or Megatron's "
             "alltoall / allgather dispatchers, or flex with hybridep / deepep (needs deep_ep).",
    )
    # The layer knobs default to None so that a flag given with another backend can be told apart
    # from its default (it is validated anyway, and warned about once: it has no effect there).
    group.add_argument("--mok-fwd-comm-sms", type=int, default=None,
                       help=f"SMs the forward kernel gives to token movement (default {defaults.fwd_comm_sms})")
    group.add_argument("--mok-bwd-comm-sms", type=int, default=None,
                       help="SMs (4 CTAs each) of the backward's pull, push and row-gather kernels "
                            f"(default {defaults.bwd_comm_sms})")
    group.add_argument("--mok-minibatch-rows", type=int, default=None,
                       help=f"routed rows per communication/compute overlap step (default {defaults.minibatch_rows})")
    group.add_argument("--mok-capacity-factor", type=float, default=None,
                       help="fraction of the worst case the routed buffer holds (1.0, the default, never overflows)")
    group.add_argument("--mok-peer-timeout-s", type=float, default=None,
                       help="seconds a wait on a peer rank may take before it raises MoKPeerTimeoutError naming "
                            f"that rank (default {defaults.peer_timeout_s:g})")
    group.add_argument("--mok-precision", choices=("bf16", "fp8"), default=None,
                       help="fp8: the routed experts' forward GEMMs, backward dgrads and weight gradients "
                            "and the shared expert's forward GEMMs on block-scaled e4m3 operands (weights "
                            "quantized once per optimizer step); the rest of the layer bf16 (default bf16)")
    group.add_argument("--mok-forward-kernel", choices=FORWARD_KERNELS, default=None,
                       help="persistent: the forward as one persistent megakernel (bf16 only); staged: one "
                            "launch per stage; auto (default): persistent for bf16, staged for fp8. Same bits")
    group.add_argument("--mok-wgrad-accumulation", choices=WGRAD_ACCUMULATIONS, default=None,
                       help="fused: the experts' weight-gradient GEMMs add into Megatron's fp32 main_grad "
                            "themselves (needs neither apex nor TransformerEngine); unfused: Megatron's DDP hook "
                            "adds their bf16 gradients; auto (default): fused exactly with "
                            "--gradient-accumulation-fusion")
    group.add_argument("--mok-wgrad-microbatches", type=int, default=None, metavar="N",
                       help="with fused weight-gradient accumulation: the routed experts' weight gradients of up "
                            "to N consecutive micro-batches of a step run as one GEMM pass that adds their fp32 "
                            "sum into main_grad (main_grad read and written once per N; the waiting operands "
                            f"take memory; changes main_grad's rounding; default {defaults.wgrad_microbatches})")
    group.add_argument("--mok-bf16-dgrad", action="store_true",
                       help="with --mok-precision fp8: keep the backward's routed dgrads in bf16")
    group.add_argument("--mok-bf16-wgrad", action="store_true",
                       help="with --mok-precision fp8: keep the routed experts' weight gradients in bf16")
    group.add_argument("--mok-bf16-shared", action="store_true",
                       help="with --mok-precision fp8: keep the shared expert's forward GEMMs in bf16")
    group.add_argument("--mok-recompute-gate-up", action="store_true",
                       help="do not keep the gate/up GEMM outputs for the backward; recompute them "
                            "(less activation memory, one GEMM more, same bits)")
    group.add_argument("--mok-strict", action="store_true",
                       help="raise instead of warning once when a layer call would run the slow pure-PyTorch "
                            "reference on CUDA (fp16/fp32 activations, sizes the kernels do not take)")
    group.add_argument("--mok-param-digest-every", type=int, default=0, metavar="N",
                       help="megatron_mok.pretrain_gpt: every N iterations (and at the last) each rank prints a "
                            "digest of its parameters' bits, to check that two runs train bitwise alike (syncs "
                            "the host; 0, the default: off). Works with every --moe-backend")
    return parser


_ARG_TO_FIELD = {
    "mok_fwd_comm_sms": "fwd_comm_sms",
    "mok_bwd_comm_sms": "bwd_comm_sms",
    "mok_minibatch_rows": "minibatch_rows",
    "mok_capacity_factor": "capacity_factor",
    "mok_peer_timeout_s": "peer_timeout_s",
    "mok_precision": "precision",
    "mok_forward_kernel": "forward_kernel",
    "mok_wgrad_accumulation": "wgrad_accumulation",
    "mok_wgrad_microbatches": "wgrad_microbatches",
}
# Switches of the mok layer (store_true flags) and the MoKConfig field each one sets.
_SWITCHES = ("mok_bf16_dgrad", "mok_bf16_wgrad", "mok_bf16_shared", "mok_recompute_gate_up", "mok_strict")


def _flag(arg: str) -> str:
    return f"--{arg.replace('_', '-')}"


def given_layer_flags(args) -> list[str]:
    """The --mok-* layer flags the command line set (entry-point flags such as
    --mok-param-digest-every, which work with every backend, are not layer flags)."""
    given = [_flag(a) for a in _ARG_TO_FIELD if getattr(args, a, None) is not None]
    return given + [_flag(a) for a in _SWITCHES if getattr(args, a, False)]


def mok_config_from_args(args) -> MoKConfig:
    """The MoKConfig of the --mok-* flags; an invalid value raises MoKConfigError naming the flag."""
    values = {field: getattr(args, arg) for arg, field in _ARG_TO_FIELD.items() if getattr(args, arg, None) is not None}
    if getattr(args, "mok_recompute_gate_up", False):
        values["save_gate_up"] = False
    if getattr(args, "mok_strict", False):
        values["strict"] = True
    for flag, field, what in (("dgrad", "fp8_dgrad", "the dgrads are"), ("wgrad", "fp8_wgrad", "the weight gradients are"),
                              ("shared", "fp8_shared", "the shared expert is")):
        if getattr(args, f"mok_bf16_{flag}", False):
            if values.get("precision") != "fp8":
                raise MoKConfigError(f"--mok-bf16-{flag}: {what} bf16 already; it only applies with "
                                     "--mok-precision fp8")
            values[field] = False
    try:
        return MoKConfig(**values)
    except MoKConfigError as err:
        flag = next((_flag(a) for a, f in _ARG_TO_FIELD.items() if f"MoKConfig.{f}" in str(err)), None)
        raise MoKConfigError(f"{flag}: {err}" if flag else str(err)) from None


_WARNED_UNUSED = False


def check_mok_args(args) -> MoKConfig:
    """Validate the --mok-* flags whatever --moe-backend is (an invalid value raises, naming the
    flag). With another backend (or none) the layer flags have no effect: one warning lists them.

    A warning, not an error: one argument file serves every backend (configs/*.args carry
    --mok-capacity-factor, and scripts/compare_backends.py runs each backend from the same file), as
    Megatron's own configs carry settings of features a run does not use."""
    global _WARNED_UNUSED
    cfg = mok_config_from_args(args)
    every = getattr(args, "mok_param_digest_every", 0)
    if every is None or isinstance(every, bool) or not isinstance(every, int) or every < 0:
        raise MoKConfigError(f"--mok-param-digest-every must be an int >= 0, got {every!r}")
    backend = getattr(args, "moe_backend", None)
    given = given_layer_flags(args)
    if backend != "mok" and given and not _WARNED_UNUSED:
        _WARNED_UNUSED = True
        now = f"--moe-backend {backend}" if backend else "no --moe-backend"
        warnings.warn(f"megatron_mok: {', '.join(given)} only apply to --moe-backend mok; with {now} they have no "
                      "effect (their values are valid)", UserWarning, stacklevel=2)
    return cfg


def _require_deep_ep(symbol: str, backend: str) -> None:
    try:
        module = importlib.import_module("deep_ep")
    except ImportError as err:
        raise BackendUnavailableError(
            f"--moe-backend {backend} needs the deep_ep package (DeepEP{' with HybridEP' if backend == 'hybridep' else ''}), "
            f"which is not installed ({err}). Install DeepEP from github.com/deepseek-ai/DeepEP "
            "or choose --moe-backend mok / alltoall."
        ) from None
    if not hasattr(module, symbol):
        raise BackendUnavailableError(
            f"--moe-backend {backend} needs deep_ep.{symbol}, which this deep_ep build lacks"
        )


def apply_backend(args) -> None:
    """Map ``args.moe_backend`` onto Megatron's own fields (call before ``validate_args``)."""
    backend = getattr(args, "moe_backend", None)
    cfg = check_mok_args(args)  # whatever the backend
    set_backend(backend)
    if backend is None:
        return
    if not getattr(args, "num_experts", None):
        raise ValueError(f"--moe-backend {backend} needs an MoE model: pass --num-experts")
    if backend == "mok":
        from .layer import set_mok_config

        if getattr(args, "fp8", None):
            raise MoKConfigError(f"--fp8-format {args.fp8}: Megatron's fp8 recipe (TransformerEngine) does not "
                                 "cover --moe-backend mok's experts; use --mok-precision fp8 for mok's block-scaled "
                                 "e4m3 expert GEMMs, or choose --moe-backend alltoall")
        set_mok_config(cfg)
        if cfg.precision == "fp8":
            from .. import fp8

            fp8.WEIGHT_CACHE.register_optimizer_hook()  # the e4m3 weights follow every step
        args.moe_token_dispatcher_type = "alltoall"
    elif backend in ("alltoall", "allgather"):
        _check_graph_capturable(args, backend)
        args.moe_token_dispatcher_type = backend
    elif backend == "hybridep":
        _require_deep_ep("HybridEPBuffer", backend)
        args.moe_token_dispatcher_type = "flex"
        args.moe_flex_dispatcher_backend = "hybridep"
    elif backend == "deepep":
        _require_deep_ep("Buffer", backend)
        args.moe_token_dispatcher_type = "flex"
        args.moe_flex_dispatcher_backend = "deepep"


def _check_graph_capturable(args, backend: str) -> None:
    """Megatron's alltoall and allgather dispatchers copy token counts to the host in every layer
    unless they drop and pad to a fixed capacity; a full-iteration CUDA graph cannot capture that (the
    dropless capture failed with cudaErrorCapturedEvent at the dispatcher's stream synchronize).
    Said at start-up, not after the warm-up steps."""
    drop_and_pad = getattr(args, "moe_expert_capacity_factor", None) is not None and \
        getattr(args, "moe_pad_expert_input_to_capacity", False)
    if getattr(args, "cuda_graph_impl", None) == "full_iteration" and not drop_and_pad:
        raise ValueError(
            f"--cuda-graph-impl full_iteration cannot capture --moe-backend {backend}: unless it drops and pads, "
            "its dispatcher copies the token counts to the host in every layer. Use --moe-backend mok (no host "
            "syncs), or Megatron's drop-and-pad (--moe-expert-capacity-factor with "
            "--moe-pad-expert-input-to-capacity)")


def _uses_te_grouped_experts(experts_builder) -> bool:
    target = getattr(experts_builder, "func", experts_builder)
    return getattr(target, "__name__", "") == "TEGroupedMLP"


def _wrap_spec_factory(original):
    @functools.wraps(original)
    def get_moe_module_spec_for_backend(*args, **kwargs):
        spec = original(*args, **kwargs)
        backend = get_backend()
        if backend is None:
            return spec
        from .experts import GroupedMLP
        from .layer import MoKMoELayer

        submodules = spec.keywords["submodules"]
        if backend == "mok":
            return functools.partial(MoKMoELayer, submodules=dataclasses.replace(submodules, experts=GroupedMLP))
        if backend in ("alltoall", "allgather") and not _uses_te_grouped_experts(submodules.experts):
            return functools.partial(spec.func, submodules=dataclasses.replace(submodules, experts=GroupedMLP))
        return spec

    get_moe_module_spec_for_backend.__wrapped_by_mok__ = True
    return get_moe_module_spec_for_backend


def install_spec_hook() -> None:
    """Wrap the MoE spec factory where Megatron looks it up (idempotent)."""
    from megatron.core.models.gpt import gpt_layer_specs, moe_module_specs

    for module in (gpt_layer_specs, moe_module_specs):
        current = module.get_moe_module_spec_for_backend
        if not getattr(current, "__wrapped_by_mok__", False):
            module.get_moe_module_spec_for_backend = _wrap_spec_factory(current)
