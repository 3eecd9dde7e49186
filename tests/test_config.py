"""MoKConfig validation and routed-row capacity sizing (host only, no process group)."""

from __future__ import annotations

import dataclasses
import math
import random

import pytest

from megatron_mok import ROW_ALIGN, MoKConfig, MoKConfigError
from megatron_mok.config import PRECISIONS, TILE_ROWS, routed_capacity

INT_FIELDS = ("fwd_comm_sms", "bwd_comm_sms", "minibatch_rows")

# (field, bad value, why): every entry must raise MoKConfigError naming the field.
BAD_VALUES = [
    # int knobs: wrong type (float, str, None), bool (an int subclass), zero, negative
    *[(f, v, why) for f in INT_FIELDS for v, why in (
        (24.0, "float"), ("24", "str"), (None, "None"), (True, "bool True"), (False, "bool False"),
        (0, "zero"), (-1, "negative"), (-TILE_ROWS, "negative multiple of TILE_ROWS"),
    )],
    # comm SMs: out of [1, 64] (forward), [1, 132] (backward)
    ("fwd_comm_sms", 65, "above 64"), ("fwd_comm_sms", 10**9, "huge"),
    ("bwd_comm_sms", 133, "above 132"), ("bwd_comm_sms", 1000, "huge"),
    # row counts: not a multiple of TILE_ROWS (ROW_ALIGN, a segment's alignment, is not enough)
    ("minibatch_rows", TILE_ROWS - 1, "below TILE_ROWS"), ("minibatch_rows", TILE_ROWS + 1, "not aligned"),
    ("minibatch_rows", ROW_ALIGN, "a segment alignment only"),
    ("minibatch_rows", 1000, "not aligned"), ("minibatch_rows", 1, "one row"),
    # capacity_factor: non-finite, zero, negative, above 1, non-numbers
    ("capacity_factor", float("nan"), "NaN"), ("capacity_factor", float("inf"), "inf"),
    ("capacity_factor", float("-inf"), "-inf"), ("capacity_factor", 0.0, "zero"), ("capacity_factor", 0, "int zero"),
    ("capacity_factor", -0.5, "negative"), ("capacity_factor", 1.0000001, "just above 1"),
    ("capacity_factor", 2, "int above 1"), ("capacity_factor", 1.5, "above 1"),
    ("capacity_factor", "1.0", "str"), ("capacity_factor", None, "None"), ("capacity_factor", True, "bool"),
    # precision: unknown names and non-strings
    ("precision", "fp16", "unknown"), ("precision", "BF16", "wrong case"), ("precision", "fp32", "unknown"),
    ("precision", "", "empty"), ("precision", None, "None"), ("precision", 16, "int"),
    # peer_timeout_s: zero, negative, non-finite, non-numbers
    ("peer_timeout_s", 0, "zero"), ("peer_timeout_s", 0.0, "zero float"), ("peer_timeout_s", -1.0, "negative"),
    ("peer_timeout_s", float("inf"), "inf"), ("peer_timeout_s", float("nan"), "NaN"),
    ("peer_timeout_s", "30", "str"), ("peer_timeout_s", None, "None"), ("peer_timeout_s", True, "bool"),
    # save_gate_up: only a bool
    ("save_gate_up", 0, "int"), ("save_gate_up", "False", "str"), ("save_gate_up", None, "None"),
]


@pytest.mark.parametrize(("field", "value", "why"), BAD_VALUES,
                         ids=[f"{f}-{why.replace(' ', '_')}" for f, _, why in BAD_VALUES])
def test_invalid_field_raises_naming_it(field, value, why):
    with pytest.raises(MoKConfigError) as info:
        MoKConfig(**{field: value})
    assert field in str(info.value), f"{why}: message does not name {field}: {info.value}"
    assert isinstance(info.value, ValueError)  # MoKConfigError is a ValueError
    # replace() validates the same way
    with pytest.raises(MoKConfigError, match=field):
        MoKConfig().replace(**{field: value})


def test_defaults_are_valid():
    cfg = MoKConfig()
    assert cfg.fwd_comm_sms == 24 and cfg.bwd_comm_sms == 28
    assert cfg.minibatch_rows == 4096
    assert cfg.capacity_factor == 1.0 and cfg.precision == "bf16" and cfg.peer_timeout_s == 30.0
    assert cfg.save_gate_up is True
    assert cfg.minibatch_rows % TILE_ROWS == 0
    assert cfg.precision in PRECISIONS
    assert ROW_ALIGN == 32 and TILE_ROWS % ROW_ALIGN == 0


@pytest.mark.parametrize("changes", [
    dict(fwd_comm_sms=1, bwd_comm_sms=132),
    dict(fwd_comm_sms=64, bwd_comm_sms=1),
    dict(minibatch_rows=TILE_ROWS),
    dict(minibatch_rows=3 * TILE_ROWS),
    dict(capacity_factor=1), dict(capacity_factor=1e-6), dict(capacity_factor=0.5),
    dict(peer_timeout_s=1), dict(peer_timeout_s=1e-3), dict(peer_timeout_s=1e9),
    dict(save_gate_up=False), dict(precision="fp8"),
], ids=lambda c: ",".join(f"{k}={v}" for k, v in c.items()))
def test_valid_values_accepted(changes):
    cfg = MoKConfig(**changes)
    for k, v in changes.items():
        assert getattr(cfg, k) == v
    assert MoKConfig().replace(**changes) == cfg


def test_config_is_frozen():
    cfg = MoKConfig()
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.capacity_factor = 0.5  # type: ignore[misc]


def _max_padded_rows(ep: int, tokens: int, topk: int, nle: int) -> int:
    """Exact maximum, over every routing, of the padded rows one rank can receive.

    Each local expert receives c_e <= ep*tokens rows (a token holds an expert at most once) and the
    rank receives sum_e c_e <= ep*tokens*min(topk, nle) rows. Its padded size is
    ROW_ALIGN * sum_e ceil(c_e / ROW_ALIGN). The first block of an expert costs one row, each
    further block ROW_ALIGN rows, so a greedy fill gives the maximum of this relaxation (which is
    >= the maximum over real routings).
    """
    total = ep * tokens * min(topk, nle)
    per_expert = ep * tokens
    first_blocks = min(nle, total)
    extra_per_expert = -(-per_expert // ROW_ALIGN) - 1
    extra = min((total - first_blocks) // ROW_ALIGN, nle * extra_per_expert)
    return ROW_ALIGN * (first_blocks + extra)


def _brute_force_max_padded_rows(ep, tokens, topk, nle):
    """Enumerate count vectors to validate ``_max_padded_rows`` itself.

    Only the smallest count of each padded size is enumerated (0, 1, ROW_ALIGN + 1, ...): lowering a
    count to the smallest one with the same ceil(c / ROW_ALIGN) keeps the padded rows and only
    loosens the row budget, so the maximum is the same as over every count vector.
    """
    import itertools

    total, per_expert = ep * tokens * min(topk, nle), ep * tokens
    candidates = sorted({0} | {min(per_expert, ROW_ALIGN * j + 1) for j in range(-(-per_expert // ROW_ALIGN))})
    best = 0
    for counts in itertools.product(candidates, repeat=nle):
        if sum(counts) <= total:
            best = max(best, sum(-(-c // ROW_ALIGN) * ROW_ALIGN for c in counts))
    return best


@pytest.mark.parametrize(("ep", "tokens", "topk", "nle"), [
    (1, 130, 1, 2), (1, 300, 2, 2), (2, 129, 1, 3), (1, 257, 3, 3), (3, 50, 2, 2), (1, 5, 2, 3),
    (4, 333, 2, 4), (2, 600, 3, 4), (1, 700, 4, 5), (1, 1, 1, 4), (8, 17, 4, 3), (1, 128, 2, 2), (1, 129, 2, 2),
])
def test_max_padded_rows_helper_is_exact(ep, tokens, topk, nle):
    assert _max_padded_rows(ep, tokens, topk, nle) == _brute_force_max_padded_rows(ep, tokens, topk, nle)


def test_routed_capacity_covers_worst_case_at_capacity_factor_one():
    rng = random.Random(20240611)
    cfg = MoKConfig(capacity_factor=1.0)
    cases = [(1, 1, 1, 1), (1, 1, 8, 8), (72, 1, 8, 1), (8, 4096, 8, 32), (64, 1, 1, 256)]
    cases += [(rng.choice([1, 2, 3, 4, 8, 16, 64]), rng.randint(1, 5000), rng.randint(1, 16), rng.randint(1, 64))
              for _ in range(3000)]
    for ep, tokens, topk, nle in cases:
        cap = routed_capacity(cfg, ep, tokens, topk, nle)
        worst = _max_padded_rows(ep, tokens, topk, nle)
        assert cap >= worst, (ep, tokens, topk, nle, cap, worst)
        assert cap % TILE_ROWS == 0
        # ... and not absurdly larger than needed (at most one extra block per local expert, then
        # the rounding to whole tiles)
        assert cap < ep * tokens * min(topk, nle) + nle * ROW_ALIGN + TILE_ROWS


def test_routed_capacity_is_monotone_in_capacity_factor():
    rng = random.Random(7)
    for _ in range(500):
        ep, tokens, topk, nle = rng.randint(1, 16), rng.randint(1, 3000), rng.randint(1, 8), rng.randint(1, 16)
        caps = [routed_capacity(MoKConfig(capacity_factor=cf), ep, tokens, topk, nle)
                for cf in (1e-3, 0.1, 0.25, 0.5, 0.9, 1.0)]
        assert caps == sorted(caps)
        assert all(c % TILE_ROWS == 0 and c >= nle * (ROW_ALIGN - 1) for c in caps)
        # a fraction f of the worst-case rows always fits, plus the padding of every segment
        assert caps[3] >= math.ceil(0.5 * ep * tokens * min(topk, nle))


# ---- the Megatron flags (--mok-*), parsed without Megatron ---------------------------------------------


def _parse(*argv):
    import argparse

    from megatron_mok.adapter.backends import add_mok_args

    args = add_mok_args(argparse.ArgumentParser()).parse_args(list(argv))
    args.num_experts = 8
    return args


def _apply(*argv):
    from megatron_mok.adapter import backends

    args = _parse(*argv)
    try:
        backends.apply_backend(args)
    finally:
        backends.set_backend(None)
    return args


@pytest.fixture
def fresh_warning(monkeypatch):
    from megatron_mok.adapter import backends

    monkeypatch.setattr(backends, "_WARNED_UNUSED", False)


def test_flags_map_onto_the_config():
    from megatron_mok.adapter.backends import mok_config_from_args

    assert mok_config_from_args(_parse()) == MoKConfig()
    cfg = mok_config_from_args(_parse("--mok-forward-kernel", "staged", "--mok-strict", "--mok-capacity-factor", "0.5",
                                      "--mok-precision", "fp8", "--mok-bf16-wgrad", "--mok-recompute-gate-up",
                                      "--mok-wgrad-accumulation", "fused", "--mok-wgrad-microbatches", "4"))
    assert cfg == MoKConfig(forward_kernel="staged", strict=True, capacity_factor=0.5, precision="fp8",
                            fp8_wgrad=False, save_gate_up=False, wgrad_accumulation="fused", wgrad_microbatches=4)
    assert _parse().mok_param_digest_every == 0 and _parse("--mok-param-digest-every", "50").mok_param_digest_every == 50


@pytest.mark.parametrize("backend", [None, "mok", "alltoall", "allgather"])
@pytest.mark.parametrize(("argv", "flag"), [
    (("--mok-fwd-comm-sms", "0"), "--mok-fwd-comm-sms"),
    (("--mok-minibatch-rows", "100"), "--mok-minibatch-rows"),
    (("--mok-capacity-factor", "1.5"), "--mok-capacity-factor"),
    (("--mok-peer-timeout-s", "0"), "--mok-peer-timeout-s"),
    (("--mok-forward-kernel", "persistent", "--mok-precision", "fp8"), "--mok-forward-kernel"),
    (("--mok-bf16-dgrad",), "--mok-bf16-dgrad"),
    (("--mok-wgrad-microbatches", "0"), "--mok-wgrad-microbatches"),
    (("--mok-param-digest-every", "-1"), "--mok-param-digest-every"),
])
def test_invalid_flags_raise_whatever_the_backend(backend, argv, flag):
    extra = ("--moe-backend", backend) if backend else ()
    with pytest.raises(MoKConfigError, match=flag):
        _apply(*extra, *argv)


@pytest.mark.parametrize("backend", ["alltoall", "allgather"])
def test_full_iteration_graph_with_a_syncing_dispatcher_is_refused_at_start_up(backend):
    from megatron_mok.adapter import backends

    def apply(name, **fields):
        args = _parse("--moe-backend", name)
        vars(args).update(cuda_graph_impl="full_iteration", **fields)
        try:
            backends.apply_backend(args)
        finally:
            backends.set_backend(None)
        return args

    with pytest.raises(ValueError, match=f"full_iteration cannot capture --moe-backend {backend}"):
        apply(backend)
    apply(backend, moe_expert_capacity_factor=1.0, moe_pad_expert_input_to_capacity=True)  # drop-and-pad
    assert apply("mok").moe_token_dispatcher_type == "alltoall"  # mok's layer has no host sync


@pytest.mark.parametrize("argv", [("--mok-forward-kernel", "fast"), ("--mok-wgrad-accumulation", "always")])
def test_invalid_flag_choice_is_rejected_by_the_parser(argv):
    with pytest.raises(SystemExit):
        _parse(*argv)


@pytest.mark.parametrize("backend", [None, "alltoall", "allgather"])
def test_layer_flags_with_another_backend_warn_once(backend, fresh_warning):
    import warnings

    extra = ("--moe-backend", backend) if backend else ()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _apply(*extra, "--mok-capacity-factor", "0.5", "--mok-strict")
        _apply(*extra, "--mok-capacity-factor", "0.5")
    texts = [str(w.message) for w in caught if "megatron_mok" in str(w.message)]
    assert len(texts) == 1, texts
    assert "--mok-capacity-factor, --mok-strict only apply to --moe-backend mok" in texts[0]


@pytest.mark.parametrize("argv", [("--moe-backend", "mok", "--mok-capacity-factor", "0.5"),
                                  ("--moe-backend", "alltoall", "--mok-param-digest-every", "10"),
                                  ("--moe-backend", "alltoall")])
def test_no_warning_when_the_flags_apply(argv, fresh_warning):
    import warnings

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        args = _apply(*argv)
    assert not [str(w.message) for w in caught if "megatron_mok" in str(w.message)]
    if "mok" in argv:
        from megatron_mok.adapter.layer import get_mok_config, set_mok_config

        assert get_mok_config().capacity_factor == 0.5
        set_mok_config(MoKConfig())
    assert args.moe_token_dispatcher_type == "alltoall"


def test_new_config_fields_are_validated():
    for field, value in (("forward_kernel", "fast"), ("forward_kernel", None), ("strict", 1), ("strict", "yes"),
                         ("wgrad_accumulation", "always"), ("wgrad_accumulation", True),
                         ("wgrad_microbatches", 0), ("wgrad_microbatches", 9), ("wgrad_microbatches", True),
                         ("wgrad_microbatches", 2.0)):
        with pytest.raises(MoKConfigError, match=field):
            MoKConfig(**{field: value})
    with pytest.raises(MoKConfigError, match="forward_kernel"):
        MoKConfig(forward_kernel="persistent", precision="fp8")
    assert MoKConfig(forward_kernel="persistent").resolved_forward_kernel(1) == "persistent"
    assert MoKConfig().resolved_forward_kernel(2) == "persistent" and MoKConfig().resolved_forward_kernel(1) == "persistent"
    assert MoKConfig(precision="fp8").resolved_forward_kernel(8) == "staged"
