"""CPU tests of the block-scaled e4m3 recipe (megatron_mok/fp8.py) and of MoKConfig(precision="fp8")
on the reference path: the scale blocks, the kernel's ratio form, the error against bf16, and the
errors for inputs the fp8 GEMMs cannot take."""

from __future__ import annotations

import pytest
import torch

from megatron_mok import MoKConfig, MoKInputError, fp8, functional, get_workspace, reference

E4M3_REL = 2.0 ** -4  # half an e4m3 ulp (3 mantissa bits), relative


def test_quantize_rows_scales_and_roundtrip():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(5, 384, generator=g).to(torch.bfloat16)
    x[1, 128:256] *= 1000.0  # one loud block: only its own scale moves
    x[2] = 0.0  # an all-zero row (a padding row) gets the floor scale, exact zeros
    q, s = fp8.quantize_rows(x)
    assert q.dtype == torch.float8_e4m3fn and s.shape == (5, 3)
    amax = x.float().view(5, 3, 128).abs().amax(-1)
    assert torch.equal(s, amax.clamp(min=fp8.MIN_AMAX) / fp8.E4M3_MAX)
    assert s[1, 1] > 500 * s[1, 0]
    assert torch.equal(q[2].float(), torch.zeros(384)) and torch.all(s[2] == fp8.MIN_AMAX / fp8.E4M3_MAX)
    # every block's largest element maps to +-448 exactly; the rest within half an e4m3 ulp
    assert torch.all(q.float().view(5, 3, 128).abs().amax(-1)[[0, 1, 3, 4]] == fp8.E4M3_MAX)
    back = fp8.dequantize_rows(q, s)
    err = (back - x.float()).abs()
    assert torch.all(err <= E4M3_REL * x.float().abs() + s.repeat_interleave(128, dim=1) * 2.0 ** -9)


def test_quantize_rows_saturates_and_rejects_ragged_k():
    x = torch.tensor([[448.0] + [1.0] * 127], dtype=torch.bfloat16)
    q, s = fp8.quantize_rows(x)
    assert s.item() == 1.0 and q[0, 0].float().item() == 448.0
    with pytest.raises(ValueError, match="not a multiple of the 128-column scale blocks"):
        fp8.quantize_rows(torch.zeros(2, 100))


@pytest.mark.parametrize("swiglu", [True, False])
def test_weight_tiles_follow_the_gemm_tasks(swiglu):
    nseg, n, k = 2, 192, 256  # n not a multiple of the tile: a partial last tile
    rows = 2 * n if swiglu else n
    w = torch.ones(nseg, rows, k)
    tile = 64 if swiglu else 128
    # every row gets the magnitude of its tile (gate and up rows of one pair tile share one)
    for r in range(rows):
        b = (r % n) // tile if swiglu else r // tile
        w[:, r] *= 2.0 ** b
    w[1, :, 128:] *= 4.0  # second K block of expert 1 is louder
    qw = fp8.quantize_weight(w.to(torch.bfloat16), swiglu=swiglu)
    tiles = -(-n // tile)
    assert qw.scale.shape == (nseg, tiles, 2)
    for b in range(tiles):
        assert qw.scale[0, b, 0].item() == pytest.approx(2.0 ** b / 448, rel=1e-6)
        assert qw.scale[1, b, 1].item() == pytest.approx(4 * 2.0 ** b / 448, rel=1e-6)
    assert torch.equal(qw.dequantize(), w)  # powers of two are exact in e4m3


def _layer_problem(T=40, H=256, I=128, E=4, k=2, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(T, H, generator=g).to(torch.bfloat16)
    top = torch.rand(T, E, generator=g).argsort(dim=1)[:, :k]
    top[:5] = torch.arange(k)  # a few tokens pinned: experts 0 and 1 surely hold rows
    probs = torch.softmax(torch.randn(T, k, generator=g), dim=1)
    fc1 = (torch.randn(E, 2 * I, H, generator=g) / H**0.5).to(torch.bfloat16)
    fc2 = (torch.randn(E, H, I, generator=g) / I**0.5).to(torch.bfloat16)
    sfc1 = (torch.randn(2 * I, H, generator=g) / H**0.5).to(torch.bfloat16)
    sfc2 = (torch.randn(H, I, generator=g) / I**0.5).to(torch.bfloat16)
    return x, top, probs, fc1, fc2, sfc1, sfc2


def _rel(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


def test_reference_fp8_forward_is_close_to_bf16_and_not_equal():
    x, top, probs, fc1, fc2, sfc1, sfc2 = _layer_problem()
    out = {}
    for precision in ("bf16", "fp8"):
        cfg = MoKConfig(precision=precision)
        ws = get_workspace(None, "cpu", x.shape[0], x.shape[1], top.shape[1], fc1.shape[0], cfg)
        sched = functional.build_schedule(cfg, ws, top)
        out[precision], _ = functional.forward(cfg, ws, sched, x, probs, fc1, fc2, sfc1, sfc2)
        direct, _ = reference.forward(ws, sched, x, probs, fc1, fc2, sfc1, sfc2, precision)
        assert torch.equal(out[precision], direct)
    rel = _rel(out["fp8"], out["bf16"])
    # e4m3 carries 3 mantissa bits: a few percent against bf16, well above bf16's own rounding (6.5%
    # here with the routed and the shared expert's GEMMs in e4m3; 5.x% with the routed ones alone)
    assert 5e-3 < rel < 8e-2, rel


def test_fp8_input_errors():
    x, top, probs, fc1, fc2, sfc1, sfc2 = _layer_problem()
    cfg = MoKConfig(precision="fp8")
    ws = get_workspace(None, "cpu", x.shape[0], x.shape[1], top.shape[1], fc1.shape[0], cfg)
    sched = functional.build_schedule(cfg, ws, top)
    w8 = functional.quantize_expert_weights(fc1, fc2)
    out, _ = functional.forward(cfg, ws, sched, x, probs, fc1, fc2, sfc1, sfc2, fp8_weights=w8)
    assert torch.isfinite(out.float()).all()
    bf = MoKConfig()
    with pytest.raises(MoKInputError, match="precision is not 'fp8'"):
        functional.forward(bf, ws, sched, x, probs, fc1, fc2, sfc1, sfc2, fp8_weights=w8)
    other = functional.quantize_expert_weights(fc1[:2], fc2[:2])  # two experts, not four
    with pytest.raises(MoKInputError, match="quantize_expert_weights"):
        functional.forward(cfg, ws, sched, x, probs, fc1, fc2, sfc1, sfc2, fp8_weights=other)
    # H not a multiple of 128
    x2, top2, probs2, fc1b, fc2b, _, _ = _layer_problem(H=192)
    ws2 = get_workspace(None, "cpu", x2.shape[0], x2.shape[1], top2.shape[1], fc1b.shape[0], cfg)
    sched2 = functional.build_schedule(cfg, ws2, top2)
    with pytest.raises(MoKInputError, match="needs H to be a multiple of 128"):
        functional.forward(cfg, ws2, sched2, x2, probs2, fc1b, fc2b)
    with pytest.raises(ValueError, match="not a multiple of the 128-column scale blocks"):
        functional.quantize_expert_weights(fc1b, fc2b)


def test_weight_cache_follows_versions_and_optimizer_steps():
    """fp8.WeightCache: one quantization per weight version; in-place updates and optimizer steps
    (which Megatron applies through .data, invisible to version counters) start a new one."""
    cache = fp8.WeightCache()
    calls = []

    def quantize(a, b, transposed):
        calls.append(1)
        return fp8.quantize_expert_weights(a, b, transposed)

    fc1 = torch.nn.Parameter(torch.randn(2, 256, 128).bfloat16())
    fc2 = torch.nn.Parameter(torch.randn(2, 128, 128).bfloat16())
    w = cache.get(fc1, fc2, quantize)
    assert cache.get(fc1, fc2, quantize) is w and len(calls) == 1
    with torch.no_grad():
        fc1.mul_(2.0)  # a visible in-place update bumps the version counter
    w2 = cache.get(fc1, fc2, quantize)
    assert len(calls) == 2 and torch.equal(w2.fc1.scale, 2 * w.fc1.scale)
    fc2.data.mul_(0.5)  # through .data: not visible, until the optimizer hook clears the cache
    assert cache.get(fc1, fc2, quantize) is w2
    cache.register_optimizer_hook()
    cache.register_optimizer_hook()  # idempotent
    opt = torch.optim.SGD([fc1, fc2], lr=0.0)
    fc1.grad, fc2.grad = torch.zeros_like(fc1), torch.zeros_like(fc2)
    opt.step()
    w3 = cache.get(fc1, fc2, quantize)
    assert len(calls) == 3 and torch.equal(w3.fc2.scale, 0.5 * w2.fc2.scale)
    other = torch.nn.Parameter(fc1.detach().clone())  # another tensor: its own entry
    cache.get(other, fc2, quantize)
    assert len(calls) == 4 and len(cache) == 2
    wt = cache.get(fc1, fc2, quantize, transposed=True)  # with the dgrads' copies: its own entry
    assert len(calls) == 5 and wt.has_transposed and not w3.has_transposed
    assert cache.get(fc1, fc2, quantize, transposed=True) is wt


def test_weight_cache_and_quantized_weights_hold_the_shared_expert():
    """With the shared expert's weights, fp8.WeightCache keys on all four tensors and their
    versions; the entry carries the shared expert's e4m3 stacks ([1, 2 Is, H], [1, H, Is]), which
    FP8ExpertWeights.shared_for hands out for weights of those shapes only; a shared expert whose
    size is not a multiple of 128 is not quantized."""
    cache = fp8.WeightCache()
    calls = []

    def quantize(*args):
        calls.append(len(args))
        return fp8.quantize_expert_weights(*args)

    _, _, _, fc1, fc2, sfc1, sfc2 = _layer_problem()
    sfc1, sfc2 = torch.nn.Parameter(sfc1), torch.nn.Parameter(sfc2)
    w = cache.get(fc1, fc2, quantize, shared_fc1=sfc1, shared_fc2=sfc2)
    assert calls == [5] and cache.get(fc1, fc2, quantize, shared_fc1=sfc1, shared_fc2=sfc2) is w
    assert tuple(w.shared.fc1.q.shape) == (1, *sfc1.shape) and tuple(w.shared.fc2.q.shape) == (1, *sfc2.shape)
    ref1 = fp8.quantize_weight(sfc1.detach()[None], swiglu=True)
    assert torch.equal(w.shared.fc1.q.view(torch.uint8), ref1.q.view(torch.uint8))
    assert w.shared_for(sfc1, sfc2) is w.shared and not w.shared.has_transposed
    assert w.shared_for(sfc1) is not None and w.shared_for(sfc1[:128], sfc2) is None
    wt = cache.get(fc1, fc2, quantize, transposed=True, shared_fc1=sfc1, shared_fc2=sfc2)
    assert wt.has_transposed and not wt.shared.has_transposed  # the shared expert's backward is bf16
    assert cache.get(fc1, fc2, quantize) is not w and calls == [5, 5, 3]  # without them: another entry
    with torch.no_grad():
        sfc2.mul_(2.0)  # the shared expert's version moves: a new quantization
    w2 = cache.get(fc1, fc2, quantize, shared_fc1=sfc1, shared_fc2=sfc2)
    assert w2 is not w and torch.equal(w2.shared.fc2.scale, 2 * w.shared.fc2.scale)
    odd1, odd2 = torch.randn(2 * 64, 256).bfloat16(), torch.randn(256, 64).bfloat16()  # Is = 64
    assert not fp8.shared_in_e4m3(odd1) and fp8.shared_in_e4m3(sfc1) and not fp8.shared_in_e4m3(None)
    assert fp8.quantize_expert_weights(fc1, fc2, False, odd1, odd2).shared is None


def test_fp8_shared_false_keeps_the_shared_expert_bf16():
    """MoKConfig(precision="fp8", fp8_shared=False): the reference layer with the shared expert on
    unquantized operands; the default quantizes it (a different result); with bf16 precision the
    field changes nothing."""
    x, top, probs, fc1, fc2, sfc1, sfc2 = _layer_problem()
    outs = {}
    for name, cfg in (("fp8", MoKConfig(precision="fp8")), ("fp8_bf16_shared", MoKConfig(precision="fp8", fp8_shared=False)),
                      ("bf16", MoKConfig()), ("bf16_flag", MoKConfig(fp8_shared=False))):
        ws = get_workspace(None, "cpu", x.shape[0], x.shape[1], top.shape[1], fc1.shape[0], cfg)
        sched = functional.build_schedule(cfg, ws, top)
        outs[name], _ = functional.forward(cfg, ws, sched, x, probs, fc1, fc2, sfc1, sfc2)
    assert torch.equal(outs["bf16"], outs["bf16_flag"])
    assert not torch.equal(outs["fp8"], outs["fp8_bf16_shared"])
    # the routed experts alone in e4m3 deviate less from bf16 than routed + shared
    assert _rel(outs["fp8_bf16_shared"], outs["bf16"]) < _rel(outs["fp8"], outs["bf16"])
    with pytest.raises(Exception, match="fp8_shared must be a bool"):
        MoKConfig(fp8_shared=1)


def test_quantize_columns_one_scale_per_column():
    """The weight gradients' operands: one scale per column over all rows of an expert; zero
    columns (and an expert without rows) get the finite all-zero scale."""
    g = torch.Generator().manual_seed(4)
    x = torch.randn(300, 192, generator=g).to(torch.bfloat16)
    x[:, 5] = 0
    x[7, 9] = 1000.0  # one large value sets its column's scale only
    q, s = fp8.quantize_columns(x)
    assert q.dtype == fp8.E4M3 and q.shape == x.shape and s.shape == (192,)
    assert torch.equal(s, x.float().abs().amax(0).clamp(min=fp8.MIN_AMAX) / fp8.E4M3_MAX)
    assert s[5] == fp8.MIN_AMAX / fp8.E4M3_MAX and torch.equal(q[:, 5].float(), torch.zeros(300))
    back = fp8.dequantize_columns(q, s)
    assert (back - x.float()).abs().max() <= s.max() * 16  # half an e4m3 step at the top binade
    assert _rel(back, x.float()) < 4e-2
    q0, s0 = fp8.quantize_columns(x[:0])
    assert q0.shape == (0, 192) and torch.equal(s0, torch.full((192,), fp8.MIN_AMAX / fp8.E4M3_MAX))


def test_reference_fp8_wgrads():
    """wgrad_precision fp8 (MoKConfig.fp8_wgrad) moves the routed weight gradients by a few percent,
    leaves dx, dprobs and the shared expert's gradients exactly, and experts without rows keep exact
    zeros; the CPU path follows the flag."""
    x, top, probs, fc1, fc2, sfc1, sfc2 = _layer_problem(I=256)
    top[:, 0] = 0  # expert 0 gets every token (the longest token sum), experts 1 and 2 half, 3 none
    top[:, 1] = 1 + torch.arange(x.shape[0]) % 2
    g = torch.randn(x.shape, generator=torch.Generator().manual_seed(5)).to(torch.bfloat16)
    grads = {}
    for fp8_wgrad in (True, False):
        cfg = MoKConfig(precision="fp8", fp8_wgrad=fp8_wgrad)
        ws = get_workspace(None, "cpu", x.shape[0], x.shape[1], top.shape[1], fc1.shape[0], cfg)
        sched = functional.build_schedule(cfg, ws, top)
        _, ctx = functional.forward(cfg, ws, sched, x, probs, fc1, fc2, sfc1, sfc2)
        grads[fp8_wgrad] = functional.backward(cfg, ws, sched, ctx, g, x, probs, fc1, fc2, sfc1, sfc2)
        direct = reference.backward(ws, sched, ctx, g, x, probs, fc1, fc2, sfc1, sfc2,
                                    dgrad_precision=cfg.dgrad_precision, wgrad_precision=cfg.wgrad_precision)
        assert torch.equal(grads[fp8_wgrad].dfc1, direct[2])
    q, b = grads[True], grads[False]
    for name in ("dx", "dprobs", "dshared_fc1", "dshared_fc2"):
        assert torch.equal(getattr(q, name), getattr(b, name)), name
    for name in ("dfc1", "dfc2"):
        assert 2e-3 < _rel(getattr(q, name), getattr(b, name)) < 6e-2, name
        assert torch.count_nonzero(getattr(q, name)[-1]) == 0, name
    assert MoKConfig(fp8_wgrad=True).wgrad_precision == "bf16"
    with pytest.raises(Exception, match="fp8_wgrad must be a bool"):
        MoKConfig(fp8_wgrad=1)


def test_pair_columns_and_paired_row_blocks():
    g = torch.Generator().manual_seed(1)
    x = torch.randn(3, 2 * 192, generator=g).to(torch.bfloat16)  # [gate | up], 192 columns each
    paired = fp8.pair_columns(x)
    assert torch.equal(paired[:, :64], x[:, :64]) and torch.equal(paired[:, 64:128], x[:, 192:256])
    assert torch.equal(paired[:, 128:192], x[:, 64:128])
    assert torch.equal(fp8.unpair_columns(paired), x)
    q, s = fp8.quantize_rows(x, gate_up_pairs=True)
    q0, s0 = fp8.quantize_rows(paired)
    assert torch.equal(q.view(torch.uint8), q0.view(torch.uint8)) and torch.equal(s, s0)
    with pytest.raises(ValueError, match="multiple of 64"):
        fp8.pair_columns(torch.zeros(2, 2 * 96))


@pytest.mark.parametrize("swiglu", [True, False])
def test_transposed_weight_copy_is_the_same_tiles(swiglu):
    """The dgrads' copy: each tile transposed with its own scale, so it dequantizes to the transposed
    weight (fc1: its rows in gate/up pair order)."""
    g = torch.Generator().manual_seed(2)
    w = torch.randn(2, 512 if swiglu else 256, 384, generator=g).to(torch.bfloat16)
    qw = fp8.quantize_weight(w, swiglu=swiglu)
    t = qw.transposed()
    assert not t.swiglu and t.q.dtype == fp8.E4M3 and t.q.shape == (2, 384, w.shape[1])
    assert t.scale.shape == (2, 3, qw.scale.shape[1])
    want = qw.dequantize().transpose(1, 2)
    assert torch.equal(t.dequantize(), fp8.pair_columns(want) if swiglu else want)
    with pytest.raises(ValueError, match="whole"):
        fp8.quantize_weight(w[:, :192], swiglu=swiglu).transposed()  # 96 gate rows / 192 rows


def test_reference_fp8_dgrads():
    """dgrad_precision fp8 moves dx and dprobs (formed from the down dgrad's product, as the
    kernels do) by a few percent (e4m3 operands), leaves the fc2 gradient (unquantized grad_out
    rows) and the shared expert's gradients (its backward stays bf16) exactly,
    and the CPU path follows MoKConfig.fp8_dgrad, with the shared expert's forward in e4m3 or not."""
    x, top, probs, fc1, fc2, sfc1, sfc2 = _layer_problem(I=256)
    g = torch.randn(x.shape, generator=torch.Generator().manual_seed(3)).to(torch.bfloat16)
    grads = {}
    for fp8_dgrad, fp8_shared in ((True, True), (False, True), (True, False)):
        cfg = MoKConfig(precision="fp8", fp8_dgrad=fp8_dgrad, fp8_shared=fp8_shared)
        ws = get_workspace(None, "cpu", x.shape[0], x.shape[1], top.shape[1], fc1.shape[0], cfg)
        sched = functional.build_schedule(cfg, ws, top)
        _, ctx = functional.forward(cfg, ws, sched, x, probs, fc1, fc2, sfc1, sfc2)
        grads[fp8_dgrad, fp8_shared] = functional.backward(cfg, ws, sched, ctx, g, x, probs, fc1, fc2, sfc1, sfc2)
        direct = reference.backward(ws, sched, ctx, g, x, probs, fc1, fc2, sfc1, sfc2,
                                    dgrad_precision=cfg.dgrad_precision)
        assert torch.equal(grads[fp8_dgrad, fp8_shared].dx, direct[0].to(x.dtype))
    q, b = grads[True, True], grads[False, True]
    assert torch.equal(q.dfc2, b.dfc2)
    assert 2e-3 < _rel(q.dprobs, b.dprobs) < 6e-2
    assert torch.equal(q.dshared_fc1, b.dshared_fc1) and torch.equal(q.dshared_fc2, b.dshared_fc2)
    assert 2e-3 < _rel(q.dx, b.dx) < 6e-2
    assert 2e-3 < _rel(q.dfc1, b.dfc1) < 6e-2  # dh comes from the e4m3 dgrad of dy
