"""The CPU compatibility layer: active only without a GPU, and each patch does what it says."""

from __future__ import annotations

import subprocess
import sys
import textwrap


def _python(code: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, timeout=300)


def test_inactive_when_a_gpu_is_present():
    proc = _python("""
        import torch
        torch.cuda.is_available = lambda: True
        from megatron_mok.adapter import cpu_compat
        assert cpu_compat.activate_if_no_gpu() is False
        assert not cpu_compat.is_active() and cpu_compat.PATCHES == {}
        assert torch.cuda.current_device is not cpu_compat._cpu_current_device
        print("ok")
    """)
    assert proc.returncode == 0 and "ok" in proc.stdout, proc.stderr[-3000:]


def test_patches_map_cuda_onto_the_cpu():
    proc = _python("""
        import torch
        if torch.cuda.is_available():
            print("skip"); raise SystemExit
        from megatron_mok.adapter import cpu_compat
        assert cpu_compat.activate_if_no_gpu() is True and cpu_compat.is_active()
        assert cpu_compat.activate_if_no_gpu() is True  # idempotent
        assert len(cpu_compat.PATCHES) >= 20 and all(cpu_compat.PATCHES.values())
        # device="cuda" and integer device indices land on the CPU
        for t in (torch.zeros(2, device="cuda"), torch.empty(3, device=torch.cuda.current_device()),
                  torch.ones(1, device=0), torch.arange(4).to("cuda"), torch.arange(2).cuda()):
            assert t.device.type == "cpu", t.device
        # streams, events and timers work
        s = torch.cuda.Stream(); s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            pass
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record(); b.record(); b.synchronize()
        assert a.elapsed_time(b) >= 0
        torch.cuda.synchronize(); assert torch.cuda.max_memory_allocated() == 0
        # Megatron's router and clipping run on CPU tensors
        from megatron.core.optimizer import clip_grads
        p = torch.nn.Parameter(torch.ones(4)); p.grad = torch.full((4,), 2.0)
        clip_grads.clip_grad_by_total_norm_fp32([p], max_norm=1.0, total_norm=4.0)
        assert torch.allclose(p.grad, torch.full((4,), 0.5), rtol=1e-5)
        from megatron.core.transformer.moe import token_dispatcher
        assert token_dispatcher.maybe_move_tensor_to_cpu(torch.tensor([1, 2]), as_numpy=True).tolist() == [1, 2]
        print("ok")
    """)
    assert proc.returncode == 0 and proc.stdout.strip().splitlines()[-1] in ("ok", "skip"), proc.stderr[-3000:]
