"""Single-GPU (EP=1) tests of the CUDA path against the pure-PyTorch reference."""

from __future__ import annotations

import pytest
import torch

from megatron_mok import ROW_ALIGN, MoKCapacityError, MoKConfig, MoKInputError, create_workspace
from megatron_mok.schedule import build_schedule_reference

from ._util import (SHAPES, bits, check_forward_bitwise_repeats, check_forward_graph_equals_eager,
                    gemm_bits_over_cta_counts, gpu_marks, make_case, make_routing, poison_internal, reference_out,
                    rel_err, schedules_equal)
from ._util import cuda_path as _kp

pytestmark = gpu_marks()

DEV = "cuda:0"  # the workspace compares devices exactly


# ---- grouped GEMM alone ---------------------------------------------------------------------------


@pytest.mark.parametrize("swiglu", [False, True])
@pytest.mark.parametrize("K,N", [(256, 256), (384, 192), (136, 40), (1024, 520)])
def test_grouped_gemm_matches_matmul(swiglu, K, N):
    """The token-major GEMM (without seg_counts) in 2-CTA clusters on m-tile pairs sharing B within a
    segment (7 m-tiles here: pairs inside a segment, pairs across segments, an incomplete last pair),
    and the expert-major GEMM (with seg_counts): the same bits for every CTA count, against fp32."""
    from megatron_mok import ops

    gen = torch.Generator().manual_seed(K * 7 + N)
    counts = [130, 0, 1, 255, 128, 0, 17]
    nseg = len(counts)
    padded = [(c + 127) // 128 * 128 for c in counts]
    offs = [0]
    for p in padded:
        offs.append(offs[-1] + p)
    cap = offs[-1] + 256  # unused tail rows must stay untouched
    a = torch.randn(cap, K, generator=gen).bfloat16().to(DEV)
    for e in range(nseg):  # padding rows are zero rows, as the dispatch writes them
        a[offs[e] + counts[e]: offs[e + 1]] = 0
    cnt = torch.tensor(counts, dtype=torch.int32, device=DEV)
    b_rows = 2 * N if swiglu else N
    b = (torch.randn(nseg, b_rows, K, generator=gen) / K**0.5).bfloat16().to(DEV)
    out = torch.full((cap, N), float("nan"), dtype=torch.bfloat16, device=DEV)
    seg = torch.tensor(offs, dtype=torch.int32, device=DEV)
    runs = [(0, cnt), (3, cnt), (0, None), (5, None), (1, None)]
    for ctas, seg_counts in runs:
        out2 = torch.full_like(out, float("nan"))
        ops.grouped_gemm(a, b, seg, out2, swiglu, ctas, seg_counts)
        if (ctas, seg_counts) == runs[0]:
            out.copy_(out2)
        else:
            # bit patterns (the untouched tail rows hold NaN, which torch.equal never matches)
            assert torch.equal(out.view(torch.int16), out2.view(torch.int16)), \
                f"bits depend on the CTA count or the tile layout ({ctas}, {seg_counts is None})"
    torch.cuda.synchronize()
    for e in range(nseg):
        rows = slice(offs[e], offs[e + 1])
        h = a[rows].float() @ b[e].float().t()
        if swiglu:
            g, u = h[:, :N], h[:, N:]
            ref = torch.nn.functional.silu(g) * u
        else:
            ref = h
        if offs[e + 1] > offs[e]:
            assert rel_err(out[rows], ref) < 1e-2, (e, rel_err(out[rows], ref))
    assert torch.isnan(out[offs[-1]:].float()).all(), "rows past the last segment were written"


def _expert_case(K, N, swiglu, counts, seed):
    gen = torch.Generator().manual_seed(seed)
    padded = [-(-c // ROW_ALIGN) * ROW_ALIGN for c in counts]  # the schedule's segments
    offs = [0]
    for p in padded:
        offs.append(offs[-1] + p)
    cap = offs[-1] + 256  # rows past the last segment must stay untouched
    a = torch.randn(cap, K, generator=gen).bfloat16().to(DEV)
    for e in range(len(counts)):  # padding rows are zero rows, as the dispatch writes them
        a[offs[e] + counts[e]: offs[e + 1]] = 0
    b = (torch.randn(len(counts), 2 * N if swiglu else N, K, generator=gen) / K**0.5).bfloat16().to(DEV)
    seg = torch.tensor(offs, dtype=torch.int32, device=DEV)
    cnt = torch.tensor(counts, dtype=torch.int32, device=DEV)
    return a, b, seg, cnt, offs


@pytest.mark.parametrize("swiglu", [False, True])
@pytest.mark.parametrize("K,N", [(256, 256), (384, 192), (136, 40), (1024, 520)])
def test_expert_gemm_matches_matmul(swiglu, K, N):
    """The expert-major GEMM (the default with seg_counts): token chunks of 1..256 rows in every
    16-row size class, experts with 0, 1, 256, 257 and 700 rows; real rows against fp32 matmul,
    padding rows +0, rows past the last segment untouched, bits independent of the CTA count."""
    from megatron_mok import ops

    counts = [130, 0, 1, 255, 256, 257, 700, 17, 48, 200, 15]
    a, b, seg, cnt, offs = _expert_case(K, N, swiglu, counts, K * 5 + N)
    cap = a.shape[0]
    out, h = gemm_bits_over_cta_counts(
        lambda out, h, ctas: ops.grouped_gemm(a, b, seg, out, swiglu, ctas, cnt, pre_out=h),
        cap, N, swiglu, (0, 1, 3, 37), DEV)
    torch.cuda.synchronize()
    for e, n in enumerate(counts):
        lo, end = offs[e], offs[e + 1]
        if n:
            hh = a[lo:lo + n].float() @ b[e].float().t()
            ref = torch.nn.functional.silu(hh[:, :N]) * hh[:, N:] if swiglu else hh
            assert rel_err(out[lo:lo + n], ref) < 1e-2, (e, rel_err(out[lo:lo + n], ref))
            if swiglu:
                assert rel_err(h[lo:lo + n], hh) < 1e-2, e
        assert bool((out[lo + n:end] == 0).all()), f"padding rows of expert {e} are not +0"
        if swiglu:
            assert bool((h[lo + n:end] == 0).all()), f"pre_out padding rows of expert {e} are not +0"
    assert torch.isnan(out[offs[-1]:].float()).all(), "rows past the last segment were written"


def test_grouped_gemm_single_segment_tail_rows():
    from megatron_mok import ops

    gen = torch.Generator().manual_seed(3)
    T, K, N = 300, 512, 384
    a = torch.randn(T, K, generator=gen).bfloat16().to(DEV)
    b = (torch.randn(2 * N, K, generator=gen) / K**0.5).bfloat16().to(DEV)
    out = torch.full((T, N), float("nan"), dtype=torch.bfloat16, device=DEV)
    ops.grouped_gemm(a, b, None, out, True)
    h = a.float() @ b.float().t()
    ref = torch.nn.functional.silu(h[:, :N]) * h[:, N:]
    assert not torch.isnan(out.float()).any()
    assert rel_err(out, ref) < 1e-2


def test_grouped_gemm_rejects_misaligned_outputs():
    """The epilogue writes 16-byte vectors: an output view that starts off a 16-byte boundary is
    refused with a message that says so, and nothing is written."""
    from megatron_mok import ops

    a = torch.randn(128, 256, device=DEV).bfloat16()
    b = torch.randn(256, 256, device=DEV).bfloat16()
    flat = torch.zeros(128 * 256 + 8, dtype=torch.bfloat16, device=DEV)
    out = flat[1:1 + 128 * 256].view(128, 256)  # contiguous, 2 bytes past an aligned address
    with pytest.raises(RuntimeError, match="16-byte aligned"):
        ops.grouped_gemm(a, b, None, out, False)
    torch.cuda.synchronize()
    assert not flat.any(), "a refused launch wrote its output"


# ---- schedule ------------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", ["random", "skewed", "one_expert", "half_empty"])
@pytest.mark.parametrize("T,k,E", [(300, 4, 16), (1024, 8, 64), (77, 1, 4)])
def test_schedule_bit_exact(kind, T, k, E):
    gen = torch.Generator().manual_seed(T + k + E)
    cfg = MoKConfig()
    ws = create_workspace(None, DEV, T, 128, k, E, cfg)
    top = make_routing(kind, T, k, E, gen).to(DEV)
    ref = build_schedule_reference(ws, top)
    for dtype in (torch.int64, torch.int32):
        got = _kp().build_schedule(cfg, ws, top.to(dtype))
        assert schedules_equal(got, ref) == []
    ws.check_errors(blocking=True)


# ---- forward -------------------------------------------------------------------------------------


@pytest.mark.parametrize("forward_kernel", ["persistent", "staged"])
@pytest.mark.parametrize("kind", ["random", "skewed", "one_expert", "half_empty"])
@pytest.mark.parametrize("shape", SHAPES)
def test_forward_matches_reference(kind, shape, forward_kernel):
    T, H = shape[:2]
    cfg, ws, top, (x, probs, fc1, fc2, sfc1, sfc2), _ = make_case(shape, kind, sum(shape) + len(kind), DEV)
    cfg = cfg.replace(forward_kernel=forward_kernel)
    sched = _kp().build_schedule(cfg, ws, top)
    ref_sched = build_schedule_reference(ws, top)
    assert schedules_equal(sched, ref_sched) == []
    ref = reference_out(ws, ref_sched, x, probs, fc1, fc2, sfc1, sfc2)
    for _ in range(2):  # the second run also sees NaN-poisoned internal buffers
        out = torch.full((T, H), float("nan"), dtype=torch.bfloat16, device=DEV)
        out, ctx = _kp().forward(cfg, ws, sched, x, probs, fc1, fc2, sfc1, sfc2, out=out)
        torch.cuda.synchronize()
        assert torch.isfinite(out.float()).all(), "output elements not written (or NaN)"
        err = rel_err(out, ref)
        assert err <= 1e-2, err
        poison_internal(ws)
    ws.check_errors(blocking=True)


# ---- the persistent megakernel vs the staged launches (bitwise) ------------------------------------


def _forward_both(cfg, ws, sched, inputs, rows, **knobs):
    """Persistent and staged forward on NaN-poisoned outputs and buffers; returns both (out, ctx)."""
    T, H = ws.num_tokens, ws.hidden
    res = {}
    for kernel in ("staged", "persistent"):
        poison_internal(ws)
        out = torch.full((T, H), float("nan"), dtype=torch.bfloat16, device=DEV)
        res[kernel] = _kp().forward(cfg.replace(forward_kernel=kernel), ws, sched, *inputs, out=out,
                                    **(knobs if kernel == "persistent" else {}))
    torch.cuda.synchronize()
    return res


def _assert_same_bits(res, rows):
    (o_s, c_s), (o_m, c_m) = res["staged"], res["persistent"]
    assert torch.isfinite(o_m.float()).all(), "megakernel left output elements unwritten (NaN)"
    assert torch.equal(bits(o_m), bits(o_s)), "megakernel output differs from the staged path"
    assert torch.equal(bits(c_m.h[:rows]), bits(c_s.h[:rows])), "megakernel ctx.h differs from the staged path"
    if c_s.shared_h is not None:
        assert torch.equal(bits(c_m.shared_h), bits(c_s.shared_h)), "shared_h differs"


@pytest.mark.parametrize("kind", ["random", "skewed", "one_expert", "half_empty"])
@pytest.mark.parametrize("shape", SHAPES)
def test_megakernel_bitwise_equals_staged(kind, shape):
    cfg, ws, top, inputs, _ = make_case(shape, kind, 3 * sum(shape) + len(kind), DEV)
    sched = _kp().build_schedule(cfg, ws, top)
    rows = int(sched.expert_offsets[-1])
    _assert_same_bits(_forward_both(cfg, ws, sched, inputs, rows), rows)
    ws.check_errors(blocking=True)


def test_megakernel_timeline_records_every_task():
    """With ops.megakernel_timeline on, every task of the launch is stamped once, in causal order,
    and the output bits do not change."""
    from megatron_mok import ops
    from megatron_mok.tools import timeline

    shape = T, H, I, Is, E, k = 1024, 512, 256, 256, 16, 4
    cfg, ws, top, inputs, _ = make_case(shape, "skewed", 29, DEV, cfg=MoKConfig(minibatch_rows=1024))
    sched = _kp().build_schedule(cfg, ws, top)
    rows = int(sched.expert_offsets[-1])
    base = _forward_both(cfg, ws, sched, inputs, rows)["persistent"][0]
    records = timeline.new_records(4096, DEV)
    ops.megakernel_timeline(records)
    try:
        out, _ = _kp().forward(cfg.replace(forward_kernel="persistent"), ws, sched, *inputs)
        torch.cuda.synchronize()
    finally:
        ops.megakernel_timeline(None)
    assert torch.equal(bits(out), bits(base)), "the timeline stamps changed the output"
    # shared expert: token-major tiles (m-tile, n-tile)
    n_sup, n_sdown = (Is + 127) // 128, (H + 255) // 256
    shared_units = (T + 127) // 128
    expect = {(0, m, n) for m in range(shared_units) for n in range(n_sup)}
    expect |= {(1, m, n) for m in range(shared_units) for n in range(n_sdown)}
    # routed experts: expert-major tasks (global token chunk, weight block)
    chunks = sum((int(c) + 255) // 256 for c in sched.expert_counts.tolist())
    n_blocks = {2: (I + 63) // 64, 3: (H + 127) // 128}
    routed_all = {(kind, g, b) for kind, nb in n_blocks.items() for g in range(chunks) for b in range(nb)}
    r = records.cpu()
    tasks = r[:-timeline.DISPATCH_RECORDS]
    tasks = tasks[tasks[:, 3] > 0]
    got = [tuple(int(v) for v in row[5:8]) for row in tasks]
    assert len(set(got)) == len(got), "a task was stamped twice"
    assert {t for t in got if t[0] < 2} == expect, "shared tasks missing or unknown"
    routed = [t for t in got if t[0] >= 2]
    assert set(routed) == routed_all, "routed tasks missing or unknown"
    assert (tasks[:, 0] <= tasks[:, 1]).all() and (tasks[:, 1] <= tasks[:, 2]).all() \
        and (tasks[:, 2] <= tasks[:, 3]).all(), "stamps out of order"
    disp = r[-timeline.DISPATCH_RECORDS:]
    disp = disp[disp[:, 1] > 0]
    assert len(disp) >= 1 and (disp[:, 5] == -1).all() and (disp[:, 0] <= disp[:, 1]).all()
    s = timeline.summarize(records)
    assert s["tasks"] == len(got) and 0 < s["leader_time"]["busy"] <= 1
    ws.check_errors(blocking=True)


def test_megakernel_bits_independent_of_comm_sms_and_minibatch():
    shape = T, H, I, Is, E, k = 1024, 512, 256, 256, 16, 4  # ~36 routed m-tiles: many minibatches at 128 rows
    _, ws, top, inputs, _ = make_case(shape, "skewed", 21, DEV)  # the knobs below do not touch ws
    sched = _kp().build_schedule(MoKConfig(), ws, top)
    rows = int(sched.expert_offsets[-1])
    base = _forward_both(MoKConfig(), ws, sched, inputs, rows)
    _assert_same_bits(base, rows)
    for comm in (2, 8, 24, 40):
        for mb in (128, 256, 1024, 4096):
            cfg = MoKConfig(fwd_comm_sms=comm, minibatch_rows=mb)
            for knobs in ({}, {"gemm_ctas": 3}):
                poison_internal(ws)
                out = torch.full((T, H), float("nan"), dtype=torch.bfloat16, device=DEV)
                out, _ = _kp().forward(cfg.replace(forward_kernel="persistent"), ws, sched, *inputs, out=out,
                                       **knobs)
                assert torch.equal(bits(out), bits(base["staged"][0])), (comm, mb, knobs)
            ws.check_errors(blocking=True)


def test_launch_counts():
    """Schedule: 1 launch; persistent forward: 3 (publish + barrier, megakernel, epilogue + probs
    check), also through ``functional.forward``: 4 per layer forward."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    T, H = 512, 256
    cfg, ws, top, inputs, _ = make_case((T, H, 128, 128, 8, 2), "random", 8, DEV)
    cfg = cfg.replace(forward_kernel="persistent")
    out = torch.empty((T, H), dtype=torch.bfloat16, device=DEV)
    sched = _kp().build_schedule(cfg, ws, top)
    _kp().forward(cfg, ws, sched, *inputs, out=out)  # creates the buffers
    torch.cuda.synchronize()

    def device_ops(fn):
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            fn()
            torch.cuda.synchronize()
        return [e.name for e in prof.events() if e.device_type == DeviceType.CUDA]

    sched_ops = device_ops(lambda: _kp().build_schedule(cfg, ws, top))
    fwd_ops = device_ops(lambda: _kp().forward(cfg, ws, sched, *inputs, out=out))
    if not sched_ops and not fwd_ops:
        pytest.skip("the profiler recorded no device activity here")
    assert len(sched_ops) == 1, sched_ops
    assert len(fwd_ops) == 3, fwd_ops
    from megatron_mok import functional  # it adds no probs-check launches: the epilogue checks them

    layer_ops = device_ops(lambda: functional.forward(cfg, ws, functional.build_schedule(cfg, ws, top), *inputs))
    # the non-blocking error check's device-to-host copy is not a launch
    assert len([n for n in layer_ops if "Memcpy" not in n]) == 4, layer_ops
    ws.check_errors(blocking=True)


def test_forward_bitwise_repeat_and_knobs():
    cfgs = (MoKConfig(), MoKConfig(fwd_comm_sms=2, minibatch_rows=128, forward_kernel="persistent"),
            MoKConfig(fwd_comm_sms=64, minibatch_rows=1024, forward_kernel="persistent"))
    check_forward_bitwise_repeats((512, 512, 256, 256, 16, 4), cfgs, seed=11, dev=DEV)


@pytest.mark.parametrize("forward_kernel", ["persistent", "staged"])
def test_cuda_graph_matches_eager(forward_kernel):
    shape = T, H, I, Is, E, k = 384, 256, 128, 128, 8, 2
    cfg, ws, top, inputs, gen = make_case(shape, "random", 5, DEV, cfg=MoKConfig(forward_kernel=forward_kernel))
    x = inputs[0]
    kp = _kp()
    g, out_g = check_forward_graph_equals_eager(cfg, ws, top, inputs)
    # New inputs in the captured buffers: replay equals eager on them (nothing was baked in).
    x.copy_(torch.randn(T, H, generator=gen).bfloat16())
    top.copy_(make_routing("skewed", T, k, E, gen))
    g.replay()
    eager2, _ = kp.forward(cfg, ws, kp.build_schedule(cfg, ws, top), *inputs)
    torch.cuda.synchronize()
    assert torch.equal(out_g, eager2)
    ws.check_errors(blocking=True)


# ---- errors --------------------------------------------------------------------------------------


def test_capacity_overflow_raises():
    shape = (4096, 256, 128, 0, 16, 2)  # experts 0, 1 need 8192 rows; capacity 1024
    cfg, ws, top, (x, probs, fc1, fc2, _, _), _ = make_case(shape, "one_expert", 2, DEV,
                                                            cfg=MoKConfig(capacity_factor=0.05))
    sched = _kp().build_schedule(cfg, ws, top)
    _kp().forward(cfg, ws, sched, x, probs, fc1, fc2)  # must not fault or write out of bounds
    torch.cuda.synchronize()
    with pytest.raises(MoKCapacityError):
        ws.check_errors(blocking=True)


@pytest.mark.parametrize("bad", ["out_of_range", "negative", "duplicate", "int32_wrap"])
def test_bad_expert_ids_raise(bad):
    T, E, k = 256, 8, 2
    cfg = MoKConfig()
    ws = create_workspace(None, DEV, T, 128, k, E, cfg)
    top = make_routing("random", T, k, E, torch.Generator().manual_seed(1))
    top[17, 1] = {"out_of_range": E, "negative": -3, "duplicate": int(top[17, 0]), "int32_wrap": 2**32}[bad]
    sched = _kp().build_schedule(cfg, ws, top.to(DEV))
    torch.cuda.synchronize()
    with pytest.raises(MoKInputError, match="token 17"):
        ws.check_errors(blocking=True)
    # the gathered routing holds the reference's (saturated) ids
    assert torch.equal(sched.top_experts_all[0].long(), top.clamp(-1, E).to(DEV))


@pytest.mark.parametrize("cfg", [MoKConfig(forward_kernel="persistent"), MoKConfig(forward_kernel="staged"),
                                 MoKConfig(precision="fp8")], ids=["persistent", "staged", "fp8"])
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
def test_nonfinite_probs_raise(cfg, bad):
    """Every kernel forward flags NaN/inf router weights in its epilogue launch, which reads them
    anyway (no separate check launches); the error names the token."""
    from megatron_mok import functional

    cfg, ws, top, (x, probs, fc1, fc2, _, _), _ = make_case((256, 128, 128, 0, 8, 2), "random", 3, DEV, cfg=cfg)
    assert _kp().unsupported_reason(ws, x, fc1) is None
    probs = probs.clone()
    probs[37, 1] = bad
    sched = functional.build_schedule(cfg, ws, top)
    functional.forward(cfg, ws, sched, x, probs, fc1, fc2)
    with pytest.raises(MoKInputError, match="token 37"):
        ws.check_errors(blocking=True)
