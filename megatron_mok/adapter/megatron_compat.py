"""Fixes for gaps of the megatron-core 0.19 wheel that the shipped configs run into on any machine.

* The wheel ships the dataset helpers prebuilt (``helpers_cpp``) but no Makefile, so Megatron's
  start-up ``make`` fails: skip it when the compiled module imports.
* Multi-latent attention passes ``k_channels`` / ``v_channels`` to its core attention, which
  Megatron's local ``DotProductAttention`` (the only core attention without TransformerEngine)
  does not accept: accept them, and size its output by ``v_channels``.
"""

from __future__ import annotations

import functools


def _mark(fn):
    fn.__wrapped_by_mok__ = True
    return fn


def use_prebuilt_dataset_helpers() -> None:
    from megatron.core.datasets import utils

    original = utils.compile_helpers
    if getattr(original, "__wrapped_by_mok__", False):
        return

    @_mark
    @functools.wraps(original)
    def compile_helpers():
        try:
            from megatron.core.datasets import helpers_cpp  # noqa: F401
        except ImportError:
            original()

    utils.compile_helpers = compile_helpers


def local_attention_accepts_mla() -> None:
    from megatron.core.transformer.dot_product_attention import DotProductAttention

    original = DotProductAttention.__init__
    if getattr(original, "__wrapped_by_mok__", False):
        return

    @_mark
    @functools.wraps(original)
    def __init__(self, *args, k_channels=None, v_channels=None, **kwargs):
        original(self, *args, **kwargs)
        if v_channels is not None:
            # The context is [sq, b, heads * v_channels]; queries and keys carry their own size.
            self.hidden_size_per_partition = v_channels * self.num_attention_heads_per_partition

    DotProductAttention.__init__ = __init__


def apply() -> None:
    use_prebuilt_dataset_helpers()
    local_attention_accepts_mla()
