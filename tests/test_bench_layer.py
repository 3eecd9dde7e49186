"""Pieces of scripts/bench_layer.py that run without a GPU."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
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


def test_busy_time_merges_overlapping_kernels():
    bl = _bench()
    # two streams overlap on [2, 3); a gap [5, 6)
    assert bl.busy_time([(0.0, 3.0), (2.0, 5.0), (6.0, 7.0)]) == (6.0, 7.0)
    assert bl.busy_time([(1.0, 2.0), (1.2, 1.5)]) == (1.0, 1.0)
    assert bl.busy_time([]) == (0.0, 0.0)


def test_symm_a2a_backward_gathers_match_index_select_autograd():
    bl = _bench()
    gen = torch.Generator().manual_seed(0)
    T, k, H = 5, 3, 4
    flat = torch.randint(0, 7, (T * k,), generator=gen)
    order = torch.argsort(flat, stable=True)
    back_order = torch.argsort(order)
    x = torch.randn(T, H, generator=gen, dtype=torch.float64, requires_grad=True)
    g = torch.randn(T * k, H, generator=gen, dtype=torch.float64)
    rows = bl._GatherRows.apply(x, order // k, None, back_order, k)
    (got,) = torch.autograd.grad(rows, x, g)
    (want,) = torch.autograd.grad(x.index_select(0, order // k), x, g)
    assert torch.equal(rows, x.index_select(0, order // k))
    assert torch.allclose(got, want, rtol=0, atol=1e-12)
    perm = torch.randperm(T * k, generator=gen)
    inv = torch.empty_like(perm).index_copy_(0, perm, torch.arange(T * k))
    src = torch.randn(T * k, H, generator=gen, dtype=torch.float64, requires_grad=True)
    (got,) = torch.autograd.grad(bl._GatherRows.apply(src, perm, inv, None, 0), src, g)
    (want,) = torch.autograd.grad(src.index_select(0, perm), src, g)
    assert torch.equal(got, want)


def test_backend_names_parse_fields_and_switches():
    bl = _bench()
    assert bl.config_overrides("mok@fwd_comm_sms=8+minibatch_rows=2048") == {"fwd_comm_sms": 8, "minibatch_rows": 2048}
    assert bl.config_overrides("mok@precision=fp8") == {"precision": "fp8"}
    assert bl.config_overrides("mok@capacity_factor=0.5") == {"capacity_factor": 0.5}
    assert bl.config_overrides("mok@precision=fp8+fp8_dgrad=false") == {"precision": "fp8", "fp8_dgrad": False}
    # fields before a kernel switch; the switch is parse_env_backend's
    assert bl.config_overrides("mok@precision=fp8%MOK_FWD_OVERLAP=0") == {"precision": "fp8"}
    assert bl.parse_env_backend("mok@precision=fp8%MOK_FWD_OVERLAP=0") == (("MOK_FWD_OVERLAP", "0"),)
    assert bl.parse_env_backend("mok@precision=fp8%MOK_FP8_PUSH=0%MOK_BWD_SIDE_EARLY=0") == \
        (("MOK_FP8_PUSH", "0"), ("MOK_BWD_SIDE_EARLY", "0"))
    assert bl.config_overrides("mok@precision=fp8%MOK_FP8_PUSH=0%MOK_BWD_SIDE_EARLY=0") == {"precision": "fp8"}
    for bad in ("mok%FOO=1", "mok%MOK_FP8_PUSH=0%MOK_X", "mok%MOK_FP8_PUSH="):
        with pytest.raises(ValueError, match="MOK_ kernel switch"):
            bl.parse_env_backend(bad)
    assert bl.config_overrides("mok%MOK_BWD_KERNEL=mega") == {}
