"""Single-GPU (EP=1) tests of the CUDA backward (megatron_mok.cuda.backward) against the fp32
reference, plus its GEMMs (dgrad with the SwiGLU backward fused, wgrad with exact zeros for empty
experts) and the KERNEL_STALL error code."""

from __future__ import annotations

import pytest
import torch

from megatron_mok import ROW_ALIGN, MoKConfig, create_workspace
from megatron_mok.cuda.context import saved_bytes
from megatron_mok.schedule import build_schedule_reference

from ._bwd import (assert_bitwise, assert_fused_add, backward_case, check_backward_bitwise_repeats,
                   check_backward_graph_equals_eager, check_backward_repeats, check_close,
                   check_main_grads_accumulate, forward_backward, grads_list, poison_all, reference_grads)
from ._util import SHAPES, bits, gpu_marks, rel_err, schedules_equal
from ._util import cuda_path as _kp

pytestmark = gpu_marks()

DEV = "cuda:0"


def _case(shape, kind, seed):
    return backward_case(shape, kind, seed, DEV)


# ---- pieces ---------------------------------------------------------------------------------------


def _dgrad_case(K, M, counts, seed):
    """dy [cap, K] in segments padded to 16 rows (zero padding rows, 64 rows past the last segment),
    w [nseg, K, M], offsets / counts on the device."""
    gen = torch.Generator().manual_seed(seed)
    offs = [0]
    for c in counts:
        offs.append(offs[-1] + (c + 15) // 16 * 16)
    cap = offs[-1] + 64
    dy = torch.randn(cap, K, generator=gen).bfloat16()
    for e, c in enumerate(counts):
        dy[offs[e] + c: offs[e + 1]] = 0
    w = (torch.randn(len(counts), K, M, generator=gen) / K**0.5).bfloat16()
    return (dy.to(DEV), w.to(DEV), torch.tensor(offs, dtype=torch.int32, device=DEV),
            torch.tensor(counts, dtype=torch.int32, device=DEV), offs, gen)


DGRAD_COUNTS = [130, 0, 1, 255, 256, 257, 700, 17, 48, 200, 15]


@pytest.mark.parametrize("K,M", [(256, 256), (384, 192), (136, 40), (1024, 520)])
def test_expert_dgrad_matches_matmul(K, M):
    """out = dy @ w[e] on the expert-major GEMM with MN-major weights: experts with 0, 1, 255-257
    and 700 rows (several token chunks), K and M not multiples of the tile; real rows against fp32
    matmul, padding rows +0, rows past the last segment untouched, bits independent of the CTA count."""
    from megatron_mok import ops

    dy, w, seg, cnt, offs, _ = _dgrad_case(K, M, DGRAD_COUNTS, K + 3 * M)
    first = None
    for ctas in (0, 1, 3, 37):
        out = torch.full((dy.shape[0], M), float("nan"), dtype=torch.bfloat16, device=DEV)
        ops.expert_dgrad(dy, w, seg, cnt, out, num_ctas=ctas)
        if first is None:
            first = out
        else:
            assert torch.equal(bits(out), bits(first)), f"bits depend on the CTA count ({ctas})"
    out = first
    for e, n in enumerate(DGRAD_COUNTS):
        lo, end = offs[e], offs[e + 1]
        if n:
            ref = dy[lo:lo + n].double() @ w[e].double()
            assert rel_err(out[lo:lo + n], ref) < 1e-2, (e, rel_err(out[lo:lo + n], ref))
        assert bool((out[lo + n:end] == 0).all()), f"padding rows of expert {e} are not +0"
    assert torch.isnan(out[offs[-1]:].float()).all(), "rows past the last segment were written"


@pytest.mark.parametrize("K,M", [(256, 128), (520, 72)])
def test_expert_dgrad_fuses_swiglu_backward(K, M):
    """With h the epilogue takes da = dy @ w[e] (dy unweighted) and writes, with the rows' router
    weights w: dh = [d_gate | d_up] of w * da, act = bf16(w * silu(gate) * up) and the dot pieces
    (per 64 columns sum da * silu(gate) * up; their row sum is <dy, act_unweighted @ w[e]^T>): each
    within 1e-2 of the fp64 autograd reference, padding rows +0 (dh and act), rows past the last
    segment untouched, bits independent of the CTA count; without row_w, w = 1."""
    from megatron_mok import ops

    dy, w, seg, cnt, offs, gen = _dgrad_case(K, M, DGRAD_COUNTS, K + M)
    cap = dy.shape[0]
    h = (3 * torch.randn(cap, 2 * M, generator=gen)).bfloat16().to(DEV)  # the forward's rows
    row_w = torch.rand(cap, generator=gen).to(DEV) + 0.25
    first = None
    for ctas in (0, 1, 5):
        dh = torch.full((cap, 2 * M), float("nan"), dtype=torch.bfloat16, device=DEV)
        act = torch.full((cap, M), float("nan"), dtype=torch.bfloat16, device=DEV)
        dot = torch.full((cap, -(-M // 64)), float("nan"), device=DEV)
        ops.expert_dgrad(dy, w, seg, cnt, dh, h=h, num_ctas=ctas, row_w=row_w, act=act, dot=dot)
        if first is None:
            first = (dh, act, dot)
        else:
            for a, b in zip((dh, act, dot), first):
                assert torch.equal(bits(a), bits(b)), f"bits depend on the CTA count ({ctas})"
    dh, act, dot = first
    end = offs[-1]
    assert torch.isnan(dh[end:].float()).all() and torch.isnan(act[end:].float()).all(), \
        "rows past the last segment were written"
    real = torch.zeros(end, dtype=torch.bool, device=DEV)
    for e, n in enumerate(DGRAD_COUNTS):
        real[offs[e]:offs[e] + n] = True
    wd = row_w[:end].double()[:, None]
    hf = h[:end].double().requires_grad_(True)
    gate, up = hf.chunk(2, dim=1)
    da_ref = torch.cat([dy[offs[e]:offs[e + 1]].double() @ w[e].double() for e in range(len(DGRAD_COUNTS))])
    act_ref = torch.nn.functional.silu(gate) * up
    act_ref.backward(wd * da_ref)
    assert rel_err(dh[:end][real], hf.grad[real]) < 1e-2
    assert rel_err(act[:end][real], (wd * act_ref.detach())[real]) < 1e-2
    dot_ref = (da_ref * act_ref.detach()).sum(1)
    assert rel_err(dot[:end][real].double().sum(1), dot_ref[real]) < 1e-2
    assert bool((dh[:end][~real] == 0).all()) and bool((act[:end][~real] == 0).all()), "padding rows are not +0"
    # without the router weights: w = 1, the same dh as weights of one
    dh1 = torch.full((cap, 2 * M), float("nan"), dtype=torch.bfloat16, device=DEV)
    ops.expert_dgrad(dy, w, seg, cnt, dh1, h=h)
    ops.expert_dgrad(dy, w, seg, cnt, dh, h=h, row_w=torch.ones_like(row_w))
    assert torch.equal(bits(dh1), bits(dh))
    with pytest.raises(RuntimeError, match="go with h"):
        ops.expert_dgrad(dy, w, seg, cnt, torch.empty((cap, M), dtype=torch.bfloat16, device=DEV), row_w=row_w)


def test_expert_dgrad_rejects_bad_shapes():
    """Bad shapes raise errors that name them (messages with numbers: formatted without iostreams,
    which crash in the GPU machines' statically linked libstdc++)."""
    from megatron_mok import ops

    dy, w, seg, cnt, _, _ = _dgrad_case(64, 32, [3, 5], 1)
    out = torch.empty((dy.shape[0], 32), dtype=torch.bfloat16, device=DEV)
    with pytest.raises(RuntimeError, match=r"w must be \[nseg, K, M\]"):
        ops.expert_dgrad(dy, w.transpose(1, 2).contiguous(), seg, cnt, out)
    with pytest.raises(RuntimeError, match="out must be"):
        ops.expert_dgrad(dy, w, seg, cnt, out, h=torch.empty((dy.shape[0], 64), dtype=torch.bfloat16, device=DEV))
    with pytest.raises(RuntimeError, match="seg_offsets"):
        ops.expert_dgrad(dy, w, seg[:2], cnt, out)


@pytest.mark.parametrize("M,N", [(128, 256), (200, 264), (72, 520)])
def test_expert_wgrad_matches_matmul(M, N):
    """out[e] = a[rows of e]^T @ b[rows of e] with a in 16-row segments and b in a
    padded one (ROW_ALIGN-row segments, as the schedule makes them): experts with 0, 1, 15, 17,
    255-257 and 700 rows, M and N off the tile; against fp64, empty experts exactly zero, NaN rows past an expert's 16-row bound never
    read (a's tail past the last segment, b's padding), bits independent of the CTA count."""
    from megatron_mok import ops

    counts = [130, 0, 1, 15, 17, 255, 256, 257, 700, 48, 0]
    gen = torch.Generator().manual_seed(M * N)
    aoffs, boffs = [0], [0]
    for c in counts:
        aoffs.append(aoffs[-1] + (c + 15) // 16 * 16)
        boffs.append(boffs[-1] + -(-c // ROW_ALIGN) * ROW_ALIGN)
    a = torch.full((aoffs[-1] + 48, M), float("nan"))  # NaN past the last segment
    b = torch.full((boffs[-1] + 64, N), float("nan"))
    for e, c in enumerate(counts):
        a[aoffs[e]:aoffs[e + 1]] = 0
        a[aoffs[e]:aoffs[e] + c] = torch.randn(c, M, generator=gen)
        b[boffs[e]:boffs[e] + (c + 15) // 16 * 16] = 0  # zero up to the 16-row bound, NaN after
        b[boffs[e]:boffs[e] + c] = torch.randn(c, N, generator=gen)
    a, b = a.bfloat16().to(DEV), b.bfloat16().to(DEV)
    ao = torch.tensor(aoffs, dtype=torch.int32, device=DEV)
    bo = torch.tensor(boffs, dtype=torch.int32, device=DEV)
    cnt = torch.tensor(counts, dtype=torch.int32, device=DEV)
    first = None
    for ctas in (0, 1, 5, 77):
        out = torch.full((len(counts), M, N), float("nan"), dtype=torch.bfloat16, device=DEV)
        ops.expert_wgrad(a, ao, b, bo, cnt, out, num_ctas=ctas)
        if first is None:
            first = out
        else:
            assert torch.equal(bits(out), bits(first)), f"bits depend on the CTA count ({ctas})"
    for e, c in enumerate(counts):
        if c == 0:
            assert bool((first[e] == 0).all()), f"expert {e} without rows: not exact zeros"
            continue
        ref = a[aoffs[e]:aoffs[e] + c].double().t() @ b[boffs[e]:boffs[e] + c].double()
        assert rel_err(first[e], ref) < 1e-2, (e, rel_err(first[e], ref))
    # fp32 out (Megatron's main_grad): the fp32 sums are added into it; experts without rows add nothing
    base = torch.randn((len(counts), M, N), generator=gen).to(DEV)
    first32 = None
    for ctas in (0, 5):
        out32 = base.clone()
        ops.expert_wgrad(a, ao, b, bo, cnt, out32, num_ctas=ctas)
        if first32 is None:
            first32 = out32
        else:
            assert torch.equal(out32, first32), f"fp32 bits depend on the CTA count ({ctas})"
    for e, c in enumerate(counts):
        if c == 0:
            assert torch.equal(first32[e], base[e]), f"expert {e} without rows changed its fp32 out"
            continue
        assert_fused_add(first32[e], base[e], first[e], f"fp32 out, expert {e}")


def test_expert_wgrad_fp32_many_short_experts():
    """The fp32 epilogue's second round goes through the ring: with 1-2 stages a task the ring turns
    over every few stages and the two consumer warpgroups drift apart. 384 experts of 0-130 rows,
    8 tasks each: every expert's fp32 out is base + its bf16 GEMM's sums, bitwise the same for
    1, 7 and all CTAs and across repeats."""
    from megatron_mok import ops

    gen = torch.Generator().manual_seed(11)
    E, M, N = 384, 512, 512
    counts = torch.randint(0, 131, (E,), generator=gen)
    counts[::17] = 0
    offs = [0]
    for c in counts.tolist():
        offs.append(offs[-1] + -(-c // ROW_ALIGN) * ROW_ALIGN)
    a = torch.zeros((offs[-1], M))
    b = torch.zeros((offs[-1], N))
    for e, c in enumerate(counts.tolist()):
        a[offs[e]:offs[e] + c] = torch.randn(c, M, generator=gen)
        b[offs[e]:offs[e] + c] = torch.randn(c, N, generator=gen)
    a, b = a.bfloat16().to(DEV), b.bfloat16().to(DEV)
    off = torch.tensor(offs, dtype=torch.int32, device=DEV)
    cnt = counts.to(torch.int32).to(DEV)
    dw = torch.full((E, M, N), float("nan"), dtype=torch.bfloat16, device=DEV)  # poisoned: every element is written
    ops.expert_wgrad(a, off, b, off, cnt, dw)
    base = torch.randn((E, M, N), generator=gen).to(DEV)
    first = None
    for ctas in (0, 1, 7, 0):
        out = base.clone()
        ops.expert_wgrad(a, off, b, off, cnt, out, num_ctas=ctas)
        if first is None:
            first = out
            assert_fused_add(out, base, dw, "fp32 out")
        else:
            assert torch.equal(out, first), f"fp32 bits differ at {ctas} CTAs"


def test_expert_wgrad_rejects_bad_shapes():
    from megatron_mok import ops

    a = torch.zeros((32, 64), dtype=torch.bfloat16, device=DEV)
    b = torch.zeros((32, 48), dtype=torch.bfloat16, device=DEV)
    offs = torch.tensor([0, 16, 32], dtype=torch.int32, device=DEV)
    cnt = torch.tensor([3, 5], dtype=torch.int32, device=DEV)
    with pytest.raises(RuntimeError, match="out must be"):
        ops.expert_wgrad(a, offs, b, offs, cnt, torch.empty((2, 48, 64), dtype=torch.bfloat16, device=DEV))
    with pytest.raises(RuntimeError, match="offsets"):
        ops.expert_wgrad(a, offs[:2], b, offs, cnt, torch.empty((2, 64, 48), dtype=torch.bfloat16, device=DEV))


def test_kernel_stall_error_code():
    from megatron_mok.workspace import ErrorCode, MoKKernelStallError, MoKPeerTimeoutError

    assert ErrorCode.KERNEL_STALL == 5 and ErrorCode.NUM_CODES == 8
    ws = create_workspace(None, DEV, 16, 64, 2, 4, MoKConfig())
    assert ws.errors.numel() == ErrorCode.NUM_CODES
    ws.errors[ErrorCode.KERNEL_STALL] = 1  # rank 0's kernel stalled
    with pytest.raises(MoKKernelStallError, match="rank 0 stalled"):
        ws.check_errors(blocking=True)
    assert issubclass(MoKKernelStallError, MoKPeerTimeoutError)
    ws.check_errors(blocking=True)  # reported once


# ---- the backward against the reference -------------------------------------------------------------


@pytest.mark.parametrize("kind", ["random", "skewed", "one_expert", "half_empty"])
@pytest.mark.parametrize("shape", SHAPES)
def test_backward_matches_reference(kind, shape):
    cfg, ws, top, w, g = _case(shape, kind, sum(shape) + 7 * len(kind))
    kp = _kp()
    sched = kp.build_schedule(cfg, ws, top)
    ref_sched = build_schedule_reference(ws, top)
    assert schedules_equal(sched, ref_sched) == []
    ref = reference_grads(ws, ref_sched, *w, g)
    first, _ = check_backward_repeats(cfg, ws, sched, w, g, ref, reps=2, poison=poison_all,
                                      min_empty_experts=1 if kind in ("one_expert", "half_empty") else None)
    # a forward that keeps no gate/up outputs: the backward recomputes them, same bits
    lean = cfg.replace(save_gate_up=False)
    _, ctx = kp.forward(lean, ws, sched, *w)
    assert ctx.h is None and ctx.shared_h is None
    got = grads_list(kp.backward(lean, ws, sched, ctx, g, *w))
    torch.cuda.synchronize()
    assert_bitwise(got, first, "save_gate_up=False")
    ws.check_errors(blocking=True)


@pytest.mark.parametrize("kind", ["skewed", "one_expert"])
def test_forward_keeps_gate_up_preactivations(kind):
    """ctx.h / ctx.shared_h hold x @ fc1^T of every row below the last segment end (padding rows: +0),
    with the same bits from the persistent megakernel and the staged GEMMs, and the context holds
    nothing else (``saved_bytes``)."""
    shape = (517, 512, 320, 256, 32, 8)
    cfg, ws, top, w, _ = _case(shape, kind, 31)
    x, _probs, fc1, _fc2, sfc1, _sfc2 = w
    kp = _kp()
    sched = kp.build_schedule(cfg, ws, top)
    kept = {}
    for kernel in ("persistent", "staged"):
        _, ctx = kp.forward(cfg.replace(forward_kernel=kernel), ws, sched, *w)
        kept[kernel] = (ctx.h.clone(), ctx.shared_h.clone())
        # the context holds the design table's bytes (docs/DESIGN.md 7.1) and nothing else
        assert ctx.nbytes() == saved_bytes(sched.capacity, ws.num_tokens, fc1.shape[1] // 2, sfc1.shape[0] // 2,
                                           keep_gate_up=True), kernel
    torch.cuda.synchronize()
    h, sh = kept["persistent"]
    # the routed rows (EP=1: every row's source is this rank's token row_src_slot // k)
    slot = sched.row_src_slot.long()
    xr = torch.where((slot >= 0)[:, None], x[slot.clamp(min=0) // ws.topk], torch.zeros_like(x[:1]))
    assert torch.equal(h[: int(sched.expert_offsets[-1])].view(torch.int16),
                       kept["staged"][0][: int(sched.expert_offsets[-1])].view(torch.int16))
    assert torch.equal(sh.view(torch.int16), kept["staged"][1].view(torch.int16))
    assert rel_err(sh, x.float() @ sfc1.float().t()) < 1e-2
    offs, counts = sched.expert_offsets.tolist(), sched.expert_counts.tolist()
    for e, n in enumerate(counts):
        lo, end = offs[e], offs[e + 1]
        if n:
            assert rel_err(h[lo:lo + n], xr[lo:lo + n].float() @ fc1[e].float().t()) < 1e-2, e
        assert bool((h[lo + n:end] == 0).all()), f"padding rows of expert {e} are not zero"
    ws.check_errors(blocking=True)


def test_backward_512_local_experts():
    """As many local experts as the expert GEMMs take in one launch: against the fp32 reference."""
    shape = (128, 128, 64, 64, 512, 2)
    cfg, ws, top, w, g = _case(shape, "random", 5)
    _, _, got = forward_backward(cfg, ws, top, w, g)
    torch.cuda.synchronize()
    check_close(got, reference_grads(ws, build_schedule_reference(ws, top), *w, g))
    ws.check_errors(blocking=True)


def test_backward_bitwise_20_repeats_and_knobs():
    shape = (512, 512, 256, 256, 16, 4)
    _cfg, ws, top, w, g = _case(shape, "skewed", 77)
    check_backward_bitwise_repeats(ws, top, w, g, comm_ctas=[0, 1, 7, 100])


@pytest.mark.parametrize("forward_kernel", ["staged", "persistent"])
def test_backward_cuda_graph_matches_eager(forward_kernel):
    shape = (384, 256, 128, 128, 8, 2)
    cfg, ws, top, w, g = _case(shape, "random", 5)
    cfg = cfg.replace(forward_kernel=forward_kernel)

    def poison_buffers_and_outputs(outputs):
        poison_all(ws)
        for t in outputs:
            if t is not None:
                t.fill_(float("nan"))

    check_backward_graph_equals_eager(cfg, ws, top, w, g, before_replay=poison_buffers_and_outputs)


def test_backward_main_grads_accumulate():
    shape = (256, 256, 128, 128, 8, 2)
    cfg, ws, top, w, g = _case(shape, "half_empty", 11)
    kp = _kp()
    sched, ctx, plain = forward_backward(cfg, ws, top, w, g)
    main, before = check_main_grads_accumulate(cfg, ws, sched, ctx, w, g, plain, seed=3, dev=DEV)
    # a partial tuple fuses only the given entries; a second call adds again
    once = main[0].clone()
    got2 = kp.backward(cfg, ws, sched, ctx, g, *w, main_grads=(main[0], None, None, None))
    assert got2.dfc1 is None and torch.equal(got2.dfc2, plain[3])
    assert_fused_add(main[0], once, plain[2], "second call")
    # a main grad the GEMM cannot add into (bf16 here) gets the bf16 gradient added after it
    main16 = before[1].bfloat16()
    got3 = kp.backward(cfg, ws, sched, ctx, g, *w, main_grads=(None, main16, None, None))
    assert got3.dfc2 is None and torch.equal(got3.dfc1, plain[2])
    assert torch.equal(main16, before[1].bfloat16() + plain[3])
    ws.check_errors(blocking=True)


def test_autograd_uses_the_cuda_backward():
    from megatron_mok import mok_moe

    shape = (256, 256, 128, 128, 8, 2)
    cfg, ws, top, w, g = _case(shape, "skewed", 13)
    x, probs, fc1, fc2, sfc1, sfc2 = [t.detach().clone().requires_grad_(True) for t in w]
    out = mok_moe(x, top, probs, fc1, fc2, sfc1, sfc2, cfg=cfg)
    out.backward(g)
    ws2 = create_workspace(None, DEV, *[shape[0], shape[1], shape[5], shape[4]], cfg)
    _, _, direct = forward_backward(cfg, ws2, top, w, g)
    torch.cuda.synchronize()
    auto = [x.grad, probs.grad, fc1.grad, fc2.grad, sfc1.grad, sfc2.grad]
    assert_bitwise(auto, direct, "autograd vs cuda.backward")


def test_reference_path_selectable(monkeypatch):
    """MOK_FORCE_REFERENCE=1 (the debug switch) runs the pure-PyTorch reference on CUDA tensors."""
    from megatron_mok import functional

    shape = (256, 256, 128, 128, 8, 2)
    cfg, ws, top, w, g = _case(shape, "random", 17)
    sched, ctx, cuda = forward_backward(cfg, ws, top, w, g)
    monkeypatch.setenv("MOK_FORCE_REFERENCE", "1")
    ref = grads_list(functional.backward(cfg, ws, sched, None, g, *w))
    check_close(cuda, ref)
