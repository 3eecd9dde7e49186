"""The per-call header of the GPU path (megatron_mok/header.py) on the host: its words, the error
encoding the device check writes (csrc/kernels/comm/barrier.cuh: header_check), and the
``MoKInputError`` that ``ws.check_errors`` raises from it; the verdict word a rank whose host checks
fail sends in the call's first device barrier (functional._reject, the launch mocked), and the error
its peers raise from it. The device side: tests/gpu/test_header_check_1gpu.py and _2gpu.py."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

from megatron_mok import MoKConfig, MoKInputError, create_workspace
from megatron_mok import functional
from megatron_mok.header import (
    HEADER_FIELDS,
    HEADER_MAGIC,
    HEADER_REGIONS,
    HEADER_WORDS,
    VERDICT_ARGS,
    VERDICT_CALLS,
    VERDICT_PROBLEMS,
    VERDICT_WORDS,
    barrier_flag_ints,
    call_header,
    decode_mismatch,
    decode_verdict,
    encode_verdict,
    mismatch_message,
    precision_code,
    verdict_message,
    verdict_of,
)
from megatron_mok.workspace import ErrorCode

ROOT = Path(__file__).resolve().parents[1]


def _code(word: int, site: int, peer: int) -> int:
    return 1 + word + HEADER_WORDS * (site + 2 * peer)  # what header_check stores


def test_layout_matches_the_kernels():
    api = (ROOT / "csrc" / "kernels" / "api.h").read_text()
    assert f"constexpr int kHeaderWords = {HEADER_WORDS};" in api
    assert f"constexpr int kHeaderRegions = {HEADER_REGIONS};" in api
    common = (ROOT / "csrc" / "kernels" / "common.cuh").read_text()
    assert f"kErrHeaderMismatch = {int(ErrorCode.HEADER_MISMATCH)}," in common
    assert f"kErrHeaderValue = {int(ErrorCode.HEADER_VALUE)}," in common
    barrier = (ROOT / "csrc" / "kernels" / "comm" / "barrier.cuh").read_text()
    assert "1 + w + kHeaderWords * (site + 2 * p)" in barrier
    assert len(HEADER_FIELDS) == HEADER_WORDS
    assert f"constexpr int kVerdictWords = {VERDICT_WORDS};" in api
    assert "kStateHalted = 9," in api
    assert barrier_flag_ints(2) == 2 + 3 * 2 * 8 + 2 * 2  # epochs, three header regions, verdict records
    # what a waiter stores for a rejecting peer, and the record it reads (epoch, then the verdict word)
    assert "atomicCAS(errors + kErrHeaderMismatch, 0, -(1 + p))" in barrier
    barrier_cu = (ROOT / "csrc" / "kernels" / "comm" / "barrier.cu").read_text()
    assert "rec[0] = epoch;" in barrier_cu and "rec[1] = verdict;" in barrier_cu
    # the reference path's agreement packet carries every error slot
    from megatron_mok import workspace

    assert ErrorCode.NUM_CODES <= workspace._ERROR_WORDS


def test_header_words():
    cfg = MoKConfig(precision="fp8", fp8_dgrad=True, fp8_wgrad=False)
    h = call_header(num_tokens=4096, hidden=7168, topk=8, num_experts=256, capacity=65536, dtype=torch.bfloat16,
                    cfg=cfg, ep_size=8)
    assert h[:7] == [HEADER_MAGIC, 4096, 7168, 8, 256, 65536, 1]
    assert h[7] == precision_code(cfg, 8) == 0b0011  # fp8, fp8 dgrad, bf16 wgrad, staged
    assert precision_code(MoKConfig(), 2) == 0b1000  # bf16, persistent at EP > 1 ("auto")
    assert precision_code(MoKConfig(forward_kernel="staged"), 2) == 0
    assert all(-(2**31) <= w < 2**31 for w in h)


@pytest.mark.parametrize("word,site,peer", [(0, 0, 1), (1, 0, 1), (7, 1, 3), (6, 1, 71)])
def test_decode(word, site, peer):
    assert decode_mismatch(_code(word, site, peer)) == (word, site, peer)


def _ws(rank: int = 0):
    ws = create_workspace(None, "cpu", 64, 32, 2, 4, MoKConfig())
    ws.rank = rank
    return ws


def test_check_errors_names_the_field_and_both_values():
    ws = _ws()
    ws.call_headers[0] = call_header(num_tokens=64, hidden=32, topk=2, num_experts=4, capacity=256, dtype=None,
                                     cfg=MoKConfig(), ep_size=2)
    ws.errors[ErrorCode.HEADER_MISMATCH] = _code(1, 0, 1)
    ws.errors[ErrorCode.HEADER_VALUE] = 128
    ws.errors[ErrorCode.EXPERT_ID_OUT_OF_RANGE] = 5  # a consequence of the mismatch: not the error raised
    with pytest.raises(MoKInputError) as ei:
        ws.check_errors()
    msg = str(ei.value)
    assert "mok build_schedule: the ranks of the EP group disagree on num_tokens (T)" in msg
    assert "this rank (rank 0): 64; rank 1: 128" in msg
    assert "every rank raises this error" in msg
    ws.check_errors()  # reported once (every slot was cleared)


def test_check_errors_decodes_dtype_precision_and_magic():
    ws = _ws(rank=2)
    cfg = MoKConfig(forward_kernel="staged")
    ws.call_headers[1] = call_header(num_tokens=64, hidden=32, topk=2, num_experts=4, capacity=256,
                                     dtype=torch.bfloat16, cfg=cfg, ep_size=4)
    ws.errors[ErrorCode.HEADER_MISMATCH] = _code(7, 1, 0)
    ws.errors[ErrorCode.HEADER_VALUE] = precision_code(MoKConfig(precision="fp8"), 4)
    with pytest.raises(MoKInputError, match=re.escape(
            "mok backward: the ranks of the EP group disagree on precision: this rank (rank 2): precision=bf16, "
            "dgrad=bf16, wgrad=bf16, forward_kernel=staged; rank 0: precision=fp8, dgrad=fp8, wgrad=fp8, "
            "forward_kernel=staged")):
        ws.check_errors()
    ws.errors[ErrorCode.HEADER_MISMATCH] = _code(6, 1, 3)
    ws.errors[ErrorCode.HEADER_VALUE] = 3
    with pytest.raises(MoKInputError, match=re.escape("activation dtype: this rank (rank 2): bfloat16; rank 3: float32")):
        ws.check_errors()
    ws.errors[ErrorCode.HEADER_MISMATCH] = _code(0, 0, 1)
    ws.errors[ErrorCode.HEADER_VALUE] = 0
    with pytest.raises(MoKInputError, match=r"this rank \(rank 2\): unknown; rank 1: 0x0 \(no mok header"):
        ws.check_errors()  # no schedule header recorded on this rank: its own value is unknown


def test_message_of_unknown_codes_does_not_fail():
    assert "rank 5" in mismatch_message(_code(6, 0, 5), 99, 0, None)
    assert "precision code 4096" in mismatch_message(_code(7, 0, 1), 4096, 0, [HEADER_MAGIC] + [0] * 7)


# ---- the verdict word --------------------------------------------------------------------------


def test_verdict_word_round_trips():
    for c in VERDICT_CALLS:
        for a in VERDICT_ARGS:
            for pr in VERDICT_PROBLEMS:
                for dim, value in ((0, 0), (2, 7168), (3, 4), (1, 2**40)):
                    w = encode_verdict(c, a, pr, dim, value)
                    assert 0 <= w < 2**31
                    assert decode_verdict(w) == (c, a, pr, dim, min(value, 2**19 - 1))
    assert decode_verdict(encode_verdict("no such call", "nothing", "unknown")) == ("build_schedule", "an input",
                                                                                   "other", 0, 0)


def _reason(err, call="forward", peer=1, rank=0) -> str:
    return verdict_message(peer, verdict_of(err, call), rank)


def _raised(fn) -> Exception:
    with pytest.raises(MoKInputError) as ei:
        fn()
    return ei.value


def test_verdict_of_names_the_check_that_failed():
    ws = _ws()
    T, H = ws.num_tokens, ws.hidden
    x = torch.randn(T, H)
    err = _raised(lambda: functional._check_tensor("x", x.half(), (T, H), (torch.float32,), ws.device))
    assert _reason(err).startswith("mok forward: rank 1 rejected its input: x has dtype float16 (")
    nle = ws.num_local_experts
    fc1, fc2 = torch.randn(nle, 32, H).bfloat16(), torch.randn(nle, H, 16).bfloat16()
    err = _raised(lambda: functional.check_inputs(ws, x.half(), torch.rand(T, 2), fc1, fc2))
    assert str(err) == "x has dtype float16; the expert weights (fc1, fc2) have bfloat16, and x must have theirs"
    assert "rank 1 rejected its input: x has dtype float16 (" in _reason(err)
    err = _raised(lambda: functional.check_inputs(ws, x.bfloat16(), torch.rand(T, 2), fc1, fc2.float()))
    assert "rank 1 rejected its input: fc2 has dtype float32" in _reason(err)  # the weights disagree: fc2's fault
    err = _raised(lambda: functional._check_tensor("x", x[:0], (T, H), (torch.float32,), ws.device))  # T = 0
    assert "rank 1 rejected its input: x has the wrong shape (size 0 in dim 0)" in _reason(err)
    err = _raised(lambda: functional._check_tensor("grad_out", x[:, :-8], (T, H), (torch.float32,), ws.device))
    assert f"mok backward: rank 1 rejected its input: grad_out has the wrong shape (size {H - 8} in dim 1)" in \
        _reason(err, "backward")
    err = _raised(lambda: functional._check_tensor("probs", x.view(-1), (T, 2), (torch.float32,), ws.device))
    assert "probs has 1 dimensions" in _reason(err)
    err = _raised(lambda: functional._check_cfg(None))
    assert "cfg is not what the call takes" in _reason(err)
    err = _raised(lambda: functional.report_slow_path(MoKConfig(strict=True), "x is float32"))
    assert "pure-PyTorch reference and MoKConfig.strict is set" in _reason(err)
    # checks of other modules: read from their messages
    from megatron_mok.schedule import validate_top_experts

    err = _raised(lambda: validate_top_experts(ws, torch.zeros(T, 2)))
    assert "mok build_schedule: rank 1 rejected its input: top_experts has dtype float32" in \
        _reason(err, "build_schedule")
    stale = functional.build_schedule(MoKConfig(), ws, torch.zeros(T, 2, dtype=torch.int32) + torch.tensor([0, 1]))
    functional.build_schedule(MoKConfig(), ws, torch.zeros(T, 2, dtype=torch.int32) + torch.tensor([0, 1]))
    err = _raised(lambda: functional.check_schedule(ws, stale, "forward", latest=True))
    assert "sched is not the schedule this call must use" in _reason(err)
    assert "failed a host check" in _reason(MoKInputError("something new"))


def test_check_errors_names_the_rejecting_rank_and_its_reason():
    ws = _ws(rank=0)
    word = encode_verdict("forward", "x", "shape", 0, 0)
    ws.errors[ErrorCode.HEADER_MISMATCH] = -(1 + 3)
    ws.errors[ErrorCode.HEADER_VALUE] = word
    ws.errors[ErrorCode.EXPERT_ID_OUT_OF_RANGE] = 2  # not the error raised
    with pytest.raises(MoKInputError, match=re.escape(
            "mok forward: rank 3 rejected its input: x has the wrong shape (size 0 in dim 0) (that rank's host "
            "check failed before the call's first device barrier")) as ei:
        ws.check_errors()
    assert "every rank raises, this is rank 0" in str(ei.value)
    ws.check_errors()  # reported once


class _FakeComm:
    state = object()
    flag_ptrs = [16, 32]


@pytest.fixture
def kernel_path(monkeypatch):
    """A two-rank workspace that claims a GPU, with the kernels 'available' and the rejection launch
    recorded instead of run (no GPU here): what the failing rank sends and raises."""
    from megatron_mok import ops
    from megatron_mok.cuda import comm as comm_module

    sent = []
    monkeypatch.setattr(ops, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    monkeypatch.setattr(comm_module, "comm", lambda ws: _FakeComm())
    monkeypatch.setattr(ops, "barrier_reject", lambda *a, **kw: sent.append((a, kw)))
    ws = create_workspace(None, "cpu", 64, 32, 2, 4, MoKConfig())
    ws.device, ws.ep_size, ws.rank = torch.device("cuda", 0), 2, 1
    return ws, sent


def _layer_inputs(ws):
    T, H, nle = ws.num_tokens, ws.hidden, ws.num_local_experts
    return (torch.randn(T, H).bfloat16(), torch.rand(T, ws.topk), torch.randn(nle, 32, H).bfloat16(),
            torch.randn(nle, H, 16).bfloat16())


def test_failing_rank_sends_its_verdict_then_raises_its_own_error(kernel_path):
    ws, sent = kernel_path
    cfg = MoKConfig()
    # the schedule: the peers wait in the routing all-gather's barrier (it flips the gather half)
    with pytest.raises(MoKInputError, match="top_experts must be int32 or int64, got torch.float32"):
        functional.build_schedule(cfg, ws, torch.zeros(ws.num_tokens, 2))
    (args, kw), = sent
    assert args[:3] == (_FakeComm.state, ws.errors, _FakeComm.flag_ptrs) and args[3] == 1
    assert decode_verdict(args[4]) == ("build_schedule", "top_experts", "dtype", 0, 3) and kw == {"bump_gather": True}
    # the forward: T = 0 on this rank (the shape check fails before the device check)
    sched = functional.MoKSchedule(*(torch.zeros(1),) * 5, workspace_uid=ws.uid, step=ws.schedule_step)
    x, probs, fc1, fc2 = _layer_inputs(ws)
    with pytest.raises(MoKInputError, match=re.escape("x must have shape [64, 32], got [0, 32]")):
        functional.forward(cfg, ws, sched, x[:0], probs, fc1, fc2)
    assert decode_verdict(sent[-1][0][4]) == ("forward", "x", "shape", 0, 0) and sent[-1][1] == {"bump_gather": False}
    with pytest.raises(MoKInputError, match="cfg must be a MoKConfig"):
        functional.recompute_forward_context(None, ws, sched, x, fc1, fc2)
    assert decode_verdict(sent[-1][0][4])[:3] == ("recompute_forward_context", "cfg", "type")
    assert len(sent) == 3
    # what a peer raises from that verdict (its barrier stored -(1 + 1) and the word)
    peer = _ws(rank=0)
    peer.errors[ErrorCode.HEADER_MISMATCH] = -2
    peer.errors[ErrorCode.HEADER_VALUE] = sent[1][0][4]
    with pytest.raises(MoKInputError, match=re.escape("mok forward: rank 1 rejected its input: x has the wrong "
                                                      "shape (size 0 in dim 0)")):
        peer.check_errors()


def test_failing_backward_sends_grad_out(kernel_path, monkeypatch):
    ws, sent = kernel_path
    monkeypatch.setattr(functional, "check_inputs", lambda *a, **kw: None)  # the CPU tensors' device
    sched = functional.MoKSchedule(*(torch.zeros(1),) * 5, workspace_uid=ws.uid, step=ws.schedule_step)
    x, probs, fc1, fc2 = _layer_inputs(ws)
    with pytest.raises(MoKInputError, match="grad_out has dtype float32; expected bfloat16"):
        functional.backward(MoKConfig(), ws, sched, None, x.float(), x, probs, fc1, fc2)
    (args, kw), = sent
    assert decode_verdict(args[4]) == ("backward", "grad_out", "dtype", 0, 3) and kw == {"bump_gather": False}


def test_no_rejection_launch_when_checks_pass_or_alone(kernel_path):
    ws, sent = kernel_path
    assert functional._verdict(torch.zeros(1), ws, "forward", lambda: True) == (None, True)
    ws.ep_size = 1  # alone: no peer to tell; the error is raised as before
    with pytest.raises(MoKInputError, match="top_experts must be int32"):
        functional.build_schedule(MoKConfig(), ws, torch.zeros(ws.num_tokens, 2))
    assert sent == []


def test_a_failed_rejection_launch_does_not_hide_the_input_error(kernel_path, monkeypatch):
    ws, _ = kernel_path
    from megatron_mok import ops

    def broken(*a, **kw):
        raise RuntimeError("no such op")

    monkeypatch.setattr(ops, "barrier_reject", broken)
    with pytest.raises(MoKInputError, match="top_experts must be int32") as ei:
        functional.build_schedule(MoKConfig(), ws, torch.zeros(ws.num_tokens, 2))
    assert any("could not reach the peers (no such op)" in n for n in ei.value.__notes__)
