"""End-to-end Megatron training of the tiny DeepSeek-V3-style config on 2 CPU ranks (gloo, EP=2).

Covers: the README's training command (20 iterations, falling loss), bitwise-repeatable runs,
checkpoint interchange between --moe-backend alltoall and mok (both directions), the runner for a
user's own script, and clear errors for bad command lines.
"""

from __future__ import annotations

import importlib.util
import math
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
TINY = (ROOT / "configs" / "deepseek-v3-tiny.args").read_text().split()
ITER_RE = re.compile(r"iteration\s+(\d+)/\s*(\d+) \|.*?\| lm loss: ([0-9.eE+-]+) \|.*?grad norm: ([0-9.eE+-]+)")

pytestmark = pytest.mark.timeout(900)


def _env():
    env = dict(os.environ)
    env.update(NCCL_NVLS_ENABLE="0", TORCH_SYMM_MEM_DISABLE_MULTICAST="1", NVSHMEM_DISABLE_NVLS="1",
               OMP_NUM_THREADS="1", CUDA_DEVICE_MAX_CONNECTIONS="1", PYTHONUNBUFFERED="1")
    return env


# "stock": no --moe-backend, so Megatron's own MoE layer with its SequentialMLP experts (local spec).
STOCK = "stock"


def train(backend: str, *extra: str, cwd: Path, nproc: int = 2, check: bool = True, args_file: Path | None = None):
    """Run a tiny config; return (iteration -> (loss, grad norm) as printed, full log)."""
    config = args_file.read_text().split() if args_file else TINY
    choice = ["--moe-token-dispatcher-type", "alltoall"] if backend == STOCK else ["--moe-backend", backend]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
           "-m", "megatron_mok.pretrain_gpt", *config, *choice, *extra]
    proc = subprocess.run(cmd, cwd=cwd, env=_env(), capture_output=True, text=True, timeout=600)
    log = proc.stdout + proc.stderr
    if check and proc.returncode != 0:
        raise AssertionError(f"training failed (rc={proc.returncode}):\n{log[-6000:]}")
    iters = {int(m.group(1)): (m.group(3), m.group(4)) for m in ITER_RE.finditer(log)}
    return iters, log


def test_tiny_training_with_mok_loss_falls(tmp_path):
    iters, log = train("mok", cwd=tmp_path)
    assert sorted(iters) == list(range(1, 21)), log[-3000:]
    losses = [float(iters[i][0]) for i in range(1, 21)]
    assert all(math.isfinite(x) for x in losses)
    first, last = sum(losses[:5]) / 5, sum(losses[-5:]) / 5
    assert last < first - 1.0, losses  # 5.5 -> ~3.5 on this config
    # Both decoder MoE layers and the MTP layer's MoE run mok.
    built = re.findall(r"\[megatron_mok\] MoE (decoder layer|MTP layer): --moe-backend mok, 4 local experts x EP 2", log)
    assert sorted(built) == ["MTP layer", "decoder layer", "decoder layer"], built
    # No TransformerEngine or apex here: Megatron's torch Adam runs the fused kernel (pretrain.py).
    assert "Megatron's torch Adam runs torch's fused kernel" in log


def _params_from_checkpoint(ckpt_dir: Path, iteration: int, out: Path) -> dict:
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    dcp_to_torch_save(ckpt_dir / f"iter_{iteration:07d}", out)
    state = torch.load(out, weights_only=False)
    return {k: v for k, v in state.items() if isinstance(v, torch.Tensor)}  # weights and optimizer states


def test_mok_training_is_bitwise_repeatable(tmp_path):
    runs = []
    for name in ("a", "b"):
        ckpt = tmp_path / name
        iters, log = train("mok", "--train-iters", "5", "--save", str(ckpt), "--save-interval", "5",
                           "--mok-param-digest-every", "2", cwd=tmp_path)
        digests = sorted(re.findall(r"\[megatron_mok\] param-digest rank=(\d+) iteration=(\d+) value=([0-9a-f]{16})", log))
        runs.append((iters, _params_from_checkpoint(ckpt, 5, tmp_path / f"{name}.pt"), digests))
    (iters_a, params_a, digests_a), (iters_b, params_b, digests_b) = runs
    assert iters_a == iters_b and len(iters_a) == 5
    # --mok-param-digest-every 2: both ranks print digests (every 2 iterations and the last), the same in both runs
    assert digests_a == digests_b and {d[0] for d in digests_a} == {"0", "1"} and len(digests_a) >= 4, digests_a
    assert params_a.keys() == params_b.keys() and len(params_a) > 10
    for key in params_a:
        assert torch.equal(params_a[key], params_b[key]), key


@pytest.mark.parametrize("first,others", [("alltoall", ("mok",)), ("mok", ("alltoall", STOCK))])
def test_checkpoint_moves_between_backends(tmp_path, first, others):
    """A checkpoint loads into the other backends under Megatron's default --dist-ckpt-strictness
    (none is passed), with the same next-step loss: alltoall -> mok, and mok -> alltoall's grouped
    experts and -> stock Megatron's SequentialMLP (no --moe-backend)."""
    ckpt = tmp_path / "ckpt"
    # The schedule is planned for 4 iterations; the first run stops after saving iteration 3.
    train(first, "--train-iters", "4", "--exit-interval", "3", "--save", str(ckpt), "--save-interval", "3",
          cwd=tmp_path)
    assert (ckpt / "latest_checkpointed_iteration.txt").read_text().strip() == "3"
    same, log_same = train(first, "--train-iters", "4", "--load", str(ckpt), cwd=tmp_path)
    assert list(same) == [4], log_same[-2000:]
    loss_same = float(same[4][0])
    for second in others:
        other, log_other = train(second, "--train-iters", "4", "--load", str(ckpt), cwd=tmp_path)
        assert list(other) == [4], (second, log_other[-3000:])
        if second == STOCK:
            assert "--moe-backend mok" not in log_other  # Megatron's own layer, not mok's
        # Same weights, same batch: the next-step loss agrees to fp32 rounding of the two backends.
        assert float(other[4][0]) == pytest.approx(loss_same, rel=1e-5), (first, second, loss_same, other[4])


def _run_entry(*args, cwd, module="megatron_mok.pretrain_gpt"):
    cmd = [sys.executable, "-m", module, *args]
    env = _env()
    env.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT="29531")
    return subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=300)


def test_unknown_backend_lists_choices(tmp_path):
    proc = _run_entry(*TINY, "--moe-backend", "bogus", cwd=tmp_path)
    assert proc.returncode == 2
    assert "invalid choice: 'bogus'" in proc.stderr
    for name in ("mok", "alltoall", "allgather", "hybridep", "deepep"):
        assert name in proc.stderr


@pytest.mark.parametrize("backend", ["hybridep", "deepep"])
def test_deep_ep_backends_fail_clearly_without_deep_ep(tmp_path, backend):
    if importlib.util.find_spec("deep_ep") is not None:
        pytest.skip("deep_ep is installed here")
    proc = _run_entry(*TINY, "--moe-backend", backend, cwd=tmp_path)
    assert proc.returncode == 2
    assert f"--moe-backend {backend} needs the deep_ep package" in proc.stderr


def test_bad_mok_knob_names_the_flag(tmp_path):
    proc = _run_entry(*TINY, "--moe-backend", "mok", "--mok-minibatch-rows", "100", cwd=tmp_path)
    assert proc.returncode != 0
    assert "--mok-minibatch-rows" in proc.stderr and "multiple of 128" in proc.stderr


def test_mok_flags_are_validated_with_another_backend(tmp_path):
    proc = _run_entry(*TINY, "--moe-backend", "alltoall", "--mok-fwd-comm-sms", "0", cwd=tmp_path)
    assert proc.returncode != 0
    assert "--mok-fwd-comm-sms" in proc.stderr and "[1, 64]" in proc.stderr, proc.stderr[-3000:]


USER_SCRIPT = '''
from megatron.training.arguments import parse_and_validate_args
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

args = parse_and_validate_args(args_defaults={"tokenizer_type": "GPT2BPETokenizer"})
spec = get_gpt_layer_local_spec(num_experts=args.num_experts, multi_latent_attention=True)
mlp = spec.submodules.mlp
print("BACKEND", args.moe_backend, args.moe_token_dispatcher_type)
print("LAYER", mlp.func.__name__, mlp.keywords["submodules"].experts.__name__)
'''


def test_runner_injects_plugin_into_user_script(tmp_path):
    script = tmp_path / "my_pretrain.py"
    script.write_text(USER_SCRIPT)
    args = [a for a in TINY]
    ep = args.index("--expert-model-parallel-size")
    args[ep + 1] = "1"
    proc = _run_entry(str(script), *args, "--moe-backend", "mok", cwd=tmp_path, module="megatron_mok.run")
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "BACKEND mok alltoall" in proc.stdout
    assert "LAYER MoKMoELayer GroupedMLP" in proc.stdout, proc.stdout
