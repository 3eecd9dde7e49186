"""Megatron-Core adapter: ``--moe-backend``, ``MoKMoELayer``, grouped experts, CPU mode, entry points.

``install()`` makes a Megatron process mok-aware: the argument parser learns ``--moe-backend`` and
the ``--mok-*`` knobs, the MoE spec factory builds the chosen backend, and, on a machine without a
GPU, the CPU compatibility layer is activated. It is idempotent.
"""

from __future__ import annotations

import functools

from .backends import BACKENDS, BackendUnavailableError, add_mok_args, apply_backend, get_backend, set_backend

_INSTALLED = False


def _wrap_parse_args(original):
    @functools.wraps(original)
    def parse_args(extra_args_provider=None, ignore_unknown_args=False):
        def provider(parser):
            if extra_args_provider is not None:
                parser = extra_args_provider(parser)
            return add_mok_args(parser)

        args = original(provider, ignore_unknown_args)
        apply_backend(args)
        from . import cpu_compat

        if cpu_compat.is_active():
            cpu_compat.adjust_args(args)
        return args

    parse_args.__wrapped_by_mok__ = True
    return parse_args


def install() -> None:
    global _INSTALLED
    if _INSTALLED:
        return
    from megatron.training import arguments

    from . import cpu_compat, megatron_compat
    from .backends import install_spec_hook
    from .steps import install_step_hooks

    cpu_compat.activate_if_no_gpu()
    install_spec_hook()
    install_step_hooks()
    megatron_compat.apply()
    if not getattr(arguments.parse_args, "__wrapped_by_mok__", False):
        arguments.parse_args = _wrap_parse_args(arguments.parse_args)
    _INSTALLED = True


__all__ = [
    "BACKENDS", "BackendUnavailableError", "add_mok_args", "apply_backend", "get_backend", "install", "set_backend",
]
