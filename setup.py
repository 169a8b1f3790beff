"""Builds pagedserve's native CPU op library at install time (`pip install
--no-build-isolation -e .`; the Makefile does it). Metadata lives in pyproject.toml.

The library is one shared object whose ops register themselves with torch
(`TORCH_LIBRARY_FRAGMENT`), loaded by `torch.ops.load_library`: it needs neither
pybind11 nor torch/extension.h, which keeps each file's compile short. Where the
build fails or the CPU lacks AVX2/FMA/F16C, pagedserve runs its pure-torch path
(pagedserve.kernels decides at run time).
"""
from pathlib import Path

from setuptools import setup

try:
    from torch.utils.cpp_extension import BuildExtension, CppExtension
except ImportError:  # building without torch: the pure-torch path only
    ext_modules, cmdclass = [], {}
else:
    sources = sorted(str(p) for p in Path("src/pagedserve/kernels/csrc").glob("*.cpp"))
    ext_modules = [
        CppExtension(
            "pagedserve.kernels._C",
            sources,
            extra_compile_args=["-O3", "-mavx2", "-mfma", "-mf16c", "-fopenmp", "-std=c++20"],
            extra_link_args=["-fopenmp"],
        )
    ]
    cmdclass = {"build_ext": BuildExtension.with_options(no_python_abi_suffix=True)}

setup(ext_modules=ext_modules, cmdclass=cmdclass)
