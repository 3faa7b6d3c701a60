"""The owner of what hf-adaspec keeps for one enabled model: ``ModelState``, made by ``api.enable``.

A target model's speculative requests leave three kinds of state behind, and each used to live somewhere of
its own (module-level dictionaries keyed by the module, a closure, learned tables keyed by ``id()``). Here one
object holds them, for as long as the model lives:

- ``arenas``: the target's ``backend.arenas.ModelArenas``: its preallocated KV arenas, their recordings and the
  widths it compiles (the draft's are its own ``ModelArenas``: recordings belong to a module object);
- ``learned``: the ``SpeculationState`` its requests learn into: the draft's confidence calibration, keyed by the
  assistant's weights (``policy.modes.assistant_identity``: a new draft model never inherits a collected one's
  calibration), the costless drafters' match tables (one per drafter), the draft's recent caches (per draft
  model object), the recent responses; a request's own ``speculation_state=`` replaces it for that request;
- the thread policy: the ``ThreadChooser`` of the learned state in use (``learned.threads``, or the given
  state's) picks torch's intra-op thread count per step on a CPU (``engine.threads``); torch's count is
  process-wide, so requests on two models at once in two threads still share it; ``run_request`` restores it
  when a request ends.

Contract: one speculative request per model at a time. ``request`` holds the target and the assistant
(``ModelArenas.hold``): a request from another thread waits for the one running, a request started inside
another on the same thread (a streamer or step callback calling ``generate``) raises RuntimeError naming the
fix. Within it the models run speculation's attention (``hf_compat.speculative_attention``); outside it plain
``generate`` runs transformers' own.
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Iterator

import torch

from ..backend import hf_compat
from ..backend.arenas import ModelArenas, arenas_of
from ..policy.modes import assistant_kind
from .run import SpeculationState


class ModelState:
    """Everything kept for one target model across its speculative requests (module docstring): ``arenas``,
    ``learned`` and, in it, the thread chooser; and how its attention and its draft models' is swapped for a
    request (``hf_compat.AttentionSwap``, one per model, each found at its first request). Holds the models
    weakly (the target through its ``ModelArenas``)."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.arenas: ModelArenas = arenas_of(model)
        self.learned = SpeculationState()
        self._swaps: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # model → its attention swap

    def _swap(self, model: torch.nn.Module) -> hf_compat.AttentionSwap:
        swap = self._swaps.get(model)
        if swap is None:
            swap = self._swaps[model] = hf_compat.AttentionSwap(model)
        return swap

    @contextlib.contextmanager
    def request(
        self, assistant: torch.nn.Module | None, state: SpeculationState | None = None
    ) -> Iterator[SpeculationState]:
        """One speculative request of this state's model with ``assistant`` (a draft model, a draft head or None):
        within the block the models are held (another thread's request waits) and run speculation's attention (a
        draft head's is its own); yields the learned state to use, ``state`` if given, else ``learned``.
        Afterwards the models have their own attention again.

        Raises:
            RuntimeError: the model or ``assistant`` is already in a request on this thread.
        """
        model = self.arenas.model
        held = [model] if assistant is None or assistant is model else [model, assistant]
        draft = assistant if assistant_kind(assistant) == "model" else None
        with contextlib.ExitStack() as stack:
            for owner in sorted((arenas_of(m) for m in held), key=id):  # one order: no two requests deadlock
                stack.enter_context(owner.hold())
            swaps = [self._swap(m) for m in held if m is model or m is draft]
            stack.enter_context(hf_compat.speculative_attention(*swaps))
            yield self.learned if state is None else state
