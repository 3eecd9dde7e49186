"""What runs once per training step, around Megatron's ``train_step`` (installed by ``install()``).

* Before the step: ``--mok-param-digest-every N`` prints a digest of the parameters' bits.
* After the step: mok's device error flags are read (``check_workspace_errors``, sync-free). Each
  mok call reads them itself in eager steps; under ``--cuda-graph-impl full_iteration`` the step's
  forward and backward replay as one CUDA graph, in which no Python of the layers runs.
"""

from __future__ import annotations

import functools

import torch

from ..workspace import check_workspace_errors


def param_digest(module: torch.nn.Module) -> str:
    """64-bit digest of every parameter's bits, sensitive to values, positions and parameter order.

    Integer sums (wrapping int64) do not depend on the reduction order, so the digest is itself
    deterministic; any changed bit changes it (barring a 2**-64 coincidence)."""
    params = sorted(module.named_parameters(), key=lambda kv: kv[0])
    dev = params[0][1].device if params else "cpu"
    total = torch.zeros((), dtype=torch.int64, device=dev)
    chunk = 1 << 24
    for i, (_name, p) in enumerate(params):
        flat = p.detach().reshape(-1)
        bits = flat.view({1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[flat.element_size()])
        for start in range(0, bits.numel(), chunk):
            part = bits[start:start + chunk].to(torch.int64)
            pos = torch.arange(start + 1, start + 1 + part.numel(), dtype=torch.int64, device=dev)
            total += (part * pos).sum() * (2 * i + 1)
    return f"{int(total) & (2**64 - 1):016x}"


def maybe_print_digest(model, args) -> None:
    """The digest of the first model chunk, every ``--mok-param-digest-every`` iterations and at the
    last one (it syncs the host, so it is off by default). Any --moe-backend."""
    every = getattr(args, "mok_param_digest_every", 0) or 0
    it = getattr(args, "curr_iteration", None)
    if every <= 0 or it is None:
        return
    if it % every and it != args.train_iters - 1:
        return
    chunk = model[0] if isinstance(model, (list, tuple)) else model
    rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
    print(f"[megatron_mok] param-digest rank={rank} iteration={it} value={param_digest(chunk)}", flush=True)


def _wrap_train_step(original):
    @functools.wraps(original)
    def train_step(forward_step_func, data_iterator, model, *args, **kwargs):
        from megatron.training import get_args

        maybe_print_digest(model, get_args())
        out = original(forward_step_func, data_iterator, model, *args, **kwargs)
        check_workspace_errors()
        return out

    train_step.__wrapped_by_mok__ = True
    return train_step


def install_step_hooks() -> None:
    """Wrap ``megatron.training.training.train_step``, which Megatron's ``train`` calls by name (idempotent)."""
    from megatron.training import training

    if not getattr(training.train_step, "__wrapped_by_mok__", False):
        training.train_step = _wrap_train_step(training.train_step)
