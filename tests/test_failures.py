"""Failure semantics across ranks (CPU, gloo): one rank's bad input or stall makes every rank raise
the same clear error, fast, and nothing mismatched is ever exchanged.

Each multi-process test runs its cases one after another in one process group (an error raised by
the agreement leaves no collective pending, so the group stays usable); every rank reports, per
case, the exception it raised and how long the call took, and the parent checks that all ranks
raised the same ``MoKInputError`` naming the field and the failing rank, well inside
``peer_timeout_s``. ``run_distributed``'s hard timeout turns a regression (a rank left waiting)
into a failure instead of a hang.
"""

from __future__ import annotations

import time
import warnings

import pytest
import torch
import torch.distributed as dist
from dist_utils import run_distributed

import megatron_mok as mok
from megatron_mok import MoKConfig, MoKInputError, functional

pytestmark = pytest.mark.timeout(240)

T, H, I, E, K = 8, 32, 16, 4, 2
FAST_S = 5.0  # an agreed error must come this fast (peer_timeout_s below is far longer)
CFG = MoKConfig(peer_timeout_s=60.0)


def _inputs(rank, dtype=torch.float32, tokens=T, hidden=H, nle=E // 2):
    gen = torch.Generator().manual_seed(10 + rank)
    x = torch.randn(tokens, hidden, generator=gen, dtype=torch.float64).to(dtype)
    top = torch.stack([torch.randperm(E, generator=gen)[:K] for _ in range(tokens)]).to(torch.int32)
    probs = torch.rand(tokens, K, generator=gen)
    fc1 = (0.1 * torch.randn(nle, 2 * I, hidden, generator=gen, dtype=torch.float64)).to(dtype)
    fc2 = (0.1 * torch.randn(nle, hidden, I, generator=gen, dtype=torch.float64)).to(dtype)
    return x, top, probs, fc1, fc2


def _attempt(fn):
    t0 = time.monotonic()
    try:
        fn()
    except Exception as err:  # noqa: BLE001 - reported to the parent
        return type(err).__name__, str(err), time.monotonic() - t0
    return "ok", "", time.monotonic() - t0


def _layer(rank, cfg=CFG, **changes):
    """One mok_moe call (forward and backward) with this rank's inputs, ``changes`` applied."""
    x, top, probs, fc1, fc2 = _inputs(rank)
    args = dict(x=x, top=top, probs=probs, fc1=fc1, fc2=fc2)
    args.update(changes)
    x = args["x"].requires_grad_() if args["x"].is_floating_point() else args["x"]
    out = mok.mok_moe(x, args["top"], args["probs"], args["fc1"], args["fc2"], cfg=cfg, num_experts=E)
    out.float().sum().backward()


def _bad_on_rank1(rank, case):
    """Case name -> the changes rank 1 applies (rank 0 stays healthy)."""
    x, top, probs, fc1, fc2 = _inputs(rank)
    return {
        "x dtype float64": dict(x=x.double(), fc1=fc1.double(), fc2=fc2.double()),
        "x shape (hidden size)": dict(x=torch.randn(T, H + 8)),
        "x 3-D": dict(x=x.view(T, 2, H // 2)),
        "T=0": dict(x=x[:0], top=top[:0], probs=probs[:0]),
        "T differs": dict(x=x[:4], top=top[:4], probs=probs[:4]),
        "fc1 dtype": dict(fc1=fc1.double()),
        "fc2 shape": dict(fc2=fc2[:, :, :-1]),
        "probs shape": dict(probs=torch.rand(T, K + 1)),
        "probs dtype": dict(probs=probs.double()),
        "probs NaN": dict(probs=torch.where(torch.arange(T)[:, None] == 3, float("nan"), probs)),
        "top_experts dtype": dict(top=top.float()),
        "top_experts out of range": dict(top=torch.where(torch.arange(T)[:, None] == 2, E + 5, top)),
    }[case]


LAYER_CASES = {
    # case: substrings every rank's message must hold
    "x dtype float64": ["activation dtype", "'float32'", "'float64'", "rank 1"],
    "x shape (hidden size)": ["rank 1", "x has hidden size 40"],
    "x 3-D": ["rank 1", "x must be a [T, H] tensor"],
    "T=0": ["rank 1", "T=0"],
    "T differs": ["num_tokens (T)", "rank 0: 8", "rank 1: 4"],
    "fc1 dtype": ["rank 1", "fc1 has dtype float64"],
    "fc2 shape": ["rank 1", "fc2 must have shape"],
    "probs shape": ["rank 1", "probs must have shape"],
    "probs dtype": ["rank 1", "probs has dtype float64"],
    "probs NaN": ["probs holds a NaN"],
    "top_experts dtype": ["rank 1", "top_experts must be int32 or int64"],
    "top_experts out of range": ["top_experts holds an expert id outside"],
}


def _layer_cases(rank, world):
    _layer(rank)  # warm: both ranks hold the workspace, so rank 1's bad call meets rank 0's next call
    report = {}
    for case in LAYER_CASES:
        changes = _bad_on_rank1(rank, case) if rank == 1 else {}
        report[case] = _attempt(lambda changes=changes: _layer(rank, **changes))
        report[case + " / then healthy"] = _attempt(lambda: _layer(rank))  # the group still works
    return report


def _check_same_error(results, case, needles, kind="MoKInputError"):
    got = [r[case] for r in results]
    kinds = {g[0] for g in got}
    assert kinds == {kind}, f"{case}: {[g[:2] for g in got]}"
    messages = {g[1] for g in got}
    assert len(messages) == 1, f"{case}: ranks raised different messages: {messages}"
    message = messages.pop()
    for needle in needles:
        assert needle in message, f"{case}: {needle!r} not in {message!r}"
    assert max(g[2] for g in got) < FAST_S, f"{case}: took {[round(g[2], 2) for g in got]} s"
    return message


def test_one_rank_bad_layer_input_raises_on_every_rank():
    results = run_distributed(_layer_cases, world_size=2, timeout=200)
    for case, needles in LAYER_CASES.items():
        _check_same_error(results, case, needles)
        assert all(r[case + " / then healthy"][0] == "ok" for r in results), [r[case + " / then healthy"] for r in results]


# ---- functional API: per-call checks, grad_out, precision, schedule identity --------------------------


def _functional_cases(rank, world):
    x, top, probs, fc1, fc2 = _inputs(rank)
    ws = mok.get_workspace(None, "cpu", T, H, K, E, CFG, torch.float32)
    report = {}

    def fwd_bwd(cfg=CFG, grad=None, sched_for_fwd=None, sched_for_bwd=None, ctx_from=None, ws_fwd=ws):
        sched = functional.build_schedule(cfg, ws, top)
        out, ctx = functional.forward(cfg, ws_fwd, sched_for_fwd or sched, x, probs, fc1, fc2)
        g = torch.ones_like(out) if grad is None else grad
        functional.backward(cfg, ws, sched_for_bwd or sched, ctx_from or ctx, g, x, probs, fc1, fc2)

    bad = rank == 1
    report["bad grad_out shape"] = _attempt(lambda: fwd_bwd(grad=torch.ones(T, H + 1) if bad else None))
    report["bad grad_out dtype"] = _attempt(lambda: fwd_bwd(grad=torch.ones(T, H, dtype=torch.float64) if bad else None))
    fp8_cfg = CFG.replace(precision="fp8")
    report["precision fp8 on one rank"] = _attempt(lambda: fwd_bwd(cfg=fp8_cfg if bad else CFG))
    report["cfg differs on one rank"] = _attempt(lambda: fwd_bwd(cfg=CFG.replace(minibatch_rows=256) if bad else CFG))

    old = functional.build_schedule(CFG, ws, top)
    report["stale schedule on one rank"] = _attempt(lambda: fwd_bwd(sched_for_fwd=old if bad else None))
    other_ws = mok.create_workspace(None, "cpu", T, H, K, E, CFG.replace(capacity_factor=0.5), torch.float32)
    foreign = functional.build_schedule(CFG, other_ws, top)
    report["foreign schedule on one rank"] = _attempt(lambda: fwd_bwd(sched_for_fwd=foreign if bad else None))

    def mismatched_backward():
        s1 = functional.build_schedule(CFG, ws, top)
        out1, ctx1 = functional.forward(CFG, ws, s1, x, probs, fc1, fc2)
        s2 = functional.build_schedule(CFG, ws, top)
        _, ctx2 = functional.forward(CFG, ws, s2, x, probs, fc1, fc2)
        functional.backward(CFG, ws, s2, ctx1 if bad else ctx2, torch.ones_like(out1), x, probs, fc1, fc2)

    report["backward ctx and schedule apart on one rank"] = _attempt(mismatched_backward)
    report["top_experts shape on one rank (schedule)"] = _attempt(
        lambda: functional.build_schedule(CFG, ws, top[:, :1] if bad else top))
    report["healthy at the end"] = _attempt(fwd_bwd)
    return report


FUNCTIONAL_CASES = {
    "bad grad_out shape": ["rank 1 (backward)", "grad_out must have shape"],
    "bad grad_out dtype": ["rank 1 (backward)", "grad_out has dtype float64"],
    "precision fp8 on one rank": ["MoKConfig.precision", "rank 0: 'bf16'", "rank 1: 'fp8'"],
    "cfg differs on one rank": ["MoKConfig.minibatch_rows", "rank 0: 4096", "rank 1: 256"],
    "stale schedule on one rank": ["rank 1 (forward)", "sched is stale"],
    "foreign schedule on one rank": ["rank 1 (forward)", "sched is foreign"],
    "backward ctx and schedule apart on one rank": ["rank 1 (backward)", "ctx and sched do not belong together"],
    "top_experts shape on one rank (schedule)": ["rank 1 (schedule)", "top_experts must have shape"],
}


def test_one_rank_bad_functional_call_raises_on_every_rank():
    results = run_distributed(_functional_cases, world_size=2, timeout=200)
    for case, needles in FUNCTIONAL_CASES.items():
        _check_same_error(results, case, needles)
    assert [r["healthy at the end"][0] for r in results] == ["ok", "ok"], [r["healthy at the end"] for r in results]


# ---- workspace creation: agreement on everything that sizes an exchange ------------------------------


CREATION_CASES = {
    # case: (rank 1's changes to create_workspace's keyword arguments, substrings)
    "capacity_factor": (dict(cfg=CFG.replace(capacity_factor=0.5)),
                        ["MoKConfig.capacity_factor", "rank 0: 1.0", "rank 1: 0.5"]),
    "dtype fp64 vs fp32": (dict(dtype=torch.float64), ["activation dtype", "rank 0: 'float32'", "rank 1: 'float64'"]),
    "precision": (dict(cfg=CFG.replace(precision="fp8")), ["MoKConfig.precision", "rank 0: 'bf16'", "rank 1: 'fp8'"]),
    "forward_kernel": (dict(cfg=CFG.replace(forward_kernel="staged")),
                       ["MoKConfig.forward_kernel", "rank 0: 'auto'", "rank 1: 'staged'"]),
    "save_gate_up": (dict(cfg=CFG.replace(save_gate_up=False)),
                     ["MoKConfig.save_gate_up", "rank 0: True", "rank 1: False"]),
    "hidden": (dict(hidden=64), ["hidden size (H)", "rank 0: 32", "rank 1: 64"]),
    "top-k and experts": (dict(topk=1, num_experts=8), ["top-k: rank 0: 2, rank 1: 1", "num_experts: rank 0: 4, rank 1: 8"]),
    "T=0 on one rank": (dict(num_tokens=0), ["rank 1 (workspace creation)", "num_tokens must be a positive int"]),
}


def _creation_cases(rank, world):
    base = dict(group=None, device="cpu", num_tokens=T, hidden=H, topk=K, num_experts=E, cfg=CFG, dtype=torch.float32)
    report = {}
    for case, (changes, _) in CREATION_CASES.items():
        kwargs = {**base, **(changes if rank == 1 else {})}
        report[case] = _attempt(lambda kwargs=kwargs: mok.create_workspace(**kwargs))
    report["agreeing ranks"] = _attempt(lambda: mok.create_workspace(**base))
    return report


def test_workspace_creation_agrees_on_everything_that_sizes_an_exchange():
    results = run_distributed(_creation_cases, world_size=2, timeout=120)
    for case, (_, needles) in CREATION_CASES.items():
        message = _check_same_error(results, case, needles)
        assert "nothing was exchanged" in message or "input checks failed" in message, message
    assert [r["agreeing ranks"][0] for r in results] == ["ok", "ok"]


def _three_rank_case(rank, world):
    x, _, probs, fc1, fc2 = _inputs(rank, nle=1)
    gen = torch.Generator().manual_seed(rank)
    top = torch.stack([torch.randperm(3, generator=gen)[:K] for _ in range(T)])
    bad_fc1 = fc1.double() if rank in (0, 2) else fc1
    return {"two ranks bad": _attempt(lambda: mok.mok_moe(x, top, probs, bad_fc1, fc2, cfg=CFG, num_experts=3))}


def test_every_failing_rank_is_named():
    """Three ranks, ranks 0 and 2 fail: every rank's message names both, with their reasons."""
    results = run_distributed(_three_rank_case, world_size=3, timeout=120)
    message = _check_same_error(results, "two ranks bad", ["ranks 0, 2", "rank 0 (forward)", "rank 2 (forward)"])
    assert message.count("fc1 has dtype float64") == 2


# ---- stalled and dead peers ----------------------------------------------------------------------------

PEER_TIMEOUT_S = 2.0


def _stalled_peer(rank, world):
    cfg = MoKConfig(peer_timeout_s=PEER_TIMEOUT_S)
    _layer(rank, cfg)  # both ranks healthy first
    if rank == 1:
        time.sleep(PEER_TIMEOUT_S + 3)  # alive, never calls again (until rank 0 has timed out)
        return "stalled"
    return _attempt(lambda: _layer(rank, cfg))


def test_stalled_peer_raises_peer_timeout_naming_it():
    results = run_distributed(_stalled_peer, world_size=2, timeout=90)
    kind, message, took = results[0]
    assert kind == "MoKPeerTimeoutError", (kind, message)
    assert "rank 1 (global rank 1" in message and "peer_timeout_s" in message, message
    assert PEER_TIMEOUT_S * 0.9 < took < PEER_TIMEOUT_S + 3.0, took


def _stalled_at_creation(rank, world):
    if rank == 1:
        time.sleep(PEER_TIMEOUT_S + 3)
        return "stalled"
    return _attempt(lambda: _layer(rank, MoKConfig(peer_timeout_s=PEER_TIMEOUT_S)))


def test_peer_missing_at_workspace_creation_raises_peer_timeout():
    results = run_distributed(_stalled_at_creation, world_size=2, timeout=90)
    kind, message, took = results[0]
    assert kind == "MoKPeerTimeoutError" and "rank 1" in message and "workspace creation" in message, (kind, message)
    assert took < PEER_TIMEOUT_S + 3.0, took


def _dead_peer(rank, world):
    cfg = MoKConfig(peer_timeout_s=30.0)  # a dead peer is reported at once, not after the timeout
    _layer(rank, cfg)
    if rank == 1:
        dist.destroy_process_group()  # its connections close: dead, as far as rank 0 can tell
        return "dead"
    time.sleep(1.0)
    return _attempt(lambda: _layer(rank, cfg))


def test_dead_peer_raises_peer_error_naming_it():
    results = run_distributed(_dead_peer, world_size=2, timeout=90)
    kind, message, took = results[0]
    assert kind == "MoKPeerTimeoutError", (kind, message)
    assert "rank 1 (global rank 1" in message, message
    assert took < 15.0, took


# ---- single process: messages that blame the right argument, schedule identity, slow paths ------------


def test_messages_blame_the_argument_at_fault():
    x, top, probs, fc1, fc2 = _inputs(0, nle=E)
    cases = [
        (dict(x=torch.randn(T, H + 16)), "x has hidden size 48"),
        (dict(x=x.to("meta")), "x is on meta, but the expert weights (fc1) are on cpu"),
        (dict(top=top.to("meta")), "top_experts is on meta"),
        (dict(probs=probs.to("meta")), "probs is on meta"),
        (dict(x=x[:0], top=top[:0], probs=probs[:0]), "x has no tokens (T=0"),
    ]
    for changes, needle in cases:
        args = {**dict(x=x, top=top, probs=probs, fc1=fc1, fc2=fc2), **changes}
        with pytest.raises(MoKInputError) as info:
            mok.mok_moe(args["x"], args["top"], args["probs"], args["fc1"], args["fc2"], cfg=CFG)
        assert needle in str(info.value), (needle, str(info.value))
        assert "fc1 must have shape" not in str(info.value)


def test_schedule_identity_single_rank():
    x, top, probs, fc1, fc2 = _inputs(0, nle=E)
    ws = mok.get_workspace(None, "cpu", T, H, K, E, CFG, torch.float32)
    s1 = functional.build_schedule(CFG, ws, top)
    s2 = functional.build_schedule(CFG, ws, top.flip(1))
    assert (s1.workspace_uid, s1.step + 1) == (s2.workspace_uid, s2.step) == (ws.uid, ws.schedule_step)
    assert s2.top_experts_all.shape == (1, T, K)
    with pytest.raises(MoKInputError, match="stale"):
        functional.forward(CFG, ws, s1, x, probs, fc1, fc2)
    out, ctx = functional.forward(CFG, ws, s2, x, probs, fc1, fc2)
    assert ctx.schedule_id == s2.identity
    with pytest.raises(MoKInputError, match="do not belong together"):
        functional.backward(CFG, ws, s1, ctx, torch.ones_like(out), x, probs, fc1, fc2)
    functional.backward(CFG, ws, s2, ctx, torch.ones_like(out), x, probs, fc1, fc2)
    functional.backward(CFG, ws, s1, None, torch.ones_like(out), x, probs, fc1, fc2)  # recompute: an older one is fine
    other = mok.create_workspace(None, "cpu", T, H, K, E, CFG, torch.float32)
    with pytest.raises(MoKInputError, match="foreign"):
        functional.forward(CFG, other, s2, x, probs, fc1, fc2)
    with pytest.raises(MoKInputError, match="foreign"):
        functional.recompute_forward_context(CFG, other, s2, x, fc1, fc2)
    with pytest.raises(MoKInputError, match="MoKSchedule"):
        functional.forward(CFG, ws, "not a schedule", x, probs, fc1, fc2)


def test_slow_path_warns_once_and_strict_raises():
    functional._SLOW_WARNED.clear()
    reason = "x is float32; the kernels take bf16 activations and weights"
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        functional.report_slow_path(CFG, reason, "forward")
        functional.report_slow_path(CFG, reason, "backward")
        functional.report_slow_path(CFG, None, "forward")
    assert len(caught) == 1, [str(w.message) for w in caught]
    text = str(caught[0].message)
    assert reason in text and "pure-PyTorch reference" in text and "--mok-strict" in text
    with pytest.raises(MoKInputError, match="bf16 activations"):
        functional.report_slow_path(CFG.replace(strict=True), reason, "forward")
    functional.report_slow_path(CFG.replace(strict=True), None, "forward")  # no reason: nothing to say


def test_slow_path_reason_at_layer_build(monkeypatch):
    """What the Megatron layer reports when it is built on a GPU machine (the CUDA path's own
    ``unsupported_reason`` on meta stand-ins; the CPU here pretends to be a GPU machine)."""
    from megatron_mok import ops

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(ops, "is_available", lambda: True)
    monkeypatch.delenv("MOK_FORCE_REFERENCE", raising=False)
    reason = functional.layer_slow_path_reason(torch.float32, 64, 32, 32, 8, 2, 2)
    assert reason is not None and "float32" in reason and "bf16" in reason, reason
    reason = functional.layer_slow_path_reason(torch.bfloat16, 60, 32, None, 8, 2, 2)
    assert reason is not None and "multiple" in reason, reason
    assert functional.layer_slow_path_reason(torch.bfloat16, 64, 32, 32, 8, 2, 2) is None
    monkeypatch.setattr(ops, "is_available", lambda: False)
    assert "extension" in functional.layer_slow_path_reason(torch.bfloat16, 64, 32, 32, 8, 2, 2)
    monkeypatch.setenv("MOK_FORCE_REFERENCE", "1")  # asked for: not a silent slow path
    assert functional.layer_slow_path_reason(torch.float32, 64, 32, 32, 8, 2, 2) is None
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.delenv("MOK_FORCE_REFERENCE")
    assert functional.layer_slow_path_reason(torch.float32, 64, 32, 32, 8, 2, 2) is None  # CPU: the CPU path


def test_cpu_inputs_are_not_a_slow_path():
    x, top, probs, fc1, fc2 = _inputs(0, nle=E)
    ws = mok.get_workspace(None, "cpu", T, H, K, E, CFG, torch.float32)
    assert functional.slow_path_reason(ws, x, fc1) is None
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no warning on the CPU path, strict or not
        mok.mok_moe(x, top, probs, fc1, fc2, cfg=CFG.replace(strict=True))


def test_megatron_layer_reports_slow_path_at_build(monkeypatch):
    """MoKMoELayer's build-time check (on a GPU machine): fp32 params warn once, naming the reason
    and --bf16; --mok-strict raises; bf16 with kernel-friendly sizes says nothing."""
    from types import SimpleNamespace

    from megatron_mok import ops
    from megatron_mok.adapter import layer

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(ops, "is_available", lambda: True)
    monkeypatch.delenv("MOK_FORCE_REFERENCE", raising=False)
    monkeypatch.setattr(functional, "_SLOW_WARNED", set())
    config = SimpleNamespace(params_dtype=torch.float32, hidden_size=64, moe_ffn_hidden_size=32,
                             moe_shared_expert_intermediate_size=32, num_moe_experts=8, moe_router_topk=2)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        layer._report_slow_path(config, 2, True)
        layer._report_slow_path(config, 2, True)  # a second layer: no second warning
    texts = [str(w.message) for w in caught if "megatron_mok" in str(w.message)]
    assert len(texts) == 1 and "--moe-backend mok" in texts[0] and "float32" in texts[0] and "--bf16" in texts[0], texts
    monkeypatch.setattr(layer, "_MOK_CONFIG", MoKConfig(strict=True))
    with pytest.raises(MoKInputError, match="--mok-strict"):
        layer._report_slow_path(config, 2, True)
    config.params_dtype = torch.bfloat16
    layer._report_slow_path(config, 2, True)  # supported: silent, even strict
