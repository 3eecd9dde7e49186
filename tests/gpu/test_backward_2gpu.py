"""EP=2 tests of the stage-1 CUDA backward: two processes (torch.multiprocessing spawn), NCCL for the
reference collectives, torch symmetric memory (no multicast) for the kernels."""

from __future__ import annotations

import torch

from ._util import run_two_rank_suite, two_gpu_marks

pytestmark = two_gpu_marks()


def _suite(rank: int, world: int) -> list[str]:
    import torch.distributed as dist

    from megatron_mok import kernel_path as kp, mok_moe
    from megatron_mok.schedule import build_schedule_reference

    from ._bwd import (assert_bitwise, backward_case, check_backward_bitwise_repeats, check_backward_graph_equals_eager,
                       check_backward_repeats, check_main_grads_accumulate, forward_backward, grads_list, poison_all,
                       reference_grads)
    from ._util import EP2_CASES, check_stalled_peer_times_out, make_check, schedules_equal

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

    def with_kernel(kernel, fn):
        """fn() with MOK_BWD_KERNEL=kernel (the staged default, or the persistent kernel)."""
        import os

        os.environ["MOK_BWD_KERNEL"] = kernel
        try:
            return fn()
        finally:
            os.environ.pop("MOK_BWD_KERNEL", None)

    def cuda_graph():
        cfg, ws, top, w, g = case((384, 256, 128, 128, 8, 2), "random", 5)
        check_backward_graph_equals_eager(cfg, ws, top, w, g, before_capture=dist.barrier,
                                          before_replay=lambda _outputs: sync_poison(ws))

    for kernel in ("staged", "mega"):
        check(f"forward_backward_cuda_graph_equals_eager[{kernel}]",
              lambda kernel=kernel: with_kernel(kernel, cuda_graph))

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
        assert_bitwise([t.grad for t in leaves], direct, "autograd vs kernel_path.backward")

    check("autograd_uses_the_cuda_backward", autograd)

    def mega_equals_staged(kind, shape):
        cfg, ws, top, w, g = case(shape, kind, 7 + len(kind))
        sched = kp.build_schedule(cfg, ws, top)
        _, ctx = kp.forward(cfg, ws, sched, *w)
        got = {}
        for kernel in ("staged", "mega"):
            got[kernel] = with_kernel(kernel, lambda: [None if t is None else t.clone()
                                                       for t in grads_list(kp.backward(cfg, ws, sched, ctx, g, *w))])
            sync_poison(ws)
        assert_bitwise(got["mega"], got["staged"], "mega vs staged")
        ws.check_errors(blocking=True)

    for kind, shape in EP2_CASES[:4]:
        check(f"backward_megakernel_equals_staged[{kind}-{shape}]",
              lambda kind=kind, shape=shape: mega_equals_staged(kind, shape))

    def fp8_backward(kind, shape):
        """The fp8 backward at EP=2 (e4m3 dgrads, the fc1 dgrad pushing the dx rows into the peer's
        slots) against the reference on the reference fp8 context; the same bits with the pushes in
        bwd_push, with the side stream waiting for the pull, or off, and with grad_out's remote rows
        pulled once (MOK_TOKEN_DEDUP=1)."""
        import os

        from megatron_mok import MoKConfig

        from ._bwd import check_close, clone_all, fp8_reference_grads
        from ._util import make_case

        cfg, ws, top, w, gen = make_case(shape, kind, 1000 * rank + 31 + len(kind), dev, MoKConfig(precision="fp8"),
                                         world)
        g = torch.randn(shape[0], shape[1], generator=gen).bfloat16().to(dev)
        sched = kp.build_schedule(cfg, ws, top)
        _, ctx = kp.forward(cfg, ws, sched, *w)
        base = clone_all(grads_list(kp.backward(cfg, ws, sched, ctx, g, *w)))
        sync_poison(ws)
        errs = check_close(base, fp8_reference_grads(ws, top, w, g, cfg.dgrad_precision, cfg.wgrad_precision))
        for knob, value in (("MOK_FP8_PUSH", "0"), ("MOK_BWD_SIDE_EARLY", "0"), ("MOK_BWD_OVERLAP", "0"),
                            ("MOK_WGRAD8_SIDE", "0"), ("MOK_TOKEN_DEDUP", "1"), ("MOK_FP8_ROW_PAIRS", "0")):
            os.environ[knob] = value
            try:
                got = grads_list(kp.backward(cfg, ws, sched, ctx, g, *w))
                torch.cuda.synchronize()
                assert_bitwise(got, base, f"{knob}={value}")
            finally:
                os.environ.pop(knob)
            sync_poison(ws)
        ws.check_errors(blocking=True)
        return "max rel err " + " ".join(f"{n}={e:.1e}" for n, e in errs.items())

    for kind, shape in (("skewed", (384, 512, 256, 256, 16, 4)), ("one_expert", (256, 384, 256, 128, 8, 2))):
        check(f"fp8_backward_vs_reference_and_knobs[{kind}]",
              lambda kind=kind, shape=shape: fp8_backward(kind, shape))

    def stalled_peer():
        from megatron_mok import MoKConfig

        _, ws, top, w, g = backward_case((256, 256, 128, 128, 8, 2), "random", 3 + rank, dev, world)
        cfg = MoKConfig(peer_timeout_s=1.0)
        sched, ctx, _ = forward_backward(cfg, ws, top, w, g)  # creates the buffers on both ranks
        check_stalled_peer_times_out(ws, lambda: kp.backward(cfg, ws, sched, ctx, g, *w), rank)

    for kernel in ("staged", "mega"):
        check(f"backward_stalled_peer_times_out[{kernel}]", lambda kernel=kernel: with_kernel(kernel, stalled_peer))
    return lines


def test_backward_ep2_suite(tmp_path):
    run_two_rank_suite(_suite, tmp_path)
