"""Helpers of the backward GPU tests: fp32 reference gradients, poisoning, bitwise comparison."""

from __future__ import annotations


import torch

from megatron_mok import MoKConfig

from ._util import bits, cuda_path, eager_before_capture, make_case, poison_buffers, rel_err

GRAD_NAMES = ("dx", "dprobs", "dfc1", "dfc2", "dshared_fc1", "dshared_fc2")


def backward_case(shape, kind: str, seed: int, dev, world: int = 1):
    """(cfg, ws, top, inputs, grad_out) of one layer; see ``make_case``."""
    cfg, ws, top, w, gen = make_case(shape, kind, seed, dev, world=world)
    g = torch.randn(shape[0], shape[1], generator=gen).bfloat16().to(dev)
    return cfg, ws, top, w, g


def grads_list(g) -> list:
    return [g.dx, g.dprobs, g.dfc1, g.dfc2, g.dshared_fc1, g.dshared_fc2]


def reference_grads(ws, sched_ref, x, probs, fc1, fc2, sfc1, sfc2, grad_out) -> list:
    """fp32 reference gradients on the same (bf16-valued) inputs, in GRAD_NAMES order."""
    from megatron_mok import reference

    f = lambda t: None if t is None else t.float()  # noqa: E731
    ctx = reference.recompute_forward_context(ws, sched_ref, f(x), f(fc1), f(fc2), f(sfc1))
    return list(reference.backward(ws, sched_ref, ctx, f(grad_out), f(x), probs, f(fc1), f(fc2), f(sfc1), f(sfc2)))


def fp8_reference_grads(ws, top, inputs, grad_out, dgrad_precision: str, wgrad_precision: str) -> list:
    """fp32 reference gradients on the reference fp8 forward's context (dequantized rows, the e4m3
    GEMMs' h), in GRAD_NAMES order."""
    from megatron_mok import reference
    from megatron_mok.schedule import build_schedule_reference

    f = lambda t: None if t is None else t.float()  # noqa: E731
    x, probs, fc1, fc2, sfc1, sfc2 = inputs
    rs = build_schedule_reference(ws, top)
    rctx = reference.recompute_forward_context(ws, rs, f(x), f(fc1), f(fc2), f(sfc1), "fp8")
    return list(reference.backward(ws, rs, rctx, f(grad_out), f(x), probs, f(fc1), f(fc2), f(sfc1), f(sfc2),
                                   dgrad_precision=dgrad_precision, wgrad_precision=wgrad_precision))


def check_close(got: list, ref: list, tol: float = 1e-2) -> dict:
    """Every gradient finite and within ``tol`` (relative, Frobenius) of the reference."""
    errs = {}
    for name, a, b in zip(GRAD_NAMES, got, ref):
        assert (a is None) == (b is None), f"{name}: {a is None} vs reference {b is None}"
        if a is None:
            continue
        assert a.shape == b.shape, f"{name}: shape {tuple(a.shape)} vs {tuple(b.shape)}"
        assert torch.isfinite(a.float()).all(), f"{name}: non-finite elements"
        errs[name] = rel_err(a, b)
        assert errs[name] <= tol, f"{name}: rel err {errs[name]:.3e} > {tol}"
    return errs


def assert_bitwise(a: list, b: list, what: str = "") -> None:
    for name, x, y in zip(GRAD_NAMES, a, b):
        assert (x is None) == (y is None), f"{what} {name}: None mismatch"
        if x is not None:
            assert x.dtype == y.dtype and x.shape == y.shape, f"{what} {name}: dtype/shape differ"
            assert torch.equal(bits(x), bits(y)), f"{what} {name}: bits differ"


def clone_all(lst: list) -> list:
    return [None if t is None else t.clone() for t in lst]


def assert_empty_experts_zero(grads, sched) -> int:
    """Experts without rows have exactly zero weight gradients; returns how many were checked."""
    counts = sched.expert_counts.cpu()
    n = 0
    for e in range(counts.numel()):
        if int(counts[e]) == 0:
            n += 1
            assert bool((grads.dfc1[e] == 0).all()), f"dfc1[{e}] of an expert without rows is not exactly zero"
            assert bool((grads.dfc2[e] == 0).all()), f"dfc2[{e}] of an expert without rows is not exactly zero"
    return n


def poison_all(ws) -> None:
    """NaN-fill every float symmetric buffer of the kernel path (forward and backward ones)."""
    poison_buffers(ws, (torch.bfloat16, torch.float32))


def poison_ctx_tail(ctx, sched) -> None:
    """NaN-fill the rows of the forward context past the last segment (the backward must not read them)."""
    total = int(sched.expert_offsets[-1])
    if ctx.h is not None:
        ctx.h[total:] = float("nan")


def forward_backward(cfg, ws, top, w, g):
    """(sched, ctx, grads as a list) of one schedule + forward + backward."""
    kp = cuda_path()
    sched = kp.build_schedule(cfg, ws, top)
    _, ctx = kp.forward(cfg, ws, sched, *w)
    return sched, ctx, grads_list(kp.backward(cfg, ws, sched, ctx, g, *w))


def check_backward_repeats(cfg, ws, sched, w, g, ref, reps: int, poison, min_empty_experts=None):
    """``reps`` forward + backward runs: each within tolerance of ``ref`` and bitwise equal to the first
    (later runs see NaN-poisoned context tails, and ``poison(ws)`` runs after each); then a backward
    without context gives the same bits. With ``min_empty_experts``, the first run has at least that many
    experts without rows, with exactly zero weight gradients. Returns (first grads, last rel errs)."""
    kp = cuda_path()
    first, errs = None, None
    for rep in range(reps):
        _, ctx = kp.forward(cfg, ws, sched, *w)
        if rep:
            poison_ctx_tail(ctx, sched)
        grads = kp.backward(cfg, ws, sched, ctx, g, *w)
        torch.cuda.synchronize()
        got = grads_list(grads)
        errs = check_close(got, ref)
        if first is None:
            first = clone_all(got)
            if min_empty_experts is not None:
                assert assert_empty_experts_zero(grads, sched) >= min_empty_experts
        else:
            assert_bitwise(got, first, f"rep {rep} (after poisoning)")
        poison(ws)
    # no context: recomputed inside (staged dispatch + GEMMs), same bits
    got = grads_list(kp.backward(cfg, ws, sched, None, g, *w))
    torch.cuda.synchronize()
    assert_bitwise(got, first, "ctx=None")
    return first, errs


def check_backward_bitwise_repeats(ws, top, w, g, comm_ctas: list, reps: int = 20) -> None:
    """``reps`` schedule + forward + backward runs, cycling through configs (both forward
    compositions, comm SMs, minibatch rows) and backward comm CTA counts: all gradients bitwise equal
    to the first run's."""
    kp = cuda_path()
    cfgs = [MoKConfig(), MoKConfig(bwd_comm_sms=1, fwd_comm_sms=2, minibatch_rows=128, forward_kernel="persistent"),
            MoKConfig(bwd_comm_sms=64, minibatch_rows=256, forward_kernel="staged")]
    base = None
    for rep in range(reps):
        c = cfgs[rep % len(cfgs)]
        sched = kp.build_schedule(c, ws, top)
        _, ctx = kp.forward(c, ws, sched, *w)
        got = grads_list(kp.backward(c, ws, sched, ctx, g, *w, comm_ctas=comm_ctas[rep % len(comm_ctas)]))
        if base is None:
            torch.cuda.synchronize()
            base = clone_all(got)
        else:
            assert_bitwise(got, base, f"rep {rep}")
    ws.check_errors(blocking=True)


def assert_fused_add(main, before, gw, what: str) -> None:
    """``main`` = ``before`` + the fp32 sums whose bf16 rounding is ``gw`` (the weight-gradient GEMM
    added them itself): within half a bf16 ulp of gw plus the fp32 add's rounding, elementwise."""
    m, b, w = main.double(), before.double(), gw.double()
    bound = w.abs() * 2.0 ** -8 + (m.abs() + b.abs()) * 2.0 ** -23
    assert main.dtype == torch.float32 and bool(((m - b - w).abs() <= bound).all()), \
        f"{what}: main grad is not before + the GEMM's fp32 sums (max excess {float(((m - b - w).abs() - bound).max())})"


def check_main_grads_accumulate(cfg, ws, sched, ctx, w, g, plain, seed: int, dev):
    """A backward with fp32 ``main_grads`` adds the weight gradients into random main grads in fp32
    (the GEMMs add their sums themselves; nothing is returned for them), gives the dx / dprobs bits of
    the plain backward ``plain``, and repeats bitwise from the same main grads. Returns (main grads,
    their values before)."""
    kp = cuda_path()
    gen = torch.Generator().manual_seed(seed)
    before = [torch.randn(t.shape, generator=gen).to(dev) for t in w[2:]]
    main = [b.clone() for b in before]
    got = kp.backward(cfg, ws, sched, ctx, g, *w, main_grads=tuple(main))
    torch.cuda.synchronize()
    assert got.dfc1 is None and got.dfc2 is None and got.dshared_fc1 is None and got.dshared_fc2 is None
    assert_bitwise(grads_list(got)[:2], plain[:2], "main_grads dx/dprobs")
    for i, (m, b, gw) in enumerate(zip(main, before, plain[2:])):
        assert_fused_add(m, b, gw, f"main_grads[{i}]")
    again = [b.clone() for b in before]
    kp.backward(cfg, ws, sched, ctx, g, *w, main_grads=tuple(again))
    torch.cuda.synchronize()
    assert_bitwise(again, main, "main_grads repeat")
    return main, before


def check_backward_graph_equals_eager(cfg, ws, top, w, g, before_replay, before_capture=None) -> None:
    """Eager schedule + forward + backward on a side stream, then the same captured in a CUDA graph: 3 replays,
    each after ``before_replay(graph outputs)``, give the eager bits."""
    kp = cuda_path()

    def eager_run():
        sched = kp.build_schedule(cfg, ws, top)
        out, ctx = kp.forward(cfg, ws, sched, *w)
        return [out.clone()] + clone_all(grads_list(kp.backward(cfg, ws, sched, ctx, g, *w)))

    eager = eager_before_capture(eager_run, before_capture)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        sched_g = kp.build_schedule(cfg, ws, top)
        out_g, ctx_g = kp.forward(cfg, ws, sched_g, *w)
        grads_g = kp.backward(cfg, ws, sched_g, ctx_g, g, *w)
    got = [out_g] + grads_list(grads_g)
    for _ in range(3):
        before_replay(got)
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(got[0], eager[0]), "graph forward differs from eager"
        assert_bitwise(got[1:], eager[1:], "graph replay")
    ws.check_errors(blocking=True)
