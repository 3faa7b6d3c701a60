"""Online acceptance-rate estimate: discounted Beta-geometric pseudo-counts around a prior."""

from __future__ import annotations

import pytest

from hf_adaspec.policy.acceptance import AcceptanceEstimator, AcceptancePrior


def test_starts_at_prior_mean():
    assert AcceptanceEstimator().alpha == pytest.approx(AcceptancePrior().mean)
    assert AcceptanceEstimator(AcceptancePrior(mean=0.3, strength=2.0)).alpha == pytest.approx(0.3)


def test_geometric_likelihood_counts():
    est = AcceptanceEstimator(AcceptancePrior(mean=0.5, strength=4.0, decay=1.0))
    est.update(3, 1)  # 1 success, then 1 failure (the rejection)
    assert (est.successes, est.trials) == (1.0, 2.0)
    assert est.alpha == pytest.approx((2.0 + 1.0) / (4.0 + 2.0))
    est.update(3, 3)  # all accepted: 3 successes, no failure
    assert (est.successes, est.trials) == (4.0, 5.0)
    assert est.alpha == pytest.approx((2.0 + 4.0) / (4.0 + 5.0))


def test_all_accepted_pushes_alpha_up_monotonically():
    est = AcceptanceEstimator()
    history = [est.alpha]
    for _ in range(20):
        est.update(4, 4)
        history.append(est.alpha)
    assert all(a < b for a, b in zip(history, history[1:]))
    assert 0.9 < history[-1] < 1.0


def test_all_rejected_pushes_alpha_down_monotonically():
    est = AcceptanceEstimator()
    history = [est.alpha]
    for _ in range(20):
        est.update(4, 0)
        history.append(est.alpha)
    assert all(a > b for a, b in zip(history, history[1:]))
    assert 0.0 < history[-1] < 0.3


@pytest.mark.parametrize("start", ["rejected", "accepted"])
def test_plain_steps_relax_towards_prior(start):
    prior = AcceptancePrior(mean=0.6, strength=4.0, decay=0.9)
    est = AcceptanceEstimator(prior)
    for _ in range(20):
        est.update(4, 0 if start == "rejected" else 4)
    gaps = [abs(est.alpha - prior.mean)]
    for _ in range(60):
        est.update(0, 0)  # a plain step: nothing drafted, only decay
        gaps.append(abs(est.alpha - prior.mean))
    assert gaps[0] > 0.25
    assert all(a > b for a, b in zip(gaps, gaps[1:]))
    assert gaps[-1] < 0.01


def test_no_decay_means_plain_steps_change_nothing():
    est = AcceptanceEstimator(AcceptancePrior(decay=1.0))
    est.update(4, 0)
    before = est.alpha
    for _ in range(10):
        est.update(0, 0)
    assert est.alpha == before


def test_decay_forgets_old_evidence():
    fast, slow = AcceptanceEstimator(AcceptancePrior(decay=0.5)), AcceptanceEstimator(AcceptancePrior(decay=1.0))
    for est in (fast, slow):
        for _ in range(10):
            est.update(4, 0)
        for _ in range(3):
            est.update(4, 4)
    assert fast.alpha > slow.alpha  # the recent all-accepted steps weigh more with a faster decay


@pytest.mark.parametrize("drafted, accepted", [(3, 4), (3, -1), (0, 1)])
def test_update_rejects_invalid_counts(drafted, accepted):
    est = AcceptanceEstimator(AcceptancePrior(decay=0.5))
    est.update(4, 4)
    before = est.alpha
    with pytest.raises(ValueError):
        est.update(drafted, accepted)
    assert est.alpha == before  # nothing recorded, not even the decay


@pytest.mark.parametrize(
    "kwargs",
    [
        {"mean": 0.0},
        {"mean": 1.0},
        {"mean": -0.2},
        {"strength": 0.0},
        {"strength": -1.0},
        {"decay": 0.0},
        {"decay": 1.01},
    ],
)
def test_prior_validation(kwargs):
    with pytest.raises(ValueError):
        AcceptancePrior(**kwargs)


def test_prior_accepts_boundary_decay_one():
    assert AcceptancePrior(mean=0.01, strength=0.1, decay=1.0).decay == 1.0
