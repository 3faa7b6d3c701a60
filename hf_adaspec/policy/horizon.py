"""How many tokens a request still has to generate: the horizon over which a drafter's one-off setup
(the draft model ingesting the prompt, or catching up after plain steps) is amortised.

Without history the end is unknown, so a request that has run for g tokens is taken to be as likely as
not to run g more (``lindy_horizon``): a long prompt with a short answer stays on plain steps. That
rule also keeps every request's first steps plain, since over a horizon of a few tokens the prompt's
catch-up cannot pay, even where drafting from the first step would. The model's past requests say more:
``LengthMemory`` keeps their lengths, and ``expected_remaining`` averages, over the past requests that
ran past g tokens (the ones like this request so far), the tokens they generated after g, capped by
this request's tokens left. A request cut by its budget counts what it did generate, a lower bound.
The mean is what minimises expected time over the memory's mix of requests. One memory per target
model, across requests (a batch records each row). Measured against ``lindy_horizon`` in an in-run
ablation on 26 Spec-Bench prompts (docs/experiments.md): 1.07x / 1.09x / 1.08x plain with the learned
horizon, 1.03x / 1.04x / 1.05x without.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence



def lindy_horizon(generated: int, tokens_left: int) -> int:
    """Tokens still to come without history: as many as so far, at least 1, at most ``tokens_left``."""
    return max(1, min(tokens_left, generated))


def expected_remaining(generated: int, tokens_left: int, lengths: Sequence[int]) -> float | None:
    """Mean of min(L − g, tokens_left) over the past requests' lengths L > g (tokens), g = ``generated``;
    None when none ran past g.

    Raises:
        ValueError: generated < 0 or tokens_left < 0.
    """
    if generated < 0 or tokens_left < 0:
        raise ValueError(f"generated and tokens_left must be >= 0, got {generated}, {tokens_left}")
    remaining = [min(length - generated, tokens_left) for length in lengths if length > generated]
    return sum(remaining) / len(remaining) if remaining else None


class LengthMemory:
    """The lengths (tokens generated) of one target model's last ``size`` finished requests."""

    def __init__(self, size: int = 64) -> None:
        if size < 1:
            raise ValueError(f"size must be >= 1, got {size}")
        self.lengths: deque[int] = deque(maxlen=size)

    def record(self, generated: int) -> None:
        """Remember a finished request of ``generated`` tokens.

        Raises:
            ValueError: generated < 0.
        """
        if generated < 0:
            raise ValueError(f"generated must be >= 0, got {generated}")
        self.lengths.append(generated)

    def horizon(self, generated: int, tokens_left: int) -> int:
        """Tokens still to come (≥ 1, ≤ ``tokens_left``): ``expected_remaining`` rounded, else
        ``lindy_horizon`` when no past request ran past ``generated``."""
        expected = expected_remaining(generated, tokens_left, self.lengths)
        if expected is None:
            return lindy_horizon(generated, tokens_left)
        return max(1, min(tokens_left, round(expected)))
