"""EP=2 test of the per-call header check (issue #33, megatron_mok/header.py): two ranks that call the
kernel path with disagreeing per-call values both raise the same named ``MoKInputError`` from
``ws.check_errors``, with no host collective in the call; matching calls raise nothing.

The verdict: rank 1's bad top_experts dtype (schedule), T = 0 or x dtype (forward) or grad_out dtype (backward)
raises its own ``MoKInputError`` at once, and rank 0, which ran the whole layer step with its good
inputs, raises ``MoKInputError`` naming rank 1 and the reason from ``ws.check_errors`` within seconds
(``peer_timeout_s`` is 60 s); then both ranks run the step again and get the bits of the step before.

On a workspace's first call of each kind (its symmetric buffers do not exist yet, and making them is
a host collective): rank 1 makes the buffers rank 0 makes before it sends its verdict, and rank 0,
stopped by it, raises before the next creation rank 1 will not join; the same fast error. And
``mok_moe``'s own argument checks: rank 1's 3-D x on a later step goes into the schedule's barrier,
on the first step into the workspace creation's exchange."""

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
    for kernel in ("persistent", "staged"):
        for site in ("build_schedule", "forward", "forward_dtype", "backward"):
            check(f"rank1_rejects_{site}_{kernel}_every_rank_raises_fast",
                  lambda site=site, kernel=kernel: _rejection(rank, world, site, kernel))
    for mode in ("persistent", "staged", "fp8"):
        for site in ("build_schedule", "forward", "backward"):
            check(f"rank1_rejects_first_{site}_{mode}_every_rank_raises_fast",
                  lambda site=site, mode=mode: _first_call_rejection(rank, world, site, mode))
    for first in (False, True):
        check(f"rank1_mok_moe_bad_x_{'first' if first else 'later'}_step_every_rank_raises_fast",
              lambda first=first: _mok_moe_rejection(rank, world, first))
    return lines


FAST_S = 10.0  # far inside peer_timeout_s: the verdict, not a timeout
EXPECTED = {  # site -> (rank 1's own error, what rank 0 raises)
    "build_schedule": ("top_experts must be int32 or int64, got torch.float32",
                       "mok build_schedule: rank 1 rejected its input: top_experts has dtype float32"),
    "forward": ("x must have shape [256, 256], got [0, 256]",
                "mok forward: rank 1 rejected its input: x has the wrong shape (size 0 in dim 0)"),
    "forward_dtype": ("x has dtype float16; the expert weights (fc1, fc2) have bfloat16",
                      "mok forward: rank 1 rejected its input: x has dtype float16"),
    "backward": ("grad_out has dtype float32; expected bfloat16",
                 "mok backward: rank 1 rejected its input: grad_out has dtype float32"),
}


def _rejection(rank: int, world: int, site: str, kernel: str) -> str:
    """One layer step (schedule, forward, backward) through the functional API on both ranks, with
    rank 1's input bad at ``site`` (forward: T = 0; forward_dtype: x in fp16); every rank raises,
    fast; then the step again on both."""

    import torch
    import torch.distributed as dist

    from megatron_mok import MoKConfig, functional

    from ._util import bits, make_case

    dev = torch.device("cuda", rank)
    cfg = MoKConfig(forward_kernel=kernel, peer_timeout_s=60.0)
    cfg, ws, top, w, gen = make_case((256, 256, 128, 128, 8, 2), "random", 30 + rank, dev, cfg=cfg, world=world)
    x, probs, fc1, fc2, sfc1, sfc2 = w
    g = torch.randn(256, 256, generator=gen).bfloat16().to(dev)

    def step(bad: str | None):
        sched = functional.build_schedule(cfg, ws, top.float() if bad == "build_schedule" else top)
        xs = x[:0] if bad == "forward" else x.half() if bad == "forward_dtype" else x
        out, ctx = functional.forward(cfg, ws, sched, xs, probs, fc1, fc2, sfc1, sfc2)
        grads = functional.backward(cfg, ws, sched, ctx, g.float() if bad == "backward" else g, *w)
        return [out, grads.dx, grads.dprobs, grads.dfc1, grads.dfc2, grads.dshared_fc1, grads.dshared_fc2]

    base = step(None)  # also creates every symmetric buffer (collectively) before the bad step
    torch.cuda.synchronize()
    ws.check_errors(blocking=True)
    dist.barrier()

    own, theirs = EXPECTED[site]
    elapsed = _raised_fast(rank, ws, lambda: step(site if rank == 1 else None), own, theirs)
    dist.barrier()  # both ranks have raised before the next step

    again = step(None)  # the epochs are still in step: the same bits as before
    torch.cuda.synchronize()
    ws.check_errors(blocking=True)
    for a, b in zip(base, again):
        assert (a is None and b is None) or torch.equal(bits(a), bits(b))
    return elapsed


def _raised_fast(rank: int, ws, run, own: str, theirs: str) -> str:
    """``run()`` on both ranks, then rank 0 syncs and checks its flags: rank 1 raises ``own``, rank 0
    ``theirs`` (rank 1's verdict, not a timeout), both within FAST_S."""
    import time

    import torch

    from megatron_mok import MoKInputError
    from megatron_mok.workspace import ErrorCode

    t0 = time.monotonic()
    raised = None
    try:
        run()
        torch.cuda.synchronize()
        if ws is not None:
            ws.check_errors(blocking=True)
    except MoKInputError as exc:
        raised = str(exc)
    elapsed = time.monotonic() - t0
    assert raised is not None, f"rank {rank} raised nothing"
    if rank == 1:
        assert own in raised, raised
    else:
        assert raised.startswith(theirs), raised
        if ws is not None:
            assert int(ws.errors.cpu()[ErrorCode.PEER_TIMEOUT]) == 0
    assert elapsed < FAST_S, f"rank {rank} took {elapsed:.1f} s"
    torch.cuda.synchronize()
    if ws is not None:
        assert [int(v) for v in ws.errors.cpu().tolist()] == [0] * ErrorCode.NUM_CODES
    return f"{elapsed:.2f}s"


FIRST_EXPECTED = {  # site -> (rank 1's own error, what rank 0 raises)
    "build_schedule": EXPECTED["build_schedule"],
    "forward": EXPECTED["forward"],
    "backward": ("grad_out has dtype float32; expected bfloat16",
                 "mok backward: rank 1 rejected its input: grad_out has dtype float32"),
}


def _first_call_rejection(rank: int, world: int, site: str, mode: str) -> str:
    """A new workspace; rank 1's input is bad in the first call of kind ``site`` (build_schedule: the
    workspace's very first; forward: its first forward; backward: its first backward), each making
    symmetric buffers: every rank raises, fast, with no buffer made on one rank only; then the step
    runs on both, and again with the same bits."""
    import torch
    import torch.distributed as dist

    from megatron_mok import MoKConfig, functional

    from ._util import bits, make_case

    dev = torch.device("cuda", rank)
    cfg = MoKConfig(precision="fp8", peer_timeout_s=60.0) if mode == "fp8" else \
        MoKConfig(forward_kernel=mode, peer_timeout_s=60.0)
    cfg, ws, top, w, gen = make_case((256, 256, 128, 128, 8, 2), "random", 50 + rank, dev, cfg=cfg, world=world)
    x, probs, fc1, fc2, sfc1, sfc2 = w
    g = torch.randn(256, 256, generator=gen).bfloat16().to(dev)

    def step(bad: str | None):
        sched = functional.build_schedule(cfg, ws, top.float() if bad == "build_schedule" else top)
        out, ctx = functional.forward(cfg, ws, sched, x[:0] if bad == "forward" else x, probs, fc1, fc2, sfc1, sfc2)
        grads = functional.backward(cfg, ws, sched, ctx, g.float() if bad == "backward" else g, *w)
        return [out, grads.dx, grads.dprobs, grads.dfc1, grads.dfc2, grads.dshared_fc1, grads.dshared_fc2]

    if site == "backward":  # the schedule's and the forward's buffers exist, not the backward's
        sched = functional.build_schedule(cfg, ws, top)
        functional.forward(cfg, ws, sched, x, probs, fc1, fc2, sfc1, sfc2)
        torch.cuda.synchronize()
        ws.check_errors(blocking=True)
    own, theirs = FIRST_EXPECTED[site]
    took = _raised_fast(rank, ws, lambda: step(site if rank == 1 else None), own, theirs)
    dist.barrier()  # both ranks have raised before the next step

    base = step(None)  # makes what the bad step left unmade, on both ranks alike
    torch.cuda.synchronize()
    ws.check_errors(blocking=True)
    again = step(None)
    torch.cuda.synchronize()
    ws.check_errors(blocking=True)
    for a, b in zip(base, again):
        assert (a is None and b is None) or torch.equal(bits(a), bits(b))
    return took


def _mok_moe_rejection(rank: int, world: int, first: bool) -> str:
    """mok_moe with rank 1's x 3-D: ``_check_call`` fails before the workspace is known. A later
    step: the verdict goes into the schedule's first barrier of the workspace the peers use; the
    first step: into the workspace creation's exchange (every rank raises the agreed error)."""
    import torch
    import torch.distributed as dist

    import megatron_mok as mok
    from megatron_mok import MoKConfig
    from megatron_mok.workspace import clear_workspace_cache, get_workspace

    from ._util import make_inputs, make_routing

    dev = torch.device("cuda", rank)
    T, H, I, Is, E, k = 256, 256, 128, 128, 8, 2
    cfg = MoKConfig(peer_timeout_s=60.0)
    gen = torch.Generator().manual_seed(70 + rank)
    x, probs, fc1, fc2, sfc1, sfc2 = make_inputs(T, H, I, Is, E // world, k, gen, dev)
    top = make_routing("random", T, k, E, gen).to(dev)
    clear_workspace_cache()

    def step(bad: bool):
        xs = (x.view(T, 2, H // 2) if bad else x).detach().requires_grad_()
        out = mok.mok_moe(xs, top, probs, fc1, fc2, sfc1, sfc2, cfg=cfg, num_experts=E)
        out.float().sum().backward()

    if not first:
        step(False)
        torch.cuda.synchronize()
    ws = None if first else get_workspace(None, dev, T, H, k, E, cfg, torch.bfloat16)
    if not first:
        ws.check_errors(blocking=True)
    own = "x must be a [T, H] tensor, got torch.Size([256, 2, 128])"
    theirs = ("mok: the input checks failed on rank 1 of the EP group" if first else
              "mok build_schedule: rank 1 rejected its input: x has 3 dimensions")
    took = _raised_fast(rank, ws, lambda: step(rank == 1), own, theirs)
    dist.barrier()
    step(False)  # the workspace (made now, or before) runs as if nothing had happened
    torch.cuda.synchronize()
    get_workspace(None, dev, T, H, k, E, cfg, torch.bfloat16).check_errors(blocking=True)
    clear_workspace_cache()
    return took


def test_header_check_ep2(tmp_path):
    run_two_rank_suite(_suite, tmp_path)
