"""The per-call header of the GPU path (megatron_mok/header.py) on the host: its words, the error
encoding the device check writes (csrc/kernels/comm/barrier.cuh: header_check), and the
``MoKInputError`` that ``ws.check_errors`` raises from it. The device side: tests/gpu/test_header_check_1gpu.py."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

from megatron_mok import MoKConfig, MoKInputError, create_workspace
from megatron_mok.header import (
    HEADER_FIELDS,
    HEADER_MAGIC,
    HEADER_REGIONS,
    HEADER_WORDS,
    barrier_flag_ints,
    call_header,
    decode_mismatch,
    mismatch_message,
    precision_code,
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
    assert barrier_flag_ints(2) == 2 + 3 * 2 * 8
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
