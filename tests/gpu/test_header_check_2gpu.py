"""EP=2 test of the per-call header check (issue #33, megatron_mok/header.py): two ranks that call the
kernel path with disagreeing per-call values both raise the same named ``MoKInputError`` from
``ws.check_errors``, with no host collective in the call; matching calls raise nothing."""

from __future__ import annotations

from ._util import run_two_rank_suite, two_gpu_marks

pytestmark = two_gpu_marks()


def _suite(rank: int, world: int) -> list[str]:
    import torch

    from megatron_mok import MoKConfig, MoKInputError
    from megatron_mok.workspace import ErrorCode

    from ._util import cuda_path, make_case, make_check

    kp = cuda_path()
    dev = torch.device("cuda", rank)
    lines = []
    check = make_check(lines)
    staged = MoKConfig(forward_kernel="staged")
    other = 1 - rank

    def expect_mismatch(ws, where: str, field: str, mine: str, theirs: str):
        torch.cuda.synchronize()
        try:
            ws.check_errors(blocking=True)
        except MoKInputError as exc:
            msg = str(exc)
            assert f"mok {where}: the ranks of the EP group disagree on {field}" in msg, msg
            assert f"this rank (rank {rank}): {mine}" in msg and f"rank {other}: {theirs}" in msg, msg
            return msg.split(" (the device")[0]
        raise AssertionError("no MoKInputError")

    def schedule_precision():
        cfg, ws, top, _, _ = make_case((256, 256, 128, 0, 8, 2), "random", 10 + rank, dev, cfg=staged, world=world)
        kp.build_schedule(cfg, ws, top)  # both ranks agree (and the buffers exist)
        torch.cuda.synchronize()
        ws.check_errors(blocking=True)
        mine = cfg if rank == 0 else cfg.replace(precision="fp8")
        kp.build_schedule(mine, ws, top)
        desc = {0: "precision=bf16", 1: "precision=fp8"}
        msg = expect_mismatch(ws, "build_schedule", "precision", desc[rank], desc[other])
        kp.build_schedule(cfg, ws, top)  # agreeing again: nothing flagged
        torch.cuda.synchronize()
        ws.check_errors(blocking=True)
        assert int(ws.errors.cpu()[ErrorCode.HEADER_MISMATCH]) == 0
        return msg

    def backward_forward_kernel():
        cfg, ws, top, w, gen = make_case((256, 256, 128, 128, 8, 2), "random", 20 + rank, dev, cfg=staged,
                                         world=world)
        g = torch.randn(256, 256, generator=gen).bfloat16().to(dev)
        sched = kp.build_schedule(cfg, ws, top)
        _, ctx = kp.forward(cfg, ws, sched, *w)
        kp.backward(cfg, ws, sched, ctx, g, *w)  # both ranks agree (and the buffers exist)
        torch.cuda.synchronize()
        ws.check_errors(blocking=True)
        # the backward's launches do not depend on forward_kernel: only the header tells the ranks apart
        mine = cfg if rank == 0 else cfg.replace(forward_kernel="persistent")
        kp.backward(mine, ws, sched, ctx, g, *w)
        desc = {0: "forward_kernel=staged", 1: "forward_kernel=persistent"}
        return expect_mismatch(ws, "backward", "precision", f"precision=bf16, dgrad=bf16, wgrad=bf16, {desc[rank]}",
                               f"precision=bf16, dgrad=bf16, wgrad=bf16, {desc[other]}")

    check("schedule_precision_mismatch_raises_on_every_rank", schedule_precision)
    check("backward_header_mismatch_raises_on_every_rank", backward_forward_kernel)
    return lines


def test_header_check_ep2(tmp_path):
    run_two_rank_suite(_suite, tmp_path)
