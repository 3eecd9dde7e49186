"""The shipped recipes: every args file parses with Megatron's parser, full and 2xH200 proxy recipes
have the MoE layer shape of their model, and every CPU-tiny recipe trains with --moe-backend mok.

The one-GPU proxy (configs/deepseek-v3-1gpu.args) keeps DeepSeek-V3's expert regime, its comments'
arithmetic follows from its flags, its CPU-tiny variant differs only in size flags and trains on one
rank (EP=1) and, with the recipe's EP=2 changes, on two."""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest

from megatron_mok.tools.shapes import MOE_SHAPES, PROXY_SHAPES

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
    from megatron_mok.adapter.backends import add_mok_args, apply_backend, get_backend, set_backend

    base = (CONFIGS / "deepseek-v3-tiny.args").read_text().split()
    monkeypatch.setattr(sys, "argv", ["pretrain", *base, "--moe-backend", "mok", "--fp8-format", "e4m3"])
    before = get_backend()
    try:
        with pytest.raises(MoKConfigError, match=r"--fp8-format e4m3: .* use --mok-precision fp8"):
            apply_backend(parse_args(add_mok_args))
    finally:
        set_backend(before)


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


# --- the one-GPU proxy recipe (configs/deepseek-v3-1gpu.args) and its CPU-tiny variant -----------

ONE_GPU = CONFIGS / "deepseek-v3-1gpu.args"
ONE_GPU_TINY = CONFIGS / "deepseek-v3-1gpu-tiny.args"
# The flags the tiny variant may set to other values (sizes, schedule); every other flag is the recipe's.
SIZE_FLAGS = {
    "--num-layers", "--hidden-size", "--ffn-hidden-size", "--num-attention-heads", "--kv-channels", "--seq-length",
    "--max-position-embeddings", "--micro-batch-size", "--global-batch-size", "--num-experts",
    "--moe-ffn-hidden-size", "--moe-shared-expert-intermediate-size", "--moe-router-topk", "--vocab-size",
    "--train-iters", "--lr", "--min-lr", "--lr-warmup-iters", "--init-method-std",
}
# What the recipe's "EP=2" comment says to append.
EP2_FLAGS = ["--expert-model-parallel-size", "2", "--num-experts", "32", "--global-batch-size", "32"]
EP2_TINY_FLAGS = ["--expert-model-parallel-size", "2", "--num-experts", "8", "--global-batch-size", "16"]


def _args_of(path: Path) -> list[str]:
    """Whitespace-separated flags; `#` starts a comment (as compare_backends.py and train.sbatch read them)."""
    return [tok for line in path.read_text().splitlines() for tok in line.split("#", 1)[0].split()]


def _flag_map(tokens: list[str]) -> dict:
    out, key = {}, None
    for tok in tokens:
        if tok.startswith("--"):
            key = tok
            out[key] = []
        else:
            out[key].append(tok)
    return {k: " ".join(v) for k, v in out.items()}


def _parse_tokens(tokens, monkeypatch):
    from megatron.training.arguments import parse_args

    from megatron_mok.adapter.backends import add_mok_args

    monkeypatch.setattr(sys, "argv", ["pretrain", *tokens])
    return parse_args(add_mok_args)


def _param_count(args) -> int:
    """Parameters of the all-MoE, standard-attention model the recipe describes."""
    h, L, e = args.hidden_size, args.num_layers, args.num_experts
    attn_width = args.num_attention_heads * args.kv_channels
    groups = args.num_query_groups if args.group_query_attention else args.num_attention_heads  # set by validation
    kv_width = groups * args.kv_channels
    per_layer = (e * 3 * h * args.moe_ffn_hidden_size + 3 * h * args.moe_shared_expert_intermediate_size
                 + h * (attn_width + 2 * kv_width) + attn_width * h + e * h + 2 * h)
    vocab = -(-args.vocab_size // args.make_vocab_size_divisible_by) * args.make_vocab_size_divisible_by
    return L * per_layer + 2 * vocab * h + h


def test_one_gpu_recipe_keeps_the_deepseek_v3_expert_regime(monkeypatch):
    args = _parse_tokens([*_args_of(ONE_GPU), "--moe-backend", "alltoall"], monkeypatch)
    shape = MOE_SHAPES["deepseek-v3"]
    assert (args.hidden_size, args.moe_ffn_hidden_size, args.moe_router_topk) == (shape.hidden, shape.ffn, shape.topk)
    assert args.moe_shared_expert_intermediate_size == args.moe_ffn_hidden_size
    assert args.num_experts < shape.num_experts and args.num_layers < 61
    assert args.moe_layer_freq == 1 and not args.multi_latent_attention  # every layer MoE, standard attention
    assert args.transformer_impl == "local" and args.bf16 and args.optimizer == "adam"
    assert args.expert_model_parallel_size == 1 and args.tensor_model_parallel_size == 1
    microbatches = args.global_batch_size // args.micro_batch_size
    assert microbatches >= 4  # the optimizer is amortized over several micro-batches
    tokens = args.micro_batch_size * args.seq_length
    rows = tokens * args.moe_router_topk / args.num_experts
    assert 256 <= rows <= 1024, rows
    # bench_layer.py's proxy shape is this recipe's MoE layer
    proxy = PROXY_SHAPES["deepseek-v3-1gpu"]
    assert (proxy.num_experts, proxy.hidden, proxy.ffn, proxy.topk) == (
        args.num_experts, args.hidden_size, args.moe_ffn_hidden_size, args.moe_router_topk)
    # The same per-GPU regime with the EP=2 flags of the recipe's comment.
    ep2 = _parse_tokens([*_args_of(ONE_GPU), "--moe-backend", "alltoall", *EP2_FLAGS], monkeypatch)
    assert ep2.num_experts // ep2.expert_model_parallel_size == args.num_experts
    assert ep2.global_batch_size // (ep2.micro_batch_size * 2) == microbatches
    assert 2 * tokens * ep2.moe_router_topk / ep2.num_experts == rows


def test_one_gpu_recipe_comments_match_its_flags(monkeypatch):
    """The parameter count and the 18 B/param memory in the comments follow from the flags."""
    args = _parse_tokens([*_args_of(ONE_GPU), "--moe-backend", "alltoall"], monkeypatch)
    text = ONE_GPU.read_text()
    n = _param_count(args)
    assert f"= {n:,}" in text, n
    assert f"-> {18 * n / 1e9:.1f} GB" in text
    experts = args.num_layers * args.num_experts * 3 * args.hidden_size * args.moe_ffn_hidden_size
    assert f"= {experts:,}" in text and f"+{4 * experts / 1e9:.1f} GB" in text
    assert 18 * n + 4 * experts < 100e9  # static + optimizer temporaries leave room for activations on 141 GB


def test_one_gpu_tiny_is_the_recipe_at_toy_size():
    full, tiny = _flag_map(_args_of(ONE_GPU)), _flag_map(_args_of(ONE_GPU_TINY))
    assert set(full) - set(tiny) == {"--bf16"}  # CPU: Megatron's mixed-precision optimizer wants CUDA tensors
    assert set(tiny) - set(full) == set()
    changed = {k for k in tiny if tiny[k] != full[k]}
    assert changed <= SIZE_FLAGS, changed - SIZE_FLAGS
    assert tiny["--expert-model-parallel-size"] == "1"


def test_compare_backends_megatron_flags_parse_with_the_recipe(monkeypatch, tmp_path):
    """The flags scripts/compare_backends.py adds (variants, profiler, digests, soak, noise control) exist in the
    parsers."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("compare_backends", CONFIGS.parent / "scripts" / "compare_backends.py")
    cb = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(cb)
    moe_backend, extra = cb.backend_args("mok_fp8", gpu=True)
    args = _parse_tokens([*_args_of(ONE_GPU), "--moe-backend", moe_backend, *extra, "--mok-param-digest-every", "100",
                          "--deterministic-mode", *cb.profile_megatron_args(12, 13, tmp_path / "tb"),
                          *cb.noise_control_args(_args_of(ONE_GPU))], monkeypatch)
    assert args.mok_precision == "fp8" and args.mok_strict
    assert args.moe_router_dtype == "fp64"  # the soak's noise control (the recipe routes in fp32)
    assert args.mok_param_digest_every == 100 and args.deterministic_mode
    assert args.profile and args.use_pytorch_profiler and args.pytorch_profiler_collect_callstack
    assert (args.profile_step_start, args.profile_step_end, args.profile_ranks) == (12, 13, [0])
    assert args.mok_wgrad_accumulation == "fused"  # the recipe's
    moe_backend, extra = cb.backend_args("mok_unfused", gpu=True)
    args = _parse_tokens([*_args_of(ONE_GPU), "--moe-backend", moe_backend, *extra], monkeypatch)
    assert args.mok_wgrad_accumulation == "unfused"  # the variant's flag comes after the recipe's


def _tiny_file(tmp_path: Path, *extra: str) -> Path:
    path = tmp_path / "tiny.args"
    path.write_text(" ".join([*_args_of(ONE_GPU_TINY), *extra]))
    return path


@pytest.mark.timeout(120)
def test_one_gpu_tiny_trains_on_one_rank(tmp_path):
    from test_training import train

    iters, log = train("mok", "--train-iters", "3", cwd=tmp_path, nproc=1, args_file=_tiny_file(tmp_path))
    assert sorted(iters) == [1, 2, 3], log[-3000:]
    assert log.count("[megatron_mok] MoE decoder layer: --moe-backend mok, 4 local experts x EP 1") == 2


@pytest.mark.timeout(120)
def test_one_gpu_tiny_trains_at_ep2_on_two_ranks(tmp_path):
    from test_training import train

    iters, log = train("alltoall", "--train-iters", "3", cwd=tmp_path, nproc=2,
                       args_file=_tiny_file(tmp_path, *EP2_TINY_FLAGS))
    assert sorted(iters) == [1, 2, 3], log[-3000:]
    assert re.search(r"expert_model_parallel_size \.+ 2\b", log) and re.search(r"num_experts \.+ 8\b", log)
