"""Tuning knobs of the mok MoE layer.

Every knob except ``precision``, ``fp8_dgrad``, ``fp8_wgrad``, ``fp8_shared``, ``wgrad_accumulation``
and ``wgrad_microbatches`` changes only *how* the layer is computed (SM split, pipelining granularity,
buffer sizes), never a result bit. Invalid values raise ``MoKConfigError`` naming the field.
"""

from __future__ import annotations

import dataclasses
import math

# Every expert segment of the routed-row buffer starts at a multiple of this many rows: the e4m3
# weight gradients sum tokens in 32-row MMA groups, and every other kernel masks or zero-fills by
# the expert's count. The capacity and minibatch_rows are multiples of TILE_ROWS (the persistent
# megakernel's 128-row readiness tiles). Layout constants, not knobs: they change the schedule and
# the memory, not the results.
ROW_ALIGN = 32
TILE_ROWS = 128

PRECISIONS = ("bf16", "fp8")  # fp8: the routed experts' GEMMs in block-scaled e4m3 (fp8_dgrad)
# How the forward pass is composed from the GEMM core: one persistent megakernel that overlaps the
# dispatch and the combine with the GEMMs, or one launch per stage. The same bits either way.
FORWARD_KERNELS = ("auto", "persistent", "staged")
# Where the weight gradients go when Megatron's DDP gave the weights a main_grad (the adapter).
WGRAD_ACCUMULATIONS = ("auto", "fused", "unfused")


class MoKConfigError(ValueError):
    """A MoKConfig field (or a value derived from one) is invalid."""


@dataclasses.dataclass(frozen=True)
class MoKConfig:
    """Knobs of one mok MoE layer pass.

    fwd_comm_sms: SMs of the persistent forward megakernel that pull-dispatch tokens before they
        compute (1-64).
    bwd_comm_sms: SMs for the backward's pull and push kernels (1-132): they run 4 CTAs per such SM,
        and the shared expert's side stream takes the rest.
    minibatch_rows: routed rows per compute/communication overlap step of the persistent forward
        (multiple of TILE_ROWS): it overlaps in minibatch_rows / 256 token chunks of up to 256 rows
        (at least one).
    capacity_factor: fraction of the worst case (every token of every rank routed here) that the
        routed-row buffer holds; 1.0 can never overflow. Overflow raises, it never drops tokens.
    precision: "bf16", or "fp8": the routed experts' forward GEMMs on block-scaled e4m3 operands
        (megatron_mok/fp8.py; the staged forward; outputs stay bf16). Unlike the other knobs it
        changes results (within the e4m3 quantization).
    fp8_dgrad: with precision "fp8", also the backward's routed dgrads (dy against fc2, dh against
        fc1) on e4m3 operands; False: they stay bf16. Changes results like precision does.
    fp8_wgrad: with precision "fp8", also the routed experts' weight gradients on e4m3 operands
        (dy, act, dh and the dispatched rows quantized per expert and column: one scale per column
        over the expert's rows, as DeepSeek-V3 quantizes the token axis); False: they stay bf16.
        Changes results like precision does.
    fp8_shared: with precision "fp8", also the shared expert's forward GEMMs on e4m3 operands (when
        its intermediate size is a multiple of 128; its backward stays bf16: e4m3 dgrads measured
        slower, docs/DESIGN.md); False: they stay bf16. Changes results like precision does.
    peer_timeout_s: how long a device-side wait on a peer rank may spin before it reports a
        stalled peer instead of hanging.
    save_gate_up: keep the gate/up GEMM outputs for the backward (2 I bf16 per routed row, 2 Is
        per token for the shared expert); False: the backward recomputes them (one gate/up GEMM
        more, same bits).
    forward_kernel: "persistent" runs the forward as one persistent megakernel (dispatch and
        combine overlapped with the GEMMs; bf16 only), "staged" as one launch per stage, "auto"
        picks by precision (``resolved_forward_kernel``). The same bits either way.
    strict: raise instead of warning once when a call cannot run on the CUDA kernels (dtype or sizes
        they do not take) and would run the slow pure-PyTorch reference instead.
    wgrad_accumulation: in Megatron (the adapter), where the weight gradients go when the weights
        have Megatron's ``main_grad``. "fused": the weight-gradient GEMMs add them into it themselves
        (fp32 sums, not rounded to bf16 first, nor written and read back; needs neither apex nor
        TransformerEngine); "unfused": they are returned, and Megatron's DDP hook adds their bf16
        values; "auto": fused exactly when Megatron's --gradient-accumulation-fusion is on. Changes
        the main_grad's rounding (fused is the more precise).
    wgrad_microbatches: with the routed weight gradients added into fp32 main grads by their GEMMs
        (fused, bf16 weight gradients), the backwards of up to this many consecutive micro-batches
        of a step run their routed weight gradients as one pass that adds the micro-batches' sum
        (formed in fp32) into main_grad, so main_grad is read and written once per group instead of
        once per micro-batch. The earlier micro-batches' operands wait in memory: (2 H + 3 I) bf16
        a routed row of the capacity, per layer and micro-batch of the group. Which backwards may wait is the
        caller's (``hold_wgrads``; in Megatron every micro-batch but a step's last). 1 (the
        default): every backward adds its own. Changes the main_grad's rounding (1-8).
    """

    fwd_comm_sms: int = 24
    bwd_comm_sms: int = 28
    minibatch_rows: int = 4096
    capacity_factor: float = 1.0
    precision: str = "bf16"
    fp8_dgrad: bool = True
    fp8_wgrad: bool = True
    fp8_shared: bool = True
    peer_timeout_s: float = 30.0
    save_gate_up: bool = True
    forward_kernel: str = "auto"
    strict: bool = False
    wgrad_accumulation: str = "auto"
    wgrad_microbatches: int = 1

    def __post_init__(self) -> None:
        for name in ("fwd_comm_sms", "bwd_comm_sms", "minibatch_rows", "wgrad_microbatches"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int):
                raise MoKConfigError(f"MoKConfig.{name} must be an int, got {value!r}")
        for name, most in (("fwd_comm_sms", 64), ("bwd_comm_sms", 132), ("wgrad_microbatches", 8)):
            value = getattr(self, name)
            if not 1 <= value <= most:
                raise MoKConfigError(f"MoKConfig.{name} must be in [1, {most}], got {value}")
        if self.minibatch_rows <= 0 or self.minibatch_rows % TILE_ROWS:
            raise MoKConfigError(
                f"MoKConfig.minibatch_rows must be a positive multiple of {TILE_ROWS}, "
                f"got {self.minibatch_rows}"
            )
        cf = self.capacity_factor
        if isinstance(cf, bool) or not isinstance(cf, (int, float)) or not math.isfinite(cf):
            raise MoKConfigError(f"MoKConfig.capacity_factor must be a finite number, got {cf!r}")
        if not 0.0 < cf <= 1.0:
            raise MoKConfigError(f"MoKConfig.capacity_factor must be in (0, 1], got {cf}")
        if self.precision not in PRECISIONS:
            raise MoKConfigError(
                f"MoKConfig.precision must be one of {PRECISIONS}, got {self.precision!r}"
            )
        if self.forward_kernel not in FORWARD_KERNELS:
            raise MoKConfigError(
                f"MoKConfig.forward_kernel must be one of {FORWARD_KERNELS}, got {self.forward_kernel!r}"
            )
        if self.wgrad_accumulation not in WGRAD_ACCUMULATIONS:
            raise MoKConfigError(
                f"MoKConfig.wgrad_accumulation must be one of {WGRAD_ACCUMULATIONS}, "
                f"got {self.wgrad_accumulation!r}"
            )
        if self.forward_kernel == "persistent" and self.precision != "bf16":
            raise MoKConfigError(
                "MoKConfig.forward_kernel='persistent' runs bf16 only; with precision='fp8' use "
                "'staged' or 'auto'"
            )
        for name in ("save_gate_up", "fp8_dgrad", "fp8_wgrad", "fp8_shared", "strict"):
            if not isinstance(getattr(self, name), bool):
                raise MoKConfigError(f"MoKConfig.{name} must be a bool, got {getattr(self, name)!r}")
        t = self.peer_timeout_s
        if isinstance(t, bool) or not isinstance(t, (int, float)) or not (0 < t < math.inf):
            raise MoKConfigError(f"MoKConfig.peer_timeout_s must be a positive finite number, got {t!r}")

    def replace(self, **changes) -> "MoKConfig":
        return dataclasses.replace(self, **changes)

    def resolved_forward_kernel(self, ep_size: int) -> str:
        """The forward composition a call runs: ``forward_kernel``, or for "auto" the persistent
        megakernel for bf16 (it hides the dispatch and combine behind the GEMMs at EP > 1, and at
        EP=1 it measured 3-5% faster than the staged launches on H100, 1-5% slower on H200) and the
        staged launches for fp8. docs/DESIGN.md has the figures. ``ep_size`` is part of the rule's
        signature because the figures are per EP size."""
        if self.forward_kernel != "auto":
            return self.forward_kernel
        return "persistent" if self.precision == "bf16" else "staged"

    @property
    def dgrad_precision(self) -> str:
        """The precision of the backward's routed dgrads."""
        return "fp8" if self.precision == "fp8" and self.fp8_dgrad else "bf16"

    @property
    def wgrad_precision(self) -> str:
        """The precision of the backward's routed weight gradients."""
        return "fp8" if self.precision == "fp8" and self.fp8_wgrad else "bf16"

    @property
    def shared_precision(self) -> str:
        """The precision of the shared expert's forward GEMMs (``fp8.shared_in_e4m3`` decides whether
        a shared expert of a given size can run in e4m3)."""
        return "fp8" if self.precision == "fp8" and self.fp8_shared else "bf16"


def routed_capacity(cfg: MoKConfig, ep_size: int, num_tokens: int, topk: int, num_local_experts: int) -> int:
    """Rows of the routed-row buffer on one rank (host-side sizing, no device data involved).

    The worst case is every token of every rank sending min(topk, local experts) rows here, plus
    the padding of each local expert segment to ROW_ALIGN, rounded up to TILE_ROWS.
    """
    worst = ep_size * num_tokens * min(topk, num_local_experts)
    rows = math.ceil(cfg.capacity_factor * worst) + num_local_experts * (ROW_ALIGN - 1)
    return -(-rows // TILE_ROWS) * TILE_ROWS
