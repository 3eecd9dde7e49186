"""Single-GPU tests of the block-scaled e4m3 path: the row quantizer against megatron_mok/fp8.py
(bit for bit), the e4m3 expert GEMM against fp64 products of the dequantized operands (as accurate
as the bf16 GEMM is against its own), and the fp8 layer forward against the reference that
quantizes at the same points."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from megatron_mok import ROW_ALIGN, MoKConfig, fp8, functional
from megatron_mok.schedule import build_schedule_reference

from ._bwd import assert_bitwise, assert_fused_add, check_close, fp8_reference_grads, grads_list
from ._util import (bits, eager_before_capture, gemm_bits_over_cta_counts, gpu_marks, make_case, poison_internal,
                    rel_err)
from ._util import cuda_path as _kp

pytestmark = gpu_marks()

DEV = "cuda:0"


def _u8(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8)


@pytest.mark.parametrize("rows,K", [(1, 128), (300, 384), (4097, 7168)])
def test_quantize_rows_matches_reference_bits(rows, K):
    from megatron_mok import ops

    gen = torch.Generator().manual_seed(rows + K)
    x = (torch.randn(rows, K, generator=gen) * torch.rand(rows, 1, generator=gen) * 50).bfloat16()
    x[rows // 2] = 0  # a zero row: floor scale, zero bytes
    if rows > 2:
        x[1, :128] = 1e4  # saturating magnitudes stay finite
    xd = x.to(DEV)
    end = torch.tensor([max(1, rows - 7)], dtype=torch.int32, device=DEV)
    q, scale = ops.quantize_rows_e4m3(xd)
    q2, scale2 = ops.quantize_rows_e4m3(xd, end)
    torch.cuda.synchronize()
    for ref_dev in ("cpu", DEV):  # the recipe gives the same bits on both (scales: exact division)
        q_ref, s_ref = fp8.quantize_rows(x.to(ref_dev))
        assert torch.equal(_u8(q).to(ref_dev), _u8(q_ref)), f"e4m3 bytes differ from the reference ({ref_dev})"
        assert torch.equal(scale[:, :rows].to(ref_dev).t(), s_ref), f"scales differ from the reference ({ref_dev})"
    n = int(end.item())
    assert torch.equal(_u8(q2[:n]), _u8(q[:n])) and torch.equal(scale2[:, :n], scale[:, :n])
    # one scale row per token (the dispatch's layout, pitch rounded up to 4) and back to bf16
    pitch = -(-(K // 128) // 4) * 4
    q3 = torch.empty_like(q)
    s3 = torch.full((rows, pitch), float("nan"), device=DEV)
    ops.quantize_rows_e4m3_into(xd, q3, s3, scale_rows=True)
    assert torch.equal(_u8(q3), _u8(q)) and torch.equal(s3[:, :K // 128], scale[:, :rows].t())
    back = torch.full_like(xd, float("nan"))
    ops.dequantize_rows_e4m3(q3, s3, back, end, scale_rows=True)
    ref_back = fp8.dequantize_rows(q_ref, s_ref).bfloat16()
    assert torch.equal(bits(back[:n]), bits(ref_back[:n])), "dequantized rows differ from the reference"
    assert torch.isnan(back[n:].float()).all(), "rows past rows_end were written"


def test_dispatch_e4m3_moves_rows_and_transposes_scales():
    """ops.dispatch_e4m3 at one rank: routed row i gets token row_src_slot[i] / k's e4m3 bytes and
    its H / 128 scales in column i of scale_t (the GEMM's layout); padding rows get zeros; rows past
    the last segment stay untouched; shapes that do not fit are named errors."""
    from megatron_mok import ops

    gen = torch.Generator().manual_seed(5)
    T, H, k, pitch = 37, 384, 2, 4  # pitch: H / 128 rounded up to 4, as _x_e4m3_buffers makes it
    q = torch.randint(0, 256, (T, H), generator=gen, dtype=torch.uint8).to(DEV)
    s = torch.randn(T, pitch, generator=gen).to(DEV)
    offsets = torch.tensor([0, 48, 48, 96], dtype=torch.int32, device=DEV)  # the middle expert: no rows
    cap = 100
    src_rank = torch.full((cap,), -1, dtype=torch.int32)
    src_slot = torch.full((cap,), -1, dtype=torch.int32)
    real = list(range(0, 45)) + list(range(48, 90))
    slots = torch.randint(0, T * k, (len(real),), generator=gen, dtype=torch.int32)
    src_rank[real], src_slot[real] = 0, slots
    src_rank, src_slot = src_rank.to(DEV), src_slot.to(DEV)
    q_routed = torch.full((cap, H), 0x7F, dtype=torch.uint8, device=DEV).view(torch.float8_e4m3fn)
    scale_t = torch.full((H // 128, 104), float("nan"), device=DEV)
    ops.dispatch_e4m3(src_rank, src_slot, offsets, q_routed, scale_t, [q.data_ptr()], [s.data_ptr()], pitch, k, 3)
    torch.cuda.synchronize()
    tok = (src_slot[real] // k).long()
    assert torch.equal(_u8(q_routed)[real], q[tok]), "routed rows differ from their tokens' rows"
    assert torch.equal(scale_t[:, real], s[tok, :H // 128].t()), "routed scales differ from their tokens' scales"
    pad = [r for r in range(96) if r not in real]
    assert bool((_u8(q_routed)[pad] == 0).all()) and bool((scale_t[:, pad] == 0).all()), "padding rows not zeroed"
    assert bool((_u8(q_routed)[96:] == 0x7F).all()) and bool(scale_t[:, 96:].isnan().all()), \
        "rows past the last segment were written"
    with pytest.raises(RuntimeError, match="scale_t must be"):
        ops.dispatch_e4m3(src_rank, src_slot, offsets, q_routed, torch.empty(H // 128, 99, device=DEV),
                          [q.data_ptr()], [s.data_ptr()], pitch, k, 0)
    with pytest.raises(RuntimeError, match="scale pitch"):
        ops.dispatch_e4m3(src_rank, src_slot, offsets, q_routed, scale_t, [q.data_ptr()], [s.data_ptr()], 2, k, 0)


@pytest.mark.parametrize("swiglu", [True, False])
@pytest.mark.parametrize("nseg,n,K", [(3, 192, 256), (2, 320, 7168), (1, 8, 128)])
def test_quantize_weight_matches_reference_bits(swiglu, nseg, n, K):
    """The CUDA weight quantizer (behind functional.quantize_expert_weights) against
    fp8.quantize_weight, partial tiles included; one loud block per weight."""
    from megatron_mok import ops

    gen = torch.Generator().manual_seed(nseg * n + K)
    w = torch.randn(nseg, 2 * n if swiglu else n, K, generator=gen)
    w[:, 0, :128] *= 300.0
    w = w.bfloat16().to(DEV)
    q, scale = ops.quantize_weight_e4m3(w, swiglu)
    ref = fp8.quantize_weight(w, swiglu=swiglu)
    assert torch.equal(_u8(q), _u8(ref.q)), "e4m3 bytes differ from the reference"
    assert torch.equal(scale, ref.scale), "scales differ from the reference"
    if n % (64 if swiglu else 128):
        return  # the transposed copy needs whole tiles
    # the dgrads' transposed copy from the same pass
    q2, scale2, q_t, scale_t = ops.quantize_weight_e4m3(w, swiglu, transposed=True)
    ref_t = ref.transposed()
    assert torch.equal(_u8(q2), _u8(q)) and torch.equal(scale2, scale)
    assert torch.equal(_u8(q_t), _u8(ref_t.q)), "transposed e4m3 bytes differ from the reference"
    assert torch.equal(scale_t, ref_t.scale), "transposed scales differ from the reference"


def test_quantize_rows_gate_up_pairs_bits():
    """dh's quantizer for the fp8 dgrad: [gate | up] columns in gate/up pair blocks."""
    from megatron_mok import ops

    gen = torch.Generator().manual_seed(4)
    x = (torch.randn(333, 2 * 320, generator=gen) * 3).bfloat16()
    q, scale = ops.quantize_rows_e4m3(x.to(DEV), gate_up_pairs=True)
    q_ref, s_ref = fp8.quantize_rows(x, gate_up_pairs=True)
    assert torch.equal(_u8(q).cpu(), _u8(q_ref)), "paired e4m3 bytes differ from the reference"
    assert torch.equal(scale[:, :333].cpu().t(), s_ref), "paired scales differ from the reference"


def _segments(counts, K, gen):
    padded = [-(-c // ROW_ALIGN) * ROW_ALIGN for c in counts]  # the schedule's segments
    offs = [0]
    for p in padded:
        offs.append(offs[-1] + p)
    cap = offs[-1] + 256  # rows past the last segment must stay untouched
    a = torch.randn(cap, K, generator=gen).bfloat16()
    for e in range(len(counts)):
        a[offs[e] + counts[e]: offs[e + 1]] = 0  # padding rows are zero rows
    return a, offs, cap


@pytest.mark.parametrize("swiglu", [True, False])
@pytest.mark.parametrize("K,N,counts,positive", [
    (256, 128, [130, 0, 1, 255, 256, 257, 700, 17, 48, 200, 15], False),  # chunk sizes 1..256, empty experts
    (1024, 320, [0, 0, 1000, 0], False),  # all rows on one expert
    (7168, 256, [300, 211], False),  # DeepSeek-V3's K (56 scale blocks)
    (7168, 128, [129, 77], True),  # all-positive operands: no cancellation hides accumulation loss
    (512, 512, [130, 0, 1, 255, 257, 300, 600, 17], False),  # 4+ weight tiles: row pairs of 1-5 chunks
])
def test_expert_gemm_fp8_matches_dequantized_products(swiglu, K, N, counts, positive):
    """Real rows against fp64 products of the dequantized operands, padding rows +0, rows past the
    last segment untouched, bits independent of the CTA count (the gate/up GEMM: paired column
    tasks; the other: row tasks in 2-CTA row pairs; 1 CTA asks for one cluster). The accumulation
    must lose no more than the bf16 expert GEMM does on the same shapes (its error against fp64
    products of its own operands): e4m3 wgmma sums each 128-K block only, fp32 sums the blocks."""
    from megatron_mok import ops

    gen = torch.Generator().manual_seed(K + N + len(counts))
    a, offs, cap = _segments(counts, K, gen)
    w = (torch.randn(len(counts), 2 * N if swiglu else N, K, generator=gen) / K**0.5).bfloat16()
    if positive:
        a, w = a.abs(), w.abs()
    qw = fp8.quantize_weight(w.to(DEV), swiglu=swiglu)
    xq, xs = ops.quantize_rows_e4m3(a.to(DEV))
    seg = torch.tensor(offs, dtype=torch.int32, device=DEV)
    cnt = torch.tensor(counts, dtype=torch.int32, device=DEV)
    run = lambda out, h, ctas: ops.expert_gemm_fp8(xq, xs, qw.q, qw.scale, seg, cnt, out, swiglu,  # noqa: E731
                                                   pre_out=h, num_ctas=ctas)
    first = gemm_bits_over_cta_counts(run, cap, N, swiglu, (0, 1, 5, 6, 77), DEV)
    # the bf16 expert GEMM on the unquantized operands: its error against fp64 is the bar for the accumulation
    out_bf16 = torch.full((cap, N), float("nan"), dtype=torch.bfloat16, device=DEV)
    h_bf16 = torch.full((cap, 2 * N), float("nan"), dtype=torch.bfloat16, device=DEV) if swiglu else None
    ops.grouped_gemm(a.to(DEV), w.to(DEV), seg, out_bf16, swiglu, 0, cnt, pre_out=h_bf16)
    out, h = (t.cpu() if t is not None else None for t in first)
    out_bf16 = out_bf16.cpu()
    q_ref, s_ref = fp8.quantize_rows(a)
    a_deq = fp8.dequantize_rows(q_ref, s_ref).double()
    w_deq = qw.dequantize().cpu().double()
    worst_vs_bf16 = 0.0
    for e, n in enumerate(counts):
        lo, end = offs[e], offs[e + 1]
        if n:
            hh = a_deq[lo:lo + n] @ w_deq[e].t()
            ref = torch.nn.functional.silu(hh[:, :N]) * hh[:, N:] if swiglu else hh
            hb = a[lo:lo + n].double() @ w[e].double().t()
            ref_bf16 = torch.nn.functional.silu(hb[:, :N]) * hb[:, N:] if swiglu else hb
            err, err_bf16_kernel = rel_err(out[lo:lo + n], ref), rel_err(out_bf16[lo:lo + n], ref_bf16)
            assert err < 1e-2, (e, err)
            assert err <= 1.5 * err_bf16_kernel + 1e-4, (e, err, err_bf16_kernel)
            if swiglu:
                assert rel_err(h[lo:lo + n], hh) <= 1.5 * rel_err(h_bf16[lo:lo + n].cpu(), hb) + 1e-4, e
            worst_vs_bf16 = max(worst_vs_bf16, rel_err(out[lo:lo + n], ref_bf16))
        assert bool((out[lo + n:end] == 0).all()), f"padding rows of expert {e} are not +0"
        if swiglu:
            assert bool((h[lo + n:end] == 0).all()), f"pre_out padding rows of expert {e} are not +0"
    assert torch.isnan(out[offs[-1]:].float()).all(), "rows past the last segment were written"
    assert worst_vs_bf16 < 8e-2, worst_vs_bf16  # e4m3's 3 mantissa bits, against unquantized operands


def test_expert_gemm_fp8_rejects_k_past_its_task_tags():
    """A task's stages must not outlive its tag in the staged kernels' task tags: K past 128 * 251
    raises with a message naming the limit, and the largest allowed K runs."""
    from megatron_mok import ops

    for kb, ok in ((252, False), (251, True)):
        K, N, rows = 128 * kb, 128, 16
        x = torch.randn(rows, K, device=DEV).bfloat16()
        w = (torch.randn(1, N, K, device=DEV) / K**0.5).bfloat16()
        qw = fp8.quantize_weight(w, swiglu=False)
        xq, xs = ops.quantize_rows_e4m3(x)
        seg = torch.tensor([0, rows], dtype=torch.int32, device=DEV)
        cnt = torch.tensor([rows], dtype=torch.int32, device=DEV)
        out = torch.full((rows, N), float("nan"), dtype=torch.bfloat16, device=DEV)
        if ok:
            ops.expert_gemm_fp8(xq, xs, qw.q, qw.scale, seg, cnt, out, False)
            ref = fp8.dequantize_rows(*fp8.quantize_rows(x.cpu())).double() @ qw.dequantize().cpu().double()[0].t()
            assert rel_err(out.cpu(), ref) < 1e-2
        else:
            with pytest.raises(RuntimeError, match="K must be at most 128 \\* 251"):
                ops.expert_gemm_fp8(xq, xs, qw.q, qw.scale, seg, cnt, out, False)


@pytest.mark.parametrize("H,I,counts", [
    (256, 128, [130, 0, 1, 255, 256, 257, 17]),  # chunk sizes 1..128, an empty expert
    (512, 384, [0, 700, 0]),  # all rows on one expert
    (7168, 256, [300, 211]),  # DeepSeek-V3's H (56 scale blocks of dy)
    (512, 512, [130, 0, 1, 257, 300, 17]),  # 4 weight tiles a side: row pairs in both dgrads
])
def test_expert_gemm_fp8_dgrads_match_dequantized_products(H, I, counts):
    """The backward's two e4m3 dgrads: dh = swiglu_backward(h, bf16(dy @ fc2[e])) against fc2's
    transposed copy, then dx = dh @ fc1[e] from dh in gate/up pair blocks against fc1's transposed
    copy; each against fp64 products of its dequantized operands (<= 1e-2, and no worse than 1.5x
    the bf16 expert_dgrad against its own), padding rows +0, rows past the segments untouched,
    bits independent of the CTA count (row tasks in 2-CTA row pairs; 1 CTA asks for one cluster)."""
    from megatron_mok import ops

    E = len(counts)
    gen = torch.Generator().manual_seed(H + I + E)
    dy, offs, cap = _segments(counts, H, gen)
    h, _, _ = _segments(counts, 2 * I, gen)
    fc1 = (torch.randn(E, 2 * I, H, generator=gen) / H**0.5).bfloat16()
    fc2 = (torch.randn(E, H, I, generator=gen) / I**0.5).bfloat16()
    w8 = functional.quantize_expert_weights(fc1.to(DEV), fc2.to(DEV), transposed=True)
    seg = torch.tensor(offs, dtype=torch.int32, device=DEV)
    cnt = torch.tensor(counts, dtype=torch.int32, device=DEV)
    dyq, dys = ops.quantize_rows_e4m3(dy.to(DEV))
    first = None
    for ctas in (0, 1, 5, 6, 77):
        dh = torch.full((cap, 2 * I), float("nan"), dtype=torch.bfloat16, device=DEV)
        ops.expert_gemm_fp8(dyq, dys, w8.fc2_t.q, w8.fc2_t.scale, seg, cnt, dh, False, num_ctas=ctas, h=h.to(DEV))
        dhq, dhs = ops.quantize_rows_e4m3(dh, seg[-1:], gate_up_pairs=True)
        # dh's e4m3 copy from the same GEMM (the row tasks' epilogue): the quantizer's bits, rows
        # past the segments untouched
        dh2 = torch.full_like(dh, float("nan"))
        dhq2 = torch.full((cap, 2 * I), 0x7F, dtype=torch.uint8, device=DEV).view(torch.float8_e4m3fn)
        dhs2 = torch.full_like(dhs, float("nan"))
        ops.expert_gemm_fp8(dyq, dys, w8.fc2_t.q, w8.fc2_t.scale, seg, cnt, dh2, False, num_ctas=ctas, h=h.to(DEV),
                            dh_e4m3=(dhq2, dhs2))
        end = offs[-1]
        assert torch.equal(bits(dh2), bits(dh)), ("dh with its e4m3 copy", ctas)
        assert torch.equal(_u8(dhq2)[:end], _u8(dhq)[:end]), ("dh's e4m3 bytes", ctas)
        assert torch.equal(dhs2[:, :end], dhs[:, :end]), ("dh's e4m3 scales", ctas)
        assert bool((_u8(dhq2)[end:] == 0x7F).all()) and bool(dhs2[:, end:].isnan().all()), ctas
        dx = torch.full((cap, H), float("nan"), dtype=torch.bfloat16, device=DEV)
        ops.expert_gemm_fp8(dhq, dhs, w8.fc1_t.q, w8.fc1_t.scale, seg, cnt, dx, False, num_ctas=ctas)
        if first is None:
            first = (dh, dx)
            continue
        assert torch.equal(bits(dh), bits(first[0])) and torch.equal(bits(dx), bits(first[1])), ctas
    dh_copy = (torch.empty((cap, 2 * I), dtype=torch.float8_e4m3fn, device=DEV), torch.empty_like(dhs))
    with pytest.raises(RuntimeError, match="needs h"):  # the fc1 dgrad: no SwiGLU backward
        ops.expert_gemm_fp8(dhq, dhs, w8.fc1_t.q, w8.fc1_t.scale, seg, cnt, first[1], False, dh_e4m3=dh_copy)
    with pytest.raises(RuntimeError, match="dh_q_scale must be"):
        ops.expert_gemm_fp8(dyq, dys, w8.fc2_t.q, w8.fc2_t.scale, seg, cnt, first[0], False, h=h.to(DEV),
                            dh_e4m3=(dh_copy[0], dhs[:1].contiguous()))
    dh, dx = (t.cpu() for t in first)
    # the bf16 dgrad kernels on the unquantized operands: the bar for the accumulation
    dh16 = torch.empty((cap, 2 * I), dtype=torch.bfloat16, device=DEV)
    ops.expert_dgrad(dy.to(DEV), fc2.to(DEV), seg, cnt, dh16, h=h.to(DEV))
    dh16 = dh16.cpu()
    # the epilogue's other outputs with router weights: act (from h and w only: the bf16 dgrad's
    # bits) and the dot pieces (against the dequantized operands' products)
    row_w = (torch.rand(cap, generator=gen) + 0.25).to(DEV)
    outs = {}
    for name, run in (("fp8", lambda o, a, d: ops.expert_gemm_fp8(dyq, dys, w8.fc2_t.q, w8.fc2_t.scale, seg, cnt, o,
                                                                   False, h=h.to(DEV), row_w=row_w, act=a, dot=d)),
                      ("bf16", lambda o, a, d: ops.expert_dgrad(dy.to(DEV), fc2.to(DEV), seg, cnt, o, h=h.to(DEV),
                                                                row_w=row_w, act=a, dot=d))):
        o = torch.empty((cap, 2 * I), dtype=torch.bfloat16, device=DEV)
        a = torch.full((cap, I), float("nan"), dtype=torch.bfloat16, device=DEV)
        d = torch.full((cap, -(-I // 64)), float("nan"), device=DEV)
        run(o, a, d)
        outs[name] = (a, d)
    end = offs[-1]
    assert torch.equal(bits(outs["fp8"][0][:end]), bits(outs["bf16"][0][:end])), "act differs between the dgrads"
    from megatron_mok.reference import _swiglu_backward

    dy_deq = fp8.dequantize_rows(*fp8.quantize_rows(dy)).double()
    w1, w2 = w8.fc1.dequantize().cpu().double(), w8.fc2.dequantize().cpu().double()
    dh_rows = fp8.dequantize_rows(*fp8.quantize_rows(dh, gate_up_pairs=True))
    for e, n in enumerate(counts):
        lo, end = offs[e], offs[e + 1]
        if n:
            r = slice(lo, lo + n)
            hd = h[r].double()
            ref_dh = _swiglu_backward(hd, (dy_deq[r] @ w2[e]).bfloat16().double())
            ref_dh16 = _swiglu_backward(hd, (dy[r].double() @ fc2[e].double()).bfloat16().double())
            err = rel_err(dh[r], ref_dh)
            assert err < 1e-2 and err <= 1.5 * rel_err(dh16[r], ref_dh16) + 1e-4, (e, err)
            gate, up = hd.chunk(2, dim=1)
            dot_ref = ((dy_deq[r] @ w2[e]) * torch.nn.functional.silu(gate) * up).sum(1)
            assert rel_err(outs["fp8"][1][r.start:r.stop].double().sum(1).cpu(), dot_ref) < 1e-2, e
            ref_dx = fp8.unpair_columns(dh_rows[r]).double() @ w1[e]
            assert rel_err(dx[r], ref_dx) < 1e-2, (e, rel_err(dx[r], ref_dx))
            assert rel_err(dh[r], ref_dh16) < 8e-2  # e4m3 against the unquantized operands
        assert bool((dh[lo + n:end] == 0).all()) and bool((dx[lo + n:end] == 0).all()), f"padding rows of {e}"
    assert torch.isnan(dh[offs[-1]:].float()).all() and torch.isnan(dx[offs[-1]:].float()).all()


FP8_SHAPES = [  # T, H, I, Is, E, k (H and I multiples of 128)
    (256, 256, 128, 128, 8, 2),
    (300, 384, 256, 0, 16, 4),
    (517, 512, 384, 256, 32, 8),
    (128, 1024, 512, 512, 4, 1),
]


@pytest.mark.parametrize("kind", ["random", "skewed", "one_expert", "half_empty"])
@pytest.mark.parametrize("shape", FP8_SHAPES)
def test_fp8_forward_matches_fp8_reference(kind, shape):
    """The layer with MoKConfig(precision="fp8") (the staged launches) against the reference that
    quantizes the same operands (fp32 arithmetic), on NaN-poisoned outputs and buffers; repeats, CTA
    counts, minibatch sizes and comm SMs give the same bits (output and context); the quantization
    error against the bf16 layer is reported by its bound. The backward's second dispatch
    (``regather``) gives the forward's e4m3 rows in the layout the e4m3 GEMMs read."""
    from megatron_mok.cuda import dispatch
    from megatron_mok.cuda.context import saved_bytes

    T, H = shape[:2]
    cfg = MoKConfig(precision="fp8")
    cfg, ws, top, (x, probs, fc1, fc2, sfc1, sfc2), _ = make_case(shape, kind, 11 * sum(shape) + len(kind), DEV, cfg)
    assert cfg.resolved_forward_kernel(ws.ep_size) == "staged"
    sched = _kp().build_schedule(cfg, ws, top)
    ref_sched = build_schedule_reference(ws, top)
    f = lambda t: None if t is None else t.float()  # noqa: E731
    from megatron_mok import reference

    ref, rctx = reference.forward(ws, ref_sched, f(x), probs, f(fc1), f(fc2), f(sfc1), f(sfc2), "fp8")
    ref_bf16, _ = reference.forward(ws, ref_sched, f(x), probs, f(fc1), f(fc2), f(sfc1), f(sfc2))
    real = torch.cat([torch.arange(o, o + n) for o, n in zip(ref_sched.expert_offsets.tolist(),
                                                              ref_sched.expert_counts.tolist())]).to(DEV)
    I = fc1.shape[1] // 2
    w8 = functional.quantize_expert_weights(fc1, fc2)
    base = base_ctx = None
    # (knobs, config fields): CTA counts of the GEMMs and of the dispatch/combine (1 CTA asks for one
    # cluster, 6 for three), and the persistent forward's knobs, which the staged one must ignore
    reps = [({}, {}), ({}, {}), (dict(gemm_ctas=1, comm_ctas=3), {}), (dict(gemm_ctas=77, comm_ctas=1), {}),
            (dict(gemm_ctas=5), dict(minibatch_rows=128)), ({}, dict(fwd_comm_sms=1, minibatch_rows=4096)),
            (dict(gemm_ctas=6), {})]
    for rep, (knobs, fields) in enumerate(reps):
        out = torch.full((T, H), float("nan"), dtype=torch.bfloat16, device=DEV)
        out, ctx = _kp().forward(dataclasses.replace(cfg, **fields), ws, sched, x, probs, fc1,
                                 fc2, sfc1, sfc2, out=out, fp8_weights=w8 if rep % 2 == 0 else None, **knobs)
        torch.cuda.synchronize()
        assert torch.isfinite(out.float()).all(), f"rep {rep}: output elements not written (or NaN)"
        rows_q, rows_s = dispatch.regather(cfg, ws, sched, x)
        # the dispatched rows' scales in the layout the e4m3 GEMMs read: [H / 128, ld], ld = cap rounded to 4
        assert rows_s.shape == (H // 128, -(-sched.capacity // 4) * 4) and rows_s.is_contiguous()
        rows_deq = dispatch.rows_bf16((rows_q, rows_s), sched)[real]
        assert ctx.nbytes() == saved_bytes(sched.capacity, T, I, None if sfc1 is None else sfc1.shape[0] // 2,
                                           keep_gate_up=True)
        if base is None:
            base, base_ctx = out.clone(), ctx
            # the stages first: the routed rows' pre-activations, the rows, the output
            stages = dict(h=rel_err(ctx.h[real], rctx.fc1_out[real]), rows=rel_err(rows_deq, rctx.x_routed[real]),
                          out=rel_err(out, ref))
            if sfc1 is not None:  # the shared expert's e4m3 gate/up (fp8_shared, the default)
                stages["shared_h"] = rel_err(ctx.shared_h, rctx.shared_fc1_out)
            assert max(stages.values()) <= 1e-2, stages
            # e4m3's 3 mantissa bits, through two quantized GEMMs (no shared expert: nothing dilutes it)
            assert rel_err(out, ref_bf16) < 8e-2, rel_err(out, ref_bf16)
            base_rows = rows_deq.clone()
        else:
            assert torch.equal(bits(out), bits(base)), f"bits differ at rep {rep} ({knobs}, {fields})"
            assert torch.equal(bits(ctx.h[real]), bits(base_ctx.h[real])), f"ctx.h differs at rep {rep}"
            assert torch.equal(bits(rows_deq), bits(base_rows)), f"the dispatched e4m3 rows differ at rep {rep}"
        poison_internal(ws)
    if sfc1 is not None:
        # fp8_shared=False: the shared expert in bf16 (on the staged launches' side stream), against
        # the reference with a bf16 shared expert; two CTA counts give the same bits
        bf_shared = dataclasses.replace(cfg, fp8_shared=False)
        ref_bs, _ = reference.forward(ws, ref_sched, f(x), probs, f(fc1), f(fc2), f(sfc1), f(sfc2), "fp8", "bf16")
        outs = []
        for gemm_ctas in (0, 7):
            out = torch.full((T, H), float("nan"), dtype=torch.bfloat16, device=DEV)
            outs.append(_kp().forward(bf_shared, ws, sched, x, probs, fc1, fc2, sfc1, sfc2, out=out, fp8_weights=w8,
                                      gemm_ctas=gemm_ctas)[0])
            torch.cuda.synchronize()
            poison_internal(ws)
        assert rel_err(outs[0], ref_bs) <= 1e-2, rel_err(outs[0], ref_bs)
        assert torch.equal(bits(outs[0]), bits(outs[1])), "fp8_shared=False: bits depend on the CTA count"
        assert not torch.equal(bits(outs[0]), bits(base)), "fp8_shared=False gave the e4m3 shared expert's bits"
    ws.check_errors(blocking=True)


# experts of the weight-gradient tests: none, under/at/over the 32-row MMA groups and 128-row
# stages, long token sums (the tensor cores sum a whole expert); segments padded to ROW_ALIGN rows
# (the backward's layout)
WGRAD_COUNTS = [0, 1, 31, 32, 33, 127, 128, 129, 300, 0, 700, 2500]


def _padded_rows(counts, C, gen, scale_by_row: bool = False):
    """x [rows, C] bf16 in the padded layout (NaN in every padding row: the count bounds every read)
    and its int32 offsets/counts on the device."""
    offs = [0]
    for c in counts:
        offs.append(offs[-1] + -(-c // ROW_ALIGN) * ROW_ALIGN)
    x = torch.full((offs[-1] + 64, C), float("nan"))
    for e, c in enumerate(counts):
        v = torch.randn(c, C, generator=gen) * torch.rand(1, C, generator=gen) * 8
        if scale_by_row:
            v = v * torch.rand(c, 1, generator=gen)
        x[offs[e]:offs[e] + c] = v
    if counts[-1]:
        x[offs[-2], 3] = 3e4  # one outlier sets its column's scale
    return (x.bfloat16().to(DEV), torch.tensor(offs, dtype=torch.int32, device=DEV),
            torch.tensor(counts, dtype=torch.int32, device=DEV), offs)


def _check_columns(q_t, scale, src, offs, counts, what):
    """q_t [C, ld] / scale [nseg, C] against fp8.quantize_columns of each expert's rows of src
    (fp32 values): the same bytes and scales, zeros from the count to the segment's end."""
    for e, c in enumerate(counts):
        q_ref, s_ref = fp8.quantize_columns(src[offs[e]:offs[e] + c])
        assert torch.equal(scale[e].cpu(), s_ref), f"{what}: expert {e} scales differ"
        assert torch.equal(_u8(q_t[:, offs[e]:offs[e] + c]).t().cpu(), _u8(q_ref)), f"{what}: expert {e} bytes differ"
        pad = _u8(q_t[:, offs[e] + c:offs[e + 1]])
        assert bool((pad == 0).all()), f"{what}: expert {e}'s rows past its count are not zeros"


@pytest.mark.parametrize("C", [128, 320])
def test_quantize_columns_matches_reference_bits(C):
    """The weight gradients' e4m3 transposes: bf16 rows, and e4m3 rows with their scales in either
    layout (dequantized to bf16 first, as the backward sees them), give fp8.quantize_columns' bytes
    and scales per expert; rows past an expert's count are never read (NaN) and written as zeros."""
    from megatron_mok import ops

    gen = torch.Generator().manual_seed(C)
    x, offs_d, cnt, offs = _padded_rows(WGRAD_COUNTS, C, gen)
    q_t, scale = ops.quantize_columns_e4m3(x, offs_d, cnt)
    assert q_t.shape == (C, -(-x.shape[0] // 16) * 16) and scale.shape == (len(WGRAD_COUNTS), C)
    _check_columns(q_t, scale, x.float().cpu(), offs, WGRAD_COUNTS, "bf16 rows")
    if C % 128:
        with pytest.raises(RuntimeError, match="multiple of 128"):
            ops.quantize_columns_e4m3(torch.zeros(4, C, dtype=torch.float8_e4m3fn, device=DEV), offs_d, cnt,
                                      x_scale=torch.zeros(4, 4, device=DEV), scale_rows=True)
        return
    xz = torch.nan_to_num(x, nan=0.0)  # the row quantizer reads every row
    q8, s8 = ops.quantize_rows_e4m3(xz)
    back = fp8.dequantize_rows(_u8(q8).cpu().view(torch.float8_e4m3fn), s8[:, :x.shape[0]].t().cpu())
    for scale_rows in (False, True):
        xs = s8.t().contiguous() if scale_rows else s8
        q_t8, scale8 = ops.quantize_columns_e4m3(q8, offs_d, cnt, x_scale=xs, scale_rows=scale_rows)
        _check_columns(q_t8, scale8, back.bfloat16().float(), offs, WGRAD_COUNTS, f"e4m3 rows ({scale_rows})")
    with pytest.raises(RuntimeError, match="x_scale exactly when x is e4m3"):
        ops.quantize_columns_e4m3(q8, offs_d, cnt)


@pytest.mark.parametrize("M,N", [(128, 256), (192, 576), (64, 320)])
def test_expert_wgrad_fp8_matches_dequantized_products(M, N):
    """out[e] = A_e^T B_e on the e4m3 transposes (one scale per expert and column) against fp64
    products of the dequantized operands, M and N off the 128 x 256 tile; experts without rows exact
    zeros; the bits do not depend on the CTA count; a mismatched operand raises a named error."""
    from megatron_mok import ops

    gen = torch.Generator().manual_seed(M + N)
    a, offs_d, cnt, offs = _padded_rows(WGRAD_COUNTS, M, gen, scale_by_row=True)
    b, *_ = _padded_rows(WGRAD_COUNTS, N, gen)
    a_t, a_s = ops.quantize_columns_e4m3(a, offs_d, cnt)
    b_t, b_s = ops.quantize_columns_e4m3(b, offs_d, cnt)
    first = None
    for ctas in (0, 1, 5, 77):
        out = torch.full((len(WGRAD_COUNTS), M, N), float("nan"), dtype=torch.bfloat16, device=DEV)
        ops.expert_wgrad_fp8(a_t, a_s, b_t, b_s, offs_d, cnt, out, num_ctas=ctas)
        if first is None:
            first = out
        else:
            assert torch.equal(bits(out), bits(first)), f"bits depend on the CTA count ({ctas})"
    for e, c in enumerate(WGRAD_COUNTS):
        if c == 0:
            assert bool((first[e] == 0).all()), f"expert {e} without rows: not exact zeros"
            continue
        da = a_t[:, offs[e]:offs[e] + c].double() * a_s[e, :, None].double()
        db = b_t[:, offs[e]:offs[e] + c].double() * b_s[e, :, None].double()
        ref = da @ db.t()
        assert rel_err(first[e], ref) < 1e-2, (e, rel_err(first[e], ref))
        # and the operands themselves are e4m3-close to the bf16 rows
        assert rel_err(ref, a[offs[e]:offs[e] + c].double().t() @ b[offs[e]:offs[e] + c].double()) < 6e-2, e
    # fp32 out (Megatron's main_grad): the scaled fp32 sums are added into it; empty experts add nothing
    base = torch.randn((len(WGRAD_COUNTS), M, N), generator=gen).to(DEV)
    out32 = base.clone()
    ops.expert_wgrad_fp8(a_t, a_s, b_t, b_s, offs_d, cnt, out32, num_ctas=5)
    for e, c in enumerate(WGRAD_COUNTS):
        if c == 0:
            assert torch.equal(out32[e], base[e]), f"expert {e} without rows changed its fp32 out"
        else:
            assert_fused_add(out32[e], base[e], first[e], f"fp32 out, expert {e}")
    out = torch.empty((len(WGRAD_COUNTS), M, N), dtype=torch.bfloat16, device=DEV)
    with pytest.raises(RuntimeError, match="scales must be"):
        ops.expert_wgrad_fp8(a_t, a_s[:, :8].contiguous(), b_t, b_s, offs_d, cnt, out)
    with pytest.raises(RuntimeError, match="share one token layout"):
        ops.expert_wgrad_fp8(a_t, a_s, b_t[:, :64], b_s, offs_d, cnt, out)
    with pytest.raises(RuntimeError, match="out must be"):
        ops.expert_wgrad_fp8(a_t, a_s, b_t, b_s, offs_d, cnt, out[:, :, :8])


@pytest.mark.parametrize("fp8_dgrad,fp8_wgrad", [(True, True), (False, True), (True, False)])
def test_fp8_forward_cuda_graph_and_backward(fp8_dgrad, fp8_wgrad):
    """Schedule + fp8 forward (the staged launches) captured in a CUDA graph (no host sync) replays the
    eager bits; the backward on the fp8 forward's context (e4m3 or bf16 dgrads and weight gradients)
    matches the reference backward on the reference fp8 context (<= 1e-2 for every gradient),
    repeats bit for bit, and replays the same bits from a CUDA graph."""
    shape = (517, 512, 384, 256, 32, 8)
    cfg = MoKConfig(precision="fp8", fp8_dgrad=fp8_dgrad, fp8_wgrad=fp8_wgrad)
    cfg, ws, top, inputs, _ = make_case(shape, "skewed", 5, DEV, cfg)
    kp = _kp()
    w8 = functional.quantize_expert_weights(inputs[2], inputs[3], transposed=fp8_dgrad)

    def run():
        return kp.forward(cfg, ws, kp.build_schedule(cfg, ws, top), *inputs, fp8_weights=w8)

    eager = eager_before_capture(lambda: run()[0].clone())
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out_g, _ = run()
    for _ in range(3):
        out_g.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(bits(out_g), bits(eager)), "graph replay differs from eager"
    sched = kp.build_schedule(cfg, ws, top)
    out, ctx = kp.forward(cfg, ws, sched, *inputs, fp8_weights=w8)
    kept = ctx.nbytes()  # the gate/up pre-activations only: the backward dispatches the rows again
    assert ctx.h is not None and kept == ctx.h.nbytes + (0 if ctx.shared_h is None else ctx.shared_h.nbytes)
    grad = torch.randn(out.shape, generator=torch.Generator().manual_seed(9)).bfloat16().to(DEV)
    got = grads_list(functional.backward(cfg, ws, sched, ctx, grad, *inputs, fp8_weights=w8))
    assert ctx.nbytes() == kept, "the backward grew the context (the rows it dispatches again are its own)"
    again = grads_list(functional.backward(cfg, ws, sched, ctx, grad, *inputs))  # weights quantized inside
    assert_bitwise(got, again, "repeat")

    def bwd():
        return grads_list(functional.backward(cfg, ws, sched, ctx, grad, *inputs, fp8_weights=w8))

    bwd()
    torch.cuda.synchronize()
    g_graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g_graph):
        captured = bwd()
    for t in captured:
        if t is not None:
            t.fill_(float("nan"))
    g_graph.replay()
    torch.cuda.synchronize()
    assert_bitwise(captured, got, "graph replay")
    # the reference backward on the reference fp8 forward's context (dequantized rows, e4m3 GEMMs' h)
    check_close(got, fp8_reference_grads(ws, top, inputs, grad, cfg.dgrad_precision, cfg.wgrad_precision))
    ws.check_errors(blocking=True)


def test_captured_layers_hand_buffers_between_streams_without_deferred_frees():
    """The side stream's buffers (the shared expert's outputs, the e4m3 weight gradients' transposes)
    go back to the pool inside a CUDA-graph capture: no record_stream, whose frees a capture defers to
    its end (the fp8 one-GPU proxy's full-iteration graph ran out of memory on them). Capturing four
    fp8 forwards and backwards in one graph reserves about what capturing one does, and replays the
    eager bits."""
    shape = (2048, 1024, 512, 512, 8, 8)
    cfg = MoKConfig(precision="fp8", fp8_dgrad=True, fp8_wgrad=True)
    cfg, ws, top, inputs, _ = make_case(shape, "random", 13, DEV, cfg)
    kp = _kp()
    w8 = functional.quantize_expert_weights(inputs[2], inputs[3], transposed=True)
    grad = torch.randn(shape[:2], generator=torch.Generator().manual_seed(4)).bfloat16().to(DEV)

    def layer():
        sched = kp.build_schedule(cfg, ws, top)
        out, ctx = kp.forward(cfg, ws, sched, *inputs, fp8_weights=w8)
        return [out, *grads_list(functional.backward(cfg, ws, sched, ctx, grad, *inputs, fp8_weights=w8))]

    eager = eager_before_capture(layer)
    grown = {}
    for calls in (1, 4):
        torch.cuda.synchronize()
        torch.cuda.empty_cache()  # as torch.cuda.graph does on entry: only the graph's pool counts
        before = torch.cuda.memory_reserved()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for _ in range(calls - 1):
                layer()
            last = layer()
        torch.cuda.synchronize()
        grown[calls] = torch.cuda.memory_reserved() - before
        for t in last:
            if t is not None:
                t.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        assert_bitwise(last, eager, f"replay of {calls} captured layers")
        del graph, last
        torch.cuda.empty_cache()
    assert grown[4] <= grown[1] + (64 << 20), f"capture reserved {grown} bytes for 1 / 4 layers"


def test_fp8_pull_quantizes_dy_like_the_row_quantizer(monkeypatch):
    """The fp8 dgrad's dy operand comes from the pull (quantized on the way): the same bytes and
    scales as quantize_rows_e4m3 on the pulled dy, padding rows included."""
    from megatron_mok import ops

    shape = (300, 384, 256, 0, 16, 4)
    cfg = MoKConfig(precision="fp8")
    cfg, ws, top, inputs, _ = make_case(shape, "half_empty", 21, DEV, cfg)
    kp = _kp()
    sched = kp.build_schedule(cfg, ws, top)
    _, ctx = kp.forward(cfg, ws, sched, *inputs)
    seen = {}
    pull = ops.bwd_pull

    def spy(*args, **kwargs):
        pull(*args, **kwargs)
        if kwargs.get("q") is not None:
            seen.update(dy=args[3].clone(), q=kwargs["q"].clone(), scale=kwargs["q_scale"].clone())

    monkeypatch.setattr(ops, "bwd_pull", spy)
    grad = torch.randn(shape[:2], generator=torch.Generator().manual_seed(2)).bfloat16().to(DEV)
    functional.backward(cfg, ws, sched, ctx, grad, *inputs)
    assert seen, "the fp8 backward did not quantize dy in the pull"
    rows = int(sched.expert_offsets[-1])
    q, scale = ops.quantize_rows_e4m3(seen["dy"][:rows].contiguous())
    assert torch.equal(_u8(seen["q"][:rows]), _u8(q)), "pulled e4m3 bytes differ from the row quantizer's"
    assert torch.equal(seen["scale"][:, :rows], scale[:, :rows]), "pulled scales differ from the row quantizer's"
    ws.check_errors(blocking=True)
