"""The per-call header check of the GPU path (issue #33, megatron_mok/header.py) on one GPU.

Two ranks are simulated on one device: rank 0's kernels get peer address lists whose second entry is
another local tensor. The simulated rank 1 never runs; the test writes, into rank 0's barrier buffer,
what rank 1 would have stored there: its epoch (far ahead, so every wait passes at once), its header
and its routing. Then: a header that disagrees in one field sets the error slots and
``ws.check_errors`` raises ``MoKInputError`` naming that field and both ranks' values; a matching
header sets nothing and changes no output bit; a peer that never arrives gives the timeout, and its
missing header is not reported as a mismatch.

The verdict (a rank whose host checks failed): the simulated peer's rejection record and marker in
rank 0's buffer end rank 0's wait at once with ``MoKInputError`` naming the peer and its reason, and
the schedule is empty; while flagged, rank 0's barriers neither open, wait nor store into the peer;
once raised, the next call is the baseline's. Rank 0 as the rejecting rank: ``barrier_reject`` stores
the record and the marker into every buffer without waiting. EP=1 through the functional API: a
failed check raises as before and the workspace gives the same bits on the next good call.
"""

from __future__ import annotations

import re
import time

import pytest
import torch

from megatron_mok import MoKConfig, MoKInputError, create_workspace, functional
from megatron_mok.header import (
    HEADER_REGIONS,
    HEADER_WORDS,
    VERDICT_WORDS,
    barrier_flag_ints,
    call_header,
    encode_verdict,
    verdict_dtype,
)
from megatron_mok.workspace import ErrorCode, MoKPeerTimeoutError

from ._util import bits, cuda_path, gpu_marks, make_case, make_routing

pytestmark = gpu_marks()

DEV = "cuda:0"
EP, RANK, PEER = 2, 0, 1
T, H, K, E = 300, 256, 2, 8
NLE = E // EP
CAP = 2048  # > every routed row of either rank plus its padding (<= 1200 + 4 * 127; a multiple of 128)
AHEAD = 1 << 30  # the simulated peer's epoch: every barrier of the test finds it arrived
SCHEDULE_REGIONS, BACKWARD_REGION = (0, 1), 2
EPOCH, GATHER_COUNT, GATHER_PARITY, HALTED = 0, 1, 2, 9  # api.h StateSlot
VERDICT = encode_verdict("build_schedule", "top_experts", "dtype", 0, verdict_dtype(torch.float32))


def _header_at(flags: torch.Tensor, region: int, src: int) -> torch.Tensor:
    off = EP + (region * EP + src) * HEADER_WORDS
    return flags[off:off + HEADER_WORDS]


def _record_at(flags: torch.Tensor, src: int) -> torch.Tensor:
    """Rank ``src``'s verdict record {epoch, verdict word} in a barrier buffer."""
    off = EP + HEADER_REGIONS * EP * HEADER_WORDS + src * VERDICT_WORDS
    return flags[off:off + VERDICT_WORDS]


class SimulatedPair:
    """Rank 0's buffers and the simulated rank 1's (local tensors), and rank 0's workspace."""

    def __init__(self, cfg: MoKConfig, seed: int = 3):
        i32 = dict(dtype=torch.int32, device=DEV)
        # a real workspace only for its error tensor and its check_errors (EP = 1 on the host side)
        self.ws = create_workspace(None, DEV, T, H, K, E, cfg)
        self.cfg = cfg
        self.flags = [torch.zeros(barrier_flag_ints(EP), **i32) for _ in range(EP)]
        self.flags[RANK][PEER] = AHEAD
        self.routing = [torch.zeros((2, EP, T, K), **i32) for _ in range(EP)]
        gen = torch.Generator().manual_seed(seed)
        self.top = make_routing("random", T, K, E, gen).to(DEV).to(torch.int32)
        peer_top = make_routing("random", T, K, E, gen).to(DEV).to(torch.int32)
        self.routing[RANK][:, PEER] = peer_top  # what rank 1's gather stored, in both halves
        self.state = torch.zeros(16, **i32)
        self.header = call_header(num_tokens=T, hidden=H, topk=K, num_experts=E, capacity=CAP, dtype=None, cfg=cfg,
                                  ep_size=EP)

    def peer_header(self, regions, words) -> None:
        for r in regions:
            _header_at(self.flags[RANK], r, PEER).copy_(torch.tensor(words, dtype=torch.int32))

    def schedule(self, header, timeout_s: float = 5.0):
        from megatron_mok import ops

        i32 = dict(dtype=torch.int32, device=DEV)
        out = dict(top_all=torch.empty((EP, T, K), **i32), row_src_rank=torch.empty((CAP,), **i32),
                   row_src_slot=torch.empty((CAP,), **i32), expert_counts=torch.empty((NLE,), **i32),
                   expert_offsets=torch.empty((NLE + 1,), **i32))
        scratch = torch.empty((ops.schedule_scratch_ints(EP, T, NLE, E),), **i32)
        ops.build_schedule(top_experts=self.top, routing_buf=self.routing[RANK], state=self.state,
                           errors=self.ws.errors, scratch=scratch, peer_bufs=[r.data_ptr() for r in self.routing],
                           peer_flags=[f.data_ptr() for f in self.flags], rank=RANK, num_experts=E,
                           timeout_s=timeout_s, header=header, **out)
        if header is not None:
            self.ws.call_headers[0] = list(header)
        torch.cuda.synchronize()
        return out

    def publish(self, header, timeout_s: float = 5.0):
        from megatron_mok import ops

        gen = torch.Generator().manual_seed(11)
        g = torch.randn(T, H, generator=gen).bfloat16().to(DEV)
        probs = torch.rand(T, K, generator=gen).to(DEV)
        gbuf = torch.empty_like(g)
        pbuf = torch.empty_like(probs)
        ops.bwd_publish(g, gbuf, probs, pbuf, self.state, self.ws.errors, [f.data_ptr() for f in self.flags], RANK,
                        timeout_s, header=header)
        if header is not None:
            self.ws.call_headers[1] = list(header)
        torch.cuda.synchronize()
        return g, gbuf, probs, pbuf


def _errors(ws) -> list[int]:
    return [int(v) for v in ws.errors.cpu().tolist()]


def test_matching_headers_change_no_schedule_bit():
    pair = SimulatedPair(MoKConfig())
    pair.peer_header(SCHEDULE_REGIONS, pair.header)
    without = pair.schedule(None)
    with_header = pair.schedule(pair.header)  # the other routing half: both halves hold the peer's routing
    again = pair.schedule(pair.header)
    assert _errors(pair.ws) == [0] * ErrorCode.NUM_CODES
    for name in without:
        assert torch.equal(without[name], with_header[name]), name
        assert torch.equal(without[name], again[name]), name
    # rank 0's own header went into its slot of both ranks' buffers (the half of each gather)
    for f in pair.flags:
        assert [int(v) for v in _header_at(f, 1, RANK).tolist()] == pair.header
        assert [int(v) for v in _header_at(f, 0, RANK).tolist()] == pair.header
    pair.ws.check_errors(blocking=True)


@pytest.mark.parametrize("word,value,field,shown", [
    (1, T + 8, r"num_tokens \(T\)", rf"this rank \(rank 0\): {T}; rank 1: {T + 8}"),
    (5, CAP + 128, r"capacity", rf"rank 1: {CAP + 128}"),
    (6, 3, r"activation dtype", r"rank 1: float32"),
    (7, 1, r"precision", r"this rank \(rank 0\): precision=bf16.*; rank 1: precision=fp8"),
    (0, 0, r"magic", r"rank 1: 0x0 \(no mok header of this version\)"),
])
def test_schedule_header_mismatch_raises_named_error(word, value, field, shown):
    pair = SimulatedPair(MoKConfig(forward_kernel="staged"))
    theirs = list(pair.header)
    theirs[word] = value
    pair.peer_header(SCHEDULE_REGIONS, theirs)
    pair.schedule(pair.header)
    v = _errors(pair.ws)
    assert v[ErrorCode.HEADER_MISMATCH] == 1 + word + HEADER_WORDS * (0 + 2 * PEER), v
    assert v[ErrorCode.HEADER_VALUE] == value, v
    assert v[ErrorCode.PEER_TIMEOUT] == 0
    with pytest.raises(MoKInputError, match=rf"mok build_schedule: the ranks of the EP group disagree on .*{field}") as ei:
        pair.ws.check_errors(blocking=True)
    assert re.search(shown, str(ei.value)), str(ei.value)
    pair.ws.check_errors(blocking=True)  # reported once
    # the same pair with the peer's header fixed: nothing flagged again
    pair.peer_header(SCHEDULE_REGIONS, pair.header)
    pair.schedule(pair.header)
    assert _errors(pair.ws) == [0] * ErrorCode.NUM_CODES


def test_backward_header_mismatch_raises_named_error():
    pair = SimulatedPair(MoKConfig())
    bwd = call_header(num_tokens=T, hidden=H, topk=K, num_experts=E, capacity=CAP, dtype=torch.bfloat16,
                      cfg=pair.cfg, ep_size=EP)
    pair.peer_header([BACKWARD_REGION], bwd)
    g, gbuf, probs, pbuf = pair.publish(bwd)
    assert _errors(pair.ws) == [0] * ErrorCode.NUM_CODES
    assert torch.equal(bits(gbuf), bits(g)) and torch.equal(pbuf, probs)
    theirs = list(bwd)
    theirs[2] = H * 2  # the peer's grad_out has another hidden size
    pair.peer_header([BACKWARD_REGION], theirs)
    pair.publish(bwd)
    v = _errors(pair.ws)
    assert v[ErrorCode.HEADER_MISMATCH] == 1 + 2 + HEADER_WORDS * (1 + 2 * PEER), v
    with pytest.raises(MoKInputError, match=rf"mok backward: .*hidden size \(H\): this rank \(rank 0\): {H}; "
                                            rf"rank 1: {2 * H}"):
        pair.ws.check_errors(blocking=True)


def test_missing_peer_is_a_timeout_not_a_header_mismatch():
    pair = SimulatedPair(MoKConfig())
    pair.flags[RANK][PEER] = 0  # the peer never arrives; its header slot holds nothing
    pair.publish(pair.header, timeout_s=0.05)
    v = _errors(pair.ws)
    assert v[ErrorCode.PEER_TIMEOUT] == 1 + PEER and v[ErrorCode.HEADER_MISMATCH] == 0, v
    with pytest.raises(MoKPeerTimeoutError):
        pair.ws.check_errors(blocking=True)


def test_layer_bits_unchanged_by_the_header(monkeypatch):
    """EP = 1 through the functional kernel path: the schedule and backward launches carry the header
    (its own slot only) and set no error; forward and backward give the same bits as the same calls
    with the header left out of both launches."""
    from megatron_mok import ops

    shape = (256, 256, 128, 128, 8, 2)
    cfg, ws, top, (x, probs, fc1, fc2, sfc1, sfc2), gen = make_case(shape, "random", 5, DEV)
    g = torch.randn(shape[0], shape[1], generator=gen).bfloat16().to(DEV)
    kp = cuda_path()

    def run():
        sched = kp.build_schedule(cfg, ws, top)
        out, ctx = kp.forward(cfg, ws, sched, x, probs, fc1, fc2, sfc1, sfc2)
        grads = kp.backward(cfg, ws, sched, ctx, g, x, probs, fc1, fc2, sfc1, sfc2)
        torch.cuda.synchronize()
        return [out, grads.dx, grads.dprobs, grads.dfc1, grads.dfc2, grads.dshared_fc1, grads.dshared_fc2]

    with_header = run()
    assert ws.call_headers[0][0] != 0 and ws.call_headers[1][0] != 0
    assert _errors(ws) == [0] * ErrorCode.NUM_CODES
    for name in ("build_schedule", "bwd_publish"):
        original = getattr(ops, name)
        monkeypatch.setattr(ops, name, lambda *a, _f=original, **kw: _f(*a, **{**kw, "header": None}))
    without = run()
    for a, b in zip(with_header, without):
        assert torch.equal(bits(a), bits(b))
    ws.check_errors(blocking=True)


# ---- the verdict of a rank whose host checks failed ------------------------------------------------


def _state(pair) -> list[int]:
    return [int(v) for v in pair.state.cpu().tolist()]


def _peer_rejects(pair, epoch: int, slot: int | None = None) -> None:
    """What the simulated peer's barrier_reject at ``epoch`` leaves in rank 0's buffer (``slot``: a
    later value of its epoch slot, e.g. its next call's epoch)."""
    _record_at(pair.flags[RANK], PEER).copy_(torch.tensor([epoch, VERDICT], dtype=torch.int32))
    pair.flags[RANK][PEER] = -epoch if slot is None else slot


def _assert_empty(sched) -> None:
    assert int(sched["expert_counts"].abs().sum()) == 0 and int(sched["expert_offsets"].abs().sum()) == 0
    for name in ("row_src_rank", "row_src_slot", "top_all"):
        assert bool((sched[name] == -1).all()), name


def test_peer_rejection_ends_the_wait_at_once_and_stops_the_rank():
    cfg = MoKConfig(forward_kernel="staged", peer_timeout_s=30.0)
    pair = SimulatedPair(cfg)
    pair.peer_header(SCHEDULE_REGIONS, pair.header)
    baseline = SimulatedPair(cfg)
    baseline.peer_header(SCHEDULE_REGIONS, baseline.header)
    expected = baseline.schedule(baseline.header)

    epoch = _state(pair)[EPOCH] + 1
    _peer_rejects(pair, epoch)
    t0 = time.monotonic()
    sched = pair.schedule(pair.header, timeout_s=30.0)
    assert time.monotonic() - t0 < 3.0  # not the 30 s timeout
    v = _errors(pair.ws)
    assert v[ErrorCode.HEADER_MISMATCH] == -(1 + PEER) and v[ErrorCode.HEADER_VALUE] == VERDICT, v
    assert v[ErrorCode.PEER_TIMEOUT] == 0 and v[ErrorCode.EXPERT_ID_OUT_OF_RANGE] == 0, v
    _assert_empty(sched)  # no kernel that uses this schedule touches a peer's rows
    st = _state(pair)
    assert st[EPOCH] == epoch and st[HALTED] == 1

    # while flagged: the barriers neither open (no epoch, nothing stored into the peer) nor wait
    pair.routing[PEER].fill_(-7)
    peer_flags = pair.flags[PEER].clone()
    t0 = time.monotonic()
    sched = pair.schedule(pair.header, timeout_s=30.0)
    from megatron_mok import ops

    ptrs = [f.data_ptr() for f in pair.flags]
    ops.barrier(pair.state, pair.ws.errors, ptrs, RANK, 30.0)
    ops.barrier_open(pair.state, ptrs, RANK)
    torch.cuda.synchronize()
    assert time.monotonic() - t0 < 3.0
    _assert_empty(sched)
    assert bool((pair.routing[PEER] == -7).all())  # no routing went to the peer
    assert torch.equal(pair.flags[PEER], peer_flags)
    assert _state(pair)[:3] == st[:3]

    with pytest.raises(MoKInputError, match=re.escape(
            "mok build_schedule: rank 1 rejected its input: top_experts has dtype float32")) as ei:
        pair.ws.check_errors(blocking=True)
    assert "every rank raises, this is rank 0" in str(ei.value)
    # raised and cleared: the next call runs as the baseline's (the peer's next epoch is far ahead)
    pair.flags[RANK][PEER] = AHEAD
    again = pair.schedule(pair.header)
    assert _errors(pair.ws) == [0] * ErrorCode.NUM_CODES
    assert _state(pair)[HALTED] == 0 and _state(pair)[EPOCH] == epoch + 1
    for name in expected:
        assert torch.equal(again[name], expected[name]), name


def test_rejection_recorded_before_the_peer_moved_on_is_seen():
    pair = SimulatedPair(MoKConfig())
    pair.peer_header(SCHEDULE_REGIONS, pair.header)
    epoch = _state(pair)[EPOCH] + 1
    _peer_rejects(pair, epoch, slot=epoch + 3)  # the peer rejected here, then went on
    pair.schedule(pair.header)
    v = _errors(pair.ws)
    assert v[ErrorCode.HEADER_MISMATCH] == -(1 + PEER) and v[ErrorCode.HEADER_VALUE] == VERDICT, v
    with pytest.raises(MoKInputError, match="rank 1 rejected its input"):
        pair.ws.check_errors(blocking=True)


def test_stale_rejection_marker_is_not_an_arrival_nor_a_rejection():
    pair = SimulatedPair(MoKConfig())
    pair.peer_header(SCHEDULE_REGIONS, pair.header)
    pair.schedule(pair.header)  # epoch 1, the peer far ahead
    epoch = _state(pair)[EPOCH]
    _peer_rejects(pair, epoch)  # a rejection of the call before: the peer has not reached this one
    pair.schedule(pair.header, timeout_s=0.05)
    v = _errors(pair.ws)
    assert v[ErrorCode.PEER_TIMEOUT] == 1 + PEER and v[ErrorCode.HEADER_MISMATCH] == 0, v
    with pytest.raises(MoKPeerTimeoutError):
        pair.ws.check_errors(blocking=True)


def test_barrier_reject_stores_the_record_then_the_marker_without_waiting():
    from megatron_mok import ops

    pair = SimulatedPair(MoKConfig())
    pair.flags[RANK][PEER] = 0  # the peer never arrives: a wait would time out
    ptrs = [f.data_ptr() for f in pair.flags]
    st = _state(pair)
    t0 = time.monotonic()
    ops.barrier_reject(pair.state, pair.ws.errors, ptrs, RANK, VERDICT, bump_gather=True)
    torch.cuda.synchronize()
    assert time.monotonic() - t0 < 1.0
    e = st[EPOCH] + 1
    after = _state(pair)
    assert after[EPOCH] == e and after[GATHER_COUNT] == st[GATHER_COUNT] + 1
    assert after[GATHER_PARITY] == st[GATHER_COUNT] & 1
    for f in pair.flags:  # every buffer, its own included
        assert int(f[RANK]) == -e
        assert [int(w) for w in _record_at(f, RANK).tolist()] == [e, VERDICT]
    assert _errors(pair.ws) == [0] * ErrorCode.NUM_CODES
    ops.barrier_reject(pair.state, pair.ws.errors, ptrs, RANK, VERDICT, bump_gather=False)
    torch.cuda.synchronize()
    assert _state(pair)[EPOCH] == e + 1 and _state(pair)[GATHER_COUNT] == after[GATHER_COUNT]
    # a rank already stopped (flag set) stops its peers at that earlier barrier: nothing is sent
    pair.ws.errors[ErrorCode.HEADER_MISMATCH] = 5
    before = [f.clone() for f in pair.flags]
    ops.barrier_reject(pair.state, pair.ws.errors, ptrs, RANK, VERDICT, bump_gather=True)
    torch.cuda.synchronize()
    assert _state(pair)[EPOCH] == e + 1 and all(torch.equal(a, b) for a, b in zip(before, pair.flags))
    pair.ws.errors.zero_()


def test_ep1_failed_check_raises_as_before_and_the_workspace_stays_usable():
    shape = (256, 256, 128, 128, 8, 2)
    cfg, ws, top, w, gen = make_case(shape, "random", 7, DEV)
    x, probs, fc1, fc2, sfc1, sfc2 = w
    g = torch.randn(shape[0], shape[1], generator=gen).bfloat16().to(DEV)

    def good():
        sched = functional.build_schedule(cfg, ws, top)
        out, ctx = functional.forward(cfg, ws, sched, *w)
        grads = functional.backward(cfg, ws, sched, ctx, g, *w)
        torch.cuda.synchronize()
        return [out, grads.dx, grads.dprobs, grads.dfc1, grads.dfc2, grads.dshared_fc1, grads.dshared_fc2]

    base = good()
    with pytest.raises(MoKInputError, match="top_experts must be int32 or int64"):
        functional.build_schedule(cfg, ws, top.float())
    sched = functional.build_schedule(cfg, ws, top)
    with pytest.raises(MoKInputError, match=re.escape(f"x must have shape [{shape[0]}, {shape[1]}], got [0, ")):
        functional.forward(cfg, ws, sched, x[:0], probs, fc1, fc2, sfc1, sfc2)
    with pytest.raises(MoKInputError, match="x has dtype float16; the expert weights"):
        functional.forward(cfg, ws, sched, x.half(), probs, fc1, fc2, sfc1, sfc2)
    _, ctx = functional.forward(cfg, ws, sched, *w)
    with pytest.raises(MoKInputError, match="grad_out has dtype float32; expected bfloat16"):
        functional.backward(cfg, ws, sched, ctx, g.float(), *w)
    torch.cuda.synchronize()
    assert _errors(ws) == [0] * ErrorCode.NUM_CODES
    ws.check_errors(blocking=True)
    for a, b in zip(base, good()):
        assert (a is None and b is None) or torch.equal(bits(a), bits(b))


def test_a_stopped_barrier_empties_the_schedule_it_is_given():
    """ops.barrier / ops.publish_barrier with ``schedule=``: left alone while nothing is flagged (the
    same bits), emptied once the rank is stopped (the kernels after it then move no peer rows)."""
    import types

    from megatron_mok import ops

    pair = SimulatedPair(MoKConfig())
    ptrs = [f.data_ptr() for f in pair.flags]
    counts = torch.tensor([3, 0, 130, 5], dtype=torch.int32, device=DEV)
    offsets = torch.tensor([0, 128, 128, 384, 512], dtype=torch.int32, device=DEV)
    sched = types.SimpleNamespace(expert_counts=counts.clone(), expert_offsets=offsets.clone())
    src = torch.randn(T, H, device=DEV).bfloat16()
    dst = torch.empty_like(src)
    ops.barrier(pair.state, pair.ws.errors, ptrs, RANK, 5.0, schedule=sched)
    ops.publish_barrier(src, dst, pair.state, pair.ws.errors, ptrs, RANK, 5.0, schedule=sched)
    torch.cuda.synchronize()
    assert torch.equal(sched.expert_counts, counts) and torch.equal(sched.expert_offsets, offsets)
    assert _errors(pair.ws) == [0] * ErrorCode.NUM_CODES and torch.equal(bits(dst), bits(src))
    for launch in (lambda: ops.barrier(pair.state, pair.ws.errors, ptrs, RANK, 5.0, schedule=sched),
                   lambda: ops.publish_barrier(src, dst, pair.state, pair.ws.errors, ptrs, RANK, 5.0, schedule=sched)):
        sched.expert_counts.copy_(counts)
        sched.expert_offsets.copy_(offsets)
        _peer_rejects(pair, _state(pair)[EPOCH] + 1)
        launch()
        torch.cuda.synchronize()
        assert int(sched.expert_counts.abs().sum()) == 0 and int(sched.expert_offsets.abs().sum()) == 0
        with pytest.raises(MoKInputError, match="rank 1 rejected its input"):
            pair.ws.check_errors(blocking=True)
        pair.flags[RANK][PEER] = AHEAD
