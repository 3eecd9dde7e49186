"""megatron-mok: a deterministic fused MoE layer for Megatron-Core on Hopper.

The package is pure Python unless the CUDA extension is built. It is built for sm_90a when
MOK_BUILD_EXT=1 is set, or when CUDA is available and MOK_BUILD_EXT is not 0.
"""

import glob
import importlib.util
import os

import setuptools


def _want_extension() -> bool:
    flag = os.environ.get("MOK_BUILD_EXT")
    if flag is not None:
        return flag == "1"
    try:
        import torch
    except ImportError:
        return False
    return torch.cuda.is_available()


def _cutlass_include() -> list[str]:
    spec = importlib.util.find_spec("cutlass_library")
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError(
            "building the mok CUDA extension needs the CUTLASS headers: "
            "pip install --no-deps nvidia-cutlass==4.2.0.0"
        )
    return [os.path.join(spec.submodule_search_locations[0], "source", "include")]


ext_modules, cmdclass = [], {}
if _want_extension():
    from torch.utils.cpp_extension import BuildExtension, CUDAExtension

    here = os.path.dirname(os.path.abspath(__file__))
    # the torch op bindings by stage (csrc/bindings/*.cpp) and the kernel library by concern
    # (csrc/kernels/{comm,gemm,quant,passes}/*.cu)
    sources = sorted(os.path.relpath(p, here) for p in glob.glob(os.path.join(here, "csrc/bindings/*.cpp"))) + sorted(
        os.path.relpath(p, here) for p in glob.glob(os.path.join(here, "csrc/kernels/**/*.cu"), recursive=True)
    )
    ext_modules = [
        CUDAExtension(
            "megatron_mok._C",
            sources,
            include_dirs=[os.path.join(here, "csrc"), os.path.join(here, "csrc/kernels")] + _cutlass_include(),
            extra_compile_args={
                "cxx": ["-O3", "-std=c++17"],
                "nvcc": [
                    "-O3", "-DNDEBUG", "-std=c++17",
                    "-gencode=arch=compute_90a,code=sm_90a",
                    "--expt-relaxed-constexpr", "--expt-extended-lambda", "-lineinfo",
                    "-Xptxas=--warn-on-spills",
                ],
            },
        )
    ]
    cmdclass = {"build_ext": BuildExtension}

setuptools.setup(ext_modules=ext_modules, cmdclass=cmdclass)
