"""Single-GPU (EP=1) tests of the CUDA path against the pure-PyTorch reference."""

from __future__ import annotations

import pytest
import torch

from megatron_mok import MoKCapacityError, MoKConfig, MoKInputError, create_workspace
from megatron_mok.schedule import build_schedule_reference

from ._util import (SHAPES, bits, check_forward_bitwise_repeats, check_forward_graph_equals_eager,
                    gemm_bits_over_cta_counts, gpu_marks, make_case, make_routing, poison_internal, reference_out,
                    rel_err, schedules_equal)
from ._util import kernel_path_module as _kp

pytestmark = gpu_marks()

DEV = "cuda:0"  # the workspace compares devices exactly


# ---- grouped GEMM alone ---------------------------------------------------------------------------


@pytest.mark.parametrize("swiglu", [False, True])
@pytest.mark.parametrize("K,N", [(256, 256), (384, 192), (136, 40), (1024, 520)])
def test_grouped_gemm_matches_matmul(swiglu, K, N, monkeypatch):
    """The token-major GEMM (MOK_GEMM_EXPERT=0; without seg_counts it is the only one)."""
    from megatron_mok import ops

    monkeypatch.setenv("MOK_GEMM_EXPERT", "0")
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
    # MOK_GEMM_PAIRED: 2-CTA clusters on m-tile pairs sharing B within a segment, or one CTA per tile
    # (7 m-tiles here: pairs inside a segment, pairs across segments, and an incomplete last pair)
    runs = [("1", 0, cnt), ("1", 3, cnt), ("1", 0, None), ("1", 5, None), ("0", 0, cnt), ("0", 3, None)]
    for paired, ctas, seg_counts in runs:
        monkeypatch.setenv("MOK_GEMM_PAIRED", paired)
        out2 = torch.full_like(out, float("nan"))
        ops.grouped_gemm(a, b, seg, out2, swiglu, ctas, seg_counts)
        if (paired, ctas, seg_counts) == runs[0]:
            out.copy_(out2)
        else:
            # bit patterns (the untouched tail rows hold NaN, which torch.equal never matches)
            assert torch.equal(out.view(torch.int16), out2.view(torch.int16)), \
                f"bits depend on the CTA count / padding skip / pairing ({paired}, {ctas})"
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
    padded = [(c + 127) // 128 * 128 for c in counts]
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
def test_expert_gemm_matches_matmul(swiglu, K, N, monkeypatch):
    """The expert-major GEMM (the default with seg_counts): token chunks of 1..256 rows in every
    16-row size class, experts with 0, 1, 256, 257 and 700 rows; real rows against fp32 matmul,
    padding rows +0, rows past the last segment untouched, bits independent of the CTA count."""
    from megatron_mok import ops

    monkeypatch.setenv("MOK_GEMM_EXPERT", "1")
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


@pytest.mark.parametrize("swiglu", [False, True])
def test_expert_gemm_bits_equal_token_major(swiglu, monkeypatch):
    """Swapping the MMA's operands (weights as M, tokens as N) keeps every output bit: the megakernel
    (token-major tiles) and the staged path (expert-major) give the same bits."""
    from megatron_mok import ops

    K, N = 512, 264
    counts = [300, 5, 128, 0, 64, 1000]
    a, b, seg, cnt, offs = _expert_case(K, N, swiglu, counts, 91)
    res = {}
    for mode in ("0", "1"):
        monkeypatch.setenv("MOK_GEMM_EXPERT", mode)
        out = torch.full((a.shape[0], N), float("nan"), dtype=torch.bfloat16, device=DEV)
        ops.grouped_gemm(a, b, seg, out, swiglu, 0, cnt)
        res[mode] = out
    torch.cuda.synchronize()
    rows = offs[-1]
    assert torch.equal(bits(res["0"][:rows]), bits(res["1"][:rows]))


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


@pytest.mark.parametrize("path", ["mega", "staged"])
@pytest.mark.parametrize("kind", ["random", "skewed", "one_expert", "half_empty"])
@pytest.mark.parametrize("shape", SHAPES)
def test_forward_matches_reference(kind, shape, path):
    T, H = shape[:2]
    cfg, ws, top, (x, probs, fc1, fc2, sfc1, sfc2), _ = make_case(shape, kind, sum(shape) + len(kind), DEV)
    sched = _kp().build_schedule(cfg, ws, top)
    ref_sched = build_schedule_reference(ws, top)
    assert schedules_equal(sched, ref_sched) == []
    ref = reference_out(ws, ref_sched, x, probs, fc1, fc2, sfc1, sfc2)
    for _ in range(2):  # the second run also sees NaN-poisoned internal buffers
        out = torch.full((T, H), float("nan"), dtype=torch.bfloat16, device=DEV)
        out, ctx = _kp().forward(cfg, ws, sched, x, probs, fc1, fc2, sfc1, sfc2, out=out, path=path)
        torch.cuda.synchronize()
        assert torch.isfinite(out.float()).all(), "output elements not written (or NaN)"
        err = rel_err(out, ref)
        assert err <= 1e-2, err
        poison_internal(ws)
    ws.check_errors(blocking=True)


# ---- megakernel vs the staged launches (bitwise) ---------------------------------------------------


def _forward_both(cfg, ws, sched, inputs, rows, **knobs):
    """Megakernel and staged forward on NaN-poisoned outputs and buffers; returns both (out, ctx)."""
    T, H = ws.num_tokens, ws.hidden
    res = {}
    for path in ("staged", "mega"):
        poison_internal(ws)
        out = torch.full((T, H), float("nan"), dtype=torch.bfloat16, device=DEV)
        res[path] = _kp().forward(cfg, ws, sched, *inputs, out=out, path=path,
                                  **(knobs if path == "mega" else {}))
    torch.cuda.synchronize()
    return res


def _assert_same_bits(res, rows):
    (o_s, c_s), (o_m, c_m) = res["staged"], res["mega"]
    assert torch.isfinite(o_m.float()).all(), "megakernel left output elements unwritten (NaN)"
    assert torch.equal(bits(o_m), bits(o_s)), "megakernel output differs from the staged path"
    for name in ("x_routed", "act", "y_routed"):
        a, b = getattr(c_m, name)[:rows], getattr(c_s, name)[:rows]
        assert torch.equal(bits(a), bits(b)), f"megakernel ctx.{name} differs from the staged path"
    if c_s.shared_act is not None:
        assert torch.equal(bits(c_m.shared_act), bits(c_s.shared_act)), "shared_act differs"


@pytest.mark.parametrize("kind", ["random", "skewed", "one_expert", "half_empty"])
@pytest.mark.parametrize("shape", SHAPES)
def test_megakernel_bitwise_equals_staged(kind, shape):
    cfg, ws, top, inputs, _ = make_case(shape, kind, 3 * sum(shape) + len(kind), DEV)
    sched = _kp().build_schedule(cfg, ws, top)
    rows = int(sched.expert_offsets[-1])
    _assert_same_bits(_forward_both(cfg, ws, sched, inputs, rows), rows)
    ws.check_errors(blocking=True)


@pytest.mark.parametrize("shape", SHAPES)
def test_gemm_pairing_changes_no_bit(shape, monkeypatch):
    """Megakernel and staged forward with and without 2-CTA clusters (MOK_GEMM_PAIRED=1 / 0) give the
    same bits (skewed routing: pairs inside one expert, pairs across experts, odd m-tile counts)."""
    cfg, ws, top, inputs, _ = make_case(shape, "skewed", 5 * sum(shape), DEV)
    sched = _kp().build_schedule(cfg, ws, top)
    rows = int(sched.expert_offsets[-1])
    monkeypatch.setenv("MOK_GEMM_PAIRED", "1")
    paired = _forward_both(cfg, ws, sched, inputs, rows)
    _assert_same_bits(paired, rows)
    monkeypatch.setenv("MOK_GEMM_PAIRED", "0")
    unpaired = _forward_both(cfg, ws, sched, inputs, rows)
    for path in ("staged", "mega"):
        assert torch.equal(bits(unpaired[path][0]), bits(paired[path][0])), f"{path}: pairing changed the output"
        for name in ("act", "y_routed"):
            a, b = getattr(unpaired[path][1], name)[:rows], getattr(paired[path][1], name)[:rows]
            assert torch.equal(bits(a), bits(b)), f"{path}: pairing changed ctx.{name}"
    ws.check_errors(blocking=True)


@pytest.mark.parametrize("paired", ["1", "0"])
def test_megakernel_timeline_records_every_task(paired, monkeypatch):
    """With ops.megakernel_timeline on, every task of the launch is stamped once, in causal order,
    and the output bits do not change."""
    from megatron_mok import ops, timeline

    monkeypatch.setenv("MOK_GEMM_PAIRED", paired)
    shape = T, H, I, Is, E, k = 1024, 512, 256, 256, 16, 4
    cfg, ws, top, inputs, _ = make_case(shape, "skewed", 29, DEV, cfg=MoKConfig(minibatch_rows=1024))
    sched = _kp().build_schedule(cfg, ws, top)
    rows = int(sched.expert_offsets[-1])
    base = _forward_both(cfg, ws, sched, inputs, rows)["mega"][0]
    records = timeline.new_records(4096, DEV)
    ops.megakernel_timeline(records)
    try:
        out, _ = _kp().forward(cfg, ws, sched, *inputs, path="mega")
        torch.cuda.synchronize()
    finally:
        ops.megakernel_timeline(None)
    assert torch.equal(bits(out), bits(base)), "the timeline stamps changed the output"
    # shared expert: token-major tiles (m-tile or pair, n-tile)
    n_sup, n_sdown = (Is + 127) // 128, (H + 255) // 256
    shared_units = (T + 127) // 128 if paired == "0" else (T + 255) // 256
    expect = {(0, m, n) for m in range(shared_units) for n in range(n_sup)}
    expect |= {(1, m, n) for m in range(shared_units) for n in range(n_sdown)}
    # routed experts: expert-major tasks (global token chunk, weight block); paired, a record is the
    # unit's first task: ceil(tasks / 2) per kind and minibatch of 1024 / 256 = 4 chunks
    chunks = sum((int(c) + 255) // 256 for c in sched.expert_counts.tolist())
    n_blocks = {2: (I + 63) // 64, 3: (H + 127) // 128}
    routed_all = {(kind, g, b) for kind, nb in n_blocks.items() for g in range(chunks) for b in range(nb)}
    units = {kind: sum((nb * min(4, chunks - g0) + (paired == "1")) // (1 + (paired == "1"))
                       for g0 in range(0, chunks, 4)) for kind, nb in n_blocks.items()}
    r = records.cpu()
    tasks = r[:-timeline.DISPATCH_RECORDS]
    tasks = tasks[tasks[:, 3] > 0]
    got = [tuple(int(v) for v in row[5:8]) for row in tasks]
    assert len(set(got)) == len(got), "a task was stamped twice"
    assert {t for t in got if t[0] < 2} == expect, "shared tasks missing or unknown"
    routed = [t for t in got if t[0] >= 2]
    assert set(routed) <= routed_all, "unknown routed tasks"
    for kind in (2, 3):
        assert sum(t[0] == kind for t in routed) == units[kind], f"routed kind {kind}: units missing"
    if paired == "0":
        assert set(routed) == routed_all
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
                out, _ = _kp().forward(cfg, ws, sched, *inputs, out=out, path="mega", **knobs)
                assert torch.equal(bits(out), bits(base["staged"][0])), (comm, mb, knobs)
            ws.check_errors(blocking=True)


def test_launch_counts():
    """Schedule: 1 launch; megakernel forward: 3 (publish + barrier, megakernel, epilogue + probs
    check), also through ``functional.forward``: 4 per layer forward (issue #3)."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    T, H = 512, 256
    cfg, ws, top, inputs, _ = make_case((T, H, 128, 128, 8, 2), "random", 8, DEV)
    out = torch.empty((T, H), dtype=torch.bfloat16, device=DEV)
    sched = _kp().build_schedule(cfg, ws, top)
    _kp().forward(cfg, ws, sched, *inputs, out=out, path="mega")  # creates the buffers
    torch.cuda.synchronize()

    def device_ops(fn):
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            fn()
            torch.cuda.synchronize()
        return [e.name for e in prof.events() if e.device_type == DeviceType.CUDA]

    sched_ops = device_ops(lambda: _kp().build_schedule(cfg, ws, top))
    fwd_ops = device_ops(lambda: _kp().forward(cfg, ws, sched, *inputs, out=out, path="mega"))
    if not sched_ops and not fwd_ops:
        pytest.skip("the profiler recorded no device activity here")
    assert len(sched_ops) == 1, sched_ops
    assert len(fwd_ops) == 3, fwd_ops
    if _kp().forward_path(None) == "mega":  # functional.forward adds no probs-check ops on this path
        from megatron_mok import functional

        layer_ops = device_ops(lambda: functional.forward(cfg, ws, functional.build_schedule(cfg, ws, top), *inputs))
        # the non-blocking error check's device-to-host copy is not a launch
        assert len([n for n in layer_ops if "Memcpy" not in n]) == 4, layer_ops
    ws.check_errors(blocking=True)


def test_forward_bitwise_repeat_and_knobs():
    cfgs = (MoKConfig(), MoKConfig(fwd_comm_sms=2, minibatch_rows=128),
            MoKConfig(fwd_comm_sms=64, minibatch_rows=1024))
    check_forward_bitwise_repeats((512, 512, 256, 256, 16, 4), cfgs, seed=11, dev=DEV)


def test_cuda_graph_matches_eager():
    shape = T, H, I, Is, E, k = 384, 256, 128, 128, 8, 2
    cfg, ws, top, inputs, gen = make_case(shape, "random", 5, DEV)
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
    shape = (4096, 256, 128, 0, 16, 2)  # experts 0, 1 need 8192 rows; capacity 2560
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


@pytest.mark.parametrize("precision", ["bf16", "fp8"])
@pytest.mark.parametrize("path", ["mega", "staged"])
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
def test_nonfinite_probs_raise(path, bad, precision):
    """Every kernel forward flags NaN/inf router weights in its epilogue launch, which reads them
    anyway (no separate check launches); the error names the token."""
    from megatron_mok import functional, kernel_path

    cfg, ws, top, (x, probs, fc1, fc2, _, _), _ = make_case((256, 128, 128, 0, 8, 2), "random", 3, DEV,
                                                            cfg=MoKConfig(precision=precision))
    assert kernel_path.checks_probs_on_device(ws, x, fc1)
    probs = probs.clone()
    probs[37, 1] = bad
    sched = functional.build_schedule(cfg, ws, top)
    default = kernel_path.FORWARD_PATH
    kernel_path.FORWARD_PATH = path
    try:
        functional.forward(cfg, ws, sched, x, probs, fc1, fc2)
    finally:
        kernel_path.FORWARD_PATH = default
    with pytest.raises(MoKInputError, match="token 37"):
        ws.check_errors(blocking=True)


# ---- token dedup: remote tokens pulled once, then read locally --------------------------------------


def _simulated_routing(ep, T, k, nle, gen):
    """top_all [ep, T, k] of distinct experts (some tokens of every rank with none on rank 1), and
    rank 1's routed rows (src rank, slot), a few padding rows between them."""
    top = torch.stack([torch.randperm(ep * nle, generator=gen)[:k] for _ in range(ep * T)]).view(ep, T, k)
    top[:, ::5] = torch.arange(k)  # these tokens use rank 0's experts only (nle >= k)
    rank_rows, slot_rows = [], []
    for src in range(ep):
        for t in range(T):
            for j in range(k):
                if nle <= int(top[src, t, j]) < 2 * nle:
                    rank_rows.append(src)
                    slot_rows.append(t * k + j)
            if t % 7 == 3:  # a padding row
                rank_rows.append(-1)
                slot_rows.append(-1)
    return top.int(), torch.tensor(rank_rows, dtype=torch.int32), torch.tensor(slot_rows, dtype=torch.int32)


def test_pull_tokens_then_local_dispatch_gives_the_same_rows():
    """ops.pull_tokens at rank 1 of 3 simulated ranks (their buffers are local tensors): exactly the
    other ranks' tokens with an expert on rank 1 are copied (rows and scale rows), nothing else is
    written; dispatch_e4m3, dispatch and bwd_pull reading through ops.local_sources give the bits of
    reading the peers directly; bad input raises named errors."""
    from megatron_mok import ops

    gen = torch.Generator().manual_seed(11)
    ep, T, k, nle, H, pitch, rank = 3, 37, 4, 5, 256, 4, 1
    top, src_rank, src_slot = _simulated_routing(ep, T, k, nle, gen)
    top_d = top.to(DEV)
    q = [torch.randint(0, 256, (T, H), generator=gen, dtype=torch.uint8).to(DEV) for _ in range(ep)]
    s = [torch.randn(T, pitch, generator=gen).to(DEV) for _ in range(ep)]
    q_out = torch.full((ep, T, H), 0xAB, dtype=torch.uint8, device=DEV)
    s_out = torch.full((ep, T, pitch), float("nan"), device=DEV)
    ops.pull_tokens(top_d, rank, nle, [t.data_ptr() for t in q], q_out, [t.data_ptr() for t in s], s_out, 3)
    torch.cuda.synchronize()
    here = ((top >= rank * nle) & (top < (rank + 1) * nle)).any(2)  # [ep, T]
    for src in range(ep):
        for t in range(T):
            wanted = src != rank and bool(here[src, t])
            if wanted:
                assert torch.equal(q_out[src, t], q[src][t]) and torch.equal(s_out[src, t], s[src][t]), (src, t)
            else:
                assert bool((q_out[src, t] == 0xAB).all()) and bool(s_out[src, t].isnan().all()), (src, t)

    # the e4m3 dispatch: direct peer reads against the local copies
    cap = src_rank.numel() + 5
    rr = torch.cat([src_rank, torch.full((5,), -1, dtype=torch.int32)]).to(DEV)
    ss = torch.cat([src_slot, torch.full((5,), -1, dtype=torch.int32)]).to(DEV)
    offsets = torch.tensor([0, cap // 2, cap], dtype=torch.int32, device=DEV)
    outs = []
    for q_ptrs, s_ptrs in (([t.data_ptr() for t in q], [t.data_ptr() for t in s]),
                           (ops.local_sources([t.data_ptr() for t in q], rank, q_out),
                            ops.local_sources([t.data_ptr() for t in s], rank, s_out))):
        q_routed = torch.full((cap, H), 0x7F, dtype=torch.uint8, device=DEV).view(torch.float8_e4m3fn)
        scale_t = torch.full((H // 128, cap + 3), float("nan"), device=DEV)
        ops.dispatch_e4m3(rr, ss, offsets, q_routed, scale_t, q_ptrs, s_ptrs, pitch, k, 2)
        outs.append((q_routed.view(torch.uint8), scale_t))
    assert torch.equal(outs[0][0], outs[1][0]) and torch.equal(bits(outs[0][1]), bits(outs[1][1]))

    # bf16 rows (the bf16 dispatch and the backward's grad_out pull) through one copy
    g = [torch.randn(T, H, generator=gen).bfloat16().to(DEV) for _ in range(ep)]
    g_out = torch.empty((ep, T, H), dtype=torch.bfloat16, device=DEV)
    ops.pull_tokens(top_d, rank, nle, [t.data_ptr() for t in g], g_out)
    direct, local = [t.data_ptr() for t in g], ops.local_sources([t.data_ptr() for t in g], rank, g_out)
    routed = [torch.full((cap, H), float("nan"), dtype=torch.bfloat16, device=DEV) for _ in range(2)]
    for ptrs, out in zip((direct, local), routed):
        ops.dispatch(rr, ss, offsets, out, ptrs, k, 0)
    assert torch.equal(bits(routed[0]), bits(routed[1]))
    probs = [torch.rand(T * k, generator=gen).to(DEV) for _ in range(ep)]
    y = torch.randn(cap, H, generator=gen).bfloat16().to(DEV)
    results = []
    for ptrs in (direct, local):
        dw = [torch.full((T * k,), float("nan"), device=DEV) for _ in range(ep)]
        dy = torch.full((cap, H), float("nan"), dtype=torch.bfloat16, device=DEV)
        ops.bwd_pull(rr, ss, offsets, y, dy, ptrs, [p.data_ptr() for p in probs], [d.data_ptr() for d in dw], k, 0)
        results.append((dy, dw))
    assert torch.equal(bits(results[0][0]), bits(results[1][0]))
    for a, b in zip(results[0][1], results[1][1]):
        assert torch.equal(bits(a), bits(b))

    with pytest.raises(RuntimeError, match="top-k must be 1 to 32"):
        ops.pull_tokens(torch.zeros(2, T, 33, dtype=torch.int32, device=DEV), 0, nle, direct[:2],
                        torch.empty(2, T, H, dtype=torch.bfloat16, device=DEV))
    with pytest.raises(RuntimeError, match="rows_out must be"):
        ops.pull_tokens(top_d, rank, nle, direct, g_out[:2])
    with pytest.raises(RuntimeError, match="one peer address per rank"):
        ops.pull_tokens(top_d, rank, nle, direct[:2], g_out)
