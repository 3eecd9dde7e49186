"""CPU tests of the library API (``mok_moe`` and the functional forward/backward) on gloo ranks.

* numerics: outputs and every gradient against an independent dense fp64 oracle written here
  (a loop over tokens and top-k slots, autograd for the gradients; no megatron_mok code), at
  EP = 1, 2, 4, for fp64 / fp32 / bf16 inputs and several routings;
* the schedule contract of ``build_schedule`` (docs/DESIGN.md);
* determinism: repeated runs and every MoKConfig knob give the same bits;
* bad inputs raise a clear error on every rank, and nothing hangs;
* ``recompute_forward_context`` and ``main_grads``.

EP = 1 runs in this process without torch.distributed; EP = 2 and 4 spawn gloo ranks
(``dist_utils.run_distributed``), each spawned run grouping many checks.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import math
import re

import pytest
import torch
import torch.distributed as dist

from dist_utils import run_distributed

import megatron_mok as mok
from megatron_mok import (
    ROW_ALIGN,
    MoKCapacityError,
    MoKConfig,
    MoKInputError,
    clear_workspace_cache,
    get_workspace,
    mok_moe,
)
from megatron_mok.config import TILE_ROWS, routed_capacity

T, H, I, IS = 37, 24, 20, 12  # tokens per rank, hidden, expert and shared intermediate sizes
NLE = 3  # local experts per rank
TOL = {torch.float64: 1e-10, torch.float32: 1e-5, torch.bfloat16: 1e-2}
SPAWN_TIMEOUT = 150.0  # seconds for one spawned run (start-up included); a hang fails the test


# ==== problems (every tensor is a pure function of the seed, identical on every rank) =============


@dataclasses.dataclass
class Problem:
    """Every rank's inputs and every expert's weights, in fp64 holding fp32-representable values
    (so fp64 and fp32 runs share one oracle)."""

    top: torch.Tensor  # int64 [ep, T, k], global expert ids
    x: torch.Tensor  # [ep, T, H]
    probs: torch.Tensor  # [ep, T, k]
    grad: torch.Tensor  # [ep, T, H] gradient of the output
    fc1: torch.Tensor  # [E, 2I, H]  (all experts; rank r holds rows r*nle .. (r+1)*nle)
    fc2: torch.Tensor  # [E, H, I]
    sfc1: torch.Tensor | None  # [2Is, H] shared expert (replicated on every rank)
    sfc2: torch.Tensor | None  # [H, Is]

    @property
    def ep(self):
        return self.top.shape[0]

    @property
    def tokens(self):
        return self.top.shape[1]

    @property
    def topk(self):
        return self.top.shape[2]

    @property
    def num_experts(self):
        return self.fc1.shape[0]

    @property
    def nle(self):
        return self.num_experts // self.ep

    def rounded(self, dtype) -> "Problem":
        """The problem as a ``dtype`` run sees it, back in fp64 (router weights stay fp32)."""
        def r(t):
            return None if t is None else t.to(dtype).double()
        return Problem(self.top, r(self.x), self.probs, r(self.grad), r(self.fc1), r(self.fc2),
                       r(self.sfc1), r(self.sfc2))

    def local(self, rank, dtype, probs_dtype=torch.float32, requires_grad=True):
        """Fresh leaf tensors of ``rank`` in ``dtype``."""
        lo, hi = rank * self.nle, (rank + 1) * self.nle

        def leaf(t, dt=dtype):
            if t is None:
                return None
            return t.to(dt).clone().requires_grad_(requires_grad)

        return dict(
            x=leaf(self.x[rank]), top=self.top[rank].clone(), probs=leaf(self.probs[rank], probs_dtype),
            grad=self.grad[rank].to(dtype), fc1=leaf(self.fc1[lo:hi]), fc2=leaf(self.fc2[lo:hi]),
            sfc1=leaf(self.sfc1), sfc2=leaf(self.sfc2),
        )


def route_random(g, ep, tokens, num_experts, k):
    return torch.stack([torch.randperm(num_experts, generator=g)[:k] for _ in range(ep * tokens)]).view(ep, tokens, k)


def route_skewed(g, ep, tokens, num_experts, k):
    """Most rows on two hot experts (one on the first rank, one on the last), the rest spread."""
    w = torch.ones(num_experts, dtype=torch.float64)
    w[0], w[-1] = 60.0, 25.0
    return torch.multinomial(w.expand(ep * tokens, -1), k, replacement=False, generator=g).view(ep, tokens, k)


def route_excluding(excluded):
    def route(g, ep, tokens, num_experts, k):
        allowed = torch.tensor([e for e in range(num_experts) if e not in excluded])
        assert allowed.numel() >= k
        return torch.stack([allowed[torch.randperm(allowed.numel(), generator=g)[:k]]
                            for _ in range(ep * tokens)]).view(ep, tokens, k)
    return route


def route_fixed(experts_fn):
    """Every token of every rank routes to the same distinct experts ``experts_fn(num_experts)``."""
    def route(g, ep, tokens, num_experts, k):
        experts = torch.tensor(experts_fn(num_experts))
        assert experts.numel() == k and len(set(experts.tolist())) == k
        return experts.expand(ep, tokens, k).clone()
    return route


def make_problem(seed, ep, routing, k, tokens=T, nle=NLE, shared=True, hidden=H, inter=I, shared_inter=IS):
    g = torch.Generator().manual_seed(seed)
    num_experts = nle * ep

    def randn(*shape, scale=1.0):
        return (torch.randn(*shape, generator=g, dtype=torch.float32) * scale).double()

    top = routing(g, ep, tokens, num_experts, k).long()
    x = randn(ep, tokens, hidden)
    probs = (torch.rand(ep, tokens, k, generator=g, dtype=torch.float32) + 0.05).double()
    grad = randn(ep, tokens, hidden)
    fc1 = randn(num_experts, 2 * inter, hidden, scale=hidden ** -0.5)
    fc2 = randn(num_experts, hidden, inter, scale=inter ** -0.5)
    sfc1 = randn(2 * shared_inter, hidden, scale=hidden ** -0.5) if shared else None
    sfc2 = randn(hidden, shared_inter, scale=shared_inter ** -0.5) if shared else None
    return Problem(top, x, probs, grad, fc1, fc2, sfc1, sfc2)


# ==== the independent dense oracle (fp64, no megatron_mok code) ====================================


def _silu(v):
    return v * torch.sigmoid(v)


def dense_oracle(p: Problem, rank: int) -> dict:
    """fp64 reference of what ``rank`` must produce.

    Loss = sum_t <grad[rank, t], out[rank, t]> over this rank's tokens, plus, for the tokens of the
    other ranks, the terms probs * <grad, y> of their slots routed to THIS rank's experts, so the
    weight gradients of the local experts collect the contributions of every rank's tokens (the
    layer's output is linear in each slot's expert output).
    """
    ep, tokens, k = p.top.shape
    nle = p.nle
    inter = p.fc2.shape[2]
    top = p.top.tolist()
    x = p.x[rank].clone().requires_grad_()
    probs = p.probs[rank].clone().requires_grad_()
    w1 = p.fc1.clone().requires_grad_()
    w2 = p.fc2.clone().requires_grad_()
    shared = p.sfc1 is not None
    s1 = p.sfc1.clone().requires_grad_() if shared else None
    s2 = p.sfc2.clone().requires_grad_() if shared else None

    def expert(e, xt):
        h = torch.mv(w1[e], xt)
        return torch.mv(w2[e], _silu(h[:inter]) * h[inter:])

    rows = []
    for t in range(tokens):
        acc = torch.zeros(p.x.shape[2], dtype=torch.float64)
        for s in range(k):
            acc = acc + probs[t, s] * expert(top[rank][t][s], x[t])
        if shared:
            hs = torch.mv(s1, x[t])
            acc = acc + torch.mv(s2, _silu(hs[: s2.shape[1]]) * hs[s2.shape[1]:])
        rows.append(acc)
    out = torch.stack(rows)
    terms = [(out * p.grad[rank]).sum()]
    for r in range(ep):
        if r == rank:
            continue
        for t in range(tokens):
            for s in range(k):
                e = top[r][t][s]
                if rank * nle <= e < (rank + 1) * nle:
                    terms.append(p.probs[r, t, s] * torch.dot(p.grad[r, t], expert(e, p.x[r, t])))
    torch.stack(terms).sum().backward()
    lo, hi = rank * nle, (rank + 1) * nle
    return dict(out=out.detach(), dx=x.grad, dprobs=probs.grad, dfc1=w1.grad[lo:hi], dfc2=w2.grad[lo:hi],
                dsfc1=s1.grad if shared else None, dsfc2=s2.grad if shared else None)


def rel_err(a, b):
    a, b = a.detach().double(), b.detach().double()
    nb = b.norm().item()
    if nb == 0.0:
        return 0.0 if torch.count_nonzero(a) == 0 else math.inf
    return (a - b).norm().item() / nb


def assert_close(what, got, ref, tol):
    assert got is not None, f"{what}: missing"
    assert tuple(got.shape) == tuple(ref.shape), f"{what}: shape {tuple(got.shape)} != {tuple(ref.shape)}"
    err = rel_err(got, ref)
    assert err <= tol, f"{what}: relative error {err:.3e} > {tol:.0e}"


def rank_world(group=None):
    if dist.is_initialized():
        return dist.get_rank(group), dist.get_world_size(group)
    return 0, 1


def _grads(d):
    return [d["x"].grad, d["probs"].grad, d["fc1"].grad, d["fc2"].grad,
            None if d["sfc1"] is None else d["sfc1"].grad, None if d["sfc2"] is None else d["sfc2"].grad]


def run_autograd(d, cfg=None, group=None, main_grads=None, num_experts=None):
    """mok_moe forward + backward on the leaves of ``d``; returns [out, dx, dprobs, dfc1, dfc2, dsfc1, dsfc2]."""
    out = mok_moe(d["x"], d["top"], d["probs"], d["fc1"], d["fc2"], d["sfc1"], d["sfc2"], cfg=cfg, group=group,
                  main_grads=main_grads, num_experts=num_experts)
    out.backward(d["grad"])
    return [out.detach()] + _grads(d)


def run_functional(d, cfg=None, group=None, num_experts=None, main_grads=None):
    """build_schedule + forward + backward; returns (out, MoKGrads, ws, sched, ctx)."""
    cfg = cfg or MoKConfig()
    x, top = d["x"].detach(), d["top"]
    e = num_experts or d["fc1"].shape[0] * rank_world(group)[1]
    ws = get_workspace(group, x.device, x.shape[0], x.shape[1], top.shape[1], e, cfg)
    sched = mok.build_schedule(cfg, ws, top)
    w = [None if d[n] is None else d[n].detach() for n in ("probs", "fc1", "fc2", "sfc1", "sfc2")]
    out, ctx = mok.forward(cfg, ws, sched, x, *w)
    grads = mok.backward(cfg, ws, sched, ctx, d["grad"], x, *w, main_grads=main_grads)
    return out, grads, ws, sched, ctx


def grads_list(g):
    return [g.dx, g.dprobs, g.dfc1, g.dfc2, g.dshared_fc1, g.dshared_fc2]


def assert_bitwise(what, a, b):
    assert len(a) == len(b)
    for i, (u, v) in enumerate(zip(a, b)):
        if u is None or v is None:
            assert u is None and v is None, f"{what}[{i}]: {u is None} vs {v is None}"
            continue
        assert u.dtype == v.dtype and torch.equal(u, v), f"{what}[{i}]: not bitwise equal (max diff "\
            f"{(u.double() - v.double()).abs().max().item():.3e})"


# ==== numerics against the oracle ==================================================================

NAMES = ["out", "dx", "dprobs", "dfc1", "dfc2", "dsfc1", "dsfc2"]


def numeric_scenarios(ep):
    """(name, problem) pairs; every routing the brief asks for, with and without shared expert."""
    e = NLE * ep
    hot = e - 1  # an expert of the last rank
    zero = {1} if ep == 1 else {1, e - 2}
    return [
        ("random_k2_shared", make_problem(11, ep, route_random, 2, shared=True)),
        ("random_k3_noshared", make_problem(12, ep, route_random, 3, shared=False)),
        ("skewed_k2_shared", make_problem(13, ep, route_skewed, 2, shared=True)),
        ("zero_token_expert_k2_noshared", make_problem(14, ep, route_excluding(zero), 2, shared=False)),
        ("all_on_one_k1_noshared", make_problem(15, ep, route_fixed(lambda n: [hot]), 1, shared=False)),
        ("all_on_one_k3_shared", make_problem(16, ep, route_fixed(lambda n: [0, hot, n // 2]), 3, shared=True)),
        # more than ROW_ALIGN rows in one segment (multi-block padding); T = 150 is not special
        ("all_on_one_k1_T150_shared", make_problem(17, ep, route_fixed(lambda n: [hot]), 1, tokens=150,
                                                   shared=True)),
    ]


def check_numerics_one(name, p: Problem, dtype, group=None, probs_dtype=torch.float32):
    rank, world = rank_world(group)
    assert world == p.ep
    ref = dense_oracle(p if dtype != torch.bfloat16 else p.rounded(torch.bfloat16), rank)
    tol = TOL[dtype]
    tag = f"[{name} {str(dtype).replace('torch.', '')} ep={world} rank={rank}]"

    # mok_moe (autograd)
    d = p.local(rank, dtype, probs_dtype)
    got = run_autograd(d, group=group)
    assert got[0].dtype == dtype and got[1].dtype == dtype and got[2].dtype == probs_dtype
    assert got[3].dtype == dtype and got[4].dtype == dtype
    for n, g in zip(NAMES, got):
        if ref[n] is None:
            assert g is None, f"{tag} {n} should be None"
        elif n == "dprobs" and probs_dtype == torch.float32:
            # probs.grad has the dtype of probs: fp32 rounding of an fp64 result for fp64 x
            assert_close(f"{tag} mok_moe {n}", g, ref[n], max(tol, 1e-7))
        else:
            assert_close(f"{tag} mok_moe {n}", g, ref[n], tol)

    # experts that receive no row from any rank keep an exact zero gradient
    counts = torch.bincount(p.top.reshape(-1), minlength=p.num_experts)[rank * p.nle:(rank + 1) * p.nle]
    for e in range(p.nle):
        if counts[e] == 0:
            assert torch.count_nonzero(ref["dfc1"][e]) == 0  # sanity of the oracle
            assert torch.count_nonzero(got[3][e]) == 0 and torch.count_nonzero(got[4][e]) == 0, \
                f"{tag} expert {e} got no token but a nonzero weight gradient"

    # the lower-level functional API: same numbers, and the autograd wrapper adds nothing
    out, grads, *_ = run_functional(d, group=group)
    fg = [out] + grads_list(grads)
    wdt = torch.float64 if dtype == torch.float64 else torch.float32  # weight grads: fp32 (fp64 for fp64)
    assert grads.dfc1.dtype == wdt and grads.dfc2.dtype == wdt and grads.dx.dtype == dtype
    for n, g in zip(NAMES, fg):
        if ref[n] is None:
            assert g is None
        else:
            assert_close(f"{tag} functional {n}", g, ref[n], tol)
    cast = [fg[0], fg[1], fg[2].to(probs_dtype)] + [None if g is None else g.to(dtype) for g in fg[3:]]
    assert_bitwise(f"{tag} functional vs mok_moe", cast, got)
    for e in range(p.nle):
        if counts[e] == 0:
            assert torch.count_nonzero(grads.dfc1[e]) == 0 and torch.count_nonzero(grads.dfc2[e]) == 0


def check_numerics(rank=0, world=1):
    clear_workspace_cache()
    for name, p in numeric_scenarios(world):
        for dtype in (torch.float64, torch.float32, torch.bfloat16):
            # fp64 runs take fp64 router weights for problems with a shared expert, fp32 otherwise
            pd = torch.float64 if dtype == torch.float64 and p.sfc1 is not None else torch.float32
            check_numerics_one(name, p, dtype, probs_dtype=pd)


def check_subgroups(rank, world):
    """EP groups smaller than the world: [0, 1] and [2, 3] run independent EP=2 layers."""
    groups = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    mine = rank // 2
    for seed, route, k in ((21, route_random, 2), (22, route_skewed, 3)):
        p = make_problem(seed + 10 * mine, 2, route, k, shared=(k == 2))
        for dtype in (torch.float64, torch.float32):
            check_numerics_one(f"subgroup{mine}", p, dtype, group=groups[mine])


# ==== recompute_forward_context and main_grads ====================================================


def check_recompute_and_main_grads(rank=0, world=1):
    cfg = MoKConfig()
    for shared in (True, False):
        p = make_problem(31 + shared, world, route_skewed, 2, shared=shared)
        for dtype in (torch.float32, torch.bfloat16):
            tag = f"[shared={shared} {dtype}]"
            d = p.local(rank, dtype)
            out, grads, ws, sched, ctx = run_functional(d, cfg)
            x = d["x"].detach()
            w = [None if d[n] is None else d[n].detach() for n in ("probs", "fc1", "fc2", "sfc1", "sfc2")]
            # recompute rebuilds a context that gives the same backward bits
            ctx2 = mok.recompute_forward_context(cfg, ws, sched, x, w[1], w[2], w[3])
            for f in dataclasses.fields(ctx):
                a, b = getattr(ctx, f.name), getattr(ctx2, f.name)
                same = a == b if not isinstance(a, torch.Tensor) else torch.equal(a, b)
                assert (a is None and b is None) or same, f"{tag} ctx.{f.name} differs"
            g2 = mok.backward(cfg, ws, sched, ctx2, d["grad"], x, *w)
            assert_bitwise(f"{tag} backward(recomputed ctx)", grads_list(g2), grads_list(grads))
            g3 = mok.backward(cfg, ws, sched, None, d["grad"], x, *w)  # no ctx: recomputed inside
            assert_bitwise(f"{tag} backward(ctx=None)", grads_list(g3), grads_list(grads))

            # main_grads: fp32 buffers accumulate (existing content + gradient); fields are None
            gen = torch.Generator().manual_seed(1000 + rank)
            shapes = [d[n].shape if d[n] is not None else None for n in ("fc1", "fc2", "sfc1", "sfc2")]
            before = [None if s is None else torch.randn(s, generator=gen) for s in shapes]
            wg = grads_list(grads)[2:]
            main = [None if b is None else b.clone() for b in before]
            g4 = mok.backward(cfg, ws, sched, ctx, d["grad"], x, *w, main_grads=tuple(main))
            assert g4.dfc1 is None and g4.dfc2 is None and g4.dshared_fc1 is None and g4.dshared_fc2 is None
            assert_bitwise(f"{tag} main_grads dx/dprobs", grads_list(g4)[:2], grads_list(grads)[:2])
            for i, (m, b, gw) in enumerate(zip(main, before, wg)):
                if b is not None:
                    assert m.dtype == torch.float32 and torch.equal(m, b + gw), f"{tag} main_grads[{i}]"
            # the reference path adds at once even where the kernels could hold (hold_wgrads)
            held = [None if b is None else b.clone() for b in before]
            mok.backward(cfg.replace(wgrad_microbatches=2), ws, sched, ctx, d["grad"], x, *w,
                         main_grads=tuple(held), hold_wgrads=True)
            assert all(b is None or torch.equal(h, m) for h, m, b in zip(held, main, before)), f"{tag} hold_wgrads"
            assert mok.held_wgrads() == 0 and mok.flush_wgrads() == 0
            # a second backward adds again; a partial tuple only fuses the given entries
            g5 = mok.backward(cfg, ws, sched, ctx, d["grad"], x, *w, main_grads=(main[0], None, main[2], None))
            assert torch.equal(main[0], (before[0] + wg[0]) + wg[0]), f"{tag} second accumulation"
            assert g5.dfc1 is None and g5.dshared_fc1 is None
            assert torch.equal(g5.dfc2, grads.dfc2)
            assert (g5.dshared_fc2 is None) == (not shared)
            if shared:
                assert torch.equal(main[2], (before[2] + wg[2]) + wg[2]) and torch.equal(g5.dshared_fc2, grads.dshared_fc2)

            # ... and through mok_moe: the weight .grad stay None, the buffers accumulate
            d2 = p.local(rank, dtype)
            main = [None if b is None else b.clone() for b in before]
            got = run_autograd(d2, cfg, main_grads=tuple(main))
            assert all(g is None for g in got[3:]), f"{tag} mok_moe weight grads must be None with main_grads"
            assert torch.equal(got[0], out) and torch.equal(got[1], grads.dx) and torch.equal(got[2], grads.dprobs)
            for i, (m, b, gw) in enumerate(zip(main, before, wg)):
                if b is not None:
                    assert torch.equal(m, b + gw), f"{tag} mok_moe main_grads[{i}]"


# ==== schedule properties ==========================================================================


def check_schedule_one(p: Problem, cfg: MoKConfig, tag: str):
    rank, ep = rank_world()
    nle, k, tokens, e_all = p.nle, p.topk, p.tokens, p.num_experts
    ws = get_workspace(None, "cpu", tokens, 8, k, e_all, cfg)
    sched = mok.build_schedule(cfg, ws, p.top[rank].to(torch.int32 if p.topk % 2 else torch.int64))
    cap = routed_capacity(cfg, ep, tokens, k, nle)
    assert sched.capacity == cap == ws.capacity, tag
    for t_ in (sched.row_src_rank, sched.row_src_slot, sched.expert_counts, sched.expert_offsets, sched.top_experts_all):
        assert t_.dtype == torch.int32, tag
    assert torch.equal(sched.top_experts_all, p.top.to(torch.int32)), f"{tag} top_experts_all"
    src_rank, src_slot = sched.row_src_rank.tolist(), sched.row_src_slot.tolist()
    counts, offsets = sched.expert_counts.tolist(), sched.expert_offsets.tolist()
    assert len(counts) == nle and len(offsets) == nle + 1 and offsets[0] == 0, tag
    top = p.top.tolist()
    seen = collections.Counter()
    for e in range(nle):
        g = rank * nle + e
        expected = [(r, t * k + s) for r in range(ep) for t in range(tokens) for s in range(k) if top[r][t][s] == g]
        assert counts[e] == len(expected), f"{tag} expert_counts[{e}]"
        assert offsets[e + 1] - offsets[e] == -(-counts[e] // ROW_ALIGN) * ROW_ALIGN, f"{tag} offsets[{e}]"
        assert offsets[e] % ROW_ALIGN == 0
        rows = list(zip(src_rank[offsets[e]:offsets[e] + counts[e]], src_slot[offsets[e]:offsets[e] + counts[e]]))
        for r, slot in rows:  # every real row points at a (rank, token, slot) routed to this expert
            assert 0 <= r < ep and 0 <= slot < tokens * k, f"{tag} row ({r}, {slot})"
            assert top[r][slot // k][slot % k] == g, f"{tag} row ({r}, {slot}) is not routed to expert {g}"
            seen[(r, slot)] += 1
        # (source rank, token) strictly ascending inside the segment
        keys = [(r, slot // k) for r, slot in rows]
        assert all(a < b for a, b in zip(keys, keys[1:])), f"{tag} segment {e} not in (rank, token) order"
        assert rows == expected, f"{tag} segment {e}"
        pad = slice(offsets[e] + counts[e], offsets[e + 1])
        assert set(src_rank[pad]) <= {-1} and set(src_slot[pad]) <= {-1}, f"{tag} padding of segment {e}"
    assert offsets[nle] <= cap
    assert set(src_rank[offsets[nle]:]) <= {-1} and set(src_slot[offsets[nle]:]) <= {-1}, f"{tag} unused rows"
    routed_here = [(r, t * k + s) for r in range(ep) for t in range(tokens) for s in range(k)
                   if rank * nle <= top[r][t][s] < (rank + 1) * nle]
    assert sorted(seen) == sorted(routed_here) and all(v == 1 for v in seen.values()), \
        f"{tag} every routed slot must appear exactly once"


def schedule_cases(ep):
    e = NLE * ep
    return [
        ("random_k2", make_problem(41, ep, route_random, 2), MoKConfig()),
        ("random_k2_cf0.5", make_problem(41, ep, route_random, 2), MoKConfig(capacity_factor=0.5)),
        ("skewed_k2_T200", make_problem(42, ep, route_skewed, 2, tokens=200), MoKConfig()),
        ("zero_expert_k2", make_problem(43, ep, route_excluding({0, e - 1} if ep > 1 else {0}), 2), MoKConfig()),
        ("all_on_one_k1_T150", make_problem(44, ep, route_fixed(lambda n: [n - 1]), 1, tokens=150), MoKConfig()),
        ("fixed_k3", make_problem(45, ep, route_fixed(lambda n: [n // 2, 0, n - 1]), 3), MoKConfig()),
        ("every_expert_k=E", make_problem(46, ep, route_random, e, tokens=40), MoKConfig()),
        ("one_local_expert_k1", make_problem(47, ep, route_skewed, 1, nle=1, tokens=130), MoKConfig()),
        ("topk_gt_nle", make_problem(48, ep, route_random, min(4, 2 * ep), nle=2, tokens=29), MoKConfig()),
    ]


def check_schedules(rank=0, world=1):
    clear_workspace_cache()
    for name, p, cfg in schedule_cases(world):
        check_schedule_one(p, cfg, f"[{name} ep={world} rank={rank}]")


# ==== determinism ==================================================================================


def _needed_rows(p: Problem) -> int:
    """Largest padded routed-row count of any rank (computed here, independently)."""
    counts = torch.bincount(p.top.reshape(-1), minlength=p.num_experts).view(p.ep, p.nle)
    return int(((counts + ROW_ALIGN - 1) // ROW_ALIGN * ROW_ALIGN).sum(1).max())


def check_determinism(rank=0, world=1):
    base_cfg = MoKConfig()
    knob_cfgs = [
        MoKConfig(fwd_comm_sms=1, bwd_comm_sms=64),
        MoKConfig(fwd_comm_sms=64, bwd_comm_sms=1, minibatch_rows=TILE_ROWS),
        MoKConfig(minibatch_rows=3 * TILE_ROWS),
        MoKConfig(precision="bf16", peer_timeout_s=1.0),
    ]
    problems = [("random_k2", make_problem(51, world, route_random, 2)),
                ("skewed_k3_T150", make_problem(52, world, route_skewed, 3, tokens=150, shared=False))]
    for name, p in problems:
        # capacity factors that do not overflow for this routing, with distinct capacities
        cfs, caps = [], set()
        for cf in (1.0, 0.75, 0.5, 0.3, 0.2, 0.1, 0.05):
            cap = routed_capacity(MoKConfig(capacity_factor=cf), world, p.tokens, p.topk, p.nle)
            if cap >= _needed_rows(p) and cap not in caps:
                cfs.append(cf)
                caps.add(cap)
        if name.startswith("skewed"):
            assert len(caps) >= 2, (caps, _needed_rows(p))
        cfgs = knob_cfgs + [MoKConfig(capacity_factor=cf) for cf in cfs]
        for dtype in (torch.float64, torch.float32, torch.bfloat16):
            tag = f"[{name} {dtype} ep={world} rank={rank}]"
            ref = run_autograd(p.local(rank, dtype), base_cfg)
            for i in range(5):
                if i == 2:
                    clear_workspace_cache()  # a fresh workspace gives the same bits too
                assert_bitwise(f"{tag} repeat {i}", run_autograd(p.local(rank, dtype), base_cfg), ref)
            for cfg in cfgs:
                assert_bitwise(f"{tag} {cfg}", run_autograd(p.local(rank, dtype), cfg), ref)
            fref = run_functional(p.local(rank, dtype), base_cfg)
            for cfg in cfgs[::2]:
                f = run_functional(p.local(rank, dtype), cfg)
                assert_bitwise(f"{tag} functional {cfg}", [f[0]] + grads_list(f[1]), [fref[0]] + grads_list(fref[1]))


# ==== bad inputs ===================================================================================


def _raises_everywhere(exc_type, match, fn, what):
    """``fn()`` must raise ``exc_type`` matching ``match`` on this rank (every rank runs this)."""
    try:
        fn()
    except exc_type as exc:
        assert re.search(match, str(exc)), f"{what}: {type(exc).__name__} message does not match {match!r}: {exc}"
        return exc
    except Exception as exc:
        raise AssertionError(f"{what}: expected {exc_type.__name__} ({match!r}), got {type(exc).__name__}: {exc}") \
            from exc
    raise AssertionError(f"{what}: expected {exc_type.__name__} ({match!r}), nothing was raised")


def check_bad_inputs(rank=0, world=1):
    """Every check: each rank raises the expected error (none hangs), then a valid call on the same
    (cached) workspace still gives the baseline bits."""
    clear_workspace_cache()
    last = world - 1
    e_all = NLE * world
    p = make_problem(61, world, route_random, 2, shared=True)
    dtype = torch.float32
    baseline = run_autograd(p.local(rank, dtype))

    def valid_again(tag):
        assert_bitwise(f"valid call after {tag}", run_autograd(p.local(rank, dtype)), baseline)

    def call(d, **kw):
        return run_autograd(d, **kw)

    # -- expert ids out of range, on ONE rank only: every rank raises ---------------------------
    for bad_rank, value in ((last, -1), (0, e_all), (last, e_all + 100), (0, -(2**31)), (last, 2**31),
                            (0, 2**32), (last, 2**32 + 1), (0, -(2**32) + 2)):
        d = p.local(rank, dtype)
        if rank == bad_rank:
            d["top"][5, 1] = value
        _raises_everywhere(MoKInputError, r"outside \[0, ", lambda: call(d), f"expert id {value} on rank {bad_rank}")
        valid_again(f"expert id {value} on rank {bad_rank}")
    # -- duplicate expert within one token's top-k (one rank, then all ranks) ---------------------
    for bad_ranks in ([last], list(range(world))):
        d = p.local(rank, dtype)
        if rank in bad_ranks:
            d["top"][7, 1] = d["top"][7, 0]
        _raises_everywhere(MoKInputError, "repeats an expert", lambda: call(d), f"duplicate on ranks {bad_ranks}")
        valid_again("duplicate expert")
    # -- non-finite router weights (one rank, then all ranks) ------------------------------------
    for value, bad_ranks in ((float("nan"), [last]), (float("inf"), [0]), (float("-inf"), list(range(world))),
                             (float("nan"), list(range(world)))):
        d = p.local(rank, dtype)
        if rank in bad_ranks:
            with torch.no_grad():
                d["probs"][T - 1, 0] = value
        _raises_everywhere(MoKInputError, "probs holds a NaN or infinite", lambda: call(d),
                           f"probs {value} on ranks {bad_ranks}")
        valid_again(f"probs {value} on ranks {bad_ranks}")

    # -- ranks disagree on tokens / hidden / top-k / experts (fresh shapes) -----------------------
    if world > 1:
        odd = rank % 2 == 1
        # shapes that no rank has a cached workspace for
        for what, kwargs, match in (
            ("tokens", dict(tokens=T + 6 if odd else T + 5), r"num_tokens \(T\)"),
            ("hidden", dict(tokens=T + 7, hidden=H + 8 if rank == last else H), r"hidden size \(H\)"),
            ("topk", dict(tokens=T + 9, k=3 if rank == 0 else 2), "top-k"),
            ("experts", dict(tokens=T + 11, nle=NLE + 1 if rank == last else NLE), "num_experts"),
        ):
            k = kwargs.pop("k", 2)
            q = make_problem(62, world, route_excluding({NLE * world - 1}), k, shared=False, **kwargs)
            _raises_everywhere(MoKInputError, match, lambda: call(q.local(rank, dtype)), f"ranks disagree on {what}")
            valid_again(f"disagreeing {what}")
        # ... also when some ranks already hold a cached workspace for their shape
        q_same = make_problem(63, world, route_random, 2, shared=False, tokens=T + 3)
        call(q_same.local(rank, dtype))  # every rank caches (T + 3, H, 2)
        q_more = make_problem(63, world, route_random, 2, shared=False, tokens=T + 4)
        d = (q_more if rank == last else q_same).local(rank, dtype)
        _raises_everywhere(MoKInputError, r"num_tokens \(T\)", lambda: call(d),
                           "ranks disagree on tokens, other ranks hold a cached workspace")
        valid_again("disagreeing tokens with a cached workspace")

    # -- wrong dtypes (every rank): the message names the argument -------------------------------
    def bad(**changes):
        d = p.local(rank, dtype)
        d.update(changes)
        return d

    lo = rank * NLE
    bf = torch.bfloat16
    for d, match in (
        (bad(probs=p.probs[rank].to(bf)), "probs"),
        (bad(probs=p.probs[rank].double()), "probs"),  # fp64 router weights need fp64 x
        (bad(fc1=p.fc1[lo:lo + NLE].to(bf)), "fc1"),
        (bad(fc2=p.fc2[lo:lo + NLE].double()), "fc2"),
        (bad(sfc1=p.sfc1.to(bf)), "shared_fc1"),
        (bad(sfc2=p.sfc2.double()), "shared_fc2"),
        (bad(top=p.top[rank].float()), "top_experts"),
        (bad(x=p.x[rank].to(torch.int32)), "x must be"),
        # wrong shapes
        (bad(probs=p.probs[rank, :, :1].float()), "probs"),
        (bad(probs=p.probs[rank, :-1].float()), "probs"),
        (bad(top=p.top[rank, :-1]), "top_experts"),
        (bad(top=p.top[rank, :, 0]), "top_experts"),
        (bad(x=p.x[rank, 0].float()), "x must be"),
        (bad(fc1=p.fc1[lo:lo + NLE, :, :-1].float()), "fc1"),
        (bad(fc1=p.fc1[lo:lo + NLE, :-1].float()), "fc1"),  # odd 2I
        (bad(fc1=p.fc1[lo:lo + NLE, 0].float()), "fc1"),  # 2-D
        (bad(fc2=p.fc2[lo:lo + NLE, :, :-1].float()), "fc2"),
        (bad(fc2=p.fc2[lo:lo + NLE, :-1].float()), "fc2"),
        (bad(sfc1=p.sfc1[:, :-1].float()), "shared_fc1"),
        (bad(sfc2=p.sfc2[:, :-1].float()), "shared_fc2"),
        (bad(sfc2=None), "shared_fc1 and shared_fc2"),
    ):
        _raises_everywhere(MoKInputError, match, lambda: call(d), f"bad argument ({match})")
        valid_again(f"bad argument ({match})")
    # wrong number of local experts for an explicit num_experts
    _raises_everywhere(MoKInputError, "fc1", lambda: call(bad(fc1=p.fc1[lo:lo + NLE - 1].float(),
                                                              fc2=p.fc2[lo:lo + NLE - 1].float()),
                                                          num_experts=e_all), "fc1 with too few experts")
    # grad_out of the functional backward
    for g, match in ((p.grad[rank].double(), "grad_out"), (p.grad[rank, :-1].float(), "grad_out")):
        d = p.local(rank, dtype)
        d["grad"] = g
        _raises_everywhere(MoKInputError, match, lambda: run_functional(d), f"grad_out {g.dtype} {list(g.shape)}")
    valid_again("bad grad_out")

    # -- capacity overflow: small capacity_factor, skewed routing; every rank raises --------------
    big_t = 600
    small = MoKConfig(capacity_factor=0.8)  # 640 rows at EP=1
    if world == 1:  # segments of 129 + 129 + 342 rows: 672 padded rows
        route = route_fixed(lambda n: [0])
        q = make_problem(64, 1, route, 1, tokens=big_t, shared=False)
        q.top[0, 129:258, 0] = 1
        q.top[0, 258:, 0] = 2
    else:  # every token of every rank on one expert of the last rank
        q = make_problem(64, world, route_fixed(lambda n: [n - 1]), 1, tokens=big_t, shared=False)
    assert _needed_rows(q) > routed_capacity(small, world, big_t, 1, NLE)  # precondition
    assert _needed_rows(q) <= routed_capacity(MoKConfig(), world, big_t, 1, NLE)
    err = _raises_everywhere(MoKCapacityError, "capacity_factor", lambda: call(q.local(rank, dtype), cfg=small),
                             "capacity overflow")
    assert str(_needed_rows(q)) in str(err)
    # the same (cached) small workspace still works for a routing that fits, with the same bits as 1.0
    fits = make_problem(65, world, route_fixed(lambda n: [0]), 1, tokens=big_t, shared=False)
    fits.top = (torch.arange(world * big_t).view(world, big_t, 1) % e_all)  # 200 rows per expert
    if world == 1:  # 192 + 192 + 216 rows: 608 padded rows
        fits.top = torch.tensor([0] * 192 + [1] * 192 + [2] * 216).view(1, big_t, 1)
    assert _needed_rows(fits) <= routed_capacity(small, world, big_t, 1, NLE)
    assert_bitwise("small capacity factor, fitting routing", call(fits.local(rank, dtype), cfg=small),
                   call(fits.local(rank, dtype)))
    valid_again("capacity overflow")


# ==== pytest entry points ==========================================================================


def _spawn(world, *checks, timeout=SPAWN_TIMEOUT):
    run_distributed(functools.partial(_run_checks, checks=checks), world_size=world, timeout=timeout)


def _run_checks(rank, world, checks):
    torch.manual_seed(0)
    for check in checks:
        check(rank, world)


@pytest.fixture(autouse=True)
def _fresh_cache_one_thread():
    """EP = 1 runs in this process: one intra-op thread (like the spawned ranks; tiny matmuls on
    a loaded 2-core machine are many times slower with more), and no workspace from another test."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    clear_workspace_cache()
    yield
    clear_workspace_cache()
    torch.set_num_threads(threads)


def test_numerics_ep1():
    assert not dist.is_initialized()
    check_numerics()


def test_recompute_and_main_grads_ep1():
    check_recompute_and_main_grads()


def test_schedule_ep1():
    check_schedules()


def test_determinism_ep1():
    check_determinism()


def test_bad_inputs_ep1():
    check_bad_inputs()


@pytest.mark.parametrize("world", [2, 4])
def test_numerics_recompute_main_grads_distributed(world):
    checks = [check_numerics, check_recompute_and_main_grads] + ([check_subgroups] if world == 4 else [])
    _spawn(world, *checks)


@pytest.mark.parametrize("world", [2, 4])
def test_schedule_and_determinism_distributed(world):
    _spawn(world, check_schedules, check_determinism)


@pytest.mark.parametrize("world", [2, 4])
def test_bad_inputs_distributed(world):
    _spawn(world, check_bad_inputs, timeout=90.0)
