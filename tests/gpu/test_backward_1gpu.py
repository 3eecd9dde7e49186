"""Single-GPU (EP=1) tests of the CUDA backward (kernel_path.backward) against the fp32 reference,
plus its pieces (SwiGLU backward, the tight row layout and its gather, exact zeros of empty
experts) and the KERNEL_STALL error code."""

from __future__ import annotations

import pytest
import torch

from megatron_mok import MoKConfig, create_workspace
from megatron_mok.schedule import build_schedule_reference

from ._bwd import (assert_bitwise, backward_case, check_backward_bitwise_repeats, check_backward_graph_equals_eager,
                   check_backward_repeats, check_close, check_main_grads_accumulate, clone_all, forward_backward,
                   grads_list, poison_all, reference_grads)
from ._util import SHAPES, bits, gpu_marks, make_routing, rel_err, schedules_equal
from ._util import kernel_path_module as _kp

pytestmark = gpu_marks()

DEV = "cuda:0"


def _case(shape, kind, seed):
    return backward_case(shape, kind, seed, DEV)


# ---- pieces ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("rows,I,limit", [(300, 64, None), (384, 136, 256), (128, 8, 0)])
def test_swiglu_backward_matches_torch(rows, I, limit):
    from megatron_mok import ops

    gen = torch.Generator().manual_seed(rows + I)
    h = (3 * torch.randn(rows, 2 * I, generator=gen)).bfloat16().to(DEV)
    da = torch.randn(rows, I, generator=gen).bfloat16().to(DEV)
    dh = torch.full((rows, 2 * I), float("nan"), dtype=torch.bfloat16, device=DEV)
    seg = None if limit is None else torch.tensor([0, limit], dtype=torch.int32, device=DEV)
    ops.swiglu_backward(h, da, dh, seg)
    n = rows if limit is None else limit
    hf = h.float()[:n].requires_grad_(True)
    gate, up = hf.chunk(2, dim=1)
    (torch.nn.functional.silu(gate) * up).backward(da.float()[:n])
    assert rel_err(dh[:n], hf.grad) < 1e-2
    assert torch.isnan(dh[n:].float()).all(), "rows past the limit were written"
    dh2 = torch.full_like(dh, float("nan"))
    ops.swiglu_backward(h, da, dh2, seg)
    assert torch.equal(dh.view(torch.int16), dh2.view(torch.int16))


def _tight_map_torch(counts, offsets, align):
    rows = torch.minimum(counts, offsets[1:] - offsets[:-1]).clamp(min=0)
    toffs = torch.zeros(counts.numel() + 1, dtype=torch.int32)
    toffs[1:] = torch.cumsum((rows + align - 1) // align * align, 0)
    return rows, toffs


@pytest.mark.parametrize("kind", ["random", "skewed", "one_expert", "half_empty", "all_empty_but_last"])
def test_bwd_tight_map_and_gather_rows(kind):
    """toffs / trow of the tight layout against a torch computation; gather_rows puts every real row
    at its tight place and zeros in the tight padding rows, leaves rows past toffs[-1] untouched."""
    from megatron_mok import ops

    T, H, k, E = 517, 264, 8, 32
    cfg = MoKConfig()
    ws = create_workspace(None, DEV, T, H, k, E, cfg)
    gen = torch.Generator().manual_seed(len(kind))
    if kind == "all_empty_but_last":  # every token routes to the last k experts
        top = (E - k + torch.rand(T, k, generator=gen).argsort(dim=1)).to(DEV)
    else:
        top = make_routing(kind, T, k, E, gen).to(DEV)
    sched = _kp().build_schedule(cfg, ws, top)
    cap, nle = sched.capacity, sched.expert_counts.numel()
    toffs = torch.full((nle + 1,), -7, dtype=torch.int32, device=DEV)
    trow = torch.full((cap,), -7, dtype=torch.int32, device=DEV)
    ops.bwd_tight_map(sched.expert_counts, sched.expert_offsets, toffs, trow)
    counts, offsets = sched.expert_counts.cpu(), sched.expert_offsets.cpu()
    rows, want = _tight_map_torch(counts, offsets, ops.TIGHT_ALIGN)
    assert torch.equal(toffs.cpu(), want)
    want_row = torch.full((cap,), -1, dtype=torch.int32)
    for e in range(nle):
        n, t0, p0 = int(rows[e]), int(want[e]), int(offsets[e])
        want_row[t0:t0 + n] = torch.arange(p0, p0 + n, dtype=torch.int32)
    assert torch.equal(trow.cpu(), want_row)
    src = torch.randn(cap, H, device=DEV).bfloat16()
    dst = torch.full((cap, H), float("nan"), dtype=torch.bfloat16, device=DEV)
    ops.gather_rows(src, dst, trow, toffs)
    end = int(want[-1])
    idx = want_row[:end].long()
    ref = src.cpu()[idx.clamp(min=0)]
    ref[idx < 0] = 0
    assert torch.equal(dst[:end].cpu(), ref)
    assert torch.isnan(dst[end:].float()).all(), "rows past toffs[-1] were written"
    ws.check_errors(blocking=True)


def test_swiglu_backward_tight_rows():
    """With trow, da/dh row r pairs with h row trow[r]; trow < 0 gives zero dh rows."""
    from megatron_mok import ops

    gen = torch.Generator().manual_seed(5)
    rows, I = 160, 72
    h = (3 * torch.randn(rows, 2 * I, generator=gen)).bfloat16().to(DEV)
    da = torch.randn(rows, I, generator=gen).bfloat16().to(DEV)
    trow = torch.randperm(rows, generator=gen).to(torch.int32)
    trow[::7] = -1
    toffs = torch.tensor([0, 64, 144], dtype=torch.int32, device=DEV)  # 144 tight rows
    dh = torch.full((rows, 2 * I), float("nan"), dtype=torch.bfloat16, device=DEV)
    ops.swiglu_backward(h, da, dh, toffs, trow=trow.to(DEV))
    plain = torch.empty_like(dh)
    hp = h[trow.clamp(min=0).long().to(DEV)]
    ops.swiglu_backward(hp.contiguous(), da, plain, None)
    keep = (trow[:144] >= 0).to(DEV)
    assert torch.equal(dh[:144][keep].view(torch.int16), plain[:144][keep].view(torch.int16))
    assert bool((dh[:144][~keep] == 0).all())
    assert torch.isnan(dh[144:].float()).all()


def _dgrad_case(K, M, counts, seed):
    """dy [cap, K] in a tight layout (segments padded to 16 rows, zero padding rows, 64 rows past the
    last segment), w [nseg, K, M], offsets / counts on the device."""
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
    """With h and trow the epilogue writes dh = [d_gate | d_up]: bitwise what the unfused pair
    (expert_dgrad's da, then swiglu_backward) gives, within 1e-2 of the fp64 autograd reference;
    tight rows without a forward row (trow < 0) and padding rows are zeros."""
    from megatron_mok import ops

    dy, w, seg, cnt, offs, gen = _dgrad_case(K, M, DGRAD_COUNTS, K + M)
    cap = dy.shape[0]
    h = (3 * torch.randn(cap, 2 * M, generator=gen)).bfloat16().to(DEV)  # the forward's rows
    trow = torch.randperm(cap, generator=gen).to(torch.int32)
    for e, n in enumerate(DGRAD_COUNTS):
        trow[offs[e] + n: offs[e + 1]] = -1
    trow[offs[3] + 5] = -1  # a real row without a forward row: zeros, as swiglu_backward writes
    trow = trow.to(DEV)
    dh = torch.full((cap, 2 * M), float("nan"), dtype=torch.bfloat16, device=DEV)
    ops.expert_dgrad(dy, w, seg, cnt, dh, h=h, trow=trow)
    da = torch.empty((cap, M), dtype=torch.bfloat16, device=DEV)
    ops.expert_dgrad(dy, w, seg, cnt, da)
    unfused = torch.full_like(dh, float("nan"))
    ops.swiglu_backward(h, da, unfused, seg, trow=trow)
    end = offs[-1]
    assert torch.equal(bits(dh[:end]), bits(unfused[:end])), "fused SwiGLU backward differs from the unfused pair"
    assert torch.isnan(dh[end:].float()).all(), "rows past the last segment were written"
    keep = trow[:end] >= 0
    hf = h[trow[:end].clamp(min=0).long()].double().requires_grad_(True)
    gate, up = hf.chunk(2, dim=1)
    da_ref = torch.cat([dy[offs[e]:offs[e + 1]].double() @ w[e].double() for e in range(len(DGRAD_COUNTS))])
    (torch.nn.functional.silu(gate) * up).backward(da_ref)
    assert rel_err(dh[:end][keep], hf.grad[keep]) < 1e-2
    assert bool((dh[:end][~keep] == 0).all())


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
    h = torch.zeros((dy.shape[0], 64), dtype=torch.bfloat16, device=DEV)
    dh = torch.empty((dy.shape[0], 64), dtype=torch.bfloat16, device=DEV)
    trow = torch.zeros((dy.shape[0] - 1,), dtype=torch.int32, device=DEV)
    with pytest.raises(RuntimeError, match=f"trow must have {dy.shape[0]} entries"):
        ops.expert_dgrad(dy, w, seg, cnt, dh, h=h, trow=trow)


@pytest.mark.parametrize("M,N", [(128, 256), (200, 264), (72, 520)])
def test_expert_wgrad_matches_matmul(M, N, monkeypatch):
    """out[e] = a[rows of e]^T @ b[rows of e] with a in a tight layout (16-row segments) and b in a
    padded one (128-row segments): experts with 0, 1, 15, 17, 255-257 and 700 rows, M and N off the
    tile; against fp64, empty experts exactly zero, NaN rows past an expert's 16-row bound never
    read (a's tail past the last segment, b's padding), bits independent of the CTA count and of
    the epilogue (TMA stores or not: MOK_WGRAD_TMA_STORE)."""
    from megatron_mok import ops

    counts = [130, 0, 1, 15, 17, 255, 256, 257, 700, 48, 0]
    gen = torch.Generator().manual_seed(M * N)
    aoffs, boffs = [0], [0]
    for c in counts:
        aoffs.append(aoffs[-1] + (c + 15) // 16 * 16)
        boffs.append(boffs[-1] + (c + 127) // 128 * 128)
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
    for tma, ctas in (("1", 0), ("1", 1), ("1", 5), ("1", 77), ("0", 0), ("0", 5)):
        monkeypatch.setenv("MOK_WGRAD_TMA_STORE", tma)
        out = torch.full((len(counts), M, N), float("nan"), dtype=torch.bfloat16, device=DEV)
        ops.expert_wgrad(a, ao, b, bo, cnt, out, num_ctas=ctas)
        if first is None:
            first = out
        else:
            assert torch.equal(bits(out), bits(first)), f"bits depend on the CTA count ({ctas}) or epilogue ({tma})"
    for e, c in enumerate(counts):
        if c == 0:
            assert bool((first[e] == 0).all()), f"expert {e} without rows: not exact zeros"
            continue
        ref = a[aoffs[e]:aoffs[e] + c].double().t() @ b[boffs[e]:boffs[e] + c].double()
        assert rel_err(first[e], ref) < 1e-2, (e, rel_err(first[e], ref))


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


def test_zero_empty_segments():
    from megatron_mok import ops

    t = torch.randn(5, 24, 16, device=DEV).bfloat16()
    before = t.clone()
    counts = torch.tensor([3, 0, 1, 0, 7], dtype=torch.int32, device=DEV)
    ops.zero_empty_segments(t, counts)
    for e, c in enumerate([3, 0, 1, 0, 7]):
        if c == 0:
            assert bool((t[e] == 0).all())
        else:
            assert torch.equal(t[e], before[e])


def test_kernel_stall_error_code():
    from megatron_mok.workspace import ErrorCode, MoKKernelStallError, MoKPeerTimeoutError

    assert ErrorCode.KERNEL_STALL == 5 and ErrorCode.NUM_CODES == 6
    ws = create_workspace(None, DEV, 16, 64, 2, 4, MoKConfig())
    assert ws.errors.numel() == 6
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
    with the same bits from the megakernel and the staged GEMMs."""
    shape = (517, 512, 320, 256, 32, 8)
    cfg, ws, top, w, _ = _case(shape, kind, 31)
    x, _probs, fc1, _fc2, sfc1, _sfc2 = w
    kp = _kp()
    sched = kp.build_schedule(cfg, ws, top)
    kept = {}
    for path in ("mega", "staged"):
        _, ctx = kp.forward(cfg, ws, sched, *w, path=path)
        kept[path] = (ctx.h.clone(), ctx.shared_h.clone(), ctx.x_routed.clone())
    torch.cuda.synchronize()
    h, sh, xr = kept["mega"]
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


@pytest.mark.parametrize("kind", ["skewed", "one_expert", "half_empty"])
def test_backward_gemm_paths_agree(kind, monkeypatch):
    """The routed backward GEMMs on mok's expert-major kernels (default, padded rows) and on
    torch._grouped_mm (MOK_BWD_GEMM=torch, tight rows and gathers) give the same gradients up to
    the GEMMs' summation order; a bad MOK_BWD_GEMM value is named."""
    shape = (517, 512, 320, 256, 32, 8)
    cfg, ws, top, w, g = _case(shape, kind, 41)
    got = {}
    for impl in ("torch", "mok"):
        monkeypatch.setenv("MOK_BWD_GEMM", impl)
        _, _, got[impl] = forward_backward(cfg, ws, top, w, g)
    torch.cuda.synchronize()
    check_close(got["mok"], got["torch"], tol=1e-2)
    monkeypatch.setenv("MOK_BWD_GEMM", "cutlass")
    with pytest.raises(ValueError, match="MOK_BWD_GEMM"):
        forward_backward(cfg, ws, top, w, g)


@pytest.mark.parametrize("kind", ["random", "skewed", "one_expert", "half_empty"])
@pytest.mark.parametrize("shape", SHAPES)
def test_backward_megakernel_equals_staged(kind, shape, monkeypatch):
    """The persistent backward kernel (MOK_BWD_KERNEL=mega) gives the staged launches' bits (default)
    for every gradient, across pulling-CTA counts and minibatch sizes; a bad value is named."""
    cfg, ws, top, w, g = _case(shape, kind, 3 * sum(shape) + len(kind))
    kp = _kp()
    sched = kp.build_schedule(cfg, ws, top)
    _, ctx = kp.forward(cfg, ws, sched, *w)
    monkeypatch.setenv("MOK_BWD_KERNEL", "staged")
    staged = clone_all(grads_list(kp.backward(cfg, ws, sched, ctx, g, *w)))
    monkeypatch.setenv("MOK_BWD_KERNEL", "mega")
    for knobs in ({}, {"bwd_comm_sms": 1, "minibatch_rows": 128}, {"bwd_comm_sms": 100, "minibatch_rows": 384}):
        poison_all(ws)
        got = grads_list(kp.backward(cfg.replace(**knobs), ws, sched, ctx, g, *w))
        torch.cuda.synchronize()
        assert_bitwise(got, staged, f"mega {knobs} vs staged")
    ws.check_errors(blocking=True)
    monkeypatch.setenv("MOK_BWD_KERNEL", "persistent")
    with pytest.raises(ValueError, match="MOK_BWD_KERNEL"):
        kp.backward(cfg, ws, sched, ctx, g, *w)


def test_backward_megakernel_many_experts_runs_staged(monkeypatch):
    """More local experts than the persistent kernel's chunk prefix holds (511): MOK_BWD_KERNEL=mega
    runs the staged launches instead of failing, with their bits."""
    shape = (128, 128, 64, 64, 512, 2)
    cfg, ws, top, w, g = _case(shape, "random", 5)
    kp = _kp()
    sched = kp.build_schedule(cfg, ws, top)
    _, ctx = kp.forward(cfg, ws, sched, *w)
    got = {}
    for kernel in ("staged", "mega"):
        monkeypatch.setenv("MOK_BWD_KERNEL", kernel)
        got[kernel] = clone_all(grads_list(kp.backward(cfg, ws, sched, ctx, g, *w)))
    torch.cuda.synchronize()
    assert_bitwise(got["mega"], got["staged"], "512 experts: mega vs staged")
    check_close(got["mega"], reference_grads(ws, build_schedule_reference(ws, top), *w, g))
    ws.check_errors(blocking=True)


def test_backward_bitwise_20_repeats_and_knobs():
    shape = (512, 512, 256, 256, 16, 4)
    _cfg, ws, top, w, g = _case(shape, "skewed", 77)
    check_backward_bitwise_repeats(ws, top, w, g, comm_ctas=[0, 1, 7, 100])


@pytest.mark.parametrize("kernel", ["staged", "mega"])
def test_backward_cuda_graph_matches_eager(kernel, monkeypatch):
    monkeypatch.setenv("MOK_BWD_KERNEL", kernel)
    shape = (384, 256, 128, 128, 8, 2)
    cfg, ws, top, w, g = _case(shape, "random", 5)

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
    got2 = kp.backward(cfg, ws, sched, ctx, g, *w, main_grads=(main[0], None, None, None))
    assert got2.dfc1 is None and torch.equal(got2.dfc2, plain[3])
    assert torch.equal(main[0], (before[0] + plain[2].float()) + plain[2].float())
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
    assert_bitwise(auto, direct, "autograd vs kernel_path.backward")


def test_reference_path_selectable():
    shape = (256, 256, 128, 128, 8, 2)
    cfg, ws, top, w, g = _case(shape, "random", 17)
    sched, ctx, cuda = forward_backward(cfg, ws, top, w, g)
    ref = grads_list(_kp().backward(cfg, ws, sched, ctx, g, *w, path="reference"))
    check_close(cuda, ref)
