"""Traces and replay on tiny fp32 models: a replay takes the decisions a real run takes, emits the traced
tokens, and its virtual models answer what the trace says."""

from __future__ import annotations

import json
import math

import pytest
import torch
from conftest import single_thread

from hf_adaspec import SpeculationState
from hf_adaspec.costs.predictors import ProfileCell
from hf_adaspec.costs.profile import assemble_profile
from hf_adaspec.costs.table import CostTable
from hf_adaspec.engine.stats import SpeculationStats, StepRecord
from hf_adaspec.replay.clock import Clock, price_request
from hf_adaspec.replay.replay import plain_run, replay_request
from hf_adaspec.replay.report import replay_all, validate
from hf_adaspec.replay.trace import Trace, load_trace, load_traces, save_trace, trace_ids
from hf_adaspec.replay.virtual import TraceCache, Vocab, draft_answers, target_answers

# prompt lookup pays (free) and a draft token costs a fifth of a verification
TABLE = CostTable((10.0, 10.5, 11.0, 11.5, 12.0, 12.5, 13.0, 13.5, 14.0), 2.0, draft_catchup_ms=0.5)
PROMPTS = ([5, 6, 7, 8, 5, 6, 7, 8, 5, 6], [9, 3, 4, 9, 3, 4, 9, 3, 4, 9, 3, 4], [11, 12, 13, 14])


def _profile():
    """A flat profile: verification 10 ms + 0.5 ms per token at any batch and context, draft 2 ms a token."""
    cells = {
        "target": [ProfileCell(b, c, n, 10.0 + 0.5 * (n - 1)) for b in (1, 2) for c in (16, 64) for n in (1, 4, 9)],
        "draft": [ProfileCell(b, c, n, 2.0 if n == 1 else 16.0) for b in (1, 2) for c in (16, 64) for n in (1, 32)],
        "held_out_target": [ProfileCell(1, 40, 2, 10.5)],
        "held_out_draft": [ProfileCell(1, 40, 1, 2.0)],
    }
    return assemble_profile("tiny", {"target": "tiny"}, cells, {})


@pytest.fixture(scope="module")
def traces(models):
    target, draft = models["target"], models["noisy_copy"]
    with single_thread():  # module fixtures are set up before one_thread
        return [
            trace_ids(
                target, draft, torch.tensor([p]), 24, (100 + i, "cat-a" if i < 2 else "cat-b"), ("t", "d"), "test"
            )
            for i, p in enumerate(PROMPTS)
        ]


def _real(models, prompt, method_kwargs):
    out = models["target"].generate(
        input_ids=torch.tensor([prompt]),
        max_new_tokens=24,
        do_sample=False,
        return_dict_in_generate=True,
        speculation_costs=TABLE,
        speculation_state=SpeculationState(),
        rest=False,
        **method_kwargs,
    )
    return [(s.drafter, s.k, s.accepted) for s in out.speculation.steps], out.sequences[0].tolist()


@pytest.mark.parametrize(
    ("method", "kwargs"),
    [
        ("adaptive-lookup", {"speculation": "adaptive"}),
        # the fast suite keeps adaptive-lookup; fixed-k (the virtual draft model) is slow
        pytest.param("fixed-k", {"speculation": "fixed", "num_speculative_tokens": 5}, marks=pytest.mark.slow),
    ],
)
def test_replay_takes_the_real_runs_decisions(models, traces, one_thread, method, kwargs):
    if "num_speculative_tokens" in kwargs:
        kwargs = {**kwargs, "assistant_model": models["noisy_copy"]}
    for trace, prompt in zip(traces, PROMPTS, strict=True):
        steps, sequence = _real(models, prompt, kwargs)
        assert sequence == list(trace.tokens)  # greedy speculation equals the traced plain output
        run = replay_request([trace], method, SpeculationState(), Clock(_profile()), lambda b, c: TABLE)
        assert run.matches_trace
        assert [(s.drafter, s.k, s.accepted) for s in run.stats.steps] == steps


def test_replay_of_the_draft_and_lookup_hybrid_emits_the_traces(traces, one_thread):
    state, clock = SpeculationState(), Clock(_profile(), step_overhead_ms=1.0)
    runs = [replay_request([t], "adaptive", state, clock) for t in traces]
    assert all(r.matches_trace for r in runs)
    assert {"draft_model", "prompt_lookup"} & {d for r in runs for d in r.drafter_histogram}
    batched = replay_request(list(traces), "adaptive", SpeculationState(), clock)  # one static batch of 3 rows
    assert batched.matches_trace and batched.new_tokens == sum(t.new_tokens for t in traces)


def test_virtual_draft_gives_back_the_traced_argmax_and_q(traces):
    t = traces[0]
    vocab = Vocab([*t.tokens, *t.draft_next])
    cache = TraceCache([draft_answers(t.prompt_len, vocab.encode(t.draft_next), t.draft_q)], vocab.size)
    prompt = vocab.encode(t.tokens[: t.prompt_len])[None]
    logits = cache.append(prompt, torch.ones_like(prompt, dtype=torch.bool), keep=1)[0, -1]  # [V']
    assert vocab.decode(logits.argmax()[None]) == [t.draft_next[0]]
    assert float(torch.softmax(logits, -1).max()) == pytest.approx(max(t.draft_q[0], 2.0 / vocab.size), abs=1e-4)
    target = TraceCache([target_answers(vocab.encode(t.tokens), 0)], vocab.size)
    step = target.append(prompt, torch.ones_like(prompt, dtype=torch.bool), keep=2)  # [1, 2, V']
    assert vocab.decode(step[0].argmax(-1)) == list(t.tokens[t.prompt_len - 1 : t.prompt_len + 1])
    assert target.log[0].columns == t.prompt_len and cache.lengths.tolist() == [t.prompt_len]


def test_trace_files_round_trip_and_refuse_garbage(traces, tmp_path):
    for t in traces:
        save_trace(t, tmp_path)
    loaded = load_traces(tmp_path)
    assert [x.tokens for x in loaded] == [x.tokens for x in traces]
    assert loaded[0].draft_q == pytest.approx(traces[0].draft_q, abs=1e-5)
    assert not list(tmp_path.glob(".*.tmp"))  # nothing half-written left
    (tmp_path / "7.json").write_text(json.dumps({"schema": 99}))
    with pytest.raises(ValueError, match="re-run `hf-adaspec trace`"):
        load_trace(tmp_path / "7.json")
    with pytest.raises(FileNotFoundError, match="hf-adaspec trace"):
        load_traces(tmp_path / "none")


def test_replay_prices_plain_and_speculation_on_one_clock(traces):
    result = replay_all(traces, ["plain", "adaptive-lookup", "fixed-k"], Clock(_profile()))
    plain = [r for r in result.runs if r.method == "plain"]
    # plain: the traced prefill, then 10 ms per token after the first
    assert plain[0].seconds == pytest.approx((traces[0].prefill_ms + 10.0 * (traces[0].new_tokens - 1)) / 1000.0)
    assert {o.question_id for o in result.oracles} == {t.question_id for t in traces}
    for o in result.oracles:  # the oracle is never slower than plain on the same clock
        p = next(r for r in plain if r.question_id == o.question_id)
        assert min(o.tokens_per_s.values()) >= p.tokens_per_s * 0.999


def test_validate_reports_errors_of_predicted_speedups(traces):
    result = replay_all(traces[:1], ["plain", "adaptive-lookup"], Clock(_profile()))
    ours = {r.method: r.tokens_per_s for r in result.runs}
    measured = [
        {"question_id": 100, "method": "plain", "tokens_per_s": 10.0, "mean_accepted_length": None},
        {
            "question_id": 100,
            "method": "adaptive-lookup",
            "tokens_per_s": 10.0 * ours["adaptive-lookup"] / ours["plain"] * 1.1,
            "mean_accepted_length": 1.0,
        },
    ]
    check = validate(result.runs, measured)
    assert check.median_abs_error == pytest.approx(1 / 1.1 - 1, abs=1e-9) or check.median_abs_error == pytest.approx(
        1 - 1 / 1.1, abs=1e-9
    )
    with pytest.raises(ValueError, match="share no prompt"):
        validate(result.runs, measured[:1])


def test_the_prefill_is_the_traces_or_priced_by_the_profile(traces):
    """A projection onto another machine prices the prefill by that machine's profile (one forward over the
    padded prompts), not by the trace's own machine's timing; the plain run and every method use the same."""
    traced, priced = Clock(_profile()), Clock(_profile(), prefill="profile")
    assert traced.prefill_ms(traces) == sum(t.prefill_ms for t in traces)
    width = max(t.prompt_len for t in traces)
    assert priced.prefill_ms(traces) == pytest.approx(_profile().verify_ms(len(traces), 1, width))
    runs = {c.prefill: replay_request([traces[0]], "plain", SpeculationState(), c) for c in (traced, priced)}
    gap = traces[0].prefill_ms - priced.prefill_ms([traces[0]])
    assert runs["trace"].time_ms - runs["profile"].time_ms == pytest.approx(gap)
    with pytest.raises(ValueError, match=r"prefill='gpu'; choose one of \('trace', 'profile'\)"):
        Clock(_profile(), prefill="gpu")


def test_a_replay_rests_where_its_clock_prices_decisions_and_prices_a_rest_as_a_plain_step(traces):
    """Overheads of 2 ms a decided step and 1 ms a plain one: the controller hears a decision costs 1 ms, a
    tenth of the profile's 10 ms step, so it rests in runs of plain decisions; a rested step costs 1 ms."""
    deciding = replay_request(traces[2:], "adaptive-lookup", SpeculationState(), Clock(_profile(), 1.0, 1.0))
    clock = Clock(_profile(), 2.0, 1.0)
    resting = replay_request(traces[2:], "adaptive-lookup", SpeculationState(), clock)
    assert deciding.matches_trace and resting.matches_trace
    assert all(s.decided for s in deciding.stats.steps) and not all(s.decided for s in resting.stats.steps)
    steps = SpeculationStats(
        steps=[
            StepRecord(0, 0, 1, "plain", 0.0, 10.0, 0.5, 1.0, step=0),
            StepRecord(0, 0, 1, "plain", 0.0, 10.0, math.nan, math.nan, step=1, decided=False),
        ]
    )
    assert price_request(clock, traces[2:], [], ([], []), steps) == pytest.approx(
        clock.prefill_ms(traces[2:]) + 2.0 + 1.0
    )


def test_a_truncated_trace_is_the_same_request_asked_for_fewer_tokens():
    trace = Trace(7, "c", 3, (1, 2, 3, 4, 5, 6, 7), (4, 5, 9, 7, 0), (0.5,) * 5, (0,), 10.0, 4, "t", "d")
    short = trace.truncated(2)
    assert short.tokens == (1, 2, 3, 4, 5) and short.draft_next == (4, 5, 9) and short.draft_q == (0.5,) * 3
    assert short.new_tokens == short.max_new_tokens == 2 and short.draft_agreement() == [True]
    assert trace.truncated(4) is trace and trace.truncated(9) is trace
    with pytest.raises(ValueError, match="max_new_tokens must be >= 1"):
        trace.truncated(0)


def test_a_trace_times_its_plain_generate_per_token_and_keeps_it_through_save_load_and_truncation(traces, tmp_path):
    for t in traces:
        assert len(t.plain_ms) == t.new_tokens and list(t.plain_ms) == sorted(t.plain_ms) and t.plain_ms[0] > 0
    back = load_trace(save_trace(traces[0], tmp_path))
    assert back.plain_ms == pytest.approx(traces[0].plain_ms, abs=0.01)
    assert traces[0].truncated(3).plain_ms == traces[0].plain_ms[:3]
    with pytest.raises(ValueError, match="plain_ms needs"):
        Trace(**{**traces[0].__dict__, "plain_ms": traces[0].plain_ms[:-1]})


def test_plain_decoding_priced_as_the_trace_timed_it_or_by_the_profile(traces):
    by_trace = Clock(_profile(), plain_overhead_ms=1.0, plain="trace")
    assert plain_run(traces[:1], by_trace).time_ms == traces[0].plain_ms[-1]
    by_profile = plain_run(traces[:1], Clock(_profile(), plain_overhead_ms=1.0)).time_ms
    steps = traces[0].new_tokens - 1
    assert by_profile == pytest.approx(traces[0].prefill_ms + steps * (10.0 + 1.0))
    with pytest.raises(ValueError, match="batch size 1"):
        plain_run(traces[:2], by_trace)  # a batch's plain run is not traced
    with pytest.raises(ValueError, match="plain times"):
        plain_run([Trace(**{**traces[0].__dict__, "plain_ms": ()})], by_trace)
    with pytest.raises(ValueError, match="plain='nope'"):
        Clock(_profile(), plain="nope")


def test_a_beside_run_is_read_as_a_bench_of_plain_and_adaptive(tmp_path):
    """`replay --bench` takes `llama_cpp_prompts.py --beside`'s rows (a column per method) as runs."""
    from hf_adaspec.cli.replay_cli import _bench_runs

    path = tmp_path / "beside.json"
    path.write_text(
        json.dumps(
            {
                "runs": [
                    {
                        "question_id": 81,
                        "category": "writing",
                        "plain": 10.0,
                        "plain-again": 9.0,
                        "adaptive": 12.0,
                        "llama.cpp plain": 11.0,
                    }
                ]
            }
        )
    )
    assert _bench_runs(path) == [
        {"question_id": 81, "method": "plain", "tokens_per_s": 10.0},
        {"question_id": 81, "method": "adaptive", "tokens_per_s": 12.0},
    ]
