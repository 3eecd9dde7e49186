"""Routed experts with stacked weights and Megatron's checkpoint layout.

``GroupedMLP`` holds the weights of all local experts as two stacked parameters,
``linear_fc1.weight [nle, 2F, H]`` (rows ``[gate; up]``) and ``linear_fc2.weight [nle, H, F]``, so
both the mok kernels and ``torch._grouped_mm`` read them without a copy. Its distributed
checkpoint uses the same sharded keys and shards as Megatron's SequentialMLP / TEGroupedMLP
(``...experts.linear_fc1.weight`` with an expert axis, GLU halves split), so a checkpoint moves
between ``--moe-backend`` choices, and from stock Megatron runs.

Its ``forward`` is the grouped-GEMM expert computation used by the ``alltoall`` and ``allgather``
backends when TransformerEngine is missing: ``torch._grouped_mm``, never a per-expert loop.
"""

from __future__ import annotations

import contextlib
import functools
import re

import torch
import torch.nn.functional as F
from megatron.core.dist_checkpointing.mapping import ShardedTensor, ShardedTensorFactory
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.utils import make_sharded_object_for_checkpoint
from megatron.core.utils import get_pg_rank, get_pg_size


class _StackedLinear(torch.nn.Module):
    """One stacked weight ``[num_experts, out, in]``; loads per-expert ``weight{i}`` keys too."""

    def __init__(self, num_experts: int, out_features: int, in_features: int, dtype, device):
        super().__init__()
        self.weight = torch.nn.Parameter(
            torch.empty(num_experts, out_features, in_features, dtype=dtype, device=device)
        )
        self._register_load_state_dict_pre_hook(self._stack_per_expert_keys)

    def _stack_per_expert_keys(self, state_dict, prefix, *args, **kwargs):
        pattern = re.compile(re.escape(prefix) + r"weight(\d+)$")
        found = {int(m.group(1)): key for key in list(state_dict) if (m := pattern.match(key))}
        if found:
            if sorted(found) != list(range(self.weight.shape[0])):
                raise RuntimeError(
                    f"{prefix}: checkpoint holds experts {sorted(found)}, expected 0..{self.weight.shape[0] - 1}"
                )
            state_dict[prefix + "weight"] = torch.stack([state_dict.pop(found[i]) for i in sorted(found)])

    def get_extra_state(self):
        return None

    def set_extra_state(self, state):
        pass


class _ContiguousGrad(torch.autograd.Function):
    """Identity whose backward makes the incoming gradient contiguous (grouped_mm needs it)."""

    @staticmethod
    def forward(ctx, x):
        return x

    @staticmethod
    def backward(ctx, grad):
        return grad.contiguous()


def _expert_rng():
    """Megatron's expert-parallel CUDA RNG stream (seed + 1024 + 100 * EP rank), as its own expert
    layers use: without it every EP rank would draw the same initial experts. A no-op on CPU (no
    CUDA RNG; see cpu_compat) and where the stream was never set up (outside Megatron's init)."""
    from megatron.core.tensor_parallel.random import get_cuda_rng_tracker, get_expert_parallel_rng_tracker_name

    tracker = get_cuda_rng_tracker()
    name = get_expert_parallel_rng_tracker_name()
    if not torch.cuda.is_available() or name not in tracker.get_states():
        return contextlib.nullcontext()
    return tracker.fork(name)


def _init_expert_weights(weight: torch.Tensor, init_method, num_experts: int) -> None:
    with torch.no_grad(), _expert_rng():
        for i in range(num_experts):
            init_method(weight[i])


class GroupedMLP(MegatronModule):
    """Routed SwiGLU experts of one rank (Megatron's ``ExpertsInterface``)."""

    def __init__(self, num_local_experts: int, config, pg_collection=None, name: str | None = None):
        super().__init__(config=config)
        if not config.gated_linear_unit or config.activation_func is not F.silu:
            raise ValueError("megatron_mok experts implement SwiGLU only: pass --swiglu")
        if config.add_bias_linear:
            raise ValueError("megatron_mok experts have no biases: pass --disable-bias-linear")
        self.num_local_experts = num_local_experts
        self.ep_group = pg_collection.ep
        self.tp_group = pg_collection.expt_tp
        self.dp_group = pg_collection.expt_dp
        if get_pg_size(self.tp_group) != 1:
            raise ValueError("megatron_mok experts need --expert-tensor-parallel-size 1")
        ffn = config.moe_ffn_hidden_size
        hidden = config.hidden_size
        device = "cpu" if config.use_cpu_initialization else torch.cuda.current_device()
        self.linear_fc1 = _StackedLinear(num_local_experts, 2 * ffn, hidden, config.params_dtype, device)
        self.linear_fc2 = _StackedLinear(num_local_experts, hidden, ffn, config.params_dtype, device)
        if config.perform_initialization:
            _init_expert_weights(self.linear_fc1.weight, config.init_method, num_local_experts)
            _init_expert_weights(self.linear_fc2.weight, config.output_layer_init_method, num_local_experts)
        for p in (self.linear_fc1.weight, self.linear_fc2.weight):
            # Expert-parallel parameters: reduced over the expert-data-parallel group only.
            p.allreduce = False
            p.sequence_parallel = False
            setattr(p, "tensor_model_parallel", False)

    def forward(self, permuted_hidden: torch.Tensor, tokens_per_expert: torch.Tensor, permuted_probs: torch.Tensor):
        """Expert-major rows in, rows out (the ``alltoall`` / ``allgather`` dispatcher contract)."""
        offs = torch.cumsum(tokens_per_expert.to(device=permuted_hidden.device), 0).to(torch.int32)
        x = _ContiguousGrad.apply(permuted_hidden)
        h = torch._grouped_mm(x, self.linear_fc1.weight.transpose(1, 2), offs=offs)
        gate, up = torch.chunk(h, 2, dim=-1)
        a = (F.silu(gate) * up * permuted_probs.unsqueeze(-1)).to(x.dtype)
        y = torch._grouped_mm(_ContiguousGrad.apply(a), self.linear_fc2.weight.transpose(1, 2), offs=offs)
        return _ContiguousGrad.apply(y), None

    def backward_dw(self):
        pass

    def sharded_state_dict(self, prefix: str = "", sharded_offsets: tuple = (), metadata: dict | None = None):
        """Per-expert shards under SequentialMLP's keys (``{prefix}experts.linear_fc1.weight``).

        Each stacked weight is one ``ShardedTensorFactory`` whose data is the parameter itself (so
        Megatron maps optimizer states onto it) and which builds, per local expert, the shards
        SequentialMLP writes: an expert axis, and for the GLU ``fc1`` the gate and up halves as
        two fragments of the output axis.
        """
        singleton = (metadata or {}).get("singleton_local_shards", False)
        if singleton:
            raise NotImplementedError("megatron_mok GroupedMLP does not support singleton_local_shards checkpoints")
        num_global = get_pg_size(self.ep_group) * self.num_local_experts
        first = get_pg_rank(self.ep_group) * self.num_local_experts
        replica_id = (0, 0, get_pg_rank(self.dp_group))
        out = {}
        for name, glu in (("linear_fc1", True), ("linear_fc2", False)):
            weight = getattr(self, name).weight
            out[f"{prefix}{name}.weight"] = ShardedTensorFactory(
                key=f"{prefix}experts.{name}.weight",
                data=weight,
                build_fn=functools.partial(_build_expert_shards, sharded_offsets=sharded_offsets,
                                           first=first, num_global=num_global, glu=glu),
                merge_fn=functools.partial(_merge_expert_shards, glu=glu),
                replica_id=replica_id,
            )
            # SequentialMLP's local linears also write one (empty) extra state per expert, and stock
            # Megatron loads them under the default --dist-ckpt-strictness: write them too, so a mok
            # checkpoint loads into SequentialMLP (and a stock one into this class).
            out[f"{prefix}{name}._extra_state"] = ShardedTensorFactory(
                key=f"{prefix}experts.{name}._extra_state",
                data=None,
                build_fn=functools.partial(_build_extra_states, sharded_offsets=sharded_offsets, first=first,
                                           num_local=self.num_local_experts, num_global=num_global),
                merge_fn=_merge_extra_states,
                replica_id=replica_id,
            )
        return out


def _build_expert_shards(key, t, replica_id, flattened_range, *, sharded_offsets, first, num_global, glu):
    """One ShardedTensor per expert (two for a GLU weight: gate and up), as SequentialMLP saves."""
    if flattened_range is not None:
        raise NotImplementedError("megatron_mok GroupedMLP checkpoints need a non-flattened optimizer state")
    shards = []
    for i in range(t.shape[0]):
        offsets = (*sharded_offsets, (len(sharded_offsets), first + i, num_global))
        axis = len(offsets)  # the weight's output axis, after the prepended ones
        if glu:
            halves = t[i].chunk(2, dim=0)
            frags = [(axis, j, 2) for j in range(2)]
        else:
            halves = [t[i]]
            frags = [(axis + 1, 0, 1)]  # row-parallel: the input axis is the (size-1) TP axis
        for piece, frag in zip(halves, frags):
            shards.append(ShardedTensor.from_rank_offsets(
                key, piece, *offsets, frag, replica_id=replica_id, prepend_axis_num=len(offsets)
            ))
    return shards


def _build_extra_states(key, data, replica_id, flattened_range, *, sharded_offsets, first, num_local, num_global):
    """One empty ShardedObject per expert, as SequentialMLP's experts write (``_extra_state``)."""
    return [make_sharded_object_for_checkpoint(
        None, key, (*sharded_offsets, (len(sharded_offsets), first + i, num_global)), replica_id)
        for i in range(num_local)]


def _merge_extra_states(pieces):
    return None  # the stacked weights keep no extra state


def _merge_expert_shards(pieces, *, glu):
    if glu:
        return torch.stack([torch.cat(pieces[i : i + 2]) for i in range(0, len(pieces), 2)])
    return torch.stack(pieces)
