"""What the forward keeps for the backward (issue #32): the size formula of the CUDA path's context
(``megatron_mok.cuda.context.saved_bytes``) against the design document's table and against a
schedule built for a known routing. The GPU tests check that the context the kernels return holds
exactly these bytes (tests/gpu/test_backward_1gpu.py)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

from megatron_mok import MoKConfig, create_workspace
from megatron_mok.config import routed_capacity
from megatron_mok.cuda.context import KernelContext, saved_bytes
from megatron_mok.schedule import build_schedule_reference

ROOT = Path(__file__).resolve().parents[1]
DSV3 = dict(I=2048, Is=2048, k=8, E=256)


def _design_table() -> list[tuple[int, int, float, int, float]]:
    """(EP, T, capacity_factor, cap, KiB a token) rows of docs/DESIGN.md section 7.1's table."""
    text = (ROOT / "docs" / "DESIGN.md").read_text()
    section = text[text.index("### 7.1 What the forward keeps"):text.index("### 7.2")]
    rows = re.findall(r"^\| (\d+) \| (\d+) \| ([\d.]+) \| (\d+) \| ([\d.]+) KiB \|$", section, re.M)
    return [(int(ep), int(t), float(cf), int(cap), float(kib)) for ep, t, cf, cap, kib in rows]


def test_design_table_matches_the_formula():
    rows = _design_table()
    assert len(rows) >= 5, "the design document's table of saved bytes is missing"
    for ep, T, cf, cap, kib in rows:
        want_cap = routed_capacity(MoKConfig(capacity_factor=cf), ep, T, DSV3["k"], DSV3["E"] // ep)
        assert cap == want_cap, (ep, T, cf)
        got = saved_bytes(cap, T, DSV3["I"], DSV3["Is"], keep_gate_up=True) / T / 1024
        assert got == pytest.approx(kib, abs=0.01), (ep, T, cf, got)


def test_saved_bytes_of_a_known_routing():
    """Schedules for known routings (even; skewed: one expert takes most rows, some take none): a
    context of the shapes the forward allocates for them (on the meta device) holds the formula's
    bytes, which depend on the capacity only, never on the routing."""
    T, H, I, Is, k, E = 300, 64, 96, 32, 4, 8
    cfg = MoKConfig()
    ws = create_workspace(None, "cpu", T, H, k, E, cfg)
    gen = torch.Generator().manual_seed(3)
    sizes = set()
    for skew in (0.0, 0.9):
        top = torch.stack([torch.randperm(E, generator=gen)[:k] for _ in range(T)])
        heavy = torch.rand(T, generator=gen) < skew
        top[heavy, 0] = 0
        top[heavy, 1:] = torch.arange(1, k)  # rows of expert 0 and a few others; experts k.. get none
        sched = build_schedule_reference(ws, top.to(torch.int32))
        assert sched.capacity == routed_capacity(cfg, 1, T, k, E)
        ctx = KernelContext(torch.empty((sched.capacity, 2 * I), dtype=torch.bfloat16, device="meta"),
                            torch.empty((T, 2 * Is), dtype=torch.bfloat16, device="meta"))
        assert ctx.nbytes() == saved_bytes(sched.capacity, T, I, Is, keep_gate_up=True)
        sizes.add(ctx.nbytes())
    assert len(sizes) == 1
    assert saved_bytes(sched.capacity, T, I, None, keep_gate_up=True) == 2 * sched.capacity * 2 * I
    assert saved_bytes(sched.capacity, T, I, Is, keep_gate_up=False) == 0
