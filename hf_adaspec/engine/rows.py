"""A request's token rows: one preallocated buffer, written once per step, and the stopping check over a step's
whole accepted span.

``TokenRows.ids`` is ``[B, T_max]`` long on the CPU: row i holds its left padding (``starts[i]`` columns), its
prompt, then its generated tokens, up to ``ends[i]``; a row's padded view ``ids[i, :ends[i]]`` is what logits
processors and stopping criteria see, as in transformers' batched generate. ``emit`` writes a step's new tokens
with one copy and finds where the row stops: EOS and the length cap are read over the span in Python (the
tokens are already on the host: no tensor op, no host read); any other criterion (stop strings, a caller's own)
is asked per prefix, which is exact for a criterion that reads any part of the ids. A row stops at the first
token any criterion stops on; the tokens after it are dropped.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from ..backend import hf_compat
from ..proposers.base import Rows


@dataclass
class TokenRows:
    """Per request: the buffer ids [B, T_max] long, each row's end (padded length) and padding length, the
    prompt width T, the active rows (buffer indices), each row's finish time (ms) and the stopping criteria
    split for span checks (``hf_compat.split_stopping``)."""

    ids: torch.Tensor
    ends: list[int]
    starts: list[int]
    prompt_width: int
    active: list[int]
    finish_ms: list[float]
    stops: hf_compat.StopSplit

    @classmethod
    def open(
        cls,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor,
        max_length: int,
        stopping_criteria: object,
        pad_token_id: int,
    ) -> TokenRows:
        """input_ids, attention_mask [B, T] (left-padded) → rows with room for ``max_length`` tokens each
        (at least T + 1)."""
        batch, width = input_ids.shape
        ids = torch.full((batch, max(max_length, width + 1)), pad_token_id, dtype=torch.long)
        ids[:, :width] = input_ids.cpu()
        starts = (attention_mask.shape[1] - attention_mask.sum(1)).tolist()
        return cls(
            ids,
            [width] * batch,
            starts,
            width,
            list(range(batch)),
            [0.0] * batch,
            hf_compat.split_stopping(stopping_criteria),
        )

    def view(self, i: int) -> torch.Tensor:
        """Row i's padded view [ends[i]] long (a view of the buffer: valid until the row's next ``emit``)."""
        return self.ids[i, : self.ends[i]]

    def current(self) -> Rows:
        """The active rows as drafters see them."""
        return Rows(
            tuple(self.ids[i, : self.ends[i]] for i in self.active),
            tuple(self.starts[i] for i in self.active),
            self.prompt_width,
        )

    def emit(self, slot: int, new: Sequence[int], now_ms: float) -> bool:
        """Append active row ``slot``'s new tokens (ids on the host), cut just after the first token a stopping
        criterion stops on; True when the row stopped."""
        i = self.active[slot]
        end = self.ends[i]
        cut = _first_stop(self.stops, end, new)
        kept = len(new) if cut is None else cut + 1
        if end + kept > self.ids.shape[1]:  # more than max_length (no length criterion): room for what came
            self.ids = torch.cat([self.ids, torch.zeros_like(self.ids)], dim=1)
        if kept == 1:
            self.ids[i, end] = new[0]
        else:
            self.ids[i, end : end + kept] = torch.tensor(new[:kept], dtype=torch.long)
        self.ends[i] = end + kept
        if self.stops.others is not None:  # asked per prefix, up to where EOS or the cap stops the row
            asked = self._ask_others(i, end, kept)
            if asked is not None:
                cut = asked
                self.ends[i] = end + cut + 1
        if cut is not None:
            self.finish_ms[i] = now_ms
        return cut is not None

    def _ask_others(self, i: int, end: int, kept: int) -> int | None:
        """The first of the ``kept`` tokens written after ``end`` on which a remaining criterion stops row i."""
        for j in range(kept):
            if bool(self.stops.others(self.ids[i : i + 1, : end + j + 1], None).all()):
                return j
        return None


def _first_stop(stops: hf_compat.StopSplit, end: int, new: Sequence[int]) -> int | None:
    """Index in ``new`` of the first token that is an EOS or reaches the length cap (None: neither)."""
    for j, token in enumerate(new):
        if token in stops.eos or (stops.max_length is not None and end + j + 1 >= stops.max_length):
            return j
    return None
