"""A rejected call on a workspace's first call (no GPU): the rank whose host check fails makes the
same symmetric-buffer creations as its peers, in the same order, before it sends its verdict
(functional._reject); the peers' path takes its buffers from the same per-call set
(megatron_mok/cuda/comm.py: CALL_BUFFERS); a rank a peer's verdict stopped raises before it starts a
creation its peer will never join; mok_moe's own argument checks send their verdict the same way.

The workspace claims a GPU, its ``symmetric()`` (the creation collective) records each buffer's name,
shape and dtype, the verdict launch is recorded instead of run, and the kernels are stubs. The
device side: tests/gpu/test_header_check_2gpu.py."""

from __future__ import annotations

import ast
import re
import types
from pathlib import Path

import pytest
import torch

import megatron_mok as mok
from megatron_mok import MoKConfig, MoKInputError, autograd, functional, ops
from megatron_mok.cuda import comm as comm_module
from megatron_mok.header import barrier_flag_ints, decode_verdict, encode_verdict
from megatron_mok.schedule import MoKSchedule
from megatron_mok.workspace import ErrorCode, MoKWorkspace, clear_workspace_cache, create_workspace, get_workspace

ROOT = Path(__file__).resolve().parents[1]
T, H, K, E, I = 64, 256, 2, 4, 128
CALLS = ("build_schedule", "forward", "recompute_forward_context", "backward")
BF16, F32, I32 = torch.bfloat16, torch.float32, torch.int32
# What the kernels read (csrc/): these names, shapes and dtypes must not change. T=64, H=256, k=2, EP=2.
SCHEDULE = [("barrier_flags", (barrier_flag_ints(2),), I32), ("routing", (2, 2, T, K), I32)]
PUBLISHED = {"bf16": [("x", (T, H), BF16)], "fp8": [("x_e4m3", (T, H // 2), BF16), ("x_scale", (T, 8), BF16)]}
EXPECTED = {  # (call, precision) -> the creations of that call on a new workspace
    **{("build_schedule", p): SCHEDULE for p in PUBLISHED},
    **{("forward", p): SCHEDULE + [("comb", (T * K, H), BF16)] + PUBLISHED[p] for p in PUBLISHED},
    **{("recompute_forward_context", p): SCHEDULE + PUBLISHED[p] for p in PUBLISHED},
    **{("backward", p): SCHEDULE + [("bwd_grad", (T, H), BF16), ("bwd_probs", (T, K), F32),
                                    ("bwd_dx_slots", (T * K, H), BF16), ("bwd_dprobs_slots", (T * K,), F32)]
       + PUBLISHED[p] for p in PUBLISHED},
}


@pytest.fixture
def two_ranks(monkeypatch):
    """``make(cfg)``: a workspace of rank 1 of two that claims a GPU, and the log its buffer creations,
    verdict launches and kernel calls go to, in order."""
    log = []
    monkeypatch.setattr(ops, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    monkeypatch.setattr(ops, "barrier_reject", lambda state, errors, flags, rank, word, bump_gather: log.append(
        ("verdict", decode_verdict(word), bump_gather)))
    real_init = comm_module.Comm.__init__

    def init_on_cpu(self, ws):  # the Comm's own local tensors on the CPU, the symmetric ones recorded
        device, ws.device = ws.device, torch.device("cpu")
        try:
            real_init(self, ws)
        finally:
            ws.device = device

    monkeypatch.setattr(comm_module.Comm, "__init__", init_on_cpu)

    made = []

    def make(cfg: MoKConfig, cached: bool = False, tokens: int = T, hidden: int = H) -> MoKWorkspace:
        ws = (get_workspace(None, "cpu", tokens, hidden, K, E, cfg, BF16) if cached
              else create_workspace(None, "cpu", tokens, hidden, K, E, cfg, BF16))
        made.append(ws)
        ws.device, ws.ep_size, ws.rank = torch.device("cuda", 0), 2, 1

        def symmetric(name, shape, dtype):
            log.append(("create", name.removeprefix("mok."), tuple(shape), dtype))
            return torch.empty(shape, dtype=dtype), types.SimpleNamespace(buffer_ptrs=[0, 0])

        ws.symmetric = symmetric
        # the sync-free check copies into pinned memory (a GPU); the blocking one reads the flags
        ws.check_errors = lambda blocking=False: MoKWorkspace.check_errors(ws, True) if blocking else None
        return ws

    yield make, log
    clear_workspace_cache()
    for ws in made:  # no flag left for another test's stop check (functional._raise_if_stopped)
        comm_module._COMMS.pop(ws, None)


def _inputs(ws):
    gen = torch.Generator().manual_seed(0)
    nle = ws.num_local_experts
    return (torch.randn(T, H, generator=gen).bfloat16(), torch.rand(T, K, generator=gen),
            torch.randn(nle, 2 * I, H, generator=gen).bfloat16(), torch.randn(nle, H, I, generator=gen).bfloat16())


def _sched(ws) -> MoKSchedule:
    return MoKSchedule(*(torch.zeros(1),) * 5, workspace_uid=ws.uid, step=ws.schedule_step)


def _run(call: str, cfg, ws, bad: bool) -> None:
    """One call of kind ``call`` through the functional API; bad: with T = 0 tokens (top_experts:
    float) on this rank, so its host check fails."""
    x, probs, fc1, fc2 = _inputs(ws)
    if bad:
        x = x[:0]
    if call == "build_schedule":
        top = torch.zeros(T, K, dtype=torch.float32 if bad else torch.int32)
        functional.build_schedule(cfg, ws, top)
    elif call == "forward":
        functional.forward(cfg, ws, _sched(ws), x, probs, fc1, fc2)
    elif call == "recompute_forward_context":
        functional.recompute_forward_context(cfg, ws, _sched(ws), x, fc1, fc2)
    else:
        functional.backward(cfg, ws, _sched(ws), None, x, x, probs, fc1, fc2)


@pytest.fixture
def checks_pass(monkeypatch, two_ranks):
    """The peers' side: every host check passes (the CPU tensors stand in for the GPU's) and the
    kernels are stubs that log their call."""
    _, log = two_ranks
    monkeypatch.setattr(functional, "_verdict", lambda x, ws, call, checks, cfg=None: (None, True))
    monkeypatch.setattr(functional, "validate_top_experts", lambda ws, top: None)

    def kernel(call):
        def run(cfg, ws, *args, **kwargs):
            log.append(("kernels", call))
            if call == "build_schedule":
                return MoKSchedule(*(torch.zeros(1),) * 5)
            return (torch.zeros(1), None) if call == "forward" else None
        return run

    monkeypatch.setattr(functional, "_cuda", lambda: types.SimpleNamespace(**{c: kernel(c) for c in CALLS}))
    return two_ranks


def _creations(log):
    return [entry[1:] for entry in log if entry[0] == "create"]


@pytest.mark.parametrize("precision", ["bf16", "fp8"])
@pytest.mark.parametrize("call", CALLS)
def test_rejecting_rank_makes_the_peers_buffers_before_its_verdict(checks_pass, call, precision):
    make, log = checks_pass
    cfg = MoKConfig(precision=precision)
    _run(call, cfg, make(cfg), bad=False)  # a peer: checks pass, buffers, then the kernels
    peer = list(log)
    assert peer[-1] == ("kernels", call) and all(e[0] == "create" for e in peer[:-1])
    assert _creations(peer) == EXPECTED[call, precision]

    log.clear()
    functional._reject(make(cfg), call, MoKInputError("x must have shape [64, 256], got [0, 256]"), cfg)
    assert _creations(log) == EXPECTED[call, precision]  # the same collectives, in the same order
    assert log[-1][0] == "verdict" and log[-1][1][0] == call and log[-1][2] == (call == "build_schedule")


@pytest.mark.parametrize("precision", ["bf16", "fp8"])
@pytest.mark.parametrize("call", CALLS)
def test_failing_check_on_a_first_call_sends_its_verdict_after_the_buffers(two_ranks, call, precision):
    """Through the public call: the real host checks fail on this rank (T = 0), and what it does is
    what a peer's normal call makes (EXPECTED, checked against the peers' path above)."""
    make, log = two_ranks
    cfg = MoKConfig(precision=precision)
    with pytest.raises(MoKInputError):
        _run(call, cfg, make(cfg), bad=True)
    assert _creations(log) == EXPECTED[call, precision]
    assert [e[0] for e in log][-1:] == ["verdict"] and log[-1][1][0] == call


def test_an_invalid_cfg_rejects_with_the_workspace_config(two_ranks):
    """cfg is what failed: the buffers follow the config the ranks agreed on at creation."""
    make, log = two_ranks
    ws = make(MoKConfig(precision="fp8"))
    x, probs, fc1, fc2 = _inputs(ws)
    with pytest.raises(MoKInputError, match="cfg must be a MoKConfig"):
        functional.forward(None, ws, _sched(ws), x, probs, fc1, fc2)
    assert _creations(log) == EXPECTED["forward", "fp8"]
    assert log[-1][1][:3] == ("forward", "cfg", "type")


def test_second_call_makes_nothing_and_reads_no_flag(checks_pass):
    """Buffers exist: neither path creates anything, and the peers' path does not look at the error
    flags (no host sync per call), even with a verdict pending."""
    make, log = checks_pass
    cfg = MoKConfig()
    ws = make(cfg)
    for call in CALLS:
        _run(call, cfg, ws, bad=False)
    log.clear()
    ws.errors[ErrorCode.HEADER_MISMATCH] = -1  # raised by a later check_errors, not here
    for call in CALLS:
        _run(call, cfg, ws, bad=False)
        functional._reject(ws, call, MoKInputError("x"), cfg)
    assert _creations(log) == [] and [e[0] for e in log] == ["kernels", "verdict"] * len(CALLS)


@pytest.mark.parametrize("other_workspace", [False, True])
def test_a_stopped_rank_raises_before_it_starts_a_creation(checks_pass, other_workspace):
    """A peer rejected an earlier call (its verdict stopped this rank, on this workspace or another
    of the group): that peer has raised and will not join the next creation, so this rank raises
    the verdict instead of starting it."""
    make, log = checks_pass
    cfg = MoKConfig()
    ws = make(cfg)
    _run("build_schedule", cfg, ws, bad=False)
    flagged = ws
    if other_workspace:
        flagged = make(cfg)
        comm_module.comm(flagged)
    flagged.errors[ErrorCode.HEADER_MISMATCH] = -1  # rank 0's verdict
    flagged.errors[ErrorCode.HEADER_VALUE] = encode_verdict("build_schedule", "top_experts", "dtype", 0, 3)
    log.clear()
    with pytest.raises(MoKInputError, match=re.escape("mok build_schedule: rank 0 rejected its input: top_experts "
                                                      "has dtype float32")):
        _run("forward", cfg, ws, bad=False)
    assert log == []
    assert int(flagged.errors[ErrorCode.HEADER_MISMATCH]) == 0  # raised once
    _run("forward", cfg, ws, bad=False)  # then the call goes on
    assert _creations(log) == EXPECTED["forward", "bf16"][2:]


def test_buffers_come_only_from_the_call_sets(two_ranks):
    """A lookup of a buffer that no call set made raises (a buffer made elsewhere would be missing
    from what a rejecting rank makes); the sets' lookups create nothing."""
    make, log = two_ranks
    c = comm_module.comm(make(MoKConfig()))
    with pytest.raises(RuntimeError, match="'comb' was not created by the buffer set"):
        c.buffer("comb")
    made = c.call_buffers("forward", MoKConfig())
    log.clear()
    assert c.buffer("comb") is made["comb"] and c.buffer("x") is made["x"] and log == []


def test_kernel_code_takes_buffers_from_the_call_sets():
    """Under megatron_mok/cuda/, buffers are created only in comm.py (Comm.call_buffers) and every
    lookup names a buffer of some call kind's set."""
    declared = {name for make in comm_module.CALL_BUFFERS.values() for p in ("bf16", "fp8")
                for name in make(MoKConfig(precision=p))}
    for path in sorted((ROOT / "megatron_mok" / "cuda").glob("*.py")):
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)):
                continue
            where = f"{path.name}:{node.lineno}"
            if node.func.attr in ("symmetric", "_create", "rendezvous"):
                assert path.name == "comm.py", f"{where}: a symmetric buffer made outside comm.Comm.call_buffers"
            if node.func.attr == "buffer" and path.name != "comm.py":
                args = node.args
                assert len(args) == 1 and not node.keywords and isinstance(args[0], ast.Constant), \
                    f"{where}: look buffers up by name (comm.Comm.buffer), their shapes live in comm.buffer_spec"
                assert args[0].value in declared, f"{where}: {args[0].value!r} is in no call's set (CALL_BUFFERS)"


# ---- mok_moe's own argument checks ---------------------------------------------------------------


def _moe_args():
    gen = torch.Generator().manual_seed(1)
    nle = E // 2
    x = torch.randn(T, H, generator=gen).bfloat16()
    top = torch.stack([torch.randperm(E, generator=gen)[:K] for _ in range(T)]).to(torch.int32)
    return x, top, torch.rand(T, K, generator=gen), torch.randn(nle, 2 * I, H).bfloat16(), \
        torch.randn(nle, H, I).bfloat16()


@pytest.fixture
def spied_reject(monkeypatch):
    calls = []
    real = functional._reject

    def spy(ws, call, err, cfg=None):
        calls.append((ws, call))
        return real(ws, call, err, cfg)

    monkeypatch.setattr(functional, "_reject", spy)
    return calls


@pytest.mark.parametrize("case, verdict", [
    ("x 3-D", ("x", "shape", 3, 3)),
    ("T=0", ("x", "shape", 0, 0)),
    ("x hidden size", ("x", "shape", 1, H + 8)),
    ("top_experts rows", ("top_experts", "shape", 0, T - 1)),
    ("fc1 2-D", ("fc1", "type", 0, 0)),
])
def test_mok_moe_check_failure_sends_the_verdict_into_the_schedule_barrier(two_ranks, spied_reject, case, verdict):
    """The workspace the peers use exists (a later step): they wait in the schedule's routing
    all-gather barrier, so this rank's ``_check_call`` failure goes out through ``functional._reject``
    as a rejected build_schedule, found from what its other arguments still tell."""
    make, log = two_ranks
    cfg = MoKConfig()
    ws = make(cfg, cached=True)
    make(cfg, cached=True, hidden=2 * H)  # another shape's workspace: not the one
    x, top, probs, fc1, fc2 = _moe_args()
    bad = {"x 3-D": dict(x=x.view(T, 2, H // 2)), "T=0": dict(x=x[:0], top=top[:0], probs=probs[:0]),
           "x hidden size": dict(x=torch.randn(T, H + 8).bfloat16()), "top_experts rows": dict(top=top[1:]),
           "fc1 2-D": dict(fc1=fc1[0])}[case]
    args = dict(x=x, top=top, probs=probs, fc1=fc1, fc2=fc2) | bad
    with pytest.raises(MoKInputError):
        mok.mok_moe(args["x"], args["top"], args["probs"], args["fc1"], args["fc2"], cfg=cfg, num_experts=E)
    assert spied_reject == [(ws, "build_schedule")]
    assert log[-1] == ("verdict", ("build_schedule", *verdict), True)
    assert _creations(log) == EXPECTED["build_schedule", "bf16"]


def test_mok_moe_check_failure_before_the_workspace_exists_joins_its_creation(two_ranks, spied_reject, monkeypatch):
    """No workspace of these shapes yet: the peers are in its creation's host exchange, so the
    verdict goes there (kernel path too), not into a device barrier."""
    make, log = two_ranks
    make(MoKConfig(), cached=True, tokens=2 * T)  # another shape's
    exchanged = []

    def exchange(group, device, phase, values, error=None, **kw):
        exchanged.append(phase)
        raise MoKInputError(f"agreed: {error}")

    monkeypatch.setattr(autograd, "exchange", exchange)
    x, top, probs, fc1, fc2 = _moe_args()
    with pytest.raises(MoKInputError, match="agreed: x must be a"):
        mok.mok_moe(x.view(T, 2, H // 2), top, probs, fc1, fc2, num_experts=E)
    assert exchanged == ["mok_moe"] and spied_reject == [] and log == []


def test_mok_moe_check_failure_with_several_fitting_workspaces_sends_nothing(two_ranks, spied_reject):
    """T = 0 leaves T unknown and two workspaces differ only in T: a verdict sent into the wrong
    one's barrier would put its epochs out of step, so none is sent (the peers time out)."""
    make, log = two_ranks
    cfg = MoKConfig()
    make(cfg, cached=True)
    make(cfg, cached=True, tokens=2 * T)
    x, top, probs, fc1, fc2 = _moe_args()
    with pytest.raises(MoKInputError, match="x has no tokens") as ei:
        mok.mok_moe(x[:0], top[:0], probs[:0], fc1, fc2, cfg=cfg, num_experts=E)
    assert spied_reject == [] and log == []
    assert any("2 workspaces fit" in n for n in ei.value.__notes__)


def test_mok_moe_check_failure_on_the_reference_path_uses_the_exchange(two_ranks, spied_reject, monkeypatch):
    make, log = two_ranks
    make(MoKConfig(), cached=True)
    monkeypatch.setattr(ops, "is_available", lambda: False)
    exchanged = []
    monkeypatch.setattr(autograd, "exchange", lambda group, device, phase, values, error=None, **kw:
                        exchanged.append(phase))
    x, top, probs, fc1, fc2 = _moe_args()
    with pytest.raises(MoKInputError, match="x must be a"):
        mok.mok_moe(x.view(T, 2, H // 2), top, probs, fc1, fc2, num_experts=E)
    assert exchanged == ["mok_moe"] and spied_reject == []
