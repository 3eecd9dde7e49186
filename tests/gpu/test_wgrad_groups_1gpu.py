"""Routed weight gradients of several micro-batches in one pass (MoKConfig.wgrad_microbatches,
megatron_mok/cuda/wgrad_groups.py): the GEMM's parts against fp64 and against one concatenated part,
and the backward's groups against one add per micro-batch."""

from __future__ import annotations

import pytest
import torch

from megatron_mok import ROW_ALIGN, flush_wgrads, held_wgrads

from ._bwd import assert_bitwise, assert_fused_add, backward_case
from ._util import bits, gpu_marks, rel_err
from ._util import cuda_path as _kp

pytestmark = gpu_marks()

DEV = "cuda:0"


def _parts_case(part_counts, M, N, seed):
    """Each part's rows in its own ROW_ALIGN segments, part q at rows q * cap of a and b (NaN past
    each part's last segment, zeros up to each expert's 16-row bound); offsets [P, nseg + 1] and
    counts [P, nseg] on the device; plus each expert's rows of all parts back to back (one part,
    16-row segments) for the concatenated GEMM."""
    gen = torch.Generator().manual_seed(seed)
    nseg = len(part_counts[0])
    cap = max(sum(-(-c // ROW_ALIGN) * ROW_ALIGN for c in counts) for counts in part_counts) + 64
    a = torch.full((len(part_counts) * cap, M), float("nan"))
    b = torch.full((len(part_counts) * cap, N), float("nan"))
    offsets, rows_a, rows_b = [], [[] for _ in range(nseg)], [[] for _ in range(nseg)]
    for q, counts in enumerate(part_counts):
        offs = [0]
        for c in counts:
            offs.append(offs[-1] + -(-c // ROW_ALIGN) * ROW_ALIGN)
        offsets.append(offs)
        for e, c in enumerate(counts):
            lo = q * cap + offs[e]
            a[lo:q * cap + offs[e + 1]] = 0
            b[lo:q * cap + offs[e + 1]] = 0
            ra, rb = torch.randn(c, M, generator=gen), torch.randn(c, N, generator=gen)
            a[lo:lo + c], b[lo:lo + c] = ra, rb
            rows_a[e].append(ra)
            rows_b[e].append(rb)
    cat_counts = [sum(counts[e] for counts in part_counts) for e in range(nseg)]
    cat_offs = [0]
    for c in cat_counts:
        cat_offs.append(cat_offs[-1] + (c + 15) // 16 * 16)
    cat_a, cat_b = torch.zeros((cat_offs[-1] + 16, M)), torch.zeros((cat_offs[-1] + 16, N))
    for e, c in enumerate(cat_counts):
        cat_a[cat_offs[e]:cat_offs[e] + c] = torch.cat(rows_a[e])
        cat_b[cat_offs[e]:cat_offs[e] + c] = torch.cat(rows_b[e])
    i32 = dict(dtype=torch.int32, device=DEV)
    parts = (a.bfloat16().to(DEV), b.bfloat16().to(DEV),
             torch.tensor([[o + q * cap for o in offs] for q, offs in enumerate(offsets)], **i32),
             torch.tensor(part_counts, **i32))
    cat = (cat_a.bfloat16().to(DEV), cat_b.bfloat16().to(DEV), torch.tensor(cat_offs, **i32),
           torch.tensor(cat_counts, **i32))
    return parts, cat, gen


@pytest.mark.parametrize("part_counts,aligned", [
    # every part but the last a multiple of 16 rows an expert: the same 16-row MMA groups as the
    # concatenated rows, so the same bits
    ([[130 // 16 * 16, 0, 16, 0, 256, 704, 32], [130, 0, 1, 17, 257, 700, 15]], True),
    ([[64, 0, 0, 48, 256, 512, 16], [16, 0, 32, 0, 0, 192, 64], [1, 0, 3, 17, 255, 9, 0]], True),
    ([[130, 0, 1, 15, 17, 255, 700], [7, 0, 0, 33, 256, 1, 129]], False),
])
@pytest.mark.parametrize("M,N", [(128, 256), (200, 264)])
def test_expert_wgrad_parts(part_counts, aligned, M, N):
    """out[e] = sum over parts q of a[rows of e in q]^T @ b[rows of e in q], one accumulator over the
    parts in order: against fp64; bf16 out written (experts without rows in any part: zeros), fp32
    out added into; bits independent of the CTA count, and the concatenated rows' bits where the
    parts' 16-row groups line up."""
    from megatron_mok import ops

    (a, b, offs, cnt), (ca, cb, coffs, ccnt), gen = _parts_case(part_counts, M, N, M + N + len(part_counts))
    nseg = cnt.shape[1]
    first = None
    for ctas in (0, 1, 5, 77):
        out = torch.full((nseg, M, N), float("nan"), dtype=torch.bfloat16, device=DEV)
        ops.expert_wgrad(a, offs, b, offs, cnt, out, num_ctas=ctas)
        if first is None:
            first = out
        else:
            assert torch.equal(bits(out), bits(first)), f"bits depend on the CTA count ({ctas})"
    cat = torch.full((nseg, M, N), float("nan"), dtype=torch.bfloat16, device=DEV)
    ops.expert_wgrad(ca, coffs, cb, coffs, ccnt, cat)
    for e in range(nseg):
        c = int(ccnt[e])
        if c == 0:
            assert bool((first[e] == 0).all()), f"expert {e} without rows: not exact zeros"
            continue
        ref = ca[int(coffs[e]):int(coffs[e]) + c].double().t() @ cb[int(coffs[e]):int(coffs[e]) + c].double()
        assert rel_err(first[e], ref) < 1e-2, (e, rel_err(first[e], ref))
    if aligned:
        assert torch.equal(bits(first), bits(cat)), "parts give other bits than their rows back to back"
    base = torch.randn((nseg, M, N), generator=gen).to(DEV)
    out32, cat32 = base.clone(), base.clone()
    ops.expert_wgrad(a, offs, b, offs, cnt, out32, num_ctas=3)
    ops.expert_wgrad(ca, coffs, cb, coffs, ccnt, cat32)
    for e in range(nseg):
        if int(ccnt[e]) == 0:
            assert torch.equal(out32[e], base[e]), f"expert {e} without rows changed its fp32 out"
        else:
            assert_fused_add(out32[e], base[e], first[e], f"fp32 out, expert {e}")
    if aligned:
        assert torch.equal(out32, cat32), "fp32 parts give other bits than their rows back to back"


def test_expert_wgrad_parts_rejects_mismatched_offsets():
    from megatron_mok import ops

    a = torch.zeros((64, 64), dtype=torch.bfloat16, device=DEV)
    offs = torch.tensor([[0, 16, 32], [32, 48, 64]], dtype=torch.int32, device=DEV)
    cnt = torch.tensor([[16, 16], [16, 16]], dtype=torch.int32, device=DEV)
    out = torch.zeros((2, 64, 64), device=DEV)
    with pytest.raises(RuntimeError, match="per part"):
        ops.expert_wgrad(a, offs[:1], a, offs, cnt, out)


SHAPE = (300, 384, 192, 0, 16, 4)  # T, H, I, Is, E, k


def _microbatches(n, shared: bool = False):
    """n micro-batches of one layer: the same weights, their own tokens, routing and grad_out."""
    shape = (256, 256, 128, 128, 8, 2) if shared else SHAPE
    cfg, ws, top, w, g = backward_case(shape, "skewed", 5, DEV)
    batches = [(top, w, g)]
    for i in range(1, n):
        _, _, top_i, w_i, g_i = backward_case(shape, ("random", "half_empty", "one_expert")[i % 3], 5 + i, DEV)
        batches.append((top_i, (w_i[0], w_i[1], *w[2:]), g_i))
    return cfg, ws, batches


def _run(cfg, ws, batches, main, holds):
    """Schedule + forward + backward of each micro-batch with fused main grads; returns each one's
    (dx, dprobs)."""
    kp = _kp()
    out = []
    for (top, w, g), hold in zip(batches, holds):
        sched = kp.build_schedule(cfg, ws, top)
        _, ctx = kp.forward(cfg, ws, sched, *w)
        got = kp.backward(cfg, ws, sched, ctx, g, *w, main_grads=tuple(main), hold_wgrads=hold)
        assert got.dfc1 is None and got.dfc2 is None
        out.append([got.dx.clone(), got.dprobs.clone()])
    torch.cuda.synchronize()
    return out


@pytest.mark.parametrize("shared", [False, True])
def test_backward_wgrad_groups(shared):
    """Three micro-batches (skewed, random and half-empty routing; the same weights) with fused fp32
    main grads. Groups of 2: the first backward holds (main grads untouched), the second adds both
    micro-batches' sums, the third (hold=False) its own: main grads within the fused adds' bound of
    one add per micro-batch, dx / dprobs bits unchanged, bitwise repeatable; a group of 3 closed
    early by hold=False gives the group of 2's bits; a held part flushed alone gives the bits of an
    unheld backward."""
    cfg, ws, batches = _microbatches(3, shared)
    w = batches[0][1]
    gen = torch.Generator().manual_seed(7)
    before = [None if t is None else torch.randn(t.shape, generator=gen).to(DEV) for t in w[2:]]
    fresh = lambda: [None if b is None else b.clone() for b in before]  # noqa: E731

    single = fresh()
    plain = _run(cfg, ws, batches, single, [False] * 3)

    g2 = cfg.replace(wgrad_microbatches=2)
    grouped = fresh()
    kp = _kp()
    (top0, w0, gr0) = batches[0]
    sched = kp.build_schedule(g2, ws, top0)
    _, ctx = kp.forward(g2, ws, sched, *w0)
    kp.backward(g2, ws, sched, ctx, gr0, *w0, main_grads=tuple(grouped), hold_wgrads=True)
    torch.cuda.synchronize()
    assert held_wgrads() == 1 and held_wgrads(tuple(grouped)) == 1
    assert torch.equal(grouped[0], before[0]) and torch.equal(grouped[1], before[1]), "a held backward added"
    flush_wgrads()
    assert held_wgrads() == 0
    alone = fresh()
    _run(cfg, ws, batches[:1], alone, [False])
    assert torch.equal(grouped[0], alone[0]) and torch.equal(grouped[1], alone[1]), \
        "a held part flushed alone differs from an unheld backward"

    grouped = fresh()
    got = _run(g2, ws, batches, grouped, [True, True, False])
    assert held_wgrads() == 0
    for i, (a, b) in enumerate(zip(got, plain)):
        assert_bitwise(a, b, f"micro-batch {i} dx/dprobs")
    # the routed weight gradients: each micro-batch's fp32 sums against their sum added once
    for i in range(2):
        ref = single[i].double() - before[i].double()
        assert rel_err(grouped[i].double() - before[i].double(), ref) < 1e-5, f"main_grads[{i}]"
    for i in range(2, 4):  # the shared expert's are not grouped
        if before[i] is not None:
            assert torch.equal(grouped[i], single[i]), f"shared main_grads[{i}]"
    again = fresh()
    _run(g2, ws, batches, again, [True, True, False])
    assert all(x is None or torch.equal(x, y) for x, y in zip(again, grouped)), "groups do not repeat bitwise"
    three = fresh()
    _run(cfg.replace(wgrad_microbatches=3), ws, batches[:2], three, [True, False])
    _run(cfg, ws, batches[2:], three, [False])
    assert torch.equal(three[0], grouped[0]) and torch.equal(three[1], grouped[1]), \
        "the same grouping gives other bits under another wgrad_microbatches"
    ws.check_errors(blocking=True)


def test_backward_wgrad_groups_need_fused_bf16_main_grads():
    """Without main grads, with e4m3 weight gradients or with a bf16 main grad nothing is held: every
    backward adds (or returns) its own."""
    cfg, ws, batches = _microbatches(1, shared=True)  # H and I multiples of 128 (the e4m3 case)
    top, w, g = batches[0]
    kp = _kp()
    for c, main in ((cfg.replace(wgrad_microbatches=2), None),
                    (cfg.replace(wgrad_microbatches=2, precision="fp8"), "fp32"),
                    (cfg.replace(wgrad_microbatches=2), "bf16")):
        mains = None if main is None else tuple(
            torch.zeros(t.shape, device=DEV, dtype=torch.float32 if main == "fp32" else torch.bfloat16)
            for t in w[2:4]) + (None, None)
        sched = kp.build_schedule(c, ws, top)
        _, ctx = kp.forward(c, ws, sched, *w)
        got = kp.backward(c, ws, sched, ctx, g, *w, main_grads=mains, hold_wgrads=True)
        torch.cuda.synchronize()
        assert held_wgrads() == 0
        if main is None:
            assert got.dfc1 is not None and got.dfc2 is not None
        else:
            assert bool((mains[0] != 0).any()), f"{c.precision} {main}: the weight gradient was not added"
    ws.check_errors(blocking=True)
