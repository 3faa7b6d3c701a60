"""Where a q4 model's dense route starts on this machine (``kernels.route``), measured once and cached.

Design: the crossover is a property of the processor, torch's matmul and the layer's shape, not of the
prompt, so it is timed at a model's first load here on its largest q4 layer (``kernels.route.measure``) and read
back at later loads: ``<cache>/routes/<key>.json`` (atomic, with a digest; the rows timed and their ms beside the
decision) per processor, torch's thread count, version and CPU level, kernel source and path, dtype and the layer's
shape and kinds. A cached decision keeps a model's outputs the same from one load to the next.
"""

from __future__ import annotations

import hashlib
import json

import torch

from .. import machine
from ..files import read_json_verified, write_json_verified
from ..kernels import q4, q4_layer, route
from .assets import cache_dir


def apply(model: torch.nn.Module) -> int | None:
    """Set every q4 layer of ``model`` to take the dense route from the row count ``threshold`` gives for its
    largest q4 layer, and return it (None: no q4 layer, or the kernel was faster at every count measured)."""
    layer = route.largest(model)
    rows = None if layer is None else threshold(layer, model.dtype)
    route.set_rows(model, rows)
    return rows


def threshold(layer: q4_layer.Q4Linear, dtype: torch.dtype) -> int | None:
    """From how many activation rows of ``dtype`` ``layer`` is faster through dense weights (one of
    ``route.ROWS``; None: never there): the cached decision, else measured now (``route.measure``) and cached."""
    key = _key(layer, dtype)
    where = cache_dir() / "routes" / f"{hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]}.json"
    try:
        doc = read_json_verified(where)
        if doc["key"] == key:
            return doc["rows"]
    except (OSError, ValueError, KeyError, TypeError):
        pass
    measured, kernel_ms, dense_ms = route.measure(layer, dtype)
    rows = route.crossover(tuple(measured), kernel_ms, dense_ms)
    write_json_verified(
        where, {"key": key, "rows": rows, "measured_rows": measured, "kernel_ms": kernel_ms, "dense_ms": dense_ms}
    )
    return rows


def _key(layer: q4_layer.Q4Linear, dtype: torch.dtype) -> dict:
    """What the crossover depends on: the machine and libraries, the kernel and its path, the dtype, the rows
    measured and the layer's shape and kinds."""
    return {
        "processor": machine.processor_name(),
        "threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "aten_cpu": torch.backends.cpu.get_cpu_capability(),
        "q4_kernel": q4.source_tag(),
        "q4_path": q4.path(layer.directory),
        "dtype": str(dtype),
        "rows": list(route.ROWS),
        "in": layer.in_features,
        "out": layer.out_features,
        "kinds": list(layer.kinds),
    }
