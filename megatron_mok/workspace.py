"""Per-group, per-shape state of the mok layer: sizes, symmetric buffers and device error flags.

A workspace is created once per (group, device, shapes, dtype, capacity factor) and reused by every
layer and step with those shapes. Creating one is a collective: every rank of the group must agree
on everything that sizes or shapes an exchange (T, H, top-k, expert count, activation dtype and
every ``MoKConfig`` field), and a rank whose own arguments are invalid says so in the same
collective, so every rank raises the same ``MoKInputError`` and none is left waiting.

Agreement protocol (``exchange``): the first collective of every mok call on the reference path is
one fixed-size int64 packet per rank (the call's phase, the values that must agree, this rank's
error message if its own checks failed, its device error flags). Every rank decodes every packet
the same way, so every rank raises the same error, naming the field and each rank's value, or the
failing ranks and their messages, before anything that depends on those values is exchanged. The
layer's own gloo collectives wait at most ``MoKConfig.peer_timeout_s``; a peer that does not arrive
gives ``MoKPeerTimeoutError`` naming it.
"""

from __future__ import annotations

import dataclasses
import datetime
import enum
import itertools
import struct
from typing import Any

import torch
import torch.distributed as dist

from .config import MoKConfig, routed_capacity


class MoKInputError(ValueError):
    """An input of the mok layer is malformed (shape, dtype, expert id, probabilities...)."""


class MoKCapacityError(RuntimeError):
    """More routed rows arrived on a rank than its buffer holds (raise capacity_factor)."""


class MoKPeerTimeoutError(RuntimeError):
    """A device-side wait on a peer rank timed out: that rank stalled or skipped the call."""


class MoKKernelStallError(MoKPeerTimeoutError):
    """A wait inside a mok kernel (the megakernel's watchdog) gave up: a kernel bug or a stalled
    dependency on this rank, not a late peer. A subclass of MoKPeerTimeoutError, so existing
    handlers still catch it."""


class ErrorCode(enum.IntEnum):
    """Slots of the workspace's device error-flag tensor."""

    CAPACITY_OVERFLOW = 0  # value: rows needed on this rank
    EXPERT_ID_OUT_OF_RANGE = 1  # value: 1 + the offending id's token index on some rank
    DUPLICATE_EXPERT = 2  # value: 1 + token index
    NONFINITE_PROBS = 3  # value: 1 + token index
    PEER_TIMEOUT = 4  # value: 1 + the peer rank that stalled
    KERNEL_STALL = 5  # value: 1 + the rank whose kernel-internal wait gave up (megakernel watchdog)
    # value: 1 + word + 8 * (site + 2 * peer): a peer's per-call header differs; -(1 + peer): that peer
    # rejected its input (its verdict; megatron_mok/header.py). Nonzero: this rank's barriers stop.
    HEADER_MISMATCH = 6
    HEADER_VALUE = 7  # value: that peer's value of that header word, or its verdict word
    NUM_CODES = 8


def _group_key(group: dist.ProcessGroup | None) -> Any:
    return None if group is None else id(group)


_WORKSPACE_UIDS = itertools.count(1)
_DEFAULT_CFG = MoKConfig()


@dataclasses.dataclass(eq=False)
class MoKWorkspace:
    group: dist.ProcessGroup | None
    rank: int
    ep_size: int
    device: torch.device
    num_tokens: int
    hidden: int
    topk: int
    num_experts: int
    capacity_factor: float
    capacity: int
    # int32 [ErrorCode.NUM_CODES]: 0 = fine; set by device code, read without a sync.
    errors: torch.Tensor
    _symmetric: dict = dataclasses.field(default_factory=dict)
    _pending_error_copy: tuple | None = None
    # The MoKConfig the ranks agreed on at creation, and the activation dtype (None: any).
    cfg: MoKConfig | None = None
    dtype: torch.dtype | None = None
    # Identity of this workspace in this process, and the number of schedules built on it: every
    # MoKSchedule carries both (schedule.stamp_schedule), so a stale or foreign one is caught.
    uid: int = dataclasses.field(default_factory=lambda: next(_WORKSPACE_UIDS))
    schedule_step: int = 0
    # The per-call header this rank last sent from each site (megatron_mok/header.py), for the
    # message of a header mismatch.
    call_headers: dict = dataclasses.field(default_factory=dict)

    @property
    def peer_timeout_s(self) -> float:
        return (self.cfg or _DEFAULT_CFG).peer_timeout_s

    def describe(self) -> str:
        return (f"workspace #{self.uid} (T={self.num_tokens}, H={self.hidden}, top-k={self.topk}, "
                f"E={self.num_experts}, EP={self.ep_size}, {self.device})")

    @property
    def num_local_experts(self) -> int:
        return self.num_experts // self.ep_size

    @property
    def local_expert_start(self) -> int:
        return self.rank * self.num_local_experts

    def symmetric(self, name: str, shape: tuple[int, ...], dtype: torch.dtype):
        """A buffer that peers can read and write, cached by name.

        On CUDA: torch symmetric memory (``(tensor, handle)``; ``handle.buffer_ptrs`` are the
        peers' addresses). Elsewhere: a plain tensor and ``None``.
        """
        key = (name, tuple(shape), dtype)
        if key not in self._symmetric:
            if self.device.type == "cuda":
                import torch.distributed._symmetric_memory as symm_mem

                buf = symm_mem.empty(*shape, dtype=dtype, device=self.device)
                handle = symm_mem.rendezvous(buf, self.group if self.group is not None else dist.group.WORLD)
                self._symmetric[key] = (buf, handle)
            else:
                self._symmetric[key] = (torch.empty(shape, dtype=dtype, device=self.device), None)
        return self._symmetric[key]

    # ---- errors -----------------------------------------------------------------------------

    def raise_if_error(self, values: torch.Tensor) -> None:
        """Raise the exception that matches the first nonzero error slot of ``values`` (host)."""
        v = [int(x) for x in values.tolist()]
        if any(v):
            self.errors.zero_()  # reported once; the workspace stays usable for fixed inputs
        if v[ErrorCode.HEADER_MISMATCH] < 0:  # a peer rejected its input (its verdict)
            from .header import verdict_message

            raise MoKInputError(verdict_message(-v[ErrorCode.HEADER_MISMATCH] - 1, v[ErrorCode.HEADER_VALUE],
                                                self.rank))
        if v[ErrorCode.HEADER_MISMATCH]:  # first: everything else a mismatched call flags follows from it
            from .header import decode_mismatch, mismatch_message

            site = decode_mismatch(v[ErrorCode.HEADER_MISMATCH])[1]
            raise MoKInputError(mismatch_message(v[ErrorCode.HEADER_MISMATCH], v[ErrorCode.HEADER_VALUE], self.rank,
                                                 self.call_headers.get(site)))
        if v[ErrorCode.EXPERT_ID_OUT_OF_RANGE]:
            raise MoKInputError(
                f"top_experts holds an expert id outside [0, {self.num_experts}) "
                f"(token {v[ErrorCode.EXPERT_ID_OUT_OF_RANGE] - 1} of some rank)"
            )
        if v[ErrorCode.DUPLICATE_EXPERT]:
            raise MoKInputError(
                f"top_experts repeats an expert within one token's top-{self.topk} "
                f"(token {v[ErrorCode.DUPLICATE_EXPERT] - 1} of some rank)"
            )
        if v[ErrorCode.NONFINITE_PROBS]:
            raise MoKInputError(
                f"probs holds a NaN or infinite router weight (token {v[ErrorCode.NONFINITE_PROBS] - 1})"
            )
        if v[ErrorCode.CAPACITY_OVERFLOW]:
            raise MoKCapacityError(
                f"a rank of the EP group needs {v[ErrorCode.CAPACITY_OVERFLOW]} routed rows but the buffer "
                f"holds {self.capacity} (capacity_factor={self.capacity_factor}); raise "
                "MoKConfig.capacity_factor (1.0 can never overflow)"
            )
        if v[ErrorCode.PEER_TIMEOUT]:
            raise MoKPeerTimeoutError(
                f"rank {self.rank} timed out waiting for rank {v[ErrorCode.PEER_TIMEOUT] - 1}: "
                "that rank stalled or skipped the mok call"
            )
        if v[ErrorCode.KERNEL_STALL]:
            raise MoKKernelStallError(
                f"a mok kernel on rank {v[ErrorCode.KERNEL_STALL] - 1} stalled: a wait inside the kernel "
                "(megakernel watchdog) gave up and the kernel aborted, so this call's results are garbage; "
                "this is a kernel bug or a stalled dependency on that rank, not a slow peer"
            )

    def check_errors(self, blocking: bool = False) -> None:
        """Raise a pending device error.

        On CPU (or ``blocking=True``) the flags are read directly. On CUDA the flags are copied
        to pinned memory behind an event; a later call raises once the copy has landed, so the
        hot path never waits for the GPU.
        """
        if self.device.type != "cuda" or blocking:
            if blocking and self._pending_error_copy is not None:
                self._pending_error_copy[1].synchronize()
                self._pending_error_copy = None  # the read below holds all it holds: not raised twice
            self.raise_if_error(self.errors.cpu())
            return
        if self._pending_error_copy is not None:
            host, event = self._pending_error_copy
            if not event.query():
                return
            self._pending_error_copy = None
            self.raise_if_error(host)
        host = torch.empty(self.errors.shape, dtype=self.errors.dtype, pin_memory=True)
        host.copy_(self.errors, non_blocking=True)
        event = torch.cuda.Event()
        event.record()
        self._pending_error_copy = (host, event)


def all_gather_stacked(ws: MoKWorkspace, t: torch.Tensor) -> torch.Tensor:
    """``[ep, *t.shape]``: every rank's ``t`` in rank order (a collective over the EP group)."""
    t = t.contiguous()
    if ws.ep_size == 1:
        return t.unsqueeze(0)
    out = torch.empty((ws.ep_size * t.shape[0], *t.shape[1:]), dtype=t.dtype, device=t.device)
    timed_all_gather(ws.group, out, t, ws.peer_timeout_s, "an exchange of the mok layer")
    return out.view(ws.ep_size, *t.shape)


# ---- timed collectives (CPU / gloo) ----------------------------------------------------------------
#
# Before each of its gloo collectives a rank records, in the process group's store, how many mok
# exchanges it has entered on that group. A wait that passes peer_timeout_s then names the ranks
# that have not entered the exchange this rank is waiting in.

_ARRIVALS: dict = {}


def _group_ranks(group) -> list[int]:
    return dist.get_process_group_ranks(group if group is not None else dist.group.WORLD)


def _group_name(group) -> str:
    g = group if group is not None else dist.group.WORLD
    return str(getattr(g, "group_name", None) or id(g))


def _store():
    try:
        return dist.distributed_c10d._get_default_store()
    except Exception:  # noqa: BLE001 - no store: the error cannot name the late rank
        return None


def _arrival_key(group, global_rank: int) -> str:
    return f"megatron_mok/arrived/{_group_name(group)}/{global_rank}"


def _arrive(group) -> int:
    name = _group_name(group)
    n = _ARRIVALS.get(name, 0) + 1
    _ARRIVALS[name] = n
    store = _store()
    if store is not None:
        try:
            store.set(_arrival_key(group, dist.get_rank()), str(n))
        except Exception:  # noqa: BLE001 - bookkeeping only; the wait itself is still bounded
            pass
    return n


def _late_ranks(group, n: int) -> list[tuple[int, int, int]] | None:
    """(group rank, global rank, exchanges entered) of every peer that has not entered exchange n;
    None when the store cannot tell."""
    store = _store()
    if store is None:
        return None
    late = []
    try:
        me = dist.get_rank()
        for i, g in enumerate(_group_ranks(group)):
            if g == me:
                continue
            key = _arrival_key(group, g)
            seen = int(store.get(key)) if store.check([key]) else 0
            if seen < n:
                late.append((i, g, seen))
    except Exception:  # noqa: BLE001 - e.g. the store's host (rank 0) is the dead peer
        return None
    return late


def _uses_timed_waits(t: torch.Tensor) -> bool:
    return t.device.type == "cpu"


def timed_all_gather(group, out: torch.Tensor, t: torch.Tensor, timeout_s: float, what: str) -> None:
    """``all_gather_into_tensor`` that waits at most ``timeout_s`` (CPU tensors, gloo): a peer that
    does not arrive in time, or whose connection dies, gives ``MoKPeerTimeoutError`` naming it.
    CUDA tensors (the reference path on NCCL) use a plain collective (NCCL's own timeout)."""
    if not _uses_timed_waits(t):
        dist.all_gather_into_tensor(out, t, group=group)
        return
    n = _arrive(group)
    work = dist.all_gather_into_tensor(out, t, group=group, async_op=True)
    try:
        work.wait(timeout=datetime.timedelta(seconds=timeout_s))
    except RuntimeError as err:
        raise _peer_error(group, n, timeout_s, what, err) from err


def _peer_error(group, n: int, timeout_s: float, what: str, err: Exception) -> MoKPeerTimeoutError:
    me = dist.get_rank(group) if group is not None else dist.get_rank()
    timed_out = "timed out" in str(err).lower()
    late = _late_ranks(group, n)
    head = (f"rank {me} of the EP group waited {timeout_s:g} s (MoKConfig.peer_timeout_s) in {what} (its mok "
            f"exchange #{n} on this group)" if timed_out else
            f"rank {me} of the EP group lost a peer in {what} (its mok exchange #{n} on this group): {err}")
    if late:
        who = ", ".join(f"rank {i} (global rank {g}, entered {seen})" for i, g, seen in late)
        return MoKPeerTimeoutError(f"{head}; not arrived: {who}: those ranks stalled, died, or skipped a mok call")
    if late is None:
        return MoKPeerTimeoutError(f"{head}; a peer stalled or died (the store cannot tell which): {err}")
    return MoKPeerTimeoutError(f"{head}; every rank had entered it, so a peer died or stalled inside it: {err}")


# ---- the agreement packet -------------------------------------------------------------------------

PHASES = ("workspace creation", "mok_moe", "schedule", "forward", "recompute", "backward")
_MAGIC = 0x4D6F4B  # "MoK"
_VALUE_WORDS = 64
_ERROR_WORDS = 8
_MESSAGE_BYTES = 480
_UNKNOWN = -(2**62)  # a value this rank does not know (not compared)
_HEADER = 4  # magic, phase, has_error, value words
_PACKET_WORDS = _HEADER + _VALUE_WORDS + _ERROR_WORDS + 1 + _MESSAGE_BYTES // 8


@dataclasses.dataclass(frozen=True)
class Agreed:
    """One value every rank of the group must agree on: ``kind`` is int, bool, float, str or dtype."""

    name: str
    kind: str
    value: Any

    @property
    def words(self) -> int:
        return 2 if self.kind in ("str", "dtype") else 1


def _encode(a: Agreed) -> list[int]:
    v = a.value
    try:
        if a.kind in ("str", "dtype"):
            if v is None:
                return [_UNKNOWN, _UNKNOWN]
            text = str(v).replace("torch.", "").encode()[:16].ljust(16, b"\0")
            return list(struct.unpack("<2q", text))
        if v is None:
            return [_UNKNOWN]
        if a.kind == "float":
            return [struct.unpack("<q", struct.pack("<d", float(v)))[0]]
        if a.kind == "bool":
            return [int(bool(v))] if isinstance(v, bool) else [_UNKNOWN + 1]
        if isinstance(v, bool) or not isinstance(v, int):
            return [_UNKNOWN + 1]  # not an int: shown as such, compared as a value of its own
        return [max(min(v, 2**62), -(2**62) + 2)]
    except (TypeError, ValueError, OverflowError, struct.error):
        return [_UNKNOWN + 1] * a.words


def _decode(kind: str, words: list[int]) -> Any:
    if words[0] == _UNKNOWN:
        return None
    if words[0] == _UNKNOWN + 1:
        return "<invalid>"
    if kind in ("str", "dtype"):
        return struct.pack("<2q", *words).rstrip(b"\0").decode(errors="replace")
    if kind == "float":
        return struct.unpack("<d", struct.pack("<q", words[0]))[0]
    if kind == "bool":
        return bool(words[0])
    return words[0]


def shape_values(num_tokens, hidden, topk, num_experts, dtype, cfg: MoKConfig | None) -> list[Agreed]:
    """The values every phase's packet starts with (the same layout in every phase)."""
    out = [Agreed("num_tokens (T)", "int", num_tokens), Agreed("hidden size (H)", "int", hidden),
           Agreed("top-k", "int", topk), Agreed("num_experts", "int", num_experts),
           Agreed("activation dtype", "dtype", dtype)]
    kinds = {int: "int", bool: "bool", float: "float", str: "str"}
    for f in dataclasses.fields(MoKConfig):
        value = getattr(cfg, f.name, None) if isinstance(cfg, MoKConfig) else None
        kind = kinds.get(type(getattr(_DEFAULT_CFG, f.name)), "str")
        out.append(Agreed(f"MoKConfig.{f.name}", kind, value))
    return out


def _common_words() -> int:
    return sum(a.words for a in shape_values(0, 0, 0, 0, None, None))


def _exchange_device(group, device: torch.device) -> torch.device | None:
    """Where the packet travels: CPU on gloo, the CUDA device on NCCL; None: no such backend."""
    backend = str(dist.get_backend(group)).lower()
    if device.type == "cuda" and "nccl" in backend:
        return device
    if "gloo" in backend:
        return torch.device("cpu")
    return None


def exchange(group, device, phase: str, values: list[Agreed], error: Exception | None = None,
             errors: torch.Tensor | None = None, timeout_s: float | None = None) -> None:
    """The agreement collective of one mok call (see the module docstring).

    ``error``: this rank's own check failure (it is raised on every rank, with every failing rank's
    message); ``errors``: this rank's device error flags, replaced in place by the maximum over the
    ranks (so every rank raises the same flagged error next). Raises ``MoKInputError`` on every rank
    alike, or returns when every rank passed and agrees. Without a process group of several ranks it
    only raises ``error``.
    """
    if not dist.is_initialized() or dist.get_world_size(group) == 1:
        if error is not None:
            raise error
        return
    dev = _exchange_device(group, torch.device(device))
    if dev is None:
        if error is not None:
            raise error
        return
    ep = dist.get_world_size(group)
    words = [w for a in values for w in _encode(a)]
    if len(words) > _VALUE_WORDS:
        raise AssertionError(f"megatron_mok: {len(words)} agreement words exceed {_VALUE_WORDS}")
    packet = [_MAGIC, PHASES.index(phase), int(error is not None), len(words)]
    packet += words + [0] * (_VALUE_WORDS - len(words))
    flags = [0] * _ERROR_WORDS
    if errors is not None and error is None:
        flags[: errors.numel()] = [int(v) for v in errors.tolist()]
    packet += flags
    text = f"{type(error).__name__}: {error}".encode()[:_MESSAGE_BYTES] if error is not None else b""
    packet += [len(text)] + list(struct.unpack(f"<{_MESSAGE_BYTES // 8}q", text.ljust(_MESSAGE_BYTES, b"\0")))
    mine = torch.tensor(packet, dtype=torch.int64, device=dev)
    out = torch.empty((ep * _PACKET_WORDS,), dtype=torch.int64, device=dev)
    timeout = timeout_s if timeout_s is not None else _DEFAULT_CFG.peer_timeout_s
    timed_all_gather(group, out, mine, timeout, f"the {phase} agreement")
    rows = out.view(ep, _PACKET_WORDS).tolist()
    verdict = _verdict(phase, values, rows)
    if verdict is not None:
        raise MoKInputError(verdict) from error
    if errors is not None:
        worst = [max(r[_HEADER + _VALUE_WORDS + i] for r in rows) for i in range(errors.numel())]
        errors.copy_(torch.tensor(worst, dtype=errors.dtype))


def _verdict(phase: str, values: list[Agreed], rows: list[list[int]]) -> str | None:
    """The error every rank raises for these packets (the same text on every rank), or None."""
    if any(r[0] != _MAGIC for r in rows):
        bad = [i for i, r in enumerate(rows) if r[0] != _MAGIC]
        return (f"mok: ranks {bad} of the EP group sent something other than a mok agreement packet "
                "(they are in another collective: the ranks do not run the same sequence of calls)")
    phases = [r[1] for r in rows]
    same_phase = len(set(phases)) == 1
    # The same text on every rank: a rank's own phase is named only when every rank is in it.
    where = f"mok {phase}" if same_phase else "mok"
    failed = [i for i, r in enumerate(rows) if r[2]]
    if failed:
        msg_at = _HEADER + _VALUE_WORDS + _ERROR_WORDS
        parts = []
        for i in failed:
            n = rows[i][msg_at]
            text = struct.pack(f"<{_MESSAGE_BYTES // 8}q", *rows[i][msg_at + 1:])[:n].decode(errors="replace")
            parts.append(f"rank {i} ({PHASES[rows[i][1]]}): {text}")
        return (f"{where}: the input checks failed on rank{'s' if len(failed) > 1 else ''} "
                f"{', '.join(map(str, failed))} of the EP group; every rank raises this error. " + "; ".join(parts))
    problems = []
    if not same_phase:
        problems.append("call: " + ", ".join(f"rank {i}: {PHASES[p]}" for i, p in enumerate(phases)))
    compare = values if same_phase else shape_values(0, 0, 0, 0, None, None)
    pos = _HEADER
    for a in compare:
        seen = [r[pos:pos + a.words] for r in rows]
        pos += a.words
        if any(w[0] == _UNKNOWN for w in seen) or all(w == seen[0] for w in seen):
            continue
        shown = [_decode(a.kind, w) for w in seen]
        problems.append(f"{a.name}: " + ", ".join(f"rank {i}: {v!r}" if isinstance(v, str) else f"rank {i}: {v}"
                                                  for i, v in enumerate(shown)))
    if not problems:
        return None
    return (f"{where}: the ranks of the EP group disagree on " + "; ".join(problems)
            + " (every rank raises this error; nothing was exchanged)")


_CACHE: dict = {}


def create_workspace(
    group: dist.ProcessGroup | None,
    device: torch.device | str,
    num_tokens: int,
    hidden: int,
    topk: int,
    num_experts: int,
    cfg: MoKConfig,
    dtype: torch.dtype | None = None,
) -> MoKWorkspace:
    """Create a workspace (a collective over ``group``).

    Every rank checks its own arguments, then all ranks exchange their verdicts and everything that
    sizes an exchange (T, H, top-k, E, ``dtype`` (None: not fixed) and every ``MoKConfig`` field) in
    one collective: a failure or a mismatch raises the same ``MoKInputError`` on every rank.
    """
    device = torch.device(device)
    if dist.is_initialized():
        ep_size, rank = dist.get_world_size(group), dist.get_rank(group)
    else:
        if group is not None:
            raise MoKInputError("a process group was given but torch.distributed is not initialized")
        ep_size, rank = 1, 0
    error = None
    try:
        if not isinstance(cfg, MoKConfig):
            raise MoKInputError(f"cfg must be a MoKConfig, got {type(cfg).__name__}")
        for name, value in (("num_tokens", num_tokens), ("hidden", hidden), ("topk", topk),
                            ("num_experts", num_experts)):
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise MoKInputError(f"{name} must be a positive int, got {value!r}")
        if dtype is not None and not isinstance(dtype, torch.dtype):
            raise MoKInputError(f"dtype must be a torch.dtype or None, got {dtype!r}")
    except MoKInputError as err:
        error = err
    exchange(group, device, "workspace creation", shape_values(num_tokens, hidden, topk, num_experts, dtype, cfg),
             error, timeout_s=cfg.peer_timeout_s if isinstance(cfg, MoKConfig) else None)
    # Every rank passed and agrees from here on: the checks below fail on every rank alike.
    if num_experts % ep_size:
        raise MoKInputError(f"num_experts ({num_experts}) must be divisible by the EP size ({ep_size})")
    if topk > num_experts:
        raise MoKInputError(f"top-k ({topk}) exceeds num_experts ({num_experts})")
    nle = num_experts // ep_size
    return MoKWorkspace(
        group=group, rank=rank, ep_size=ep_size, device=device,
        num_tokens=num_tokens, hidden=hidden, topk=topk, num_experts=num_experts,
        capacity_factor=cfg.capacity_factor,
        capacity=routed_capacity(cfg, ep_size, num_tokens, topk, nle),
        errors=torch.zeros(ErrorCode.NUM_CODES, dtype=torch.int32, device=device),
        cfg=cfg, dtype=dtype,
    )


def get_workspace(group, device, num_tokens, hidden, topk, num_experts, cfg: MoKConfig,
                  dtype: torch.dtype | None = None) -> MoKWorkspace:
    """The cached workspace for these shapes (created, collectively, on first use)."""
    device = torch.device(device)
    key = (_group_key(group), str(device), num_tokens, hidden, topk, num_experts,
           getattr(cfg, "capacity_factor", None), dtype)
    ws = _CACHE.get(key)
    if ws is None:
        ws = create_workspace(group, device, num_tokens, hidden, topk, num_experts, cfg, dtype)
        _CACHE[key] = ws
    return ws


def clear_workspace_cache() -> None:
    _CACHE.clear()


def check_workspace_errors(blocking: bool = False) -> None:
    """``check_errors`` of every cached workspace. Each mok call checks its own workspace; a caller
    that replays the calls in a CUDA graph (no Python runs) calls this after each replay instead."""
    for ws in list(_CACHE.values()):
        ws.check_errors(blocking=blocking)
