"""Reproduce an AVX2-only processor's paths on a CPU with AVX512-BF16 (issue 44).

On PYTHONPATH together with ``ATEN_CPU_CAPABILITY=avx2`` (torch's own kernels):
``bitsandbytes.functional.has_avx512bf16`` returns False from the moment that module is imported, before
bitsandbytes' CPU backend binds it, so NF4 takes the dequantize-then-multiply path it takes on most consumer
CPUs; ``ATEN_CPU_CAPABILITY=avx2`` also caps our q4 kernel at its AVX2 path (``hf_adaspec.kernels.q4.path``).
On a CPU with AMX, torch 2.13's bfloat16 flash attention over 64 or more queries raises "pack_vnni2 is only
supported when avx512 is supported" under ``ATEN_CPU_CAPABILITY=avx2`` (every prefill of 64 tokens or more
fails): there, and only for such calls (bfloat16 on the CPU, at least 64 queries), ``scaled_dot_product_attention``
runs in float32 and casts its output back to bfloat16. Decoding steps (1 to k + 1 queries) are untouched, so a
timed generation differs from an AVX2-only CPU's only in the attention of a long prefill.
Usage: ``PYTHONPATH=benchmarks/avx2 ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2 hf-adaspec generate`` (the last
caps oneDNN, whose bf16 matmul the dense prefill route calls, at AVX2 too). torch.compile's cache goes to a folder of
this path's own (``TORCHINDUCTOR_CACHE_DIR``, unless set): graphs compiled on one path must not load on the other.
"""

import functools
import importlib.abc
import importlib.machinery
import os
import sys
import tempfile

_FLASH_QUERIES = 64  # from this many queries torch's bf16 CPU flash attention packs with AVX-512 (pack_vnni2)


def _no_avx512bf16(module) -> None:
    module.has_avx512bf16 = lambda: False


def _attention_in_float32_from_64_queries(module) -> None:
    import torch  # being initialised: its torch.nn.functional is what is patched here; dtypes are read at call time

    sdpa = module.scaled_dot_product_attention

    @functools.wraps(sdpa)
    def attention(query, key, value, attn_mask=None, *args, **kwargs):
        if query.dtype != torch.bfloat16 or query.device.type != "cpu" or query.shape[-2] < _FLASH_QUERIES:
            return sdpa(query, key, value, attn_mask, *args, **kwargs)
        mask = attn_mask.float() if attn_mask is not None and attn_mask.is_floating_point() else attn_mask
        return sdpa(query.float(), key.float(), value.float(), mask, *args, **kwargs).to(torch.bfloat16)

    module.scaled_dot_product_attention = attention


_PATCHES = {"bitsandbytes.functional": _no_avx512bf16, "torch.nn.functional": _attention_in_float32_from_64_queries}


class _PatchingLoader(importlib.abc.Loader):
    def __init__(self, loader, patch):
        self.loader, self.patch = loader, patch

    def create_module(self, spec):
        return self.loader.create_module(spec)

    def exec_module(self, module):
        self.loader.exec_module(module)
        self.patch(module)


class _Finder(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name not in _PATCHES:
            return None
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        if spec is not None:
            spec.loader = _PatchingLoader(spec.loader, _PATCHES[name])
        return spec


sys.meta_path.insert(0, _Finder())
# torch.compile's cache in a folder of the AVX2 path's own (unless one is set): inductor's cache key does not hold
# ATEN_CPU_CAPABILITY, and a graph compiled on one path and loaded on the other aborts in mm ("free(): invalid
# pointer"; tests/test_static_kv.py's compiled recording, torch 2.13)
os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", os.path.join(tempfile.gettempdir(), "torchinductor-avx2-path"))
