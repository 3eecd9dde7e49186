"""Block-scaled e4m3 ("fp8") operands of the routed expert GEMMs, in PyTorch.

The recipe (DeepSeek-V3's fine-grained scaling):

* token rows: one fp32 scale per (row, 128 columns), ``s = max(amax, 1e-4) / 448`` and
  ``q = e4m3(x * (448 / max(amax, 1e-4)))`` (one multiply an element; round to nearest even,
  saturating at 448); the CUDA quantizer (``ops.quantize_rows_e4m3``) gives the same bits as
  ``quantize_rows`` here;
* the weight gradients' token operands (``MoKConfig.fp8_wgrad``): one fp32 scale per (expert,
  column) over the expert's rows (``quantize_columns``), the operands transposed (e4m3 wgmma reads
  K-major operands only, and K is the token axis here);
* weights: one fp32 scale per (expert, 128-row tile, 128 columns), where the tiles are the rows
  one GEMM task loads: rows ``128 b .. 128 b + 127`` of fc2, and gate rows ``64 b .. 64 b + 63``
  together with the same up rows of fc1 (``[gate; up]`` layout).

The GEMM sums each 128-column block afresh in the tensor cores and adds it, times its two
scales, to fp32 accumulators (csrc/kernels/gemm/expert_gemm_fp8.cuh).

The backward's routed dgrads (``MoKConfig.fp8_dgrad``) use the same weight tiles transposed
(``E4M3Weight.transposed``: e4m3 wgmma reads K-major operands only, and a 128 x 128 tile keeps its
scale under transposition). Their token operands are quantized like the forward's: dy along H,
and dh along fc1's transposed K, i.e. its ``[gate | up]`` columns in gate/up pair order
(``pair_columns``: block kb = gate columns ``64 kb .. 64 kb + 63``, then the same up columns), so
that each 128-column block meets one weight tile.

Weights are quantized once per weight version: by the caller of ``functional.forward``
(``fp8_weights=``), or through ``WeightCache`` (``mok_moe`` and the Megatron layer), which keys
on the weights' storage and version counter and is cleared after every optimizer step (updates
through ``.data``, as Megatron's optimizers copy the new weights, do not bump version counters).
"""

from __future__ import annotations

import dataclasses
import weakref

import torch

BLOCK = 128
E4M3_MAX = 448.0
MIN_AMAX = 1e-4  # all-zero blocks (padding rows) get a finite scale
E4M3 = torch.float8_e4m3fn
WEIGHT_CHUNK = 8  # experts quantized per step of quantize_weight


def _scale_and_inverse(amax: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(s = a / 448, 448 / a) with a = max(amax, MIN_AMAX): the stored (dequantizing) scale and the
    quantizing factor. Elementwise divisions by tensors: CUDA divides by a Python scalar as a
    product with its rounded reciprocal, which is 1 ulp off now and then (the kernels divide
    exactly)."""
    a = amax.float().clamp(min=MIN_AMAX)
    full = torch.full_like(a, E4M3_MAX)
    return a / full, full / a


def _to_e4m3(x: torch.Tensor, inverse: torch.Tensor) -> torch.Tensor:
    return (x.float() * inverse).clamp(-E4M3_MAX, E4M3_MAX).to(E4M3)


def check_k(name: str, k: int) -> None:
    if k % BLOCK:
        raise ValueError(f"fp8: {name} has {k} columns, not a multiple of the {BLOCK}-column scale blocks")


def shared_in_e4m3(shared_fc1: torch.Tensor | None) -> bool:
    """Whether the fp8 forward runs the shared expert's GEMMs on e4m3 operands too: when its
    intermediate size Is is a multiple of the scale blocks (otherwise it stays bf16)."""
    return shared_fc1 is not None and (shared_fc1.shape[0] // 2) % BLOCK == 0


def pair_columns(t: torch.Tensor) -> torch.Tensor:
    """[..., 2N] holding [gate | up] -> gate/up pair order: 64 gate columns, then the same 64 up
    columns, and so on (N a multiple of 64)."""
    n = t.shape[-1] // 2
    if t.shape[-1] % 2 or n % 64:
        raise ValueError(f"fp8: [gate | up] columns must be 2 x a multiple of 64, got {t.shape[-1]}")
    lead = t.shape[:-1]
    return t.reshape(*lead, 2, n // 64, 64).transpose(-3, -2).reshape(*lead, 2 * n)


def unpair_columns(t: torch.Tensor) -> torch.Tensor:
    """The inverse of ``pair_columns``."""
    n = t.shape[-1] // 2
    lead = t.shape[:-1]
    return t.reshape(*lead, n // 64, 2, 64).transpose(-3, -2).reshape(*lead, 2 * n)


def quantize_rows(x: torch.Tensor, gate_up_pairs: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """x [rows, K] -> (q [rows, K] e4m3, scale [rows, K / 128] fp32). gate_up_pairs: x holds
    [gate | up] and q its columns in pair order (``pair_columns``)."""
    rows, k = x.shape
    check_k("x", k)
    if gate_up_pairs:
        x = pair_columns(x)
    blocks = x.float().view(rows, k // BLOCK, BLOCK)
    scale, inverse = _scale_and_inverse(blocks.abs().amax(dim=-1))
    return _to_e4m3(blocks, inverse.unsqueeze(-1)).view(rows, k), scale


def dequantize_rows(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    rows, k = q.shape
    return (q.float().view(rows, k // BLOCK, BLOCK) * scale.unsqueeze(-1)).view(rows, k)


def quantize_columns(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """One expert's rows x [rows, C] -> (q [rows, C] e4m3, scale [C] fp32): one scale per column over
    all rows (the weight gradients' operands; ``ops.quantize_columns_e4m3`` gives the same bits,
    transposed)."""
    xf = x.float()
    amax = xf.abs().amax(dim=0) if xf.shape[0] else xf.new_zeros(xf.shape[1])
    scale, inverse = _scale_and_inverse(amax)
    return _to_e4m3(xf, inverse), scale


def dequantize_columns(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return q.float() * scale


@dataclasses.dataclass
class E4M3Weight:
    """One stacked weight [nseg, rows, K] in e4m3 with its tile scales."""

    q: torch.Tensor  # [nseg, rows, K] e4m3
    scale: torch.Tensor  # [nseg, tiles, K / 128] fp32
    swiglu: bool

    def dequantize(self) -> torch.Tensor:
        return _apply_tiles(self.q.float(), self.scale, self.swiglu, lambda blk, s: blk * s)

    def transposed(self) -> "E4M3Weight":
        """The dgrads' copy: every tile transposed with its scale, as a plain weight [nseg, K, rows]
        (fc1: its rows in gate/up pair order). Needs whole tiles."""
        nseg, rows, k = self.q.shape
        tile_rows = 64 if self.swiglu else BLOCK
        if (rows // 2 if self.swiglu else rows) % tile_rows:
            raise ValueError(f"fp8: the transposed copy needs whole {tile_rows}-row tiles, got {rows} rows")
        q = self.q.view(torch.uint8)  # byte moves (fp8 indexing kernels are not everywhere)
        if self.swiglu:
            q = pair_columns(q.transpose(1, 2))
        else:
            q = q.transpose(1, 2)
        return E4M3Weight(q.contiguous().view(E4M3), self.scale.transpose(1, 2).contiguous(), swiglu=False)


def _apply_tiles(w: torch.Tensor, scale: torch.Tensor | None, swiglu: bool, fn):
    """Split w [nseg, rows, K] into the tiles' [nseg, tiles, rows per tile, nkb, 128] blocks (SwiGLU:
    gate and up halves side by side, 2 x 64 rows), apply fn(blocks, scale) or, when scale is None,
    return the blocks' amax [nseg, tiles, nkb]."""
    nseg, rows, k = w.shape
    nkb = k // BLOCK
    halves = list(w.chunk(2, dim=1)) if swiglu else [w]
    tr = 64 if swiglu else BLOCK  # rows per tile and half
    n = halves[0].shape[1]
    tiles = -(-n // tr)
    padded = [torch.nn.functional.pad(h, (0, 0, 0, tiles * tr - n)).view(nseg, tiles, tr, nkb, BLOCK) for h in halves]
    if scale is None:
        return torch.stack([p.abs().amax(dim=(2, 4)) for p in padded]).amax(dim=0)
    s = scale.view(nseg, tiles, 1, nkb, 1)
    out = [fn(p, s).view(nseg, tiles * tr, k)[:, :n] for p in padded]
    return torch.cat(out, dim=1) if swiglu else out[0]


def quantize_weight(w: torch.Tensor, swiglu: bool) -> E4M3Weight:
    """w [nseg, rows, K] (fc1: [gate; up] rows with swiglu=True; fc2: swiglu=False)."""
    if w.dim() != 3:
        raise ValueError(f"fp8: a stacked expert weight [nseg, rows, K] is expected, got {list(w.shape)}")
    check_k("the weight", w.shape[2])
    if swiglu and w.shape[1] % 2:
        raise ValueError(f"fp8: fc1 rows hold [gate; up] and must be even, got {w.shape[1]}")
    qs, scales = [], []
    for part in w.split(WEIGHT_CHUNK):  # a few experts at a time: fp32 temporaries stay small
        wf = part.float()
        scale, inverse = _scale_and_inverse(_apply_tiles(wf, None, swiglu, None))
        qs.append(_apply_tiles(wf, inverse, swiglu, _to_e4m3))
        scales.append(scale)
    scale = torch.cat(scales)
    return E4M3Weight(torch.cat(qs).contiguous(), scale.contiguous(), swiglu)


@dataclasses.dataclass
class FP8ExpertWeights:
    """The routed experts' fc1 and fc2 in e4m3 (``quantize_expert_weights``), for the backward's
    dgrads their transposed copies (``E4M3Weight.transposed``; None unless asked for), and ``shared``:
    the shared expert's fc1 and fc2 for its forward, as one-expert stacks ([1, 2 Is, H], [1, H, Is];
    None unless given and ``shared_in_e4m3``)."""

    fc1: E4M3Weight
    fc2: E4M3Weight
    fc1_t: E4M3Weight | None = None
    fc2_t: E4M3Weight | None = None
    shared: "FP8ExpertWeights | None" = None

    def matches(self, fc1: torch.Tensor, fc2: torch.Tensor) -> bool:
        return tuple(self.fc1.q.shape) == tuple(fc1.shape) and tuple(self.fc2.q.shape) == tuple(fc2.shape)

    def shared_for(self, shared_fc1, shared_fc2=None) -> "FP8ExpertWeights | None":
        """``shared`` if it was quantized from weights of these shapes (shared_fc2 None: fc1's alone
        is checked)."""
        s = self.shared
        if s is None or shared_fc1 is None or tuple(s.fc1.q.shape[1:]) != tuple(shared_fc1.shape):
            return None
        if shared_fc2 is not None and tuple(s.fc2.q.shape[1:]) != tuple(shared_fc2.shape):
            return None
        return s

    @property
    def has_transposed(self) -> bool:
        return self.fc1_t is not None and self.fc2_t is not None


def quantize_expert_weights(fc1: torch.Tensor, fc2: torch.Tensor, transposed: bool = False, shared_fc1=None,
                            shared_fc2=None) -> FP8ExpertWeights:
    """Quantize the routed experts' weights once per weight version (device ops, no host sync);
    transposed: also the dgrads' copies; shared_fc1/shared_fc2: also the shared expert's weights
    (when ``shared_in_e4m3``)."""
    with torch.no_grad():
        w1, w2 = quantize_weight(fc1, swiglu=True), quantize_weight(fc2, swiglu=False)
        out = FP8ExpertWeights(w1, w2, w1.transposed(), w2.transposed()) if transposed else FP8ExpertWeights(w1, w2)
        if shared_in_e4m3(shared_fc1) and shared_fc2 is not None:
            out.shared = quantize_expert_weights(shared_fc1[None], shared_fc2[None])  # forward only
        return out


class WeightCache:
    """e4m3 copies of the routed weights, one per (fc1, fc2) storage and version.

    An entry is dropped when the weights' version counters move (in-place updates through
    autograd-visible ops, checkpoint loads) and all entries after every ``torch.optim`` step
    (``register_optimizer_hook``): Megatron writes the stepped weights through ``.data``, which the
    version counters do not see.
    """

    def __init__(self):
        self._entries: dict = {}
        self._hook = None

    def get(self, fc1: torch.Tensor, fc2: torch.Tensor, quantize, transposed: bool = False, shared_fc1=None,
            shared_fc2=None) -> FP8ExpertWeights:
        """The entry of (fc1, fc2) (and the shared expert's weights, if given); a miss calls
        ``quantize(fc1, fc2, transposed)`` (``quantize(fc1, fc2, transposed, shared_fc1, shared_fc2)``
        with shared weights)."""
        ws = [w for w in (fc1, fc2, shared_fc1, shared_fc2) if w is not None]
        key = (tuple((w.data_ptr(), tuple(w.shape)) for w in ws), fc1.device, transposed)
        version = tuple(w._version for w in ws)
        hit = self._entries.get(key)
        if hit is not None and hit[0] == version and all(r() is w for r, w in zip(hit[1], ws)):
            return hit[2]
        shared = () if shared_fc1 is None else (shared_fc1, shared_fc2)
        weights = quantize(fc1, fc2, transposed, *shared)
        self._entries[key] = (version, [weakref.ref(w) for w in ws], weights)
        return weights

    def clear(self) -> None:
        self._entries.clear()

    def __len__(self) -> int:
        return len(self._entries)

    def register_optimizer_hook(self) -> None:
        """Clear after every optimizer step (of any torch.optim optimizer; idempotent)."""
        if self._hook is None:
            from torch.optim.optimizer import register_optimizer_step_post_hook

            self._hook = register_optimizer_step_post_hook(lambda *_: self.clear())


WEIGHT_CACHE = WeightCache()
