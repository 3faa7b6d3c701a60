"""Whether a step can be recorded as a CUDA graph, checked on any machine: the step runs with every host read and
every data-dependent shape refused.

A CUDA graph records the kernels a step launches; the host may not wait for the device inside it. An op that
reads a value back (``.item()``, ``.tolist()``, ``int(t)``, ``bool(t)``, ``if t:``, ``torch.equal``), an op
whose output shape depends on the values (``nonzero``, ``torch.where(mask)``, ``unique``, boolean-mask indexing
``x[mask]`` and ``x[mask] = v``, ``masked_select``), a copy to the host (``.cpu()``, ``.numpy()``) or a tensor
made on the host and copied in (``torch.arange(n)`` with no device) synchronises, and the capture fails with
``cudaErrorStreamCaptureUnsupported`` (then ``…Invalidated``). ``refusing_host_reads`` finds each of these
where they are written, on a CPU: a ``TorchDispatchMode`` refuses the aten ops torch tags as data-dependent
(``Tag.data_dependent_output``, ``Tag.dynamic_output_shape``; advanced indexing is refused only with a boolean
index), a ``TorchFunctionMode`` refuses the host copies that never reach aten on a CPU (``tolist``, ``numpy``,
``cpu``, ``.to("cpu")``), and tensors made without a device land on the ``meta`` device, which the dispatch mode
refuses (0-dim ones too, which a GPU would take as host scalars: stricter than a capture needs). Not seen:
``.to(torch.device("cpu"))`` (on a CPU that is a tensor's own device), and calls that are not tensor ops
(``torch.cuda.synchronize``, a hook's clock, a C kernel called through ctypes).

Why not a tracer: on torch 2.13 ``make_fx(tracing_mode="fake")`` passed ``.item()``, ``.tolist()``, ``nonzero``,
boolean-mask indexing and a host ``arange`` (it stopped only at ``int(t)``), and ``torch.compile(fullgraph=True)``
passed all of them but ``.tolist()``: both turn values into unbacked symbols, and neither tells a host tensor on a
CPU from a device one.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

HOST = torch.device("meta")  # where a tensor made without a device lands inside the check
_DATA_DEPENDENT = (torch.Tag.data_dependent_output, torch.Tag.dynamic_output_shape)
_INDEXING = frozenset(
    {
        torch.ops.aten.index.Tensor,
        torch.ops.aten.index_put.default,
        torch.ops.aten.index_put_.default,
        torch.ops.aten._unsafe_index.Tensor,
        torch.ops.aten._unsafe_index_put.default,
    }
)
_HOST_COPIES = frozenset({torch.Tensor.tolist, torch.Tensor.numpy, torch.Tensor.cpu, torch.Tensor.__array__})


class CaptureUnsafe(RuntimeError):
    """An op a CUDA graph cannot record (a host read, a data-dependent shape, a host tensor); the message names
    the op and why."""


def _refusal(func, args: tuple, kwargs: dict) -> str | None:
    """Why aten op ``func`` on these arguments cannot be recorded, or None."""
    tensors = [t for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
    if any(t.device == HOST for t in tensors):
        return "it reads a tensor made on the host (a factory call without device=)"
    if func in _INDEXING:
        indices = args[1] if len(args) > 1 else kwargs.get("indices", ())
        if any(i is not None and i.dtype in (torch.bool, torch.uint8) for i in indices):
            return "boolean-mask indexing has a data-dependent shape (use masked_fill / torch.where(m, a, b))"
        return None
    tags = set(func.tags) & set(_DATA_DEPENDENT)
    if torch.Tag.data_dependent_output in tags:
        return "it reads a value back to the host"
    if tags:
        return "its output's shape depends on the values"
    return None


class _RefuseOps(TorchDispatchMode):
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        why = _refusal(func, args, kwargs)
        if why is not None:
            raise CaptureUnsafe(f"{func} cannot be recorded in a CUDA graph: {why}")
        out = func(*args, **kwargs)
        if any(isinstance(t, torch.Tensor) and t.device == HOST for t in tree_leaves(out)):
            raise CaptureUnsafe(f"{func} made a tensor on the host inside a recorded step (no device= given)")
        return out


def _to_host(args: tuple, kwargs: dict | None) -> bool:
    """Whether a ``Tensor.to`` call with these arguments names the CPU in a string ("cpu"; a ``torch.device``
    passes: on a CPU it cannot be told from a tensor's own ``.device``, which is the GPU there)."""
    targets = (*args[1:], (kwargs or {}).get("device"))
    return any(isinstance(a, str) and torch.device(a).type == "cpu" for a in targets)


class _RefuseHostCopies(TorchFunctionMode):
    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func in _HOST_COPIES or (func is torch.Tensor.to and _to_host(args, kwargs)):
            raise CaptureUnsafe(f"Tensor.{func.__name__} copies to the host inside a recorded step")
        return func(*args, **(kwargs or {}))


@contextlib.contextmanager
def refusing_host_reads() -> Iterator[None]:
    """Inside: any op a CUDA graph capture cannot record raises ``CaptureUnsafe`` naming it (see the module
    docstring for the list); everything else runs as usual, on the tensors' own device. Tensors made without a
    device land on the ``meta`` device (refused when used). Raises CaptureUnsafe."""
    with torch.device(HOST), _RefuseHostCopies(), _RefuseOps():
        yield
