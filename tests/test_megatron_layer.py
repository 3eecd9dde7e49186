"""MoKMoELayer (and the grouped experts) against Megatron's own alltoall dispatcher + SequentialMLP.

Two CPU ranks on gloo, EP=2, identical weights and inputs: the outputs and every gradient must
match, and the grouped experts' distributed-checkpoint shards must be the ones SequentialMLP
writes (so checkpoints move between backends and from stock Megatron runs).
"""

from __future__ import annotations

import functools

import pytest
import torch

from dist_utils import run_distributed

pytestmark = pytest.mark.timeout(600)


def _setup_megatron(ep: int):
    from megatron_mok.adapter import cpu_compat

    cpu_compat.activate_if_no_gpu()
    from megatron.core import parallel_state

    parallel_state.initialize_model_parallel(tensor_model_parallel_size=1, expert_model_parallel_size=ep)


def _config(shared: bool, **overrides):
    import torch.nn.functional as F
    from megatron.core.transformer.transformer_config import TransformerConfig

    kwargs = dict(
        num_layers=1, hidden_size=32, num_attention_heads=4, ffn_hidden_size=64,
        num_moe_experts=8, moe_router_topk=2, moe_ffn_hidden_size=16,
        moe_shared_expert_intermediate_size=16 if shared else None,
        moe_router_score_function="sigmoid", moe_router_enable_expert_bias=True,
        moe_router_topk_scaling_factor=2.5, moe_router_load_balancing_type="seq_aux_loss",
        moe_aux_loss_coeff=1e-4, moe_router_dtype="fp32",
        gated_linear_unit=True, activation_func=F.silu, add_bias_linear=False,
        bias_activation_fusion=False, moe_token_dispatcher_type="alltoall",
        expert_model_parallel_size=torch.distributed.get_world_size(), use_cpu_initialization=True,
        params_dtype=torch.float32, init_method_std=0.02,
    )
    kwargs.update(overrides)
    return TransformerConfig(**kwargs)


def _build_layer(backend: str | None, config):
    from megatron.core.models.backends import LocalSpecProvider
    from megatron.core.models.gpt import gpt_layer_specs

    from megatron_mok.adapter import backends

    backends.install_spec_hook()
    backends.set_backend(backend)
    try:
        builder = gpt_layer_specs.get_moe_module_spec_for_backend(LocalSpecProvider(), num_experts=8)
        return builder(config=config)
    finally:
        backends.set_backend(None)


def _copy_weights(stock, target):
    """Copy a stock MoELayer (SequentialMLP experts) into a layer with GroupedMLP experts."""
    with torch.no_grad():
        target.router.weight.copy_(stock.router.weight)
        target.router.expert_bias.copy_(stock.router.expert_bias)
        for i, expert in enumerate(stock.experts.local_experts):
            target.experts.linear_fc1.weight[i].copy_(expert.linear_fc1.weight)
            target.experts.linear_fc2.weight[i].copy_(expert.linear_fc2.weight)
        if stock.use_shared_expert:
            target.shared_experts.linear_fc1.weight.copy_(stock.shared_experts.linear_fc1.weight)
            target.shared_experts.linear_fc2.weight.copy_(stock.shared_experts.linear_fc2.weight)


def _run(layer, hidden, grad):
    hidden = hidden.clone().requires_grad_()
    out, bias = layer(hidden)
    assert bias is None
    out.backward(grad)
    return out.detach(), hidden.grad


def _rel(a, b):
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


def _compare_layers(rank, world, backend, shared):
    _setup_megatron(world)
    from megatron_mok.adapter.experts import GroupedMLP

    torch.manual_seed(1234)  # same weights on every rank for the replicated parts
    config = _config(shared)
    stock = _build_layer(None, config)
    candidate = _build_layer(backend, config)
    assert isinstance(candidate.experts, GroupedMLP)
    if backend == "mok":
        from megatron_mok.adapter.layer import MoKMoELayer

        assert isinstance(candidate, MoKMoELayer)
    _copy_weights(stock, candidate)
    gen = torch.Generator().manual_seed(100 + rank)
    hidden = torch.randn(12, 3, 32, generator=gen)
    grad = torch.randn(12, 3, 32, generator=gen)
    out_ref, dx_ref = _run(stock, hidden, grad)
    out, dx = _run(candidate, hidden, grad)
    assert _rel(out, out_ref) < 1e-5, _rel(out, out_ref)
    assert _rel(dx, dx_ref) < 1e-5, _rel(dx, dx_ref)
    assert _rel(candidate.router.weight.grad, stock.router.weight.grad) < 1e-5
    for i, expert in enumerate(stock.experts.local_experts):
        g1 = candidate.experts.linear_fc1.weight.grad[i]
        g2 = candidate.experts.linear_fc2.weight.grad[i]
        r1, r2 = expert.linear_fc1.weight.grad, expert.linear_fc2.weight.grad
        if r1 is None:  # an expert that got no tokens on this rank
            assert torch.count_nonzero(g1) == 0 and torch.count_nonzero(g2) == 0
        else:
            assert _rel(g1, r1) < 1e-5 and _rel(g2, r2) < 1e-5
    if shared:
        for name in ("linear_fc1", "linear_fc2"):
            a = getattr(candidate.shared_experts, name).weight.grad
            b = getattr(stock.shared_experts, name).weight.grad
            assert _rel(a, b) < 1e-5


@pytest.mark.parametrize("backend", ["mok", "alltoall"])
@pytest.mark.parametrize("shared", [True, False])
def test_layer_matches_megatron_alltoall_sequential(backend, shared):
    run_distributed(functools.partial(_compare_layers, backend=backend, shared=shared), world_size=2, timeout=300)


def _shards(sd):
    """Every ShardedTensor of a sharded state dict, factories built (extra-state objects: _sharded_objects)."""
    from megatron.core.dist_checkpointing.mapping import ShardedTensor, ShardedTensorFactory

    for value in sd.values():
        for t in value.build() if isinstance(value, ShardedTensorFactory) else [value]:
            if isinstance(t, ShardedTensor):
                yield t


def _sharded_objects(sd):
    from megatron.core.dist_checkpointing.mapping import ShardedObject, ShardedTensorFactory

    out = []
    for value in sd.values():
        for t in value.build() if isinstance(value, ShardedTensorFactory) else [value]:
            if isinstance(t, ShardedObject):
                out.append((t.key, t.global_shape, t.global_offset, t.replica_id, t.data))
    return sorted(out, key=repr)


def _sharded_keys(sd):
    out = {}
    for t in _shards(sd):
        out.setdefault(t.key, []).append(
            (t.global_shape, t.global_offset, tuple(t.local_shape), t.axis_fragmentations, t.replica_id)
        )
    return {k: sorted(v) for k, v in out.items()}


def _compare_checkpoint_layout(rank, world):
    _setup_megatron(world)
    torch.manual_seed(0)
    config = _config(shared=False)
    stock = _build_layer(None, config)
    mok = _build_layer("mok", config)
    _copy_weights(stock, mok)
    meta = {"dp_cp_group": torch.distributed.new_group([rank])}
    ref = _sharded_keys(stock.experts.sharded_state_dict(prefix="mlp.", metadata=meta))
    got = _sharded_keys(mok.experts.sharded_state_dict(prefix="mlp.", metadata=meta))
    assert got == ref
    # ... and the per-expert (empty) extra states SequentialMLP writes, which stock Megatron loads
    # under the default --dist-ckpt-strictness (a mok checkpoint must hold them).
    ref_objects = _sharded_objects(stock.experts.sharded_state_dict(prefix="mlp.", metadata=meta))
    assert len(ref_objects) == 2 * stock.num_local_experts
    assert _sharded_objects(mok.experts.sharded_state_dict(prefix="mlp.", metadata=meta)) == ref_objects
    # The shard data are the same numbers too (gate/up halves of every local expert).
    ref_data = {(t.key, t.global_offset): t.data for t in _shards(stock.experts.sharded_state_dict(prefix="mlp.", metadata=meta))}
    for t in _shards(mok.experts.sharded_state_dict(prefix="mlp.", metadata=meta)):
        assert torch.equal(t.data, ref_data[(t.key, t.global_offset)])
    # A plain state dict with TE-style per-expert keys loads into the stacked weights.
    per_expert = {f"linear_fc1.weight{i}": e.linear_fc1.weight.detach() for i, e in enumerate(stock.experts.local_experts)}
    per_expert.update({f"linear_fc2.weight{i}": e.linear_fc2.weight.detach() for i, e in enumerate(stock.experts.local_experts)})
    fresh = _build_layer("mok", config)
    fresh.experts.load_state_dict(per_expert, strict=False)
    assert torch.equal(fresh.experts.linear_fc1.weight, mok.experts.linear_fc1.weight)
    assert torch.equal(fresh.experts.linear_fc2.weight, mok.experts.linear_fc2.weight)


def test_grouped_experts_checkpoint_layout_matches_sequential_mlp():
    run_distributed(_compare_checkpoint_layout, world_size=2, timeout=300)


def test_expert_init_draws_from_the_expert_parallel_rng(monkeypatch):
    """Each EP rank must draw its own initial experts (Megatron's expert-parallel RNG stream)."""
    import contextlib

    from megatron.core.tensor_parallel import random as mrandom

    from megatron_mok.adapter import experts

    name = mrandom.get_expert_parallel_rng_tracker_name()
    entered = []

    class FakeTracker:
        def get_states(self):
            return {name: None}

        @contextlib.contextmanager
        def fork(self, which):
            entered.append(which)
            yield

    monkeypatch.setattr(mrandom, "get_cuda_rng_tracker", lambda: FakeTracker())
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    w = torch.empty(3, 4, 5)
    experts._init_expert_weights(w, torch.nn.init.normal_, 3)
    assert entered == [name]
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)  # CPU: no CUDA RNG streams to fork
    experts._init_expert_weights(w, torch.nn.init.normal_, 3)
    assert entered == [name]


def _fused_wgrad_accumulation(rank, world):
    """Fused weight-gradient accumulation (MoKConfig.wgrad_accumulation "fused", or "auto" with
    Megatron's gradient-accumulation fusion) adds the expert and shared-expert weight gradients into
    Megatron's fp32 main_grad and marks them (grad_added_to_main_grad); "unfused" returns them even
    with Megatron's fusion on, and so does "auto" without it."""
    from megatron_mok.adapter.layer import get_mok_config, set_mok_config

    _setup_megatron(world)
    torch.manual_seed(1234)
    plain = _build_layer("mok", _config(shared=True))
    fused_cfg = _config(shared=True)
    layer = _build_layer("mok", fused_cfg)
    layer.load_state_dict(plain.state_dict())
    gen = torch.Generator().manual_seed(7 + rank)
    hidden, grad = torch.randn(12, 3, 32, generator=gen), torch.randn(12, 3, 32, generator=gen)
    out_ref, dx_ref = _run(plain, hidden, grad)
    ref = {"experts.fc1": plain.experts.linear_fc1.weight.grad, "experts.fc2": plain.experts.linear_fc2.weight.grad,
           "shared.fc1": plain.shared_experts.linear_fc1.weight.grad,
           "shared.fc2": plain.shared_experts.linear_fc2.weight.grad}
    params = {"experts.fc1": layer.experts.linear_fc1.weight, "experts.fc2": layer.experts.linear_fc2.weight,
              "shared.fc1": layer.shared_experts.linear_fc1.weight, "shared.fc2": layer.shared_experts.linear_fc2.weight}
    saved = get_mok_config()
    try:
        # (mode, Megatron's gradient_accumulation_fusion (set after construction: the local linears
        # need apex for it), whether the backward adds into main_grad)
        for mode, megatron_fusion, fused in (("auto", True, True), ("fused", False, True),
                                             ("unfused", True, False), ("auto", False, False)):
            set_mok_config(saved.replace(wgrad_accumulation=mode))
            fused_cfg.gradient_accumulation_fusion = megatron_fusion
            for p in params.values():
                p.main_grad = torch.full(p.shape, 0.5, dtype=torch.float32)  # earlier micro-batches' sum
                p.grad_added_to_main_grad = False
                p.grad = None
            out, dx = _run(layer, hidden, grad)
            assert torch.equal(out, out_ref) and torch.equal(dx, dx_ref), mode
            for name, p in params.items():
                assert p.grad_added_to_main_grad is fused, (mode, megatron_fusion, name)
                if fused:
                    assert p.grad is not None and p.grad.shape == p.shape, name  # the dummy DDP's hook expects
                    assert torch.allclose(p.main_grad, 0.5 + ref[name].float(), rtol=0, atol=1e-6), name
                else:  # returned for Megatron's DDP hook to add; main_grad untouched
                    assert torch.equal(p.grad, ref[name]), (mode, name)
                    assert torch.equal(p.main_grad, torch.full(p.shape, 0.5)), (mode, name)
    finally:
        set_mok_config(saved)


def test_fused_wgrad_accumulation_into_main_grad():
    run_distributed(_fused_wgrad_accumulation, world_size=2, timeout=300)


def test_wgrad_hold_holds_every_microbatch_of_a_step_but_the_last(monkeypatch):
    """MoKMoELayer._wgrad_hold, asked by each backward: with wgrad_microbatches > 1 and main grads,
    True for a step's micro-batches but its last (Megatron's iteration and micro-batch count), counted
    afresh each iteration; False outside Megatron's training loop, without main grads or with
    wgrad_microbatches 1; a layer whose weight gradients still wait when the next iteration starts
    raises instead of training on a main_grad that missed them."""
    import types

    from megatron_mok import functional
    from megatron_mok.adapter import layer as layer_mod

    saved = layer_mod.get_mok_config()
    step = {"now": (3, 5)}
    held = {"n": 0}
    monkeypatch.setattr(layer_mod, "_training_step", lambda: step["now"])
    monkeypatch.setattr(functional, "held_wgrads", lambda main_grads=None: held["n"])
    fake = types.SimpleNamespace(layer_number=2, _wgrad_step=None, _wgrad_calls=0)
    hold = lambda mains=("m1", "m2", None, None): layer_mod.MoKMoELayer._wgrad_hold(fake, mains)  # noqa: E731
    try:
        layer_mod.set_mok_config(saved.replace(wgrad_microbatches=2))
        assert [hold() for _ in range(5)] == [True, True, True, True, False]
        assert [hold() for _ in range(2)] == [False, False]  # more backwards than micro-batches: never hold
        step["now"] = (4, 2)
        assert [hold() for _ in range(2)] == [True, False]
        assert hold(None) is False
        step["now"] = (5, 3)
        held["n"] = 1
        with pytest.raises(RuntimeError, match="never came"):
            hold()
        held["n"] = 0
        step["now"] = (None, None)
        assert hold() is False
        layer_mod.set_mok_config(saved.replace(wgrad_microbatches=1))
        step["now"] = (6, 4)
        assert hold() is False
    finally:
        layer_mod.set_mok_config(saved)


def test_step_hook_reads_mok_errors_after_every_training_step(monkeypatch):
    """Under a full-iteration CUDA graph no Python of the layers runs: the errors a mok call flags
    must surface after Megatron's train_step (adapter/steps.py), and the wrap is installed once."""
    import megatron.training.training as training

    from megatron_mok import MoKCapacityError, MoKConfig, clear_workspace_cache, get_workspace
    from megatron_mok.adapter import steps
    from megatron_mok.workspace import ErrorCode

    calls = []
    monkeypatch.setattr(training, "train_step", lambda fs, di, model, *a, **k: calls.append("step") or "out")
    monkeypatch.setattr(steps, "maybe_print_digest", lambda model, args: calls.append("digest"))
    monkeypatch.setattr("megatron.training.get_args", lambda: None)
    steps.install_step_hooks()
    step = training.train_step
    assert getattr(step, "__wrapped_by_mok__", False)
    steps.install_step_hooks()
    assert training.train_step is step  # idempotent
    clear_workspace_cache()
    try:
        ws = get_workspace(None, "cpu", 8, 16, 2, 4, MoKConfig())
        assert step(None, None, [None]) == "out" and calls == ["digest", "step"]
        ws.errors[ErrorCode.CAPACITY_OVERFLOW] = 99
        with pytest.raises(MoKCapacityError, match="99 routed rows"):
            step(None, None, [None])
    finally:
        clear_workspace_cache()


def test_entry_point_switches_megatron_torch_adam_to_the_fused_kernel():
    """Megatron's wrappers (chained, mixed precision) hold torch optimizers; each Adam/AdamW gets the
    fused kernel, with its step counters as the fused kernel keeps them, and the update is Adam's."""
    from types import SimpleNamespace

    from megatron_mok.adapter.pretrain import use_fused_torch_adam

    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(33)) for _ in range(3)]
    twins = [torch.nn.Parameter(p.detach().clone()) for p in params]
    adamw = torch.optim.AdamW(params[:2], lr=1e-2, weight_decay=0.1)
    adam = torch.optim.Adam(params[2:], lr=1e-2)
    sgd = torch.optim.SGD([torch.nn.Parameter(torch.zeros(2))], lr=1.0)
    chained = SimpleNamespace(chained_optimizers=[SimpleNamespace(optimizer=o) for o in (adamw, adam, sgd)])
    for p, t in zip(params, twins):
        p.grad = torch.randn_like(p)
        t.grad = p.grad.clone()
    adamw.step()  # a step before the switch: its counter must move to what the fused kernel reads
    assert use_fused_torch_adam(chained) == 2
    assert all(g["fused"] and not g["foreach"] for o in (adamw, adam) for g in o.param_groups)
    assert "fused" not in sgd.param_groups[0] or not sgd.param_groups[0].get("fused")
    adamw.step()
    adam.step()
    ref_w = torch.optim.AdamW(twins[:2], lr=1e-2, weight_decay=0.1, foreach=False)
    ref = torch.optim.Adam(twins[2:], lr=1e-2, foreach=False)
    for _ in range(2):
        ref_w.step()
    ref.step()
    for p, t in zip(params, twins):
        torch.testing.assert_close(p, t, rtol=1e-6, atol=1e-7)
    assert all(s["step"].dtype == torch.float32 and float(s["step"]) == 2 for s in adamw.state.values())
