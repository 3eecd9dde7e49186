"""What the forward keeps for the backward (``KernelContext``), and its size formula.

The context keeps only what the backward cannot get back cheaply: the gate/up pre-activations.
Everything else is recovered (docs/DESIGN.md, "What the forward keeps"):

* the routed token rows: dispatched again from the layer input, which the caller keeps anyway
  (``dispatch.regather``, the forward's own dispatch: the same bits, bf16 or e4m3);
* the SwiGLU outputs (routed and shared): recomputed from ``h`` in the down dgrad's epilogue;
* the routed expert outputs, which only the router-weight gradient ``<g, y>`` needs: the down
  dgrad forms it as ``<g @ fc2[e], act>`` from its own product.
"""

from __future__ import annotations

import dataclasses

import torch


@dataclasses.dataclass
class KernelContext:
    """What the forward keeps for the backward (bf16; freshly allocated per call).

    ``h`` ``[capacity, 2 I]``: the routed gate/up pre-activations ``[x @ gate^T | x @ up^T]``, in
    the schedule's padded row layout (rows at or past ``sched.expert_offsets[nle]`` are never
    written, padding rows inside a segment hold zeros); ``shared_h`` ``[T, 2 Is]``: the shared
    expert's. Both are written by the epilogue of the GEMM that activates them. None
    (``MoKConfig.save_gate_up`` off, bf16 only): the backward recomputes them with that GEMM from
    the dispatched rows (the same bits; one gate/up GEMM more). fp8 keeps them always: a bf16
    recompute would not give the e4m3 GEMM's values.
    """

    h: torch.Tensor | None
    shared_h: torch.Tensor | None = None

    def nbytes(self) -> int:
        """Bytes this context holds (the activation memory the layer keeps for its backward)."""
        return sum(t.numel() * t.element_size() for t in dataclasses.astuple(self) if isinstance(t, torch.Tensor))


def saved_bytes(capacity: int, num_tokens: int, intermediate: int, shared_intermediate: int | None,
                keep_gate_up: bool) -> int:
    """Bytes of a ``KernelContext`` (the design table's formula): ``2 I`` bf16 per routed row of
    the capacity plus ``2 Is`` bf16 per token, or nothing when the gate/up outputs are recomputed."""
    if not keep_gate_up:
        return 0
    return 2 * (capacity * 2 * intermediate + num_tokens * 2 * (shared_intermediate or 0))
