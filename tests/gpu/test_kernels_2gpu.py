"""EP=2 tests of the CUDA path: two processes (torch.multiprocessing spawn), NCCL for the reference
collectives, torch symmetric memory (CUDA backend, no multicast) for the kernels."""

from __future__ import annotations

import torch

from ._util import run_two_rank_suite, two_gpu_marks

pytestmark = two_gpu_marks()


def _suite(rank: int, world: int) -> list[str]:
    """Every EP=2 check; returns 'PASS name' / 'FAIL name: why' lines."""
    import torch.distributed as dist

    from megatron_mok import MoKCapacityError, MoKConfig, reference
    from megatron_mok.schedule import build_schedule_reference

    from ._util import (EP2_CASES, bits, check_forward_bitwise_repeats, check_forward_graph_equals_eager,
                        check_stalled_peer_times_out, cuda_path, make_case, make_check, poison_internal, reference_out,
                        rel_err, schedules_equal)

    kp = cuda_path()
    dev = torch.device("cuda", rank)
    lines = []
    check = make_check(lines)
    PERSISTENT, STAGED = MoKConfig(forward_kernel="persistent"), MoKConfig(forward_kernel="staged")

    def forward_vs_reference(kind, shape):
        T, H, _, _, E, _ = shape
        cfg, ws, top, (x, probs, fc1, fc2, sfc1, sfc2), _ = make_case(
            shape, kind, 1000 * rank + T + E + len(kind), dev, world=world)
        assert cfg.resolved_forward_kernel(ws.ep_size) == "persistent", "auto at EP=2 (bf16) is not persistent"
        sched = kp.build_schedule(cfg, ws, top)
        ref_sched = build_schedule_reference(ws, top)
        bad = schedules_equal(sched, ref_sched)
        assert bad == [], f"schedule differs from the reference in {bad}"
        ref = reference_out(ws, ref_sched, x, probs, fc1, fc2, sfc1, sfc2)
        first = None
        for rep in range(3):
            out = torch.full((T, H), float("nan"), dtype=torch.bfloat16, device=dev)
            out, _ = kp.forward(cfg, ws, sched, x, probs, fc1, fc2, sfc1, sfc2, out=out)
            torch.cuda.synchronize()
            assert torch.isfinite(out.float()).all(), "unwritten / NaN output elements"
            err = rel_err(out, ref)
            assert err <= 1e-2, f"rel err {err:.3e}"
            first = out.clone() if first is None else first
            assert torch.equal(out, first), "not bitwise repeatable"
            poison_internal(ws)
        # the default (auto: the persistent megakernel at EP=2) and both explicit forward kernels give
        # the same bits, on NaN-poisoned outputs and buffers
        for name, c in (("staged", STAGED), ("persistent", PERSISTENT)):
            got = torch.full((T, H), float("nan"), dtype=torch.bfloat16, device=dev)
            got, _ = kp.forward(c, ws, sched, x, probs, fc1, fc2, sfc1, sfc2, out=got)
            torch.cuda.synchronize()
            assert torch.equal(bits(got), bits(first)), f"forward_kernel={name} differs from the default"
            poison_internal(ws)
        ws.check_errors(blocking=True)

    for kind, shape in EP2_CASES:
        check(f"forward_vs_reference[{kind}-{shape}]", lambda kind=kind, shape=shape: forward_vs_reference(kind, shape))

    def bitwise_20_and_knobs():
        # 20 repeats per config with varying CTA counts, every config's bits equal to the first's: the
        # persistent forward at two comm-SM / minibatch settings and the staged launches
        cfgs = (MoKConfig(), MoKConfig(fwd_comm_sms=2, minibatch_rows=128), STAGED)
        check_forward_bitwise_repeats((512, 512, 256, 256, 16, 4), cfgs, seed=77 + rank, dev=dev, world=world)

    check("bitwise_20_repeats_and_knobs", bitwise_20_and_knobs)

    def assert_persistent_bits(base, cfgs, ws, sched, inputs, what):
        """The persistent forward at each config gives base's bits (NaN-poisoned output and buffers)."""
        for cfg in cfgs:
            assert cfg.resolved_forward_kernel(ws.ep_size) == "persistent", cfg
            poison_internal(ws)
            out = torch.full(base.shape, float("nan"), dtype=torch.bfloat16, device=dev)
            out, _ = kp.forward(cfg, ws, sched, *inputs, out=out)
            torch.cuda.synchronize()
            assert torch.equal(bits(out), bits(base)), f"{what}: bits differ at {cfg}"
            ws.check_errors(blocking=True)

    def persistent_vs_staged_comm_sms_minibatch():
        T, H = 1024, 512
        _, ws, top, (x, probs, fc1, fc2, sfc1, sfc2), _ = make_case(
            (T, H, 256, 256, 16, 4), "skewed", 31 + rank, dev, world=world)  # the knobs below do not touch ws
        sched = kp.build_schedule(STAGED, ws, top)
        base, _ = kp.forward(STAGED, ws, sched, x, probs, fc1, fc2, sfc1, sfc2)
        cfgs = [MoKConfig(forward_kernel="persistent", fwd_comm_sms=comm, minibatch_rows=mb)
                for comm in (2, 8, 24, 40) for mb in (128, 256, 1024, 4096)]
        assert_persistent_bits(base.clone(), cfgs, ws, sched, (x, probs, fc1, fc2, sfc1, sfc2), "bf16")

    check("persistent_equals_staged_over_comm_sms_and_minibatch", persistent_vs_staged_comm_sms_minibatch)

    def cuda_graph(cfg):
        cfg, ws, top, inputs, _ = make_case((384, 256, 128, 128, 8, 2), "random", 5 + rank, dev, cfg=cfg, world=world)
        check_forward_graph_equals_eager(cfg, ws, top, inputs, before_capture=dist.barrier)
        ws.check_errors(blocking=True)

    for name, cfg in (("persistent", PERSISTENT), ("staged", STAGED), ("fp8", MoKConfig(precision="fp8"))):
        check(f"cuda_graph_replay_equals_eager[{name}]", lambda cfg=cfg: cuda_graph(cfg))

    def fp8_vs_reference(kind):
        # the staged fp8 forward (e4m3 rows pulled from the peer, the down GEMM's epilogue pushing
        # into the peer's slots) against the reference that quantizes at the same points, on
        # NaN-poisoned outputs and buffers; repeats and CTA counts give the same bits
        T, H = 512, 512
        cfg, ws, top, (x, probs, fc1, fc2, sfc1, sfc2), _ = make_case(
            (T, H, 256, 256, 16, 4), kind, 41 + rank, dev, cfg=MoKConfig(precision="fp8"), world=world)
        assert cfg.resolved_forward_kernel(ws.ep_size) == "staged"
        sched = kp.build_schedule(cfg, ws, top)
        ref_sched = build_schedule_reference(ws, top)
        f = lambda t: None if t is None else t.float()  # noqa: E731
        ref, _ = reference.forward(ws, ref_sched, f(x), probs, f(fc1), f(fc2), f(sfc1), f(sfc2), "fp8")
        base = None
        for knobs in ({}, dict(gemm_ctas=1, comm_ctas=3), dict(gemm_ctas=77, comm_ctas=1), dict(gemm_ctas=6)):
            out = torch.full((T, H), float("nan"), dtype=torch.bfloat16, device=dev)
            out, _ = kp.forward(cfg, ws, sched, x, probs, fc1, fc2, sfc1, sfc2, out=out, **knobs)
            torch.cuda.synchronize()
            assert torch.isfinite(out.float()).all(), f"unwritten / NaN output elements ({knobs})"
            if base is None:
                base = out.clone()
                err = rel_err(out, ref)
                assert err <= 1e-2, f"rel err {err:.3e}"
            else:
                assert torch.equal(bits(out), bits(base)), f"fp8 {kind}: bits differ at {knobs}"
            dist.barrier()  # no peer still reads this rank's buffers
            poison_internal(ws)
        ws.check_errors(blocking=True)

    for kind in ("skewed", "one_expert"):
        check(f"fp8_forward_vs_reference_and_knobs[{kind}]", lambda kind=kind: fp8_vs_reference(kind))

    def capacity_overflow():
        cfg, ws, top, (x, probs, fc1, fc2, _, _), _ = make_case(  # one_expert: all rows on rank 0
            (4096, 256, 128, 0, 16, 2), "one_expert", 9, dev, cfg=MoKConfig(capacity_factor=0.05), world=world)
        kp.forward(cfg, ws, kp.build_schedule(cfg, ws, top), x, probs, fc1, fc2)
        torch.cuda.synchronize()
        try:
            ws.check_errors(blocking=True)
        except MoKCapacityError:
            return  # both ranks: the overflow of rank 0 is seen everywhere
        raise AssertionError("no MoKCapacityError")

    check("capacity_overflow_raises_on_all_ranks", capacity_overflow)

    def stalled_peer(cfg, seed):
        cfg, ws, top, (x, probs, fc1, fc2, _, _), _ = make_case(
            (256, 256, 128, 0, 8, 2), "random", seed, dev, cfg=cfg.replace(peer_timeout_s=1.0), world=world)
        sched = kp.build_schedule(cfg, ws, top)
        kp.forward(cfg, ws, sched, x, probs, fc1, fc2)  # creates the buffers on both ranks
        check_stalled_peer_times_out(ws, lambda: kp.forward(cfg, ws, sched, x, probs, fc1, fc2), rank)

    for name, cfg, seed in (("persistent", MoKConfig(), 3), ("staged", STAGED, 5),
                            ("fp8", MoKConfig(precision="fp8"), 4)):
        check(f"stalled_peer_times_out[{name}]", lambda cfg=cfg, seed=seed: stalled_peer(cfg, seed))
    return lines


def test_ep2_suite(tmp_path):
    run_two_rank_suite(_suite, tmp_path)


def test_one_process_drives_both_gpus():
    """The persistent GEMMs raise their shared-memory limit per device: one process launching the
    bf16 grouped GEMM and both e4m3 task kinds (the gate/up GEMM's paired column tasks, the down
    GEMM's row tasks in 2-CTA row pairs) on GPU 0 and then on GPU 1 (the limit and the occupancy
    figure are per device; a cached figure once skipped the second device's limit) gets the same
    bits on both."""
    from megatron_mok import fp8, ops

    gen = torch.Generator().manual_seed(12)
    counts = [200, 0, 77, 256]
    offs = [0]
    for c in counts:
        offs.append(offs[-1] + (c + 127) // 128 * 128)
    K, N = 512, 256
    a = torch.zeros(offs[-1], K)
    for e, c in enumerate(counts):
        a[offs[e]:offs[e] + c] = torch.randn(c, K, generator=gen)
    a = a.bfloat16()
    w = (torch.randn(len(counts), 2 * N, K, generator=gen) / K**0.5).bfloat16()
    kinds = ("bf16", "fp8 gate/up", "fp8 down")
    outs = {}
    for d in (0, 1):
        dev = torch.device("cuda", d)
        with torch.cuda.device(dev):
            seg = torch.tensor(offs, dtype=torch.int32, device=dev)
            cnt = torch.tensor(counts, dtype=torch.int32, device=dev)
            qw = fp8.quantize_weight(w.to(dev), swiglu=True)
            qw_down = fp8.quantize_weight(w[:, :N].contiguous().to(dev), swiglu=False)
            xq, xs = ops.quantize_rows_e4m3(a.to(dev))
            for kind in kinds:
                out = torch.full((offs[-1], N), float("nan"), dtype=torch.bfloat16, device=dev)  # poisoned
                if kind == "bf16":
                    ops.grouped_gemm(a.to(dev), w.to(dev), seg, out, True, 0, cnt)
                elif kind == "fp8 gate/up":
                    ops.expert_gemm_fp8(xq, xs, qw.q, qw.scale, seg, cnt, out, True)
                else:
                    ops.expert_gemm_fp8(xq, xs, qw_down.q, qw_down.scale, seg, cnt, out, False)
                torch.cuda.synchronize(dev)
                assert torch.isfinite(out.float()).all(), f"{kind} on GPU {d}: output elements not written"
                outs[(kind, d)] = out.cpu()
    for kind in kinds:
        assert torch.equal(outs[(kind, 1)].view(torch.int16), outs[(kind, 0)].view(torch.int16)), \
            f"{kind}: GPU 1 differs from GPU 0"
