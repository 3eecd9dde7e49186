"""Pieces of scripts/bench_layer.py that run without a GPU."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]


def _bench():
    spec = importlib.util.spec_from_file_location("bench_layer", ROOT / "scripts" / "bench_layer.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_symm_a2a_sorts_received_rows_by_expert():
    """The symm_a2a baseline's receiver: rows of each expert contiguous, in arrival order, experts in
    order, unwritten rows (sentinel ids) last; offs are the group ends for torch._grouped_mm."""
    bench = _bench()
    nle = 5
    ids = torch.tensor([3, 0, 5, 3, 1, 0, 7, 3, -1, 1], dtype=torch.float32).to(torch.bfloat16)
    perm, offs = bench.sort_rows_by_expert(ids, nle)
    assert perm.tolist() == [1, 5, 4, 9, 0, 3, 7, 2, 6, 8]
    assert offs.dtype == torch.int32 and offs.tolist() == [2, 4, 4, 7, 7]
    # all 256 ids a bf16 column can carry exactly
    ids = torch.arange(255, -1, -1).to(torch.bfloat16)
    perm, offs = bench.sort_rows_by_expert(ids, 256)
    assert perm.tolist() == list(range(255, -1, -1)) and offs.tolist() == list(range(1, 257))
