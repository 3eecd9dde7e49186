"""CPU compatibility layer: run Megatron's training loop on CPU ranks (gloo) when no GPU exists.

Megatron-Core calls CUDA in places even with ``--transformer-impl local`` (device placement via
``torch.cuda.current_device()``, streams, events, memory statistics, RNG tracker forks, ...).
This module maps those calls onto the CPU. It is active only when ``torch.cuda.is_available()`` is
False, and only after ``activate_if_no_gpu()`` (called by ``megatron_mok.adapter.install``). On a
GPU machine it does nothing, and the same command runs on NCCL and the GPUs.

Every patch is listed in ``PATCHES`` (name -> why), and ``tests/test_cpu_compat.py`` covers them.

Known difference from a GPU run: Megatron's CUDA RNG tracker streams are not emulated (every fork
draws from the one CPU generator, seeded identically on every rank), so the experts of different
expert-parallel ranks start from the same weights on CPU. Runs stay deterministic; only the
initial weights differ from a GPU run's.
"""

from __future__ import annotations

import contextlib
import functools

import torch
from torch.overrides import TorchFunctionMode

_ACTIVE = False

PATCHES: dict[str, str] = {}


def is_active() -> bool:
    return _ACTIVE


def _patch(owner, name: str, value, why: str) -> None:
    setattr(owner, name, value)
    PATCHES[f"{getattr(owner, '__name__', owner)}.{name}"] = why


class _DummyStream:
    """Stands in for torch.cuda.Stream: CPU work is already ordered."""

    def __init__(self, *args, **kwargs):
        pass

    def wait_stream(self, stream):
        pass

    def wait_event(self, event):
        pass

    def synchronize(self):
        pass

    def record_event(self, event=None):
        return event or _DummyEvent()

    def query(self):
        return True

    cuda_stream = 0


class _DummyEvent:
    """Stands in for torch.cuda.Event; elapsed_time is measured with the host clock."""

    def __init__(self, *args, **kwargs):
        self._t = None

    def record(self, stream=None):
        import time

        self._t = time.perf_counter()

    def wait(self, stream=None):
        pass

    def synchronize(self):
        pass

    def query(self):
        return True

    def elapsed_time(self, end):
        return (end._t - self._t) * 1000.0


def _cpu_current_device():
    return torch.device("cpu")


def _is_cuda_device(dev) -> bool:
    if isinstance(dev, torch.device):
        return dev.type == "cuda"
    if isinstance(dev, str):
        return dev.startswith("cuda")
    return isinstance(dev, int) and not isinstance(dev, bool)


class _CudaDeviceToCpu(TorchFunctionMode):
    """Rewrites ``device="cuda"`` (or an int device index) in any torch call to the CPU.

    Megatron creates tensors with ``device="cuda"`` or ``device=torch.cuda.current_device()`` in
    many places (model parallel mappings, JIT warm-up, MoE buffers, loss reporting).
    """

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if "device" in kwargs and _is_cuda_device(kwargs["device"]):
            kwargs = {**kwargs, "device": "cpu"}
        if func is torch.Tensor.to and len(args) > 1 and _is_cuda_device(args[1]):
            args = (args[0], "cpu", *args[2:])
        return func(*args, **kwargs)


def activate_if_no_gpu() -> bool:
    """Activate the CPU layer when there is no GPU; return whether it is active."""
    global _ACTIVE
    if _ACTIVE or torch.cuda.is_available():
        return _ACTIVE
    cuda = torch.cuda
    _patch(cuda, "current_device", _cpu_current_device, "tensors Megatron places on the current device go to the CPU")
    _patch(cuda, "Stream", _DummyStream, "dispatchers and DDP create side streams")
    _patch(cuda, "Event", _DummyEvent, "timers and DDP record events")
    _patch(cuda, "current_stream", lambda device=None: _DummyStream(), "stream bookkeeping")
    _patch(cuda, "default_stream", lambda device=None: _DummyStream(), "stream bookkeeping")
    _patch(cuda, "stream", lambda s=None: contextlib.nullcontext(), "`with torch.cuda.stream(s)` blocks")
    _patch(cuda, "set_stream", lambda s: None, "stream bookkeeping")
    _patch(cuda, "synchronize", lambda device=None: None, "timers synchronize before reading clocks")
    _patch(cuda, "set_device", lambda device: None, "distributed init pins a device")
    _patch(cuda, "device_count", lambda: 1,
           "Megatron initializes model-parallel groups and seeds only when it sees a device")
    _patch(cuda, "manual_seed", lambda seed: None, "seeding: the CPU generator is seeded by torch.manual_seed")
    _patch(cuda, "manual_seed_all", lambda seed: None, "seeding")
    _patch(cuda, "get_rng_state", lambda device="cuda": torch.get_rng_state(), "RNG state in checkpoints")
    _patch(cuda, "set_rng_state", lambda state, device="cuda": None, "RNG state in checkpoints")
    _patch(cuda, "empty_cache", lambda: None, "memory housekeeping")
    for stat in ("memory_allocated", "max_memory_allocated", "memory_reserved", "max_memory_reserved"):
        _patch(cuda, stat, lambda device=None: 0, "memory reports (no device memory on CPU)")
    _patch(cuda, "reset_peak_memory_stats", lambda device=None: None, "memory reports")
    _patch(cuda, "memory_stats", lambda device=None: {}, "memory reports")
    _patch(torch.Tensor, "cuda", lambda self, *a, **k: self, "`.cuda()` calls keep tensors on the CPU")
    _CudaDeviceToCpu().__enter__()  # stays on for the life of the process
    PATCHES["torch (function mode)"] = _CudaDeviceToCpu.__doc__.splitlines()[0]
    _ACTIVE = True
    _patch_megatron()
    return True


def _patch_megatron() -> None:
    """Megatron-specific CUDA assumptions (see reference/megatron.md §6)."""
    from megatron.core.tensor_parallel import random as tp_random
    from megatron.core.transformer.moe import router

    _patch(tp_random.CudaRNGStatesTracker, "fork",
           lambda self, name=None: contextlib.nullcontext(),
           "the CUDA RNG tracker forks per-TP-rank RNG states (dropout); CPU ranks share torch's RNG")

    original_gating = router.Router.gating

    @functools.wraps(original_gating)
    def gating(self, input):
        from megatron.core.transformer.moe.moe_utils import router_gating_linear

        dtype = self.config.moe_router_dtype
        router_dtype = {"fp32": torch.float32, "fp64": torch.float64}.get(dtype, input.dtype)
        return router_gating_linear(input, self.weight, self.bias, router_dtype)

    _patch(router.Router, "gating", gating, "Router.gating moves its weight to the CUDA device")

    from megatron.core.optimizer import clip_grads, optimizer

    def clip_grad_by_total_norm_fp32(parameters, max_norm, total_norm, use_decoupled_grad=False):
        if isinstance(parameters, torch.Tensor):
            parameters = [parameters]
        attr = "decoupled_grad" if use_decoupled_grad else "grad"
        grads = [getattr(p, attr).detach() for p in parameters if getattr(p, attr, None) is not None]
        clip_coeff = max_norm / (total_norm + 1.0e-6)
        if isinstance(clip_coeff, torch.Tensor):
            clip_coeff = clip_coeff.clamp_max(1.0)
        elif clip_coeff >= 1.0:
            return
        for g in grads:
            g.mul_(clip_coeff)

    for module in (clip_grads, optimizer):
        _patch(module, "clip_grad_by_total_norm_fp32", clip_grad_by_total_norm_fp32,
               "gradient clipping asserts torch.cuda.FloatTensor gradients")

    from megatron.core.transformer.moe import token_dispatcher

    def maybe_move_tensor_to_cpu(tensor, as_numpy=False, record_stream=False):
        if torch.is_tensor(tensor) and as_numpy:
            return tensor.numpy()
        return tensor

    _patch(token_dispatcher, "maybe_move_tensor_to_cpu", maybe_move_tensor_to_cpu,
           "the alltoall dispatcher's split sizes stay CPU tensors instead of becoming numpy arrays")

    from megatron.training import training

    _patch(training, "initialize_megatron",
           functools.partial(training.initialize_megatron, allow_no_cuda=True),
           "pretrain() asserts that CUDA is available")


def adjust_args(args) -> None:
    """Settings a CPU run needs, applied after parsing (before Megatron validates them)."""
    args.distributed_backend = "gloo"
    args.use_cpu_initialization = True
    args.gradient_accumulation_fusion = False
    args.bias_swiglu_fusion = False
    args.bias_dropout_fusion = False
    args.masked_softmax_fusion = False
    args.apply_rope_fusion = False
    args.moe_grouped_gemm = False
    args.moe_permute_fusion = False
    args.moe_router_fusion = False
    args.cross_entropy_loss_fusion = False
