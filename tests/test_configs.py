"""The shipped recipes: every args file parses with Megatron's parser, full and 2xH200 proxy recipes
have the MoE layer shape of their model, and every CPU-tiny recipe trains with --moe-backend mok."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from megatron_mok.shapes import MOE_SHAPES

CONFIGS = Path(__file__).resolve().parents[1] / "configs"
VARIANTS = ("", "-proxy", "-tiny")


def _parse(path: Path, monkeypatch):
    from megatron.training.arguments import parse_args

    from megatron_mok.adapter.backends import add_mok_args

    monkeypatch.setattr(sys, "argv", ["pretrain", *path.read_text().split(), "--moe-backend", "mok"])
    return parse_args(add_mok_args)


def test_every_model_has_three_variants():
    for name in MOE_SHAPES:
        for variant in VARIANTS:
            assert (CONFIGS / f"{name}{variant}.args").is_file(), f"{name}{variant}.args missing"


@pytest.mark.parametrize("name", sorted(MOE_SHAPES))
@pytest.mark.parametrize("variant", VARIANTS)
def test_recipe_parses_with_the_model_moe_shape(name, variant, monkeypatch):
    args = _parse(CONFIGS / f"{name}{variant}.args", monkeypatch)
    shape = MOE_SHAPES[name]
    assert args.moe_backend == "mok"
    assert args.swiglu and not args.add_bias_linear
    assert args.moe_shared_expert_intermediate_size == args.moe_ffn_hidden_size  # one shared expert
    if variant == "-tiny":
        assert args.expert_model_parallel_size == 2 and args.mock_data
        return
    got = (args.num_experts, args.hidden_size, args.moe_ffn_hidden_size, args.moe_router_topk)
    assert got == (shape.num_experts, shape.hidden, shape.ffn, shape.topk)
    if variant == "-proxy":
        assert args.expert_model_parallel_size == 2 and args.num_layers == 2


@pytest.mark.timeout(300)
@pytest.mark.parametrize("name", sorted(set(MOE_SHAPES) - {"deepseek-v3"}))
def test_tiny_recipe_trains_with_mok(name, tmp_path):
    from test_training import train

    iters, log = train("mok", "--train-iters", "3", cwd=tmp_path,
                       args_file=CONFIGS / f"{name}-tiny.args")
    assert sorted(iters) == [1, 2, 3], log[-3000:]


def test_recompute_gate_up_flag_sets_the_knob(monkeypatch):
    from megatron.training.arguments import parse_args

    from megatron_mok.adapter.backends import add_mok_args, mok_config_from_args

    base = (CONFIGS / "deepseek-v3-tiny.args").read_text().split()
    monkeypatch.setattr(sys, "argv", ["pretrain", *base, "--moe-backend", "mok"])
    assert mok_config_from_args(parse_args(add_mok_args)).save_gate_up is True
    monkeypatch.setattr(sys, "argv", ["pretrain", *base, "--moe-backend", "mok", "--mok-recompute-gate-up"])
    assert mok_config_from_args(parse_args(add_mok_args)).save_gate_up is False


def test_fp8_flags_stop_mok_with_a_message(monkeypatch):
    from megatron.training.arguments import parse_args

    from megatron_mok import MoKConfigError
    from megatron_mok.adapter.backends import add_mok_args, mok_config_from_args

    base = (CONFIGS / "deepseek-v3-tiny.args").read_text().split()
    monkeypatch.setattr(sys, "argv", ["pretrain", *base, "--moe-backend", "mok", "--fp8-format", "e4m3"])
    with pytest.raises(MoKConfigError, match=r"--fp8-format e4m3: .* use --mok-precision fp8"):
        mok_config_from_args(parse_args(add_mok_args))


def test_mok_precision_flag_selects_fp8(monkeypatch):
    from megatron.training.arguments import parse_args

    from megatron_mok import MoKConfigError
    from megatron_mok.adapter.backends import add_mok_args, mok_config_from_args

    base = (CONFIGS / "deepseek-v3-tiny.args").read_text().split()
    monkeypatch.setattr(sys, "argv", ["pretrain", *base, "--moe-backend", "mok", "--mok-precision", "fp8"])
    cfg = mok_config_from_args(parse_args(add_mok_args))
    assert cfg.precision == "fp8" and cfg.dgrad_precision == "fp8"
    monkeypatch.setattr(sys, "argv", ["pretrain", *base, "--moe-backend", "mok", "--mok-precision", "fp8",
                                      "--mok-bf16-dgrad"])
    cfg = mok_config_from_args(parse_args(add_mok_args))
    assert cfg.precision == "fp8" and cfg.dgrad_precision == "bf16" and cfg.shared_precision == "fp8"
    monkeypatch.setattr(sys, "argv", ["pretrain", *base, "--moe-backend", "mok", "--mok-precision", "fp8",
                                      "--mok-bf16-shared"])
    cfg = mok_config_from_args(parse_args(add_mok_args))
    assert cfg.dgrad_precision == "fp8" and cfg.shared_precision == "bf16"
    assert cfg.wgrad_precision == "fp8"
    monkeypatch.setattr(sys, "argv", ["pretrain", *base, "--moe-backend", "mok", "--mok-precision", "fp8",
                                      "--mok-bf16-wgrad"])
    cfg = mok_config_from_args(parse_args(add_mok_args))
    assert cfg.wgrad_precision == "bf16" and cfg.dgrad_precision == "fp8" and cfg.shared_precision == "fp8"
    monkeypatch.setattr(sys, "argv", ["pretrain", *base, "--moe-backend", "mok"])
    cfg = mok_config_from_args(parse_args(add_mok_args))
    assert cfg.precision == "bf16" and cfg.dgrad_precision == "bf16" and cfg.wgrad_precision == "bf16"
    monkeypatch.setattr(sys, "argv", ["pretrain", *base, "--moe-backend", "mok", "--mok-bf16-dgrad"])
    with pytest.raises(MoKConfigError, match="--mok-bf16-dgrad: .* only applies with --mok-precision fp8"):
        mok_config_from_args(parse_args(add_mok_args))
    monkeypatch.setattr(sys, "argv", ["pretrain", *base, "--moe-backend", "mok", "--mok-bf16-shared"])
    with pytest.raises(MoKConfigError, match="--mok-bf16-shared: .* only applies with --mok-precision fp8"):
        mok_config_from_args(parse_args(add_mok_args))
    monkeypatch.setattr(sys, "argv", ["pretrain", *base, "--moe-backend", "mok", "--mok-bf16-wgrad"])
    with pytest.raises(MoKConfigError, match="--mok-bf16-wgrad: the weight gradients are bf16 already"):
        mok_config_from_args(parse_args(add_mok_args))
