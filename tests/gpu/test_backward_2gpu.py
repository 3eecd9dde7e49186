"""EP=2 tests of the stage-1 CUDA backward: two processes (torch.multiprocessing spawn), NCCL for the
reference collectives, torch symmetric memory (no multicast) for the kernels."""

from __future__ import annotations

import torch

from ._util import run_two_rank_suite, two_gpu_marks

pytestmark = two_gpu_marks()


def _suite(rank: int, world: int) -> list[str]:
    import torch.distributed as dist

    from megatron_mok import MoKConfig, mok_moe
    from megatron_mok.schedule import build_schedule_reference

    from ._bwd import (assert_bitwise, backward_case, check_backward_bitwise_repeats, check_backward_graph_equals_eager,
                       check_backward_repeats, check_close, check_main_grads_accumulate, clone_all,
                       forward_backward, fp8_reference_grads, grads_list, poison_all, reference_grads)
    from ._util import (EP2_CASES, bits, check_stalled_peer_times_out, cuda_path, make_case, make_check,
                        schedules_equal)

    kp = cuda_path()
    dev = torch.device("cuda", rank)
    lines = []
    check = make_check(lines)

    def case(shape, kind, seed):
        return backward_case(shape, kind, 1000 * rank + seed, dev, world)

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
        _, errs = check_backward_repeats(cfg, ws, sched, w, g, ref, reps=3, poison=sync_poison,
                                         min_empty_experts=0 if kind in ("one_expert", "half_empty") else None)
        ws.check_errors(blocking=True)
        return "max rel err " + " ".join(f"{n}={e:.1e}" for n, e in errs.items())

    for kind, shape in EP2_CASES:
        check(f"backward_vs_reference[{kind}-{shape}]",
              lambda kind=kind, shape=shape: backward_vs_reference(kind, shape))

    def bitwise_20_and_knobs():
        _cfg, ws, top, w, g = case((512, 512, 256, 256, 16, 4), "skewed", 77)
        check_backward_bitwise_repeats(ws, top, w, g, comm_ctas=[0, 1, 13, 100])

    check("backward_bitwise_20_repeats_and_knobs", bitwise_20_and_knobs)

    def cuda_graph(forward_kernel):
        cfg, ws, top, w, g = case((384, 256, 128, 128, 8, 2), "random", 5)
        cfg = cfg.replace(forward_kernel=forward_kernel)
        check_backward_graph_equals_eager(cfg, ws, top, w, g, before_capture=dist.barrier,
                                          before_replay=lambda _outputs: sync_poison(ws))

    for forward_kernel in ("persistent", "staged"):
        check(f"forward_backward_cuda_graph_equals_eager[{forward_kernel}]",
              lambda forward_kernel=forward_kernel: cuda_graph(forward_kernel))

    def main_grads():
        cfg, ws, top, w, g = case((256, 256, 128, 128, 8, 2), "half_empty", 11)
        sched, ctx, plain = forward_backward(cfg, ws, top, w, g)
        check_main_grads_accumulate(cfg, ws, sched, ctx, w, g, plain, seed=3 + rank, dev=dev)
        ws.check_errors(blocking=True)

    check("main_grads_accumulate", main_grads)

    def autograd():
        cfg, ws, top, w, g = case((256, 256, 128, 128, 8, 2), "skewed", 13)
        leaves = [t.detach().clone().requires_grad_(True) for t in w]
        out = mok_moe(leaves[0], top, *leaves[1:], cfg=cfg, num_experts=8)
        out.backward(g)
        _, _, direct = forward_backward(cfg, ws, top, w, g)
        torch.cuda.synchronize()
        assert_bitwise([t.grad for t in leaves], direct, "autograd vs megatron_mok.cuda.backward")

    check("autograd_uses_the_cuda_backward", autograd)

    def backward_same_after_either_forward(kind, shape):
        """The persistent and the staged forward leave the same context bits: the backward after
        either gives the same gradient bits."""
        cfg, ws, top, w, g = case(shape, kind, 7 + len(kind))
        sched = kp.build_schedule(cfg, ws, top)
        outs, got = {}, {}
        for forward_kernel in ("persistent", "staged"):
            c = cfg.replace(forward_kernel=forward_kernel)
            out, ctx = kp.forward(c, ws, sched, *w)
            outs[forward_kernel] = out.clone()
            got[forward_kernel] = clone_all(grads_list(kp.backward(c, ws, sched, ctx, g, *w)))
            sync_poison(ws)
        assert torch.equal(bits(outs["staged"]), bits(outs["persistent"])), "forward outputs differ"
        assert_bitwise(got["staged"], got["persistent"], "after the staged vs the persistent forward")
        ws.check_errors(blocking=True)

    for kind, shape in EP2_CASES[:4]:
        check(f"backward_same_after_persistent_and_staged_forward[{kind}-{shape}]",
              lambda kind=kind, shape=shape: backward_same_after_either_forward(kind, shape))

    def fp8_backward(kind, shape):
        """The fp8 backward at EP=2 (e4m3 dgrads, the fc1 dgrad pushing the dx rows into the peer's
        slots) against the reference on the reference fp8 context; repeats at other pull/push CTA
        counts (NaN-poisoned buffers in between) give the same bits."""
        cfg, ws, top, w, gen = make_case(shape, kind, 1000 * rank + 31 + len(kind), dev, MoKConfig(precision="fp8"),
                                         world)
        g = torch.randn(shape[0], shape[1], generator=gen).bfloat16().to(dev)
        sched = kp.build_schedule(cfg, ws, top)
        _, ctx = kp.forward(cfg, ws, sched, *w)
        base = clone_all(grads_list(kp.backward(cfg, ws, sched, ctx, g, *w)))
        sync_poison(ws)
        errs = check_close(base, fp8_reference_grads(ws, top, w, g, cfg.dgrad_precision, cfg.wgrad_precision))
        for comm_ctas in (0, 1, 13, 100):
            got = grads_list(kp.backward(cfg, ws, sched, ctx, g, *w, comm_ctas=comm_ctas))
            torch.cuda.synchronize()
            assert_bitwise(got, base, f"comm_ctas={comm_ctas}")
            sync_poison(ws)
        ws.check_errors(blocking=True)
        return "max rel err " + " ".join(f"{n}={e:.1e}" for n, e in errs.items())

    for kind, shape in (("skewed", (384, 512, 256, 256, 16, 4)), ("one_expert", (256, 384, 256, 128, 8, 2))):
        check(f"fp8_backward_vs_reference_and_repeats[{kind}]",
              lambda kind=kind, shape=shape: fp8_backward(kind, shape))

    def stalled_peer():
        _, ws, top, w, g = backward_case((256, 256, 128, 128, 8, 2), "random", 3 + rank, dev, world)
        cfg = MoKConfig(peer_timeout_s=1.0)
        sched, ctx, _ = forward_backward(cfg, ws, top, w, g)  # creates the buffers on both ranks
        check_stalled_peer_times_out(ws, lambda: kp.backward(cfg, ws, sched, ctx, g, *w), rank)

    check("backward_stalled_peer_times_out", stalled_peer)
    return lines


def test_backward_ep2_suite(tmp_path):
    run_two_rank_suite(_suite, tmp_path)
