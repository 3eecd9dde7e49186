"""The SwiGLU backward's divisions (csrc/kernels/gemm/swiglu.cuh): ``silu_and_sigmoid``, which
divides by 1 + exp(-g) with a shared reciprocal refined by FMAs and no branch, gives the bits of
``silu`` and of ``__fdiv_rn(1, 1 + __expf(-g))`` for every one of the 2^32 fp32 values of g (so
also for every bf16 pre-activation the backward reads), in the group sizes the kernels use. A probe
kernel compiled here with nvcc against the library's header runs them all on the GPU."""

from __future__ import annotations

import ctypes
import os
import shutil
import subprocess
from pathlib import Path

import pytest
import torch

from ._util import gpu_marks

pytestmark = gpu_marks()

ROOT = Path(__file__).resolve().parents[2]

PROBE = r"""
#include <stdint.h>
#include "gemm/swiglu.cuh"

// Every fp32 bit pattern, N consecutive ones a group: mismatches counted, the smallest one kept.
template <int N>
__global__ void probe(unsigned long long* bad, unsigned int* first) {
  const uint64_t groups = (1ull << 32) / N;
  for (uint64_t i = blockIdx.x * (uint64_t)blockDim.x + threadIdx.x; i < groups; i += (uint64_t)gridDim.x * blockDim.x) {
    float g[N], s[N], sig[N];
#pragma unroll
    for (int j = 0; j < N; ++j) g[j] = __uint_as_float(static_cast<uint32_t>(N * i + j));
    mok::silu_and_sigmoid<N>(g, s, sig);
#pragma unroll
    for (int j = 0; j < N; ++j) {
      const float s0 = mok::silu(g[j]);
      const float sig0 = __fdiv_rn(1.0f, __fadd_rn(1.0f, __expf(-g[j])));
      if (__float_as_uint(s0) != __float_as_uint(s[j]) || __float_as_uint(sig0) != __float_as_uint(sig[j])) {
        atomicAdd(bad, 1ull);
        atomicMin(first, static_cast<uint32_t>(N * i + j));
      }
    }
  }
}

extern "C" int run_probe(int n, unsigned long long* bad, unsigned int* first) {
  if (n == 2) probe<2><<<1056, 256>>>(bad, first);
  else if (n == 4) probe<4><<<1056, 256>>>(bad, first);
  else if (n == 8) probe<8><<<1056, 256>>>(bad, first);
  else return -1;
  return static_cast<int>(cudaDeviceSynchronize());
}
"""


def _nvcc() -> str | None:
    home = os.environ.get("CUDA_HOME", "/usr/local/cuda")
    found = shutil.which("nvcc") or os.path.join(home, "bin", "nvcc")
    return found if os.path.exists(found) else None


@pytest.fixture(scope="module")
def probe_lib(tmp_path_factory):
    nvcc = _nvcc()
    if nvcc is None:
        pytest.skip("nvcc not found: the probe kernel is compiled at test time")
    d = tmp_path_factory.mktemp("swiglu_probe")
    (d / "probe.cu").write_text(PROBE)
    so = d / "probe.so"
    subprocess.run([nvcc, "-gencode=arch=compute_90a,code=sm_90a", "-O3", "-std=c++17", "-shared", "-Xcompiler",
                    "-fPIC", "-I", str(ROOT / "csrc" / "kernels"), "-o", str(so), str(d / "probe.cu")],
                   check=True, capture_output=True, text=True)
    lib = ctypes.CDLL(str(so))
    lib.run_probe.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p]
    return lib


@pytest.mark.parametrize("n", [2, 4, 8])
def test_silu_and_sigmoid_give_the_ieee_division_bits_for_every_fp32_value(probe_lib, n):
    torch.cuda.init()
    torch.cuda.set_device(0)
    bad = torch.zeros(1, dtype=torch.int64, device="cuda:0")
    first = torch.full((1,), -1, dtype=torch.int32, device="cuda:0")  # 0xffffffff: none
    torch.cuda.synchronize()
    assert probe_lib.run_probe(n, bad.data_ptr(), first.data_ptr()) == 0
    mismatches = int(bad.item())
    first_bits = int(first.item()) & 0xFFFFFFFF
    assert mismatches == 0, f"{mismatches} fp32 values differ (group of {n}), the first 0x{first_bits:08x}"
