"""A neighbour on a shared host: a process that keeps one core busy a fraction of every 10 ms (a busy loop, then
a sleep), as another tenant or a browser does, so a timing can be repeated under the same load.

    python benchmarks/neighbour.py 0.3 &      # 30% of one core until killed; then time, then kill it
"""

from __future__ import annotations

import sys
import time


def neighbour(duty: float, period_s: float = 0.010) -> None:
    """Keep one core busy ``duty`` (in [0, 1)) of every ``period_s`` seconds, until killed."""
    while True:
        start = time.perf_counter()
        while time.perf_counter() - start < duty * period_s:
            pass
        time.sleep((1 - duty) * period_s)


if __name__ == "__main__":
    share = float(sys.argv[1])
    if not 0 < share < 1:
        raise SystemExit("usage: neighbour.py SHARE (of one core, in (0, 1))")
    neighbour(share)
