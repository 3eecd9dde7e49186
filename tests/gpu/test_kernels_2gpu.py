"""EP=2 tests of the CUDA path: two processes (torch.multiprocessing spawn), NCCL for the reference
collectives, torch symmetric memory (CUDA backend, no multicast) for the kernels."""

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
    """Every EP=2 check; returns 'PASS name' / 'FAIL name: why' lines."""
    import torch.distributed as dist

    from megatron_mok import MoKCapacityError, MoKConfig, MoKPeerTimeoutError, create_workspace, kernel_path as kp
    from megatron_mok.schedule import build_schedule_reference

    from ._util import make_inputs, make_routing, poison_internal, reference_out, rel_err, schedules_equal

    dev = torch.device("cuda", rank)
    lines = []

    def check(name, fn):
        try:
            fn()
            lines.append(f"PASS {name}")
        except Exception as exc:  # noqa: BLE001 - reported per check
            lines.append(f"FAIL {name}: {type(exc).__name__}: {exc}\n{traceback.format_exc()}")
        dist.barrier()

    def forward_vs_reference(kind, T, H, I, Is, E, k):
        gen = torch.Generator().manual_seed(1000 * rank + T + E + len(kind))
        cfg = MoKConfig()
        ws = create_workspace(None, dev, T, H, k, E, cfg)
        x, probs, fc1, fc2, sfc1, sfc2 = make_inputs(T, H, I, Is, E // world, k, gen, dev)
        top = make_routing(kind, T, k, E, gen).to(dev)
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
        # the megakernel (default) and the staged launches give the same bits
        staged = torch.full((T, H), float("nan"), dtype=torch.bfloat16, device=dev)
        staged, _ = kp.forward(cfg, ws, sched, x, probs, fc1, fc2, sfc1, sfc2, out=staged, path="staged")
        mega = torch.full((T, H), float("nan"), dtype=torch.bfloat16, device=dev)
        mega, _ = kp.forward(cfg, ws, sched, x, probs, fc1, fc2, sfc1, sfc2, out=mega, path="mega")
        torch.cuda.synchronize()
        assert torch.equal(staged.view(torch.int16), first.view(torch.int16)), "staged path differs from mega"
        assert torch.equal(mega.view(torch.int16), first.view(torch.int16)), "mega path not repeatable"
        ws.check_errors(blocking=True)

    for kind, shape in [
        ("random", (256, 256, 128, 128, 8, 2)),
        ("skewed", (300, 384, 192, 0, 16, 4)),
        ("one_expert", (517, 512, 320, 256, 32, 8)),
        ("half_empty", (1024, 512, 256, 256, 16, 4)),
        ("random", (2048, 1024, 512, 512, 64, 8)),
    ]:
        check(f"forward_vs_reference[{kind}-{shape}]", lambda kind=kind, shape=shape: forward_vs_reference(kind, *shape))

    def bitwise_20_and_knobs():
        T, H, I, Is, E, k = 512, 512, 256, 256, 16, 4
        gen = torch.Generator().manual_seed(77 + rank)
        x, probs, fc1, fc2, sfc1, sfc2 = make_inputs(T, H, I, Is, E // world, k, gen, dev)
        top = make_routing("skewed", T, k, E, gen).to(dev)
        base = None
        for cfg in (MoKConfig(), MoKConfig(fwd_comm_sms=2, minibatch_rows=128, macrobatch_rows=1024)):
            ws = create_workspace(None, dev, T, H, k, E, cfg)
            sched = kp.build_schedule(cfg, ws, top)
            for rep in range(20):
                knobs = dict(gemm_ctas=[0, 1, 7, 100][rep % 4], comm_ctas=[0, 1, 13][rep % 3])
                out, _ = kp.forward(cfg, ws, sched, x, probs, fc1, fc2, sfc1, sfc2, **knobs)
                base = out.clone() if base is None else base
                assert torch.equal(out, base), f"bits differ at rep {rep} {knobs} {cfg}"
            ws.check_errors(blocking=True)

    check("bitwise_20_repeats_and_knobs", bitwise_20_and_knobs)

    def mega_vs_staged_comm_sms_minibatch():
        T, H, I, Is, E, k = 1024, 512, 256, 256, 16, 4
        gen = torch.Generator().manual_seed(31 + rank)
        x, probs, fc1, fc2, sfc1, sfc2 = make_inputs(T, H, I, Is, E // world, k, gen, dev)
        top = make_routing("skewed", T, k, E, gen).to(dev)
        ws = create_workspace(None, dev, T, H, k, E, MoKConfig())  # the knobs below do not touch it
        sched = kp.build_schedule(MoKConfig(), ws, top)
        base, _ = kp.forward(MoKConfig(), ws, sched, x, probs, fc1, fc2, sfc1, sfc2, path="staged")
        base = base.clone()
        for comm in (2, 8, 24, 40):
            for mb in (128, 256, 1024, 4096):
                cfg = MoKConfig(fwd_comm_sms=comm, minibatch_rows=mb, macrobatch_rows=max(mb, 4096))
                poison_internal(ws)
                out = torch.full((T, H), float("nan"), dtype=torch.bfloat16, device=dev)
                out, ctx = kp.forward(cfg, ws, sched, x, probs, fc1, fc2, sfc1, sfc2, out=out, path="mega")
                torch.cuda.synchronize()
                assert torch.equal(out.view(torch.int16), base.view(torch.int16)), f"bits differ: comm {comm} mb {mb}"
                ws.check_errors(blocking=True)

    check("mega_equals_staged_over_comm_sms_and_minibatch", mega_vs_staged_comm_sms_minibatch)

    def cuda_graph():
        T, H, I, Is, E, k = 384, 256, 128, 128, 8, 2
        gen = torch.Generator().manual_seed(5 + rank)
        cfg = MoKConfig()
        ws = create_workspace(None, dev, T, H, k, E, cfg)
        x, probs, fc1, fc2, sfc1, sfc2 = make_inputs(T, H, I, Is, E // world, k, gen, dev)
        top = make_routing("random", T, k, E, gen).to(dev)
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            eager, _ = kp.forward(cfg, ws, kp.build_schedule(cfg, ws, top), x, probs, fc1, fc2, sfc1, sfc2)
            eager = eager.clone()
        torch.cuda.current_stream().wait_stream(s)
        torch.cuda.synchronize()
        dist.barrier()
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            out_g, _ = kp.forward(cfg, ws, kp.build_schedule(cfg, ws, top), x, probs, fc1, fc2, sfc1, sfc2)
        for _ in range(3):
            out_g.fill_(float("nan"))
            g.replay()
            torch.cuda.synchronize()
            assert torch.equal(out_g, eager), "graph replay differs from eager"
        ws.check_errors(blocking=True)

    check("cuda_graph_replay_equals_eager", cuda_graph)

    def capacity_overflow():
        T, H, I, E, k = 4096, 256, 128, 16, 2
        gen = torch.Generator().manual_seed(9)
        cfg = MoKConfig(capacity_factor=0.05)
        ws = create_workspace(None, dev, T, H, k, E, cfg)
        x, probs, fc1, fc2, _, _ = make_inputs(T, H, I, 0, E // world, k, gen, dev)
        top = make_routing("one_expert", T, k, E, gen).to(dev)  # all rows on rank 0
        kp.forward(cfg, ws, kp.build_schedule(cfg, ws, top), x, probs, fc1, fc2)
        torch.cuda.synchronize()
        try:
            ws.check_errors(blocking=True)
        except MoKCapacityError:
            return  # both ranks: the overflow of rank 0 is seen everywhere
        raise AssertionError("no MoKCapacityError")

    check("capacity_overflow_raises_on_all_ranks", capacity_overflow)

    def stalled_peer():
        T, H, I, E, k = 256, 256, 128, 8, 2
        gen = torch.Generator().manual_seed(3)
        cfg = MoKConfig(peer_timeout_s=1.0)
        ws = create_workspace(None, dev, T, H, k, E, cfg)
        x, probs, fc1, fc2, _, _ = make_inputs(T, H, I, 0, E // world, k, gen, dev)
        top = make_routing("random", T, k, E, gen).to(dev)
        sched = kp.build_schedule(cfg, ws, top)
        kp.forward(cfg, ws, sched, x, probs, fc1, fc2)  # creates the buffers on both ranks
        torch.cuda.synchronize()
        dist.barrier()
        if rank == 0:  # rank 1 skips this call
            kp.forward(cfg, ws, sched, x, probs, fc1, fc2)
            torch.cuda.synchronize()
            try:
                ws.check_errors(blocking=True)
            except MoKPeerTimeoutError as exc:
                assert "rank 1" in str(exc), str(exc)
            else:
                raise AssertionError("no MoKPeerTimeoutError")
        torch.cuda.synchronize()

    check("stalled_peer_times_out", stalled_peer)
    return lines


def test_ep2_suite(tmp_path):
    run_two_rank_suite(_suite, tmp_path)
