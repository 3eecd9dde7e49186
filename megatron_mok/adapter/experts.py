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

import re

import torch
import torch.nn.functional as F
from megatron.core.transformer.mlp import apply_swiglu_sharded_factory
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.utils import make_sharded_tensors_for_checkpoint
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


def _init_expert_weights(weight: torch.Tensor, init_method, num_experts: int) -> None:
    with torch.no_grad():
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
        """Per-expert shards under SequentialMLP's keys (``{prefix}experts.linear_fc1.weight``)."""
        from megatron.core.transformer.utils import ensure_metadata_has_dp_cp_group

        metadata = ensure_metadata_has_dp_cp_group(metadata)
        singleton = (metadata or {}).get("singleton_local_shards", False)
        num_global = get_pg_size(self.ep_group) * self.num_local_experts
        first = get_pg_rank(self.ep_group) * self.num_local_experts
        out = {}
        for name, tp_axis in (("linear_fc1", 0), ("linear_fc2", 1)):
            weight = getattr(self, name).weight
            for i in range(self.num_local_experts):
                g = first + i
                if singleton:
                    sh_prefix, offsets = f"{prefix}experts.{g}.{name}.", sharded_offsets
                else:
                    sh_prefix = f"{prefix}experts.{name}."
                    offsets = (*sharded_offsets, (len(sharded_offsets), g, num_global))
                sd = make_sharded_tensors_for_checkpoint(
                    {"weight": weight[i]}, sh_prefix, {"weight": tp_axis}, offsets,
                    tp_group=self.tp_group, dp_cp_group=metadata["dp_cp_group"],
                )
                sh_ten = sd[f"{sh_prefix}weight"]
                if name == "linear_fc1":
                    sh_ten = apply_swiglu_sharded_factory(
                        sh_ten, offsets, singleton, tp_group=self.tp_group, dp_group=metadata["dp_cp_group"]
                    )
                sh_ten.replica_id = (*sh_ten.replica_id[:2], get_pg_rank(self.dp_group))
                out[f"{prefix}{name}.weight{i}"] = sh_ten
        return out

