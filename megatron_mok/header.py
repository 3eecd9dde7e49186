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

The verdict (issue #33): a rank whose own host checks fail on the kernel path still takes part in
the barrier its peers wait in, the call's first (``barrier_reject``): it stores its verdict record
``{epoch, verdict word}`` into every peer's buffer, then the negated epoch into its slot, and raises
its own ``MoKInputError``. A waiter that finds the record for the epoch it waits on sets
``ws.errors[HEADER_MISMATCH] = -(1 + peer)`` and ``ws.errors[HEADER_VALUE]`` = the verdict word; the
next ``ws.check_errors()`` raises ``MoKInputError`` naming that rank and its reason
(``verdict_message``). The verdict word says which check failed: the call, the argument, the kind of
problem and one detail (a dtype, or a dimension and its size). Once ``HEADER_MISMATCH`` is set,
a rank's barriers neither open nor wait, the schedule it builds is empty and a barrier given the
call's schedule empties it, until the flag is cleared (``check_errors``): no later kernel moves a
row from or to a peer, and the epochs of the ranks stay in step (every rank stops at the barrier
where the verdict or the mismatch showed).

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


VERDICT_WORDS = 2  # api.h: kVerdictWords (a rank's verdict record: the epoch it rejected, the verdict word)


def barrier_flag_ints(ep: int) -> int:
    """int32 elements of a barrier buffer: epochs, header regions, verdict records (api.h: barrier_flag_ints)."""
    return ep + HEADER_REGIONS * ep * HEADER_WORDS + VERDICT_WORDS * ep


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


# ---- the verdict word (a rank's rejected call) ---------------------------------------------------
#
# bits 0-3: the problem, 4-7: the argument, 8-9: the call, 10-11: a dimension, 12-30: a detail value
# (a dtype's index in VERDICT_DTYPES plus 1, or the size in that dimension, saturated).
VERDICT_CALLS = ("build_schedule", "forward", "recompute_forward_context", "backward")
VERDICT_ARGS = ("an input", "x", "probs", "fc1", "fc2", "shared_fc1", "shared_fc2", "grad_out", "top_experts",
                "sched", "ctx", "cfg", "fp8_weights")
VERDICT_PROBLEMS = ("other", "type", "dtype", "shape", "device", "schedule", "context", "config", "slow_path")
VERDICT_DTYPES = (torch.bfloat16, torch.float16, torch.float32, torch.float64, torch.int32, torch.int64,
                  torch.int16, torch.int8, torch.uint8, torch.bool, torch.float8_e4m3fn, torch.float8_e5m2)
_DETAIL_MAX = (1 << 19) - 1


def verdict_dtype(dtype) -> int:
    """The detail value of a dtype (0: not one of VERDICT_DTYPES)."""
    return VERDICT_DTYPES.index(dtype) + 1 if dtype in VERDICT_DTYPES else 0


def encode_verdict(call: str, arg: str = "an input", problem: str = "other", dim: int = 0, value: int = 0) -> int:
    """The verdict word of a rejected call (int32, >= 0)."""
    c = VERDICT_CALLS.index(call) if call in VERDICT_CALLS else 0
    a = VERDICT_ARGS.index(arg) if arg in VERDICT_ARGS else 0
    p = VERDICT_PROBLEMS.index(problem) if problem in VERDICT_PROBLEMS else 0
    v = max(0, min(int(value), _DETAIL_MAX))
    return p | a << 4 | c << 8 | (max(0, min(int(dim), 3)) << 10) | v << 12


def decode_verdict(word: int) -> tuple[str, str, str, int, int]:
    """(call, argument, problem, dim, value) of a verdict word (unknown indices decode to the first)."""
    def pick(names, i):
        return names[i] if i < len(names) else names[0]

    return (pick(VERDICT_CALLS, word >> 8 & 3), pick(VERDICT_ARGS, word >> 4 & 15),
            pick(VERDICT_PROBLEMS, word & 15), word >> 10 & 3, word >> 12 & _DETAIL_MAX)


def _shape_detail(got, want) -> tuple[int, int]:
    """(dim, size) of the first dimension where ``got`` differs from ``want``; dim 3: the number of
    dimensions differs (size: got's)."""
    got, want = list(got), list(want)
    if len(got) != len(want):
        return 3, len(got)
    for i, (g, w) in enumerate(zip(got, want)):
        if g != w:
            return min(i, 2), g
    return 0, got[0] if got else 0


def tag(err: Exception, arg: str, problem: str, dim: int = 0, value: int = 0):
    """Attach what the verdict word needs to a check's error (returns it)."""
    err.mok_verdict = (arg, problem, dim, value)
    return err


def tag_shape(err: Exception, arg: str, got, want):
    return tag(err, arg, "shape", *_shape_detail(got, want))


def verdict_of(err: Exception, call: str) -> int:
    """The verdict word for a failed host check: from the tag the check attached, else from the
    message's opening words (checks of other modules), else "an input failed a check"."""
    tagged = getattr(err, "mok_verdict", None)
    if tagged is not None:
        return encode_verdict(call, *tagged)
    text = str(err)
    for prefix, arg, problem in (("sched is stale", "sched", "schedule"), ("sched is foreign", "sched", "schedule"),
                                 ("sched must be", "sched", "type"), ("ctx and sched", "ctx", "context"),
                                 ("top_experts must be int32", "top_experts", "dtype"),
                                 ("top_experts must have shape", "top_experts", "shape"),
                                 ("top_experts is on", "top_experts", "device"),
                                 ("top_experts must be a tensor", "top_experts", "type")):
        if text.split(": ", 1)[-1].startswith(prefix) or text.startswith(prefix):
            value = 0
            if problem == "dtype":
                value = next((verdict_dtype(d) for d in VERDICT_DTYPES if text.endswith(str(d))), 0)
            return encode_verdict(call, arg, problem, 0, value)
    return encode_verdict(call)


def verdict_reason(word: int) -> str:
    """The reason of a verdict word, in the words of the check that failed."""
    _, arg, problem, dim, value = decode_verdict(word)
    if problem == "dtype":
        shown = str(VERDICT_DTYPES[value - 1]).replace("torch.", "") if 0 < value <= len(VERDICT_DTYPES) else \
            "a dtype the call does not take"
        return f"{arg} has dtype {shown}"
    if problem == "shape":
        if dim == 3:
            return f"{arg} has {value} dimensions, not the shape the call takes"
        return f"{arg} has the wrong shape (size {value}{'+' if value == _DETAIL_MAX else ''} in dim {dim})"
    return {
        "type": f"{arg} is not what the call takes (its type, or a tensor of another rank or layout)",
        "device": f"{arg} is on another device than the workspace",
        "schedule": "sched is not the schedule this call must use (stale, or built on another workspace)",
        "context": "ctx and sched do not belong together (ctx comes from a forward that ran another schedule)",
        "config": f"{arg} does not suit this call's MoKConfig (precision fp8 sizes, or fp8_weights)",
        "slow_path": "its inputs would run the pure-PyTorch reference and MoKConfig.strict is set",
    }.get(problem, f"{arg} failed a host check")


def verdict_message(peer: int, word: int, rank: int) -> str:
    """The ``MoKInputError`` text on rank ``rank`` for ``errors[HEADER_MISMATCH] = -(1 + peer)``,
    ``errors[HEADER_VALUE] = word``."""
    call = decode_verdict(word)[0]
    return (f"mok {call}: rank {peer} rejected its input: {verdict_reason(word)} (that rank's host check failed "
            f"before the call's first device barrier and it raised its own error; every rank raises, this is rank "
            f"{rank}; the outputs of that call and of the calls after it that used its schedule are not valid)")
