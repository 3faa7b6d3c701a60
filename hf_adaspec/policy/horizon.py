"""How many tokens a request still has to generate: the horizon over which a drafter's one-off setup
(the draft model ingesting the prompt, or catching up after plain steps) is amortised.

The end is unknown, so a request that has run for g tokens is taken to be as likely as not to run g
more (``lindy_horizon``): a long prompt with a short answer stays on prompt lookup and plain steps, and
the draft model joins once the request has shown it runs long enough to earn its catch-up back. A
horizon learned from the model's past requests' lengths (their mean remaining length) was replaced by
this rule, chosen by replay on the Spec-Bench tune split (docs/experiments.md, row "Catch-up horizon").
"""

from __future__ import annotations


def lindy_horizon(generated: int, tokens_left: int) -> int:
    """Tokens still to come without history: as many as so far, at least 1, at most ``tokens_left``."""
    return max(1, min(tokens_left, generated))
