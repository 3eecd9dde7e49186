"""Symmetric buffers, device state and streams of one workspace's CUDA path.

Buffers are created on first use; that first call is collective and host-blocking (like
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
        self.buffers: dict = {}
        self.state = torch.zeros(STATE_INTS, dtype=torch.int32, device=ws.device)
        # the ep epoch slots, then the per-call headers (megatron_mok/header.py)
        _, self.flag_ptrs = self.buffer("barrier_flags", (barrier_flag_ints(ws.ep_size),), torch.int32,
                                        init_zero=True)
        self.route_buf, self.route_ptrs = self.buffer(
            "routing", (2, ws.ep_size, ws.num_tokens, ws.topk), torch.int32)
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

    def buffer(self, name: str, shape: tuple[int, ...], dtype: torch.dtype, init_zero: bool = False):
        """(this rank's tensor, every rank's address of it in rank order), cached by name and shape."""
        key = (name, tuple(shape), dtype)
        if key not in self.buffers:
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
            self.buffers[key] = (buf, ptrs)
        return self.buffers[key]


_COMMS: "weakref.WeakKeyDictionary[MoKWorkspace, Comm]" = weakref.WeakKeyDictionary()


def comm(ws: MoKWorkspace) -> Comm:
    """The workspace's ``Comm`` (created on first use)."""
    c = _COMMS.get(ws)
    if c is None:
        c = _COMMS[ws] = Comm(ws)
    return c


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


def join(main: torch.cuda.Stream, side: torch.cuda.Stream, tensors) -> None:
    """``main`` waits for ``side``; the side stream's tensors are used on ``main`` from here on."""
    main.wait_stream(side)
    for t in tensors:
        if t is not None:
            t.record_stream(main)
