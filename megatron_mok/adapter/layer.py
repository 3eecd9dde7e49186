"""``MoKMoELayer``: Megatron's MoELayer with the router kept and dispatch + experts + combine fused.

Megatron's stock ``TopKRouter`` (aux losses, expert bias, group-limited routing) produces
``probs [T, E]`` and ``routing_map [T, E]``; the layer turns them into top-k ids and weights and
calls ``megatron_mok.mok_moe`` with the experts' stacked weights (``GroupedMLP``) and, when it
can be fused, the shared expert's weights. Parameters keep Megatron's names and shapes.
"""

from __future__ import annotations

from functools import partial

import torch
from megatron.core import tensor_parallel
from megatron.core.transformer.moe.moe_layer import MoELayer
from megatron.core.utils import get_pg_size

from .. import functional
from ..autograd import mok_moe
from ..config import MoKConfig
from .experts import GroupedMLP

# The MoKConfig the layers use; set from the command line by megatron_mok.adapter.args.
_MOK_CONFIG = MoKConfig()


def set_mok_config(cfg: MoKConfig) -> None:
    global _MOK_CONFIG
    _MOK_CONFIG = cfg


def get_mok_config() -> MoKConfig:
    return _MOK_CONFIG


def routing_to_topk(probs: torch.Tensor, routing_map: torch.Tensor, topk: int):
    """``(top_experts int32 [T, k], weights fp32 [T, k])`` from Megatron's dense router outputs.

    Slots hold a token's experts in ascending id order (a stable sort, so the result is a pure
    function of the routing map). Differentiable in ``probs``.
    """
    order = torch.sort(routing_map.to(torch.int8), dim=1, descending=True, stable=True).indices
    top = order[:, :topk]
    weights = probs.gather(1, top).to(torch.float32)
    return top.to(torch.int32), weights


class MoKMoELayer(MoELayer):
    """MoE layer whose dispatch, experts and combine run as one mok call."""

    def __init__(self, config, submodules=None, layer_number=None, pg_collection=None, is_mtp_layer=False, name=None):
        _check_config(config)
        super().__init__(config=config, submodules=submodules, layer_number=layer_number,
                         pg_collection=pg_collection, is_mtp_layer=is_mtp_layer, name=name)
        if not isinstance(self.experts, GroupedMLP):
            raise TypeError(f"--moe-backend mok needs megatron_mok GroupedMLP experts, got {type(self.experts).__name__}")
        self.ep_group = pg_collection.ep if pg_collection is not None else self.ep_group
        self._wgrad_step, self._wgrad_calls = None, 0  # _wgrad_hold's count of this step's backwards
        _report_slow_path(config, get_pg_size(self.ep_group), self._fusable_shared_weights() is not None)
        if not torch.distributed.is_initialized() or torch.distributed.get_rank() == 0:
            where = "MTP layer" if is_mtp_layer else "decoder layer"
            print(f"[megatron_mok] MoE {where}: --moe-backend mok, {self.num_local_experts} local experts "
                  f"x EP {get_pg_size(self.ep_group)}", flush=True)

    def _wgrad_hold(self, main_grads) -> bool:
        """Asked by each backward of this layer: whether its routed weight gradients may wait for a
        later backward of the same step (MoKConfig.wgrad_microbatches > 1): yes for every
        micro-batch of a step but its last (Megatron's iteration and micro-batch count)."""
        if _MOK_CONFIG.wgrad_microbatches == 1 or main_grads is None:
            return False
        step, microbatches = _training_step()
        if step is None:
            return False
        if step != self._wgrad_step:
            if functional.held_wgrads(main_grads):
                raise RuntimeError(
                    f"megatron_mok: layer {self.layer_number}'s routed weight gradients of iteration "
                    f"{self._wgrad_step} were held for a later micro-batch that never came (iteration {step} "
                    "has begun), so its main_grad missed them; this happens when a step runs fewer backward "
                    "passes than get_num_microbatches() says. Run with --mok-wgrad-microbatches 1")
            self._wgrad_step, self._wgrad_calls = step, 0
        index = self._wgrad_calls
        self._wgrad_calls += 1
        return index < microbatches - 1

    def _fusable_shared_weights(self):
        """The shared expert's (fc1, fc2) weights when the kernel can run it, else None."""
        se = getattr(self, "shared_experts", None)
        if se is None or getattr(se, "use_shared_expert_gate", False):
            return None
        if get_pg_size(self.tp_group) != 1:
            return None
        fc1, fc2 = getattr(se.linear_fc1, "weight", None), getattr(se.linear_fc2, "weight", None)
        if fc1 is None or fc2 is None or getattr(se.linear_fc1, "bias", None) is not None:
            return None
        return fc1, fc2

    def forward(self, hidden_states, intermediate_tensors=None, padding_mask=None):
        if intermediate_tensors is not None:
            raise NotImplementedError("--moe-backend mok does not support --overlap-moe-expert-parallel-comm")
        if padding_mask is not None:
            padding_mask = padding_mask.transpose(0, 1).bool()

        def fused_forward(hidden_states, padding_mask):
            shape = hidden_states.shape
            x = hidden_states.reshape(-1, shape[-1])
            shared = self._fusable_shared_weights()
            separate_shared = None
            if shared is None and self.use_shared_expert:
                separate_shared = self.shared_experts(hidden_states)
            probs, routing_map = self.route(hidden_states, padding_mask)
            top, weights = routing_to_topk(probs, routing_map, self.config.moe_router_topk)
            fc1, fc2 = self.experts.linear_fc1.weight, self.experts.linear_fc2.weight
            params = (fc1, fc2, *(shared or (None, None)))
            main_grads = _main_grads(self.config, params)
            out = mok_moe(
                x, top, weights, *params,
                cfg=_MOK_CONFIG, group=self.ep_group, num_experts=self.config.num_moe_experts,
                main_grads=main_grads, hold_wgrads=partial(self._wgrad_hold, main_grads),
            ).view(shape)
            if separate_shared is not None:
                out = out + separate_shared
            return out

        if self.moe_layer_recompute and self.training:
            out = tensor_parallel.checkpoint(fused_forward, False, hidden_states, padding_mask)
        else:
            out = fused_forward(hidden_states, padding_mask)
        return out, None


def _training_step():
    """(Megatron's current iteration, micro-batches a step), or (None, None) outside Megatron's
    training loop (then no backward holds its weight gradients)."""
    try:
        from megatron.core.num_microbatches_calculator import get_num_microbatches
        from megatron.training.global_vars import get_args

        step = getattr(get_args(), "curr_iteration", None)
        return (step, get_num_microbatches()) if step is not None else (None, None)
    except (AssertionError, AttributeError, ImportError, RuntimeError):
        return None, None


def _main_grads(config, params):
    """With fused weight-gradient accumulation (MoKConfig.wgrad_accumulation), the weights'
    ``main_grad`` buffers (set by Megatron's DDP): the mok backward accumulates into them itself.
    Else None (autograd returns the grads)."""
    mode = _MOK_CONFIG.wgrad_accumulation
    if mode == "unfused" or (mode == "auto" and not getattr(config, "gradient_accumulation_fusion", False)):
        return None
    grads = tuple(None if p is None else getattr(p, "main_grad", None) for p in params)
    return grads if any(g is not None for g in grads) else None


def _report_slow_path(config, ep_size: int, fused_shared: bool) -> None:
    """At build time: warn once (raise with --mok-strict) when this layer's calls would run the slow
    pure-PyTorch reference on the GPU (activations not bf16, sizes the kernels do not take)."""
    shared = config.moe_shared_expert_intermediate_size if fused_shared else None
    reason = functional.layer_slow_path_reason(config.params_dtype, config.hidden_size, config.moe_ffn_hidden_size,
                                               shared, config.num_moe_experts, ep_size, config.moe_router_topk)
    hint = " (Megatron: --bf16)" if config.params_dtype != torch.bfloat16 else ""
    functional.report_slow_path(_MOK_CONFIG, reason, "--moe-backend mok", hint)


def _check_config(config) -> None:
    problems = []
    if config.moe_expert_capacity_factor is not None:
        problems.append("it is dropless: remove --moe-expert-capacity-factor")
    if getattr(config, "overlap_moe_expert_parallel_comm", False):
        problems.append("remove --overlap-moe-expert-parallel-comm")
    if config.moe_shared_expert_overlap:
        problems.append("the shared expert is fused into the layer: remove --moe-shared-expert-overlap")
    if config.moe_latent_size:
        problems.append("MoE latent projections are not supported: remove --moe-latent-size")
    if config.expert_tensor_parallel_size not in (None, 1):
        problems.append("use --expert-tensor-parallel-size 1")
    if not config.gated_linear_unit:
        problems.append("the experts are SwiGLU: pass --swiglu")
    if config.add_bias_linear:
        problems.append("the experts have no biases: pass --disable-bias-linear")
    if config.moe_apply_probs_on_input:
        problems.append("remove --moe-apply-probs-on-input")
    if problems:
        raise ValueError("--moe-backend mok: " + "; ".join(problems))
