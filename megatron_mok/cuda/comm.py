"""Symmetric buffers, device state and streams of one workspace's CUDA path.

Buffers are created on a workspace's first call of each kind, all of that kind's set at the call's
start (``CALL_BUFFERS``); that first call is collective and host-blocking (like
``symm_mem.rendezvous``). Every later call is sync-free, so a layer pass can be captured in a CUDA
graph once its buffers exist.

Device barriers are epoch counters in a symmetric int32 buffer (not torch's signal pad); a peer
that does not arrive within ``MoKConfig.peer_timeout_s`` sets ``ws.errors[PEER_TIMEOUT] = 1 + peer``
and the kernels go on instead of hanging (``ws.check_errors`` raises ``MoKPeerTimeoutError``).
After a timeout the epochs no longer agree across ranks: create a new workspace.

The first barrier of a schedule and of a backward also carries the call's header
(megatron_mok/header.py): per-call values that disagree across ranks set ``ws.errors[HEADER_MISMATCH]``
and ``ws.check_errors`` raises ``MoKInputError`` naming the field, without a host sync.
"""

from __future__ import annotations

import weakref

import torch
import torch.distributed as dist

from .. import fp8
from ..header import barrier_flag_ints
from ..workspace import MoKWorkspace

STATE_INTS = 16  # csrc/kernels/api.h: StateSlot
# Waits inside the megakernel that depend on no peer give up after at most this long (a bug, not a
# slow peer), so a stall ends the kernel with an error instead of hanging the GPU.
KERNEL_WATCHDOG_S = 10.0


class Comm:
    """Symmetric buffers and device state of one workspace (created on first use, collectively)."""

    def __init__(self, ws: MoKWorkspace):
        self.ws = ws
        self.buffers: dict = {}  # (name, shape, dtype) -> (tensor, peer addresses)
        self._named: dict = {}  # name -> the same (a name's shape is fixed by the workspace)
        self.state = torch.zeros(STATE_INTS, dtype=torch.int32, device=ws.device)
        # the schedule's buffers: the ep epoch slots, then the per-call headers (megatron_mok/header.py);
        # the routing double buffer
        made = self.call_buffers("build_schedule", None)
        self.flag_ptrs = made["barrier_flags"][1]
        self.route_buf, self.route_ptrs = made["routing"]
        self._counters: dict = {}
        # the shared expert as one segment of the expert-major GEMMs: offsets [0, T], count [T]
        self.shared_seg = torch.tensor([0, ws.num_tokens, ws.num_tokens], dtype=torch.int32, device=ws.device)

    def counters(self, n: int) -> torch.Tensor:
        """Local int32 ready counters of the forward megakernel: zero at creation, zeroed again by
        the last CTA of every launch (so graph replays start from zero)."""
        if n not in self._counters:
            self._counters[n] = torch.zeros((n,), dtype=torch.int32, device=self.ws.device)
        return self._counters[n]

    def nbytes(self) -> int:
        """Bytes of this rank's symmetric buffers (a per-GPU constant of the workspace, shared by every
        layer and call of its shape; docs/DESIGN.md 7.2 has the formula)."""
        return sum(buf.numel() * buf.element_size() for buf, _ in self.buffers.values())

    def call_buffers(self, call: str, cfg) -> dict:
        """The symmetric buffers of one call kind (``CALL_BUFFERS``), created in that fixed order
        where missing: ``{name: (this rank's tensor, every rank's address of it in rank order)}``.
        The only place buffers are created, so a rank that rejects its input (functional._reject)
        makes the very creation collectives its peers make."""
        made = {}
        for name in call_buffer_names(call, cfg):
            if name not in self._named:
                shape, dtype, init_zero = buffer_spec(self.ws, name)
                self.buffers[(name, shape, dtype)] = self._named[name] = self._create(name, shape, dtype, init_zero)
            made[name] = self._named[name]
        return made

    def has_call_buffers(self, call: str, cfg) -> bool:
        """Whether the call kind's buffers exist (no creation collective would run)."""
        return all(name in self._named for name in call_buffer_names(call, cfg))

    def buffer(self, name: str):
        """(this rank's tensor, every rank's address of it in rank order) of a buffer that the set of
        the running call kind created (``call_buffers``)."""
        got = self._named.get(name)
        if got is None:
            raise RuntimeError(
                f"megatron_mok: symmetric buffer {name!r} was not created by the buffer set of this call "
                "(megatron_mok/cuda/comm.py: CALL_BUFFERS); add it there: a rank that rejects its input "
                "creates only that set before its verdict, so a buffer made elsewhere leaves its peers waiting")
        return got

    def _create(self, name: str, shape: tuple[int, ...], dtype: torch.dtype, init_zero: bool):
        """One symmetric buffer: a host collective over the EP group (and a barrier for zeroed ones)."""
        ws = self.ws
        if ws.ep_size == 1 and not dist.is_initialized():
            buf = torch.empty(shape, dtype=dtype, device=ws.device)
            ptrs = [buf.data_ptr()]
        else:
            buf, handle = ws.symmetric(f"mok.{name}", shape, dtype)
            ptrs = [int(p) for p in handle.buffer_ptrs]
        if init_zero:
            buf.zero_()
            if dist.is_initialized() and ws.ep_size > 1:
                # No peer may store into this buffer before every rank has zeroed its own.
                torch.cuda.synchronize(ws.device)
                dist.barrier(group=ws.group)
        return buf, ptrs


# ---- the symmetric buffers of each call kind --------------------------------------------------
#
# Each buffer's shape comes from the workspace's sizes alone (agreed when it was created), so every
# rank computes the same set; the kernels depend on these names, shapes and dtypes. A call creates
# its whole set at its start, before its first device barrier: the normal path and a rank that
# rejects its input (functional._reject) go through ``Comm.call_buffers`` with the same call kind, so
# on a workspace's first call the rejecting rank joins every creation collective its peers make.


def x_scale_pitch(hidden: int) -> int:
    """Floats of one row of ``x_scale``: the H / 128 scales in whole 16-byte row pieces."""
    return -(-(hidden // fp8.BLOCK) // 4) * 4


def buffer_spec(ws: MoKWorkspace, name: str) -> tuple[tuple[int, ...], torch.dtype, bool]:
    """(shape, dtype, created zeroed) of the symmetric buffer ``name``."""
    T, H, k, ep = ws.num_tokens, ws.hidden, ws.topk, ws.ep_size
    bf16, i32, f32 = torch.bfloat16, torch.int32, torch.float32
    return {
        "barrier_flags": ((barrier_flag_ints(ep),), i32, True),  # epochs, call headers, verdict records
        "routing": ((2, ep, T, k), i32, False),  # every rank's top_experts, double-buffered
        "x": ((T, H), bf16, False),  # the published layer input
        # the fp8 publish: the row copies move bf16 pairs, so e4m3 bytes and fp32 scales ride as bf16 rows
        "x_e4m3": ((T, H // 2), bf16, False),
        "x_scale": ((T, 2 * x_scale_pitch(H)), bf16, False),
        "comb": ((T * k, H), bf16, False),  # the forward's combine slots
        "bwd_grad": ((T, H), bf16, False),
        "bwd_probs": ((T, k), f32, False),
        "bwd_dx_slots": ((T * k, H), bf16, False),
        "bwd_dprobs_slots": ((T * k,), f32, False),
    }[name]


def published_buffer_names(cfg) -> tuple[str, ...]:
    """What ``dispatch.publish_*`` writes x into: e4m3 rows and scales (precision fp8), else bf16."""
    return ("x_e4m3", "x_scale") if getattr(cfg, "precision", None) == "fp8" else ("x",)


def call_buffer_names(call: str, cfg) -> tuple[str, ...]:
    """The symmetric buffers of a call kind, in creation order (``CALL_BUFFERS``). A backward makes
    its own and the rows it dispatches again; its recompute (ctx None) and ``regather`` find them."""
    return CALL_BUFFERS[call](cfg)


CALL_BUFFERS = {
    "build_schedule": lambda cfg: ("barrier_flags", "routing"),
    "forward": lambda cfg: ("comb", *published_buffer_names(cfg)),
    "recompute_forward_context": published_buffer_names,
    "backward": lambda cfg: ("bwd_grad", "bwd_probs", "bwd_dx_slots", "bwd_dprobs_slots",
                             *published_buffer_names(cfg)),
}


_COMMS: "weakref.WeakKeyDictionary[MoKWorkspace, Comm]" = weakref.WeakKeyDictionary()


def comm(ws: MoKWorkspace) -> Comm:
    """The workspace's ``Comm`` (created on first use)."""
    c = _COMMS.get(ws)
    if c is None:
        c = _COMMS[ws] = Comm(ws)
    return c


def has_call_buffers(ws: MoKWorkspace, call: str, cfg) -> bool:
    """Whether a call of this kind would find all its buffers (creates nothing, not even the Comm)."""
    c = _COMMS.get(ws)
    return c is not None and c.has_call_buffers(call, cfg)


def workspaces_with_buffers() -> list[MoKWorkspace]:
    """The workspaces of this process whose symmetric buffers exist."""
    return list(_COMMS.keys())


_SIDE_STREAMS: dict = {}


def side_stream(device: torch.device) -> torch.cuda.Stream:
    """One side stream per device for the shared expert and other off-critical-path work."""
    key = torch.device(device).index
    key = torch.cuda.current_device() if key is None else key
    if key not in _SIDE_STREAMS:
        _SIDE_STREAMS[key] = torch.cuda.Stream(device=key)
    return _SIDE_STREAMS[key]


def mark(wanted=True) -> torch.cuda.Event | None:
    """An event at this point of the current stream (None when ``wanted`` is None: nobody waits)."""
    if wanted is None:
        return None
    ev = torch.cuda.Event()
    ev.record()
    return ev


def join(main: torch.cuda.Stream, side: torch.cuda.Stream) -> None:
    """``main`` waits for everything launched on ``side`` so far.

    The side stream's work writes only tensors allocated on ``main`` (before the side waited for
    that point) and reads tensors that ``main`` frees only after this join: no ``record_stream``,
    whose frees a CUDA-graph capture defers to its end."""
    main.wait_stream(side)
