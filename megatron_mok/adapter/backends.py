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

from ..config import MoKConfig, MoKConfigError

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
    group.add_argument("--mok-fwd-comm-sms", type=int, default=defaults.fwd_comm_sms,
                       help="SMs the forward kernel gives to token movement")
    group.add_argument("--mok-bwd-comm-sms", type=int, default=defaults.bwd_comm_sms,
                       help="SMs (4 CTAs each) of the staged backward's pull, push and row-gather "
                            "kernels; with MOK_BWD_KERNEL=mega, the CTAs that pull before they compute")
    group.add_argument("--mok-minibatch-rows", type=int, default=defaults.minibatch_rows,
                       help="routed rows per communication/compute overlap step")
    group.add_argument("--mok-capacity-factor", type=float, default=defaults.capacity_factor,
                       help="fraction of the worst case the routed buffer holds (1.0 never overflows)")
    group.add_argument("--mok-peer-timeout-s", type=float, default=defaults.peer_timeout_s,
                       help="seconds a device-side wait on a peer may take before it errors")
    group.add_argument("--mok-precision", choices=("bf16", "fp8"), default=defaults.precision,
                       help="fp8: the routed experts' forward GEMMs, backward dgrads and weight gradients "
                            "and the shared expert's forward GEMMs on block-scaled e4m3 operands (weights "
                            "quantized once per optimizer step); the rest of the layer bf16")
    group.add_argument("--mok-bf16-dgrad", action="store_true",
                       help="with --mok-precision fp8: keep the backward's routed dgrads in bf16")
    group.add_argument("--mok-bf16-wgrad", action="store_true",
                       help="with --mok-precision fp8: keep the routed experts' weight gradients in bf16")
    group.add_argument("--mok-bf16-shared", action="store_true",
                       help="with --mok-precision fp8: keep the shared expert's forward GEMMs in bf16")
    group.add_argument("--mok-recompute-gate-up", action="store_true",
                       help="do not keep the gate/up GEMM outputs for the backward; recompute them "
                            "(less activation memory, one GEMM more, same bits)")
    return parser


_ARG_TO_FIELD = {
    "mok_fwd_comm_sms": "fwd_comm_sms",
    "mok_bwd_comm_sms": "bwd_comm_sms",
    "mok_minibatch_rows": "minibatch_rows",
    "mok_capacity_factor": "capacity_factor",
    "mok_peer_timeout_s": "peer_timeout_s",
    "mok_precision": "precision",
}


def mok_config_from_args(args) -> MoKConfig:
    values = {field: getattr(args, arg) for arg, field in _ARG_TO_FIELD.items() if hasattr(args, arg)}
    if getattr(args, "mok_recompute_gate_up", False):
        values["save_gate_up"] = False
    for flag, field, what in (("dgrad", "fp8_dgrad", "the dgrads are"), ("wgrad", "fp8_wgrad", "the weight gradients are"),
                              ("shared", "fp8_shared", "the shared expert is")):
        if getattr(args, f"mok_bf16_{flag}", False):
            if values.get("precision") != "fp8":
                raise MoKConfigError(f"--mok-bf16-{flag}: {what} bf16 already; it only applies with "
                                     "--mok-precision fp8")
            values[field] = False
    if getattr(args, "fp8", None):
        raise MoKConfigError(f"--fp8-format {args.fp8}: Megatron's fp8 recipe (TransformerEngine) does not "
                             "cover --moe-backend mok's experts; use --mok-precision fp8 for mok's block-scaled "
                             "e4m3 expert GEMMs, or choose --moe-backend alltoall")
    try:
        return MoKConfig(**values)
    except MoKConfigError as err:
        flag = next((f"--{a.replace('_', '-')}" for a, f in _ARG_TO_FIELD.items() if f"MoKConfig.{f} " in str(err)), None)
        raise MoKConfigError(f"{flag}: {err}" if flag else str(err)) from None


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
    set_backend(backend)
    if backend is None:
        return
    if not getattr(args, "num_experts", None):
        raise ValueError(f"--moe-backend {backend} needs an MoE model: pass --num-experts")
    if backend == "mok":
        from .layer import set_mok_config

        cfg = mok_config_from_args(args)
        set_mok_config(cfg)
        if cfg.precision == "fp8":
            from .. import fp8

            fp8.WEIGHT_CACHE.register_optimizer_hook()  # the e4m3 weights follow every step
        args.moe_token_dispatcher_type = "alltoall"
    elif backend in ("alltoall", "allgather"):
        args.moe_token_dispatcher_type = backend
    elif backend == "hybridep":
        _require_deep_ep("HybridEPBuffer", backend)
        args.moe_token_dispatcher_type = "flex"
        args.moe_flex_dispatcher_backend = "hybridep"
    elif backend == "deepep":
        _require_deep_ep("Buffer", backend)
        args.moe_token_dispatcher_type = "flex"
        args.moe_flex_dispatcher_backend = "deepep"


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
