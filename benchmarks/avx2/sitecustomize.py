"""Reproduce an AVX2-only processor's paths on a CPU with AVX512-BF16 (issue 44).

On PYTHONPATH together with ``ATEN_CPU_CAPABILITY=avx2`` (torch's own kernels):
``bitsandbytes.functional.has_avx512bf16`` returns False from the moment that module is imported, before
bitsandbytes' CPU backend binds it, so NF4 takes the dequantize-then-multiply path it takes on most consumer
CPUs; ``ATEN_CPU_CAPABILITY=avx2`` also caps our q4 kernel at its AVX2 path (``hf_adaspec.kernels.q4.path``).
Nothing else changes. Not on a CPU with AMX: there torch 2.13's bfloat16 flash attention over 64 or more queries
raises "pack_vnni2 is only supported when avx512 is supported" under ``ATEN_CPU_CAPABILITY=avx2`` (a prefill fails);
compare the kernel's paths there with ``benchmarks/verify_curve.py``.
Usage: ``PYTHONPATH=benchmarks/avx2 ATEN_CPU_CAPABILITY=avx2 hf-adaspec generate``.
"""

import importlib.abc
import importlib.machinery
import sys

_MODULE = "bitsandbytes.functional"


class _PatchingLoader(importlib.abc.Loader):
    def __init__(self, loader):
        self.loader = loader

    def create_module(self, spec):
        return self.loader.create_module(spec)

    def exec_module(self, module):
        self.loader.exec_module(module)
        module.has_avx512bf16 = lambda: False


class _Finder(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name != _MODULE:
            return None
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        if spec is not None:
            spec.loader = _PatchingLoader(spec.loader)
        return spec


sys.meta_path.insert(0, _Finder())
