"""The per-call header of the GPU path (issue #33): agreement on per-call values without a host sync.

Creating a workspace checks, in a host collective, everything that sizes an exchange. What a call
can still change afterwards (T, the activation dtype, the precision and the forward composition) is
checked on the device: the first device barrier of a call (the schedule's routing all-gather, and
the backward's ``bwd_publish``) stores this rank's header, ``HEADER_WORDS`` int32 values known on
the host at launch, into its slot of every peer's barrier buffer together with its epoch, and
compares every rank's header with its own after the wait. A mismatch sets
``ws.errors[HEADER_MISMATCH] = 1 + word + HEADER_WORDS * (site + 2 * peer)`` and
``ws.errors[HEADER_VALUE]`` = the peer's value; the next ``ws.check_errors()`` raises
``MoKInputError`` naming the field, this rank's value and the peer's. Every rank raises: when two
ranks differ, every rank differs from at least one of them.

The layout must match ``CallHeader`` in csrc/kernels/api.h. Nothing here imports the extension or
the workspace module (``workspace.raise_if_error`` decodes with it).
"""

from __future__ import annotations

import torch

HEADER_WORDS = 8  # api.h: kHeaderWords
HEADER_REGIONS = 3  # api.h: kHeaderRegions (the schedule's two double-buffer halves, the backward's)
HEADER_MAGIC = 0x4D6F4B01  # "MoK" and the layout version (word 0; never 0)
HEADER_FIELDS = ("mok call header (magic / layout version)", "num_tokens (T)", "hidden size (H)", "top-k",
                 "num_experts (E)", "capacity (routed rows per rank)", "activation dtype", "precision")
HEADER_SITES = ("build_schedule", "backward")  # site 0: the schedule's barrier, 1: bwd_publish's
_DTYPES = (None, torch.bfloat16, torch.float16, torch.float32, torch.float64)
# Bits of the precision word (each a choice that changes what is exchanged or how it is synchronised).
_PRECISION_BITS = (("precision", "fp8", "bf16"), ("dgrad", "fp8", "bf16"), ("wgrad", "fp8", "bf16"),
                   ("forward_kernel", "persistent", "staged"))


def barrier_flag_ints(ep: int) -> int:
    """int32 elements of a barrier buffer with header regions (api.h: barrier_flag_ints)."""
    return ep + HEADER_REGIONS * ep * HEADER_WORDS


def dtype_code(dtype: torch.dtype | None) -> int:
    return _DTYPES.index(dtype) if dtype in _DTYPES else len(_DTYPES)


def precision_code(cfg, ep_size: int) -> int:
    """The precision word: precision, the backward's dgrad / wgrad precision, the forward composition."""
    bits = (cfg.precision == "fp8", cfg.dgrad_precision == "fp8", cfg.wgrad_precision == "fp8",
            cfg.resolved_forward_kernel(ep_size) == "persistent")
    return sum(int(b) << i for i, b in enumerate(bits))


def call_header(*, num_tokens: int, hidden: int, topk: int, num_experts: int, capacity: int,
                dtype: torch.dtype | None, cfg, ep_size: int) -> list[int]:
    """The ``HEADER_WORDS`` words of one call (host values only: no device data is read)."""
    return [HEADER_MAGIC, int(num_tokens), int(hidden), int(topk), int(num_experts), int(capacity),
            dtype_code(dtype), precision_code(cfg, ep_size)]


def show_value(word: int, value: int) -> str:
    """A header word as the error message shows it."""
    if word == 0:
        return f"{value:#x}" + ("" if value == HEADER_MAGIC else " (no mok header of this version)")
    if word == 6:
        if 0 <= value < len(_DTYPES):
            return str(_DTYPES[value]).replace("torch.", "") if _DTYPES[value] is not None else "any (not fixed)"
        return f"dtype code {value}"
    if word == 7:
        if not 0 <= value < 1 << len(_PRECISION_BITS):
            return f"precision code {value}"
        return ", ".join(f"{name}={on if value >> i & 1 else off}" for i, (name, on, off) in enumerate(_PRECISION_BITS))
    return str(value)


def decode_mismatch(code: int) -> tuple[int, int, int]:
    """(word, site, peer rank) of a nonzero ``errors[HEADER_MISMATCH]``."""
    word = (code - 1) % HEADER_WORDS
    rest = (code - 1) // HEADER_WORDS
    return word, rest % 2, rest // 2


def mismatch_message(code: int, peer_value: int, rank: int, mine: list[int] | None) -> str:
    """The ``MoKInputError`` text for ``errors[HEADER_MISMATCH] = code``, ``errors[HEADER_VALUE] =
    peer_value`` on rank ``rank``; ``mine``: the header this rank last sent from that site (None:
    unknown)."""
    word, site, peer = decode_mismatch(code)
    where = HEADER_SITES[site] if site < len(HEADER_SITES) else f"site {site}"
    own = show_value(word, mine[word]) if mine is not None and len(mine) == HEADER_WORDS else "unknown"
    return (f"mok {where}: the ranks of the EP group disagree on {HEADER_FIELDS[word]}: this rank (rank {rank}): "
            f"{own}; rank {peer}: {show_value(word, peer_value)} (the device header check of that call's first "
            "barrier; every rank raises this error; the outputs of that call and of the calls after it that "
            "used its schedule are not valid)")
