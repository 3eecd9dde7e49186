"""EP=2 tests of the stage-1 CUDA backward: two processes (torch.multiprocessing spawn), NCCL for the
reference collectives, torch symmetric memory (no multicast) for the kernels."""

from __future__ import annotations

import traceback

import pytest
import torch

from ._util import extension_ready, run_two_rank_suite

_ok, _why = extension_ready()
pytestmark = [
    pytest.mark.gpu,
    pytest.mark.multigpu,
    pytest.mark.skipif(not _ok, reason=_why),
    pytest.mark.skipif(_ok and torch.cuda.device_count() < 2, reason="needs 2 GPUs"),
]


def _suite(rank: int, world: int) -> list[str]:
    import torch.distributed as dist

    from megatron_mok import MoKConfig, create_workspace, kernel_path as kp, mok_moe
    from megatron_mok.schedule import build_schedule_reference

    from ._bwd import (assert_bitwise, assert_empty_experts_zero, check_close, clone_all, grads_list, poison_all,
                       poison_ctx_tail, reference_grads)
    from ._util import make_inputs, make_routing, schedules_equal

    dev = torch.device("cuda", rank)
    lines = []

    def check(name, fn):
        try:
            info = fn()
            lines.append(f"PASS {name}" + (f" {info}" if info else ""))
        except Exception as exc:  # noqa: BLE001 - reported per check
            lines.append(f"FAIL {name}: {type(exc).__name__}: {exc}\n{traceback.format_exc()}")
        torch.cuda.synchronize()
        dist.barrier()

    def case(shape, kind, seed):
        T, H, I, Is, E, k = shape
        gen = torch.Generator().manual_seed(1000 * rank + seed)
        cfg = MoKConfig()
        ws = create_workspace(None, dev, T, H, k, E, cfg)
        w = make_inputs(T, H, I, Is, E // world, k, gen, dev)
        top = make_routing(kind, T, k, E, gen).to(dev)
        g = torch.randn(T, H, generator=gen).bfloat16().to(dev)
        return cfg, ws, top, w, g

    def sync_poison(ws):
        torch.cuda.synchronize()
        dist.barrier()  # no peer still reads this rank's buffers
        poison_all(ws)
        torch.cuda.synchronize()
        dist.barrier()

    def backward_vs_reference(kind, shape):
        cfg, ws, top, w, g = case(shape, kind, sum(shape) + len(kind))
        sched = kp.build_schedule(cfg, ws, top)
        ref_sched = build_schedule_reference(ws, top)
        assert schedules_equal(sched, ref_sched) == [], "schedule differs"
        ref = reference_grads(ws, ref_sched, *w, g)
        first, errs = None, None
        for rep in range(3):
            _, ctx = kp.forward(cfg, ws, sched, *w)
            if rep:
                poison_ctx_tail(ctx, sched)
            grads = kp.backward(cfg, ws, sched, ctx, g, *w)
            torch.cuda.synchronize()
            got = grads_list(grads)
            errs = check_close(got, ref)
            if first is None:
                first = clone_all(got)
                if kind in ("one_expert", "half_empty"):
                    assert_empty_experts_zero(grads, sched)
            else:
                assert_bitwise(got, first, f"rep {rep}")
            sync_poison(ws)
        got = grads_list(kp.backward(cfg, ws, sched, None, g, *w))
        torch.cuda.synchronize()
        assert_bitwise(got, first, "ctx=None")
        ws.check_errors(blocking=True)
        return "max rel err " + " ".join(f"{n}={e:.1e}" for n, e in errs.items())

    for kind, shape in [
        ("random", (256, 256, 128, 128, 8, 2)),
        ("skewed", (300, 384, 192, 0, 16, 4)),
        ("one_expert", (517, 512, 320, 256, 32, 8)),
        ("half_empty", (1024, 512, 256, 256, 16, 4)),
        ("random", (2048, 1024, 512, 512, 64, 8)),
    ]:
        check(f"backward_vs_reference[{kind}-{shape}]",
              lambda kind=kind, shape=shape: backward_vs_reference(kind, shape))

    def bitwise_20_and_knobs():
        cfg, ws, top, w, g = case((512, 512, 256, 256, 16, 4), "skewed", 77)
        cfgs = [MoKConfig(), MoKConfig(bwd_comm_sms=1, fwd_comm_sms=2, minibatch_rows=128, macrobatch_rows=1024),
                MoKConfig(bwd_comm_sms=64, minibatch_rows=256)]
        base = None
        for rep in range(20):
            c = cfgs[rep % len(cfgs)]
            sched = kp.build_schedule(c, ws, top)
            _, ctx = kp.forward(c, ws, sched, *w)
            got = grads_list(kp.backward(c, ws, sched, ctx, g, *w, comm_ctas=[0, 1, 13, 100][rep % 4]))
            if base is None:
                torch.cuda.synchronize()
                base = clone_all(got)
            else:
                assert_bitwise(got, base, f"rep {rep}")
        ws.check_errors(blocking=True)

    check("backward_bitwise_20_repeats_and_knobs", bitwise_20_and_knobs)

    def cuda_graph():
        cfg, ws, top, w, g = case((384, 256, 128, 128, 8, 2), "random", 5)
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            sched = kp.build_schedule(cfg, ws, top)
            out, ctx = kp.forward(cfg, ws, sched, *w)
            eager = [out.clone()] + clone_all(grads_list(kp.backward(cfg, ws, sched, ctx, g, *w)))
        torch.cuda.current_stream().wait_stream(s)
        torch.cuda.synchronize()
        dist.barrier()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            sched_g = kp.build_schedule(cfg, ws, top)
            out_g, ctx_g = kp.forward(cfg, ws, sched_g, *w)
            grads_g = kp.backward(cfg, ws, sched_g, ctx_g, g, *w)
        for _ in range(3):
            sync_poison(ws)
            graph.replay()
            torch.cuda.synchronize()
            got = [out_g] + grads_list(grads_g)
            assert torch.equal(got[0], eager[0]), "graph forward differs from eager"
            assert_bitwise(got[1:], eager[1:], "graph replay")
        ws.check_errors(blocking=True)

    check("forward_backward_cuda_graph_equals_eager", cuda_graph)

    def main_grads():
        cfg, ws, top, w, g = case((256, 256, 128, 128, 8, 2), "half_empty", 11)
        sched = kp.build_schedule(cfg, ws, top)
        _, ctx = kp.forward(cfg, ws, sched, *w)
        plain = grads_list(kp.backward(cfg, ws, sched, ctx, g, *w))
        gen = torch.Generator().manual_seed(3 + rank)
        before = [torch.randn(t.shape, generator=gen).to(dev) for t in w[2:]]
        main = [b.clone() for b in before]
        got = kp.backward(cfg, ws, sched, ctx, g, *w, main_grads=tuple(main))
        torch.cuda.synchronize()
        assert got.dfc1 is None and got.dfc2 is None and got.dshared_fc1 is None and got.dshared_fc2 is None
        assert_bitwise(grads_list(got)[:2], plain[:2], "main_grads dx/dprobs")
        for m, b, gw in zip(main, before, plain[2:]):
            assert m.dtype == torch.float32 and torch.equal(m, b + gw.float()), "main_grads accumulation"
        ws.check_errors(blocking=True)

    check("main_grads_accumulate", main_grads)

    def autograd():
        cfg, ws, top, w, g = case((256, 256, 128, 128, 8, 2), "skewed", 13)
        leaves = [t.detach().clone().requires_grad_(True) for t in w]
        out = mok_moe(leaves[0], top, *leaves[1:], cfg=cfg, num_experts=8)
        out.backward(g)
        sched = kp.build_schedule(cfg, ws, top)
        _, ctx = kp.forward(cfg, ws, sched, *w)
        direct = grads_list(kp.backward(cfg, ws, sched, ctx, g, *w))
        torch.cuda.synchronize()
        assert_bitwise([t.grad for t in leaves], direct, "autograd vs kernel_path.backward")

    check("autograd_uses_the_cuda_backward", autograd)
    return lines


def test_backward_ep2_suite(tmp_path):
    run_two_rank_suite(_suite, tmp_path)
