"""GPT pretraining entry point with the mok plugin (Megatron-LM's pretrain_gpt.py is not in the wheel).

    torchrun --nproc-per-node N -m megatron_mok.pretrain_gpt <Megatron args> --moe-backend mok
"""

from __future__ import annotations

import time

_PROGRAM_START = time.time()

import sys  # noqa: E402
import functools  # noqa: E402
from functools import partial  # noqa: E402

import torch  # noqa: E402

from . import install  # noqa: E402
from .backends import BackendUnavailableError  # noqa: E402


def _loss_func(loss_mask: torch.Tensor, output_tensor: torch.Tensor, model=None):
    from megatron.core.rerun_state_machine import get_rerun_state_machine
    from megatron.training import get_args

    args = get_args()
    losses = output_tensor.view(-1).float()
    mask = loss_mask.view(-1).float()
    loss = torch.sum(losses * mask)
    num_tokens = mask.sum().clone().detach().to(torch.int)
    report = {"lm loss": torch.cat([loss.clone().detach().view(1), num_tokens.view(1)])}
    if args.check_for_nan_in_loss_and_grad:
        rsm = get_rerun_state_machine()
        for reject, what in ((torch.isnan, "NaN"), (torch.isinf, "Inf")):
            rsm.validate_result(result=loss, rejection_func=reject, tolerance=0.0, fatal=True,
                                message=f"found {what} in local forward loss calculation")
    return loss, num_tokens, report


_BATCH_KEYS = ("tokens", "labels", "loss_mask", "attention_mask", "position_ids")


def _get_batch(data_iterator, vp_stage=None):
    """Next micro-batch, broadcast over tensor-parallel ranks and sliced for context parallelism."""
    from megatron.core import parallel_state as mpu
    from megatron.core.transformer.multi_token_prediction import mtp_on_this_rank
    from megatron.core.utils import get_batch_on_this_cp_rank, get_batch_on_this_tp_rank
    from megatron.training import get_args
    from megatron.training.utils import is_first_or_last_pipeline_stage

    args = get_args()
    has_mtp = mtp_on_this_rank(args.pipeline_model_parallel_layout, args.mtp_num_layers,
                               ignore_virtual=False, vp_stage=vp_stage)
    if not is_first_or_last_pipeline_stage(vp_stage) and not has_mtp:
        return (None,) * len(_BATCH_KEYS)
    tp_rank = mpu.get_tensor_model_parallel_rank()
    batch = {}
    if tp_rank == 0:
        raw = next(data_iterator)
        device = torch.cuda.current_device()
        batch = {key: raw[key].to(device, non_blocking=True) if raw.get(key) is not None else None
                 for key in _BATCH_KEYS}
        batch["cu_seqlens"] = None
    batch = get_batch_on_this_tp_rank(
        batch,
        has_cu_seqlens=False,
        is_hybrid_cp=False,
        create_attention_mask_in_dataloader=args.create_attention_mask_in_dataloader,
        broadcast_src_rank=mpu.get_tensor_model_parallel_src_rank(),
        broadcast_group=mpu.get_tensor_model_parallel_group(),
        cp_size=args.context_parallel_size,
        tp_rank=tp_rank,
        micro_batch_size=args.micro_batch_size,
        seq_length=args.seq_length,
        mtp_on_this_rank=has_mtp,
        pipeline_model_parallel_size=args.pipeline_model_parallel_size,
        is_pipeline_first_stage=mpu.is_pipeline_first_stage(),
        is_pipeline_last_stage=mpu.is_pipeline_last_stage(),
    )
    batch = get_batch_on_this_cp_rank(batch, is_hybrid_cp=False, cp_group=mpu.get_context_parallel_group())
    return tuple(batch.get(key) for key in _BATCH_KEYS)


def forward_step(data_iterator, model, return_schedule_plan: bool = False):
    from megatron.core.utils import get_attr_wrapped_model
    from megatron.training import get_timers

    timers = get_timers()
    timers("batch-generator", log_level=2).start()
    vp_stage = get_attr_wrapped_model(model, "vp_stage")
    tokens, labels, loss_mask, attention_mask, position_ids = _get_batch(data_iterator, vp_stage)
    timers("batch-generator").stop()
    if return_schedule_plan:
        plan = model.build_schedule_plan(tokens, position_ids, attention_mask, labels=labels, loss_mask=loss_mask)
        return plan, partial(_loss_func, loss_mask, model=model)
    output = model(tokens, position_ids, attention_mask, labels=labels, loss_mask=loss_mask)
    return output, partial(_loss_func, loss_mask, model=model)


def _is_dataset_built_on_rank(vp_stage=None):
    from megatron.core import parallel_state
    from megatron.training.utils import is_first_or_last_pipeline_stage

    return is_first_or_last_pipeline_stage(vp_stage) and parallel_state.get_tensor_model_parallel_rank() == 0


def _dataset_config(args):
    from megatron.core.datasets.gpt_dataset import GPTDatasetConfig
    from megatron.training import get_tokenizer
    from megatron.training.utils import get_blend_and_blend_per_split

    tokenizer = get_tokenizer()
    blend, blend_per_split = get_blend_and_blend_per_split(args)
    return GPTDatasetConfig(
        random_seed=args.seed,
        sequence_length=args.seq_length,
        blend=blend,
        blend_per_split=blend_per_split,
        split=args.split,
        num_dataset_builder_threads=args.num_dataset_builder_threads,
        path_to_cache=args.data_cache_path,
        mmap_bin_files=args.mmap_bin_files,
        tokenizer=tokenizer,
        reset_position_ids=args.reset_position_ids,
        reset_attention_mask=args.reset_attention_mask,
        eod_mask_loss=args.eod_mask_loss,
        create_attention_mask=args.create_attention_mask_in_dataloader,
    )


def train_valid_test_datasets_provider(train_val_test_num_samples, vp_stage=None):
    from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder
    from megatron.core.datasets.gpt_dataset import GPTDataset, MockGPTDataset
    from megatron.training import get_args, print_rank_0

    args = get_args()
    dataset_type = MockGPTDataset if args.mock_data else GPTDataset
    print_rank_0("> building train, validation, and test datasets for GPT ...")
    return BlendedMegatronDatasetBuilder(
        dataset_type, train_val_test_num_samples, partial(_is_dataset_built_on_rank, vp_stage=vp_stage),
        _dataset_config(args),
    ).build()


train_valid_test_datasets_provider.is_distributed = True


def _get_embedding_ranks(pp_ranks):
    """First and last pipeline stages, plus the stages that hold MTP layers."""
    from megatron.training import get_args

    ranks = [pp_ranks[0]] if len(pp_ranks) == 1 else [pp_ranks[0], pp_ranks[-1]]
    try:
        from megatron.core.transformer.multi_token_prediction import get_mtp_ranks
        from megatron.training.argument_utils import core_transformer_config_from_args

        ranks = sorted(set(ranks) | set(get_mtp_ranks(pp_ranks, core_transformer_config_from_args(get_args()))))
    except ImportError:
        pass
    return ranks


def _torch_optimizers(optimizer):
    """The torch optimizers inside Megatron's wrappers (chained, mixed-precision, distributed)."""
    for part in getattr(optimizer, "chained_optimizers", None) or [optimizer]:
        inner = getattr(part, "optimizer", None)
        if isinstance(inner, torch.optim.Optimizer):
            yield inner


def use_fused_torch_adam(optimizer) -> int:
    """Switch the torch Adam/AdamW inside Megatron's optimizer to torch's fused kernel; returns how many.

    Without TransformerEngine or apex, Megatron falls back to ``torch.optim.AdamW`` in its foreach
    form: one kernel per operation, a full fp32 temporary per element of a group (11 GB at the
    one-GPU proxy), several times the memory traffic of the fused Adam those libraries bring. The
    fused kernel applies the same update in one pass (its step counter lives on the device)."""
    switched = 0
    for inner in _torch_optimizers(optimizer):
        if type(inner) not in (torch.optim.Adam, torch.optim.AdamW):
            continue
        for group in inner.param_groups:
            group["foreach"], group["fused"] = False, True
        inner.defaults["foreach"], inner.defaults["fused"] = False, True
        for param, state in inner.state.items():
            if torch.is_tensor(state.get("step")):
                state["step"] = state["step"].to(device=param.device, dtype=torch.float32)
        switched += 1
    return switched


def _install_fused_torch_adam() -> None:
    """Megatron builds its optimizer through ``training.get_megatron_optimizer``; wrap it (idempotent)."""
    import megatron.core.optimizer as mcore_optimizer
    from megatron.training import training

    build = training.get_megatron_optimizer
    if not getattr(mcore_optimizer, "USING_PYTORCH_OPTIMIZER", False) or getattr(build, "__fused_by_mok__", False):
        return

    @functools.wraps(build)
    def get_megatron_optimizer(*args, **kwargs):
        optimizer = build(*args, **kwargs)
        if use_fused_torch_adam(optimizer):
            training.print_rank_0("> megatron_mok: TransformerEngine and apex are not installed; "
                                  "Megatron's torch Adam runs torch's fused kernel")
        return optimizer

    get_megatron_optimizer.__fused_by_mok__ = True
    training.get_megatron_optimizer = get_megatron_optimizer


def main(argv: list[str] | None = None) -> None:
    if argv is not None:
        sys.argv = [sys.argv[0], *argv]
    install()
    _install_fused_torch_adam()
    from megatron.core.enums import ModelType
    from megatron.training import pretrain, set_startup_timestamps
    from megatron.training.argument_utils import gpt_config_from_args, pretrain_cfg_container_from_args
    from megatron.training.arguments import parse_and_validate_args

    set_startup_timestamps(program_start=_PROGRAM_START, main_entry=time.time())
    try:
        args = parse_and_validate_args(args_defaults={"tokenizer_type": "GPT2BPETokenizer"})
    except BackendUnavailableError as err:
        print(f"error: {err}", file=sys.stderr)
        raise SystemExit(2) from None
    cfg = pretrain_cfg_container_from_args(args, gpt_config_from_args(args))
    pretrain(cfg, train_valid_test_datasets_provider, ModelType.encoder_or_decoder, forward_step,
             get_embedding_ranks=_get_embedding_ranks)


if __name__ == "__main__":
    main()
