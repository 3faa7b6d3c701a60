"""Draft heads in traces and replay, on the tiny target and its trained tiny head: the traced chains are what
the head drafts, a replay with the virtual head takes the real run's decisions and predicts its goodputs, the
oracle prices the head,
and the errors name their fix."""

from __future__ import annotations

import json
import math

import pytest
import torch
from conftest import HEAD_PROMPTS, single_thread
from typer.testing import CliRunner

from hf_adaspec import SpeculationState
from hf_adaspec.cli import cli, trace_cli
from hf_adaspec.costs.predictors import ProfileCell
from hf_adaspec.costs.profile import assemble_profile
from hf_adaspec.costs.profile_files import save_profile
from hf_adaspec.costs.table import CostTable
from hf_adaspec.models.eagle3_format import save_head
from hf_adaspec.replay.clock import Clock
from hf_adaspec.replay.replay import oracle_tokens_per_s, replay_request
from hf_adaspec.replay.report import replay_all
from hf_adaspec.replay.trace import Trace, head_along, load_trace, save_trace, trace_ids, with_head

pytestmark = pytest.mark.usefixtures("one_thread", "private_cache")
TABLE = CostTable((10.0, 10.5, 11.0, 11.5, 12.0, 12.5, 13.0, 13.5, 14.0), 1.0, draft_catchup_ms=0.1)
# what _profile(1.0, head=True, chunk_ms=CHUNK_MS) prices (a catch-up of next to nothing): decisions depend on
# the slowdown ledger's booked times, which a real run with rest=False books as its costs predict a step and a
# replay as its clock prices the step's forwards (the head's catch-up of accepted positions included)
CHUNK_MS = 1e-3
PRICED = CostTable(TABLE.verify_ms, 1.0, draft_catchup_ms=CHUNK_MS / 32)
PROMPTS = (HEAD_PROMPTS[0], HEAD_PROMPTS[2], HEAD_PROMPTS[4][:8])
NEW = 20
META = {
    "versions": {},
    "machine": "m",
    "cpu": "c",
    "threads": 1,
    "created": "2025-01-01T00:00:00+00:00",
    "command": "test",
    "grid": {},
}


def _profile(draft_ms: float, head: bool, chunk_ms: float | None = None):
    """Flat costs: verification 10 ms + 0.5 ms per token; the drafter (a head when ``head``) ``draft_ms``, its
    32-column catch-up ``chunk_ms`` (default 8 × draft_ms)."""
    chunk = 8 * draft_ms if chunk_ms is None else chunk_ms
    cells = {
        "target": [ProfileCell(b, c, n, 10.0 + 0.5 * (n - 1)) for b in (1, 2) for c in (16, 64) for n in (1, 4, 9)],
        "draft": [
            ProfileCell(b, c, n, draft_ms if n == 1 else chunk) for b in (1, 2) for c in (16, 64) for n in (1, 32)
        ],
        "held_out_target": [ProfileCell(1, 40, 2, 10.5)],
        "held_out_draft": [ProfileCell(1, 40, 1, draft_ms)],
    }
    identity = {"target": "tiny", "draft": {"name": "Eagle3Head" if head else "tiny-draft"}}
    return assemble_profile("tiny", identity, cells, META)


@pytest.fixture(scope="module")
def traces(models, tiny_head):
    target = models["target"]
    with single_thread():  # module fixtures are set up before one_thread
        return [
            with_head(
                trace_ids(target, models["noisy_copy"], torch.tensor([p]), NEW, (200 + i, "cat"), ("t", "d"), "test"),
                target,
                tiny_head,
                "tiny-head",
            )
            for i, p in enumerate(PROMPTS)
        ]


def _clock(**kwargs) -> Clock:
    return Clock(_profile(2.0, head=False), head_profile=_profile(0.5, head=True), **kwargs)


def test_the_traced_chain_is_what_the_head_drafts(models, tiny_head, traces):
    from hf_adaspec.models.eagle3 import HeadCache

    t = traces[0]
    assert t.head_depth == 8 and len(t.head_next) == t.new_tokens + 1
    seq = torch.tensor([t.tokens])
    features = models["target"](seq, output_hidden_states=True).hidden_states
    features = torch.cat([features[i] for i in tiny_head.config.aux_layers], dim=-1)
    j = 5  # draft after tokens[: prompt_len + j], then feed the head's own tokens and outputs, as it drafts
    s = t.prompt_len + j - 1
    cache = HeadCache(1)
    truth = t.tokens[t.prompt_len + j : t.prompt_len + j + t.head_depth]
    assert list(t.head_next[j]) != list(truth)  # a miss: the chain goes on from the head's own token
    with torch.no_grad():
        out = tiny_head.step(
            seq[:, 1 : s + 1], tiny_head.fuse(features[:, :s]), torch.ones(1, s, dtype=torch.bool), cache
        )[:, -1]
        for d in range(t.head_depth):
            probs = torch.softmax(tiny_head.logits(out), dim=-1)[0]
            assert int(probs.argmax()) == t.head_next[j][d]
            assert float(probs.max()) == pytest.approx(t.head_q[j][d], abs=1e-5)
            out = tiny_head.step(probs.argmax()[None, None], out[:, None], torch.ones(1, 1, dtype=torch.bool), cache)[
                :, -1
            ]
    assert t.head_agreement() == [r > 0 for r in t.head_runs()] and any(t.head_agreement())
    with pytest.raises(ValueError, match="depth must be >= 1"):
        head_along(models["target"], tiny_head, seq, t.prompt_len, 0)


def _real(models, head, prompt, kwargs):
    out = models["target"].generate(
        input_ids=torch.tensor([prompt]),
        max_new_tokens=NEW,
        do_sample=False,
        return_dict_in_generate=True,
        speculation_costs=PRICED,
        speculation_state=SpeculationState(),
        assistant_model=head,
        rest=False,
        **kwargs,
    )
    return out.speculation.steps, out.sequences[0].tolist()


@pytest.mark.parametrize(
    ("method", "kwargs"),
    [
        # the fast suite keeps adaptive-head (it also reads the tokens drafted after a miss); fixed-head is slow
        pytest.param("fixed-head", {"speculation": "fixed", "num_speculative_tokens": 5}, marks=pytest.mark.slow),
        # adaptive: the confidence stop rule and the calibration also read the tokens drafted after a miss, which
        # the trace holds as the head drafts them, so k and every predicted goodput are the real run's too
        ("adaptive-head", {"speculation": "adaptive"}),
    ],
)
def test_replay_with_the_virtual_head_takes_the_real_runs_decisions(models, tiny_head, traces, method, kwargs):
    misses = 0
    for trace, prompt in zip(traces, PROMPTS, strict=True):
        steps, sequence = _real(models, tiny_head, prompt, kwargs)
        assert sequence == list(trace.tokens)
        clock = Clock(_profile(2.0, head=False), head_profile=_profile(1.0, head=True, chunk_ms=CHUNK_MS))
        run = replay_request([trace], method, SpeculationState(), clock, lambda b, c: PRICED)
        assert run.matches_trace and "draft_head" in run.drafter_histogram
        assert [(s.drafter, s.k, s.accepted) for s in run.stats.steps] == [(s.drafter, s.k, s.accepted) for s in steps]
        assert [s.predicted_goodput for s in run.stats.steps] == pytest.approx(
            [s.predicted_goodput for s in steps], rel=1e-5
        )
        misses += sum(0 < s.k and s.accepted + 1 < s.k for s in steps)
    assert misses >= 5  # the tokens drafted after a miss are read (by the stop rule), not only the accepted ones


def test_head_methods_replay_in_batches_priced_by_the_head_profile(traces):
    batched = replay_request(list(traces), "adaptive-head", SpeculationState(), _clock())
    assert batched.matches_trace and batched.new_tokens == sum(t.new_tokens for t in traces)
    cheap, dear = (
        replay_request(
            traces[:1], "fixed-head", SpeculationState(), Clock(_profile(2.0, False), head_profile=_profile(ms, True))
        )
        for ms in (0.5, 5.0)
    )
    assert [(s.k, s.accepted) for s in cheap.stats.steps] == [(s.k, s.accepted) for s in dear.stats.steps]
    assert dear.time_ms > cheap.time_ms  # same fixed schedule, dearer head forwards


def test_the_oracle_and_the_report_include_the_head(traces):
    result = replay_all(traces, ["plain", "adaptive", "adaptive-head"], _clock())
    for o in result.oracles:
        assert {"head", "head-hybrid", "all"} <= set(o.tokens_per_s) and 0.0 <= o.head_agreement <= 1.0
        assert o.tokens_per_s["all"] >= max(o.tokens_per_s.values()) * 0.999  # every drafter: the best bound
    head_runs = [r for r in result.runs if r.method == "adaptive-head"]
    assert head_runs and all(r.matches_plain and r.oracle_tokens_per_s for r in head_runs)
    without = oracle_tokens_per_s(traces[0], Clock(_profile(2.0, False)), 0)
    assert "head" not in without and "hybrid" in without


def test_head_methods_name_the_fix_when_traces_or_costs_lack_the_head(traces):
    bare = [Trace(**{**t.__dict__, "head": "", "head_next": (), "head_q": ()}) for t in traces]
    with pytest.raises(ValueError, match="hf-adaspec trace --head FOLDER"):
        replay_all(bare, ["plain", "adaptive-head"], _clock())
    with pytest.raises(ValueError, match="--head-profile"):
        replay_all(traces, ["plain", "adaptive-head"], Clock(_profile(2.0, False)))
    with pytest.raises(ValueError, match="measured with a draft model, not a head"):
        Clock(_profile(2.0, False), head_profile=_profile(0.5, False))
    other = assemble_profile(
        "x",
        {"target": "other", "draft": {"name": "Eagle3Head"}},
        {"target": [ProfileCell(1, 16, 1, 10.0), ProfileCell(1, 64, 4, 12.0)]},
        {},
    )
    with pytest.raises(ValueError, match="another target"):
        Clock(_profile(2.0, False), head_profile=other)


def test_head_fields_round_trip_and_old_traces_still_load(traces, tmp_path):
    save_trace(traces[0], tmp_path)
    loaded = load_trace(tmp_path / f"{traces[0].question_id}.json")
    assert loaded.head == "tiny-head" and loaded.head_next == traces[0].head_next
    assert loaded.head_q[3] == pytest.approx(traces[0].head_q[3], abs=1e-4)
    old = json.loads((tmp_path / f"{traces[0].question_id}.json").read_text())
    for name in ("head", "head_next", "head_q"):
        del old[name]
    (tmp_path / "1.json").write_text(json.dumps(old))
    plain = load_trace(tmp_path / "1.json")
    assert plain.head == "" and plain.head_runs() == [] and plain.tokens == traces[0].tokens
    with pytest.raises(ValueError, match="head_next/head_q need"):
        Trace(**{**traces[0].__dict__, "head_next": traces[0].head_next[:-1]})
    with pytest.raises(ValueError, match="one depth >= 1"):
        Trace(
            **{
                **traces[0].__dict__,
                "head_next": ((),) * len(traces[0].head_next),
                "head_q": ((),) * len(traces[0].head_q),
            }
        )


def test_trace_cli_adds_a_heads_chains_without_generating_again(models, tiny_head, traces, tmp_path, monkeypatch):
    from hf_adaspec import LoadedModel
    from hf_adaspec.bench.prompts import Prompt

    out, head_dir = tmp_path / "traces", save_head(tiny_head, tmp_path / "head")
    bare = Trace(
        **{
            **traces[0].__dict__,
            "head": "",
            "head_next": (),
            "head_q": (),
            "max_new_tokens": 256,
            "target": "qwen2.5-coder-1.5b",
            "draft": "",
        }
    )
    save_trace(bare, out)
    loaded = []
    monkeypatch.setattr(trace_cli, "load_prompts", lambda path, n: [Prompt(bare.question_id, "cat", "hi")])
    monkeypatch.setattr(
        trace_cli,
        "load_pair",
        lambda target, draft, q, d: loaded.append(draft) or (LoadedModel(models["target"], None, "t"), None),
    )
    monkeypatch.setattr(trace_cli, "take_trace", lambda *a, **k: pytest.fail("generated again"))
    args = ["trace", "--output", str(out), "--draft", "none", "--head", str(head_dir), "--head-depth", "3"]
    result = CliRunner().invoke(cli.app, args)
    assert result.exit_code == 0, result.output
    got = load_trace(out / f"{bare.question_id}.json")
    assert got.head == str(head_dir) and got.head_depth == 3 and got.tokens == bare.tokens and loaded == ["none"]
    assert [row[0] for row in got.head_next] == [row[0] for row in traces[0].head_next]
    again = CliRunner().invoke(cli.app, args)
    assert json.loads(again.stdout.strip().splitlines()[-1])["traced_now"] == 0
    missing = CliRunner().invoke(cli.app, [*args[:5], "--head", str(tmp_path / "nope")])
    assert missing.exit_code == 2 and "speculators-format head folder" in missing.output


def test_replay_cli_prices_the_head_from_head_profile(traces, tmp_path):
    for t in traces:
        save_trace(t, tmp_path / "traces")
    profile = save_profile(_profile(2.0, False), tmp_path / "p.json")
    heads = save_profile(_profile(0.5, True), tmp_path / "h.json")
    base = [
        "replay",
        "--traces",
        str(tmp_path / "traces"),
        "--profile",
        str(profile),
        "--methods",
        "plain,adaptive-head",
        "--output",
        str(tmp_path / "r.json"),
    ]
    refused = CliRunner().invoke(cli.app, base)
    assert refused.exit_code == 2 and "--head-profile" in refused.output
    wrong = CliRunner().invoke(cli.app, [*base, "--head-profile", str(profile)])
    assert wrong.exit_code == 2 and "not a head" in " ".join(wrong.output.replace("│", " ").split())
    result = CliRunner().invoke(cli.app, [*base, "--head-profile", str(heads)])
    assert result.exit_code == 0, result.output
    line = json.loads(result.stdout.strip().splitlines()[-1])
    assert line["all_match_traces"] and not math.isnan(line["predicted_speedup"]["adaptive-head"])
