"""Live runs (what the playground shows) on tiny random Llamas with a byte-level fake tokenizer."""

from __future__ import annotations

import threading

import pytest
import torch
from conftest import single_thread, slow_except

import hf_adaspec
from hf_adaspec import CostTable
from hf_adaspec.engine.stats import StepRecord
from hf_adaspec.playground.live import (
    SOURCE_LABELS,
    RunSettings,
    TokenPieces,
    generate_kwargs,
    run_live,
    slo_attainment,
)

pytestmark = pytest.mark.usefixtures("one_thread")
COSTS = {"speculation_costs": CostTable(verify_ms=(10.0,) * 9, draft_ms=1.0)}  # skips calibration
PROMPT = {"input_ids": torch.tensor([[5, 6, 7, 8, 9, 10] * 4])}


class ByteTokenizer:
    """Token t < 60 is the letter chr(97 + t % 26); 60 and 61 are the two UTF-8 bytes of "é"."""

    def decode(self, ids, skip_special_tokens: bool = True) -> str:
        raw = b"".join({60: b"\xc3", 61: b"\xa9"}.get(t, bytes([97 + t % 26])) for t in ids)
        return raw.decode("utf-8", errors="replace")

    def apply_chat_template(self, messages, **kwargs) -> dict:
        ids = [ord(c) % 60 for c in messages[-1]["content"]]
        return {"input_ids": torch.tensor([ids]), "attention_mask": torch.ones(1, len(ids), dtype=torch.long)}


@pytest.fixture(scope="module")
def pair(tiny_factory):
    with single_thread():  # the model's own thread chooser follows torch's count at enable; one_thread comes later
        target = hf_adaspec.enable(tiny_factory(0))
    draft = tiny_factory(0)
    with torch.no_grad():  # a slightly perturbed copy: accepts most tokens, not all
        gen = torch.Generator().manual_seed(2)
        for p in draft.parameters():
            p.add_(0.05 * p.std() * torch.randn(p.shape, generator=gen))
    return target, draft


def _final(pair, settings: RunSettings, **kwargs):
    target, draft = pair
    extra = COSTS if settings.method != "plain" else None  # plain generate takes no speculation keywords
    *_, last = run_live(target, ByteTokenizer(), PROMPT, settings, draft, extra_kwargs=extra, **kwargs)
    return last


@pytest.mark.parametrize("method", slow_except(["adaptive", "fixed", "prompt-lookup", "plain"], fast={"adaptive"}))
def test_run_live_streams_every_token_labelled(pair, method):
    target, _ = pair
    last = _final(pair, RunSettings(method, k=3, max_new_tokens=30))
    plain = target.generate(**PROMPT, max_new_tokens=30, do_sample=False)[0, PROMPT["input_ids"].shape[1] :]
    assert last.done and last.stats.new_tokens == 30 and last.stats.tokens_per_s > 0
    assert last.text == ByteTokenizer().decode(plain.tolist())  # greedy: the target's own text
    labels = {label for _, label in last.pieces}
    assert labels <= set(SOURCE_LABELS.values())
    if method == "plain":
        assert labels == {SOURCE_LABELS["plain"]} and not last.stats.steps
    else:
        assert sum(s.emitted for s in last.stats.steps) == 29  # + the prefill's token
    if method == "fixed":
        assert SOURCE_LABELS["draft_model"] in labels and {s.k for s in last.stats.steps} <= {0, 1, 2, 3}


def test_run_live_yields_partial_snapshots(pair):
    target, draft = pair
    counts = [
        s.stats.new_tokens
        for s in run_live(
            target, ByteTokenizer(), PROMPT, RunSettings("plain", max_new_tokens=20), draft, min_interval_s=0.0
        )
    ]
    assert counts == sorted(counts) and counts[-1] == 20 and len(counts) > 2


def test_stop_event_ends_the_run_and_frees_the_lock(pair):
    stop, lock = threading.Event(), threading.Lock()
    stop.set()
    last = _final(pair, RunSettings("fixed", k=3, max_new_tokens=30), stop=stop, lock=lock)
    assert last.done and last.stats.new_tokens == 1  # stopped at the first emitted token
    assert not lock.locked()


def test_closing_early_stops_the_worker(pair):
    target, draft = pair
    stop, lock = threading.Event(), threading.Lock()
    run = run_live(
        target, ByteTokenizer(), PROMPT, RunSettings("plain", max_new_tokens=200), draft, stop, lock, min_interval_s=0.0
    )
    next(run)
    run.close()  # what a cancelled consumer does
    assert stop.is_set() and not lock.locked()


def test_worker_error_is_raised_in_the_consumer(pair, tiny_factory):
    target, _ = pair
    other_vocab = tiny_factory(1, vocab_size=80)
    with pytest.raises(ValueError, match="vocabulary"):
        _final((target, other_vocab), RunSettings("adaptive"))


def test_token_pieces_hold_split_characters():
    pieces = TokenPieces(ByteTokenizer())
    assert [pieces.add(t) for t in (0, 60, 61, 1)] == ["a", "", "é", "b"]


def test_generate_kwargs_per_method(pair):
    _, draft = pair
    assert "speculation" not in generate_kwargs(RunSettings("plain"), draft)
    assert generate_kwargs(RunSettings("prompt-lookup"), draft)["speculation"] == "adaptive"
    assert "assistant_model" not in generate_kwargs(RunSettings("prompt-lookup"), draft)
    fixed = generate_kwargs(RunSettings("fixed", k=5), draft)
    assert (
        fixed["speculation"] == "fixed" and fixed["num_speculative_tokens"] == 5 and fixed["assistant_model"] is draft
    )
    sampled = generate_kwargs(RunSettings("adaptive", do_sample=True, temperature=0.5, top_p=0.8), draft)
    assert (sampled["temperature"], sampled["top_p"], sampled["do_sample"]) == (0.5, 0.8, True)
    with pytest.raises(ValueError, match="needs a draft model"):
        generate_kwargs(RunSettings("adaptive"), None)
    adaptive = generate_kwargs(RunSettings("adaptive", tpot_slo_ms=90.0), draft)
    assert adaptive["speculation"] == "adaptive" and adaptive["assistant_model"] is draft
    assert adaptive["tpot_slo_ms"] == 90.0
    assert "tpot_slo_ms" not in generate_kwargs(RunSettings("plain", tpot_slo_ms=90.0), draft)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"method": "beam"}, "not one of"),
        ({"k": 0}, "k must be"),
        ({"max_new_tokens": 0}, "max_new_tokens"),
        ({"do_sample": True, "temperature": 0.0}, "temperature"),
        ({"tpot_slo_ms": -1.0}, "tpot_slo_ms"),
    ],
)
def test_run_settings_reject_bad_values(kwargs, message):
    with pytest.raises(ValueError, match=message):
        RunSettings(**kwargs)


def test_slo_attainment_counts_tokens_of_steps_within_the_slo():
    steps = [
        StepRecord(3, 3, 4, "draft_model", 10.0, 30.0, 0.5, 1.0),  # 10 ms per token
        StepRecord(0, 0, 1, "plain", 0.0, 25.0, 0.5, 1.0),
    ]  # 25 ms per token
    assert slo_attainment(steps, 20.0) == pytest.approx(0.8)
    assert slo_attainment(steps, 30.0) == 1.0
