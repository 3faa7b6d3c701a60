"""An arena's sizes: its rows and columns for a request, and the widths its blocks run and are recorded at.

Design: plain integer arithmetic, no tensors, so the cost table, the caches and the arenas' owner size things
alike without touching an arena (``static_kv.Arena`` holds what these choose). Rows and columns are powers of
two, so a few arena shapes serve every request (columns at least ``CAPACITY_FLOOR``; attention reads every column,
so a step's cost depends on this bucket and the profile measures a context at ``capacity_for`` of it). A padding
arena (a GPU's) runs a block at the next of the bucket widths 1, 2, 3, 5, 9, …, graph_width, so a few recordings
serve every verification and catch-up width; elsewhere a block runs at its own width.
"""

from __future__ import annotations

import functools

CAPACITY_FLOOR = 256  # the smallest arena, in columns
STANDARD_NEW_TOKENS = 256  # a request's length when only its context is known (the profile's cells)


def next_power(n: int, floor: int = 1) -> int:
    """The smallest power of two ≥ n (at least ``floor``): an arena's rows for n batch rows, its columns."""
    return max(floor, 1 << max(0, n - 1).bit_length())


def capacity_for(context: int, new_tokens: int = STANDARD_NEW_TOKENS) -> int:
    """Columns of the arena a request of ``context`` tokens that generates ``new_tokens`` more is given: the
    next power of two ≥ their sum (at least ``CAPACITY_FLOOR``). Attention reads every column, so a step's
    cost depends on this bucket; the profile measures a context c at ``capacity_for(c)``."""
    if context < 0 or new_tokens < 0:
        raise ValueError(f"context and new tokens must be >= 0, got {context}, {new_tokens}")
    return next_power(context + new_tokens, CAPACITY_FLOOR)


@functools.cache
def width_buckets(graph_width: int) -> tuple[int, ...]:
    """The widths a padding arena records: 1, 2, 3, 5, 9, 17, … (1 + powers of two) below ``graph_width``, and
    ``graph_width``."""
    doubling = {1 + 2**i for i in range(graph_width.bit_length()) if 1 + 2**i < graph_width}
    return tuple(sorted({1, graph_width} | doubling))


def run_width(n: int, start: int, graph_width: int, capacity: int, pad: bool) -> int:
    """The width a block of ``n`` columns written from column ``start`` runs at: with ``pad``, the smallest of
    ``width_buckets(graph_width)`` ≥ n whose block fits in ``capacity`` columns; else (and past
    ``graph_width``) n."""
    if not pad or n > graph_width:
        return n
    return next((w for w in width_buckets(graph_width) if w >= n and start + w <= capacity), n)
