"""Bench bookkeeping: prompt selection, per-category speedups (geometric mean), markdown, errors."""

import json
from pathlib import Path

import pytest
import torch

from hf_adaspec.bench.bench import Run, method_kwargs, run_prompt
from hf_adaspec.bench.prompts import Prompt, load_prompts
from hf_adaspec.bench.summary import markdown, summarize
from hf_adaspec.costs.table import CostTable

SAMPLE = Path(__file__).parent / "data" / "spec_bench_sample.jsonl"


def test_load_prompts_first_turn_per_category():
    prompts = load_prompts(SAMPLE, per_category=1)
    assert [p.category for p in prompts] == ["coding", "math_reasoning", "qa", "summarization"]
    assert load_prompts(SAMPLE, 1, ["qa"])[0].text.strip()


def test_second_turn_rows_carry_the_conversation(tmp_path):
    path = tmp_path / "turn2.jsonl"
    path.write_text(
        json.dumps(
            {
                "question_id": 20081,
                "category": "writing",
                "history": ["Write a poem.", "Roses."],
                "turns": ["Now make it rhyme."],
            }
        )
        + "\n"
    )
    (prompt,) = load_prompts(path, per_category=1, split="held-out")
    assert prompt.messages() == [
        {"role": "user", "content": "Write a poem."},
        {"role": "assistant", "content": "Roses."},
        {"role": "user", "content": "Now make it rhyme."},
    ]
    assert load_prompts(SAMPLE, 1)[0].messages() == [{"role": "user", "content": load_prompts(SAMPLE, 1)[0].text}]


def test_load_prompts_missing_file_names_the_fix(tmp_path):
    with pytest.raises(FileNotFoundError, match="--prompts"):
        load_prompts(tmp_path / "nope.jsonl", 1)


SPEC_BENCH_CATEGORIES = (
    "writing",
    "roleplay",
    "reasoning",
    "math",
    "coding",
    "extraction",
    "stem",
    "humanities",
    "translation",
    "summarization",
    "qa",
    "math_reasoning",
    "rag",
)
ROOT = Path(__file__).resolve().parent.parent


def test_the_default_prompts_ship_inside_the_package_with_every_category():
    """The packaged Spec-Bench subset is found from the installed package (not the working directory): 8
    prompts of each of the 13 categories, its license beside it, and package-data puts it in the wheel."""
    import fnmatch
    import importlib.resources
    import tomllib

    import hf_adaspec
    from hf_adaspec.bench.prompts import PACKAGED_PER_CATEGORY, SPEC_BENCH
    from hf_adaspec.cli.cli import SPEC_BENCH as CLI_SPEC_BENCH

    package = Path(hf_adaspec.__file__).resolve().parent
    resource = importlib.resources.files("hf_adaspec") / "data" / "spec_bench.jsonl"
    assert CLI_SPEC_BENCH == SPEC_BENCH == Path(str(resource))
    assert SPEC_BENCH.is_absolute() and SPEC_BENCH.resolve().is_relative_to(package)
    assert (SPEC_BENCH.parent / "SPEC_BENCH_LICENSE").read_text().startswith("Apache License")
    assert SPEC_BENCH.stat().st_size < 200_000  # a small subset, not the 480-prompt file
    prompts = load_prompts(SPEC_BENCH, PACKAGED_PER_CATEGORY)
    assert tuple(dict.fromkeys(p.category for p in prompts)) == SPEC_BENCH_CATEGORIES
    assert len(prompts) == 13 * PACKAGED_PER_CATEGORY == len(SPEC_BENCH.read_text(encoding="utf-8").splitlines())
    assert all(p.text.strip() for p in prompts)
    for split in ("tune", "held-out"):  # each category has prompts in both halves
        assert {p.category for p in load_prompts(SPEC_BENCH, 1, split=split)} == set(SPEC_BENCH_CATEGORIES)
    package_data = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["package-data"]
    shipped = SPEC_BENCH.resolve().relative_to(package).as_posix()
    assert any(fnmatch.fnmatch(shipped, pattern) for pattern in package_data["hf_adaspec"])


def test_the_default_prompts_hold_every_spec_bench_prompt_of_the_committed_traces():
    from hf_adaspec.bench.prompts import SPEC_BENCH

    packaged = {p.question_id for p in load_prompts(SPEC_BENCH, 1000)}
    traced = {int(f.stem) for f in (ROOT / "benchmarks" / "traces").glob("*.json")}
    first_turns = {q for q in traced if q < 10000}  # 1000x: the code workload; 2008x..: second turns
    assert first_turns and first_turns <= packaged


def _cli_param(command: str, name: str):
    import typer

    from hf_adaspec.cli import cli

    (param,) = [p for p in typer.main.get_command(cli.app).commands[command].params if p.name == name]
    return param.default


def test_bench_and_trace_default_to_the_packaged_prompts_and_bench_to_256_tokens(tmp_path, monkeypatch):
    """Read from the commands' parameters, and from what the commands pass on (no model is loaded)."""
    from typer.testing import CliRunner

    from hf_adaspec.bench import batch as batch_bench
    from hf_adaspec.bench import prompts as bm
    from hf_adaspec.cli import cli, trace_cli

    assert _cli_param("bench", "prompts") == bm.SPEC_BENCH == _cli_param("trace", "prompts")
    assert _cli_param("bench", "max_new_tokens") == 256 == _cli_param("trace", "max_new_tokens")
    seen = {}

    class Stop(Exception):
        pass

    def no_models(*args, **kwargs):
        raise Stop

    def loads(name):
        def load(path, per_category, *args):
            seen[name] = Path(path)
            return [Prompt(81, "writing", "hi")] if name != "trace" else []  # trace: nothing to do

        return load

    monkeypatch.setattr(cli, "load_prompts", loads("bench"))
    monkeypatch.setattr(batch_bench, "load_prompts", loads("batch"))
    monkeypatch.setattr(trace_cli, "load_prompts", loads("trace"))
    monkeypatch.setattr(cli, "_load_pair", no_models)
    monkeypatch.setattr(
        cli,
        "_batch_bench",
        lambda prompts, sizes, count, max_new_tokens, *rest: seen.update(
            batch_prompts=Path(prompts), batch_tokens=max_new_tokens
        ),
    )
    runner = CliRunner()
    assert isinstance(runner.invoke(cli.app, ["bench"]).exception, Stop)  # stopped at loading the models
    assert runner.invoke(cli.app, ["bench", "--batch-size", "1,2"]).exit_code == 0
    result = runner.invoke(cli.app, ["trace", "--output", str(tmp_path)])
    assert result.exit_code == 0, result.output
    assert seen == {"bench": bm.SPEC_BENCH, "trace": bm.SPEC_BENCH, "batch_prompts": bm.SPEC_BENCH, "batch_tokens": 256}


def test_a_missing_prompts_file_is_a_usage_error_naming_the_fix(tmp_path):
    from typer.testing import CliRunner

    from hf_adaspec.cli import cli

    for args in (["bench"], ["bench", "--batch-size", "2"], ["trace", "--output", str(tmp_path / "t")]):
        result = CliRunner().invoke(cli.app, [*args, "--prompts", str(tmp_path / "nope.jsonl")])
        assert result.exit_code == 2, result.output
        text = " ".join(result.output.replace("│", " ").split())
        assert "nope.jsonl" in text and "--prompts" in text and "packaged Spec-Bench subset" in text


def test_batch_prompts_are_picked_round_robin_over_the_categories():
    from hf_adaspec.bench.batch import pick_prompts
    from hf_adaspec.bench.prompts import SPEC_BENCH

    picked = pick_prompts(SPEC_BENCH, 16)
    assert [p.category for p in picked[:13]] == list(SPEC_BENCH_CATEGORIES)
    assert [p.question_id for p in picked[13:]] == [82, 92, 102]
    assert len(pick_prompts(SPEC_BENCH, 104)) == 104
    with pytest.raises(ValueError, match="--prompts"):
        pick_prompts(SPEC_BENCH, 105)


def _run(qid, cat, method, tps, match=True):
    return Run(qid, cat, method, 64, 64 / tps, tps, match)


def test_summarize_speedup_is_geometric_mean_of_ratios():
    runs = [
        _run(1, "a", "plain", 10.0),
        _run(1, "a", "adaptive", 20.0),
        _run(2, "a", "plain", 10.0),
        _run(2, "a", "adaptive", 5.0, match=False),
        _run(3, "b", "plain", 8.0),
        _run(3, "b", "adaptive", 12.0),
    ]
    summary = summarize(runs, ["plain", "adaptive"])
    assert summary["table"]["a"]["adaptive"]["speedup"] == pytest.approx(1.0)  # sqrt(2 * 0.5)
    assert summary["table"]["b"]["adaptive"]["speedup"] == pytest.approx(1.5)
    assert summary["table"]["overall"]["adaptive"]["speedup"] == pytest.approx(1.5 ** (1 / 3))
    assert summary["greedy_mismatches"] == {"plain": 0, "adaptive": 1}
    table = markdown(summary, ["plain", "adaptive"])
    assert "| b | 8.00 (1.00x) | 12.00 (1.50x) |" in table


def test_unknown_method_lists_valid_ones():
    with pytest.raises(ValueError, match="adaptive"):
        method_kwargs("turbo", None, 5)


# the fast suite keeps test_write_results_json_markdown_and_png and test_summarize_speedup_is_geometric_mean_of_ratios
@pytest.mark.slow  # a batch summary written with its PNG
def test_batch_bench_summary_speedups_unsupported_and_outputs(tmp_path):
    from hf_adaspec.bench import batch as bb

    runs = [
        bb.BatchRun(2, "plain", 2, 100, 10.0, 10.0, rows_equal_plain=2),
        bb.BatchRun(2, "plain", 2, 100, 10.0, 10.0, rows_equal_plain=2),
        bb.BatchRun(2, "hf-assisted", 2, 0, 0.0, 0.0, error="assisted generate is only supported for batch_size = 1"),
        bb.BatchRun(2, "adaptive", 2, 100, 8.0, 6.0, mean_k=1.0, acceptance=0.5, rows_equal_plain=2),
        bb.BatchRun(
            2, "adaptive", 2, 100, 12.0, 8.0, mean_k=3.0, acceptance=0.7, rows_equal_plain=1, max_divergence_gap=0.125
        ),
    ]
    methods = ["plain", "hf-assisted", "adaptive"]
    summary = bb.summarize(runs, methods)
    row = summary["table"][2]
    assert row["plain"]["tokens_per_s"] == 10.0 and row["adaptive"]["speedup"] == 1.0  # 200 tokens / 20 s each
    assert row["adaptive"]["mean_k"] == 2.0 and row["adaptive"]["mean_latency_s"] == 7.0
    assert row["adaptive"]["rows_equal_plain"] == 3 and row["adaptive"]["max_divergence_gap"] == 0.125
    assert "batch_size = 1" in row["hf-assisted"]["unsupported"]
    assert "unsupported" in bb.markdown(summary, methods)
    out = tmp_path / "b.json"
    bb.write_results(out, runs, summary, {"methods": methods})
    assert json.loads(out.read_text())["summary"]["table"]["2"]["adaptive"]["speedup"] == 1.0
    assert out.with_suffix(".md").exists() and out.with_suffix(".png").stat().st_size > 0


def test_bench_oracle_agreement_lookup_runs_and_rates(models, one_thread):
    from hf_adaspec.bench.oracle_inputs import (
        draft_agreement,
        prompt_oracle,
    )
    from hf_adaspec.costs.table import CostTable

    target, prompt = models["target"], torch.tensor([[5, 6, 7, 8, 9, 10]])
    seq = target.generate(prompt, max_new_tokens=12, do_sample=False)  # plain greedy, [1, 18]
    assert draft_agreement(models["same_model"], seq, 6) == [True] * 11  # the target agrees with itself
    noisy = draft_agreement(models["other_seed"], seq, 6)
    assert len(noisy) == 11 and not all(noisy)
    costs = CostTable(verify_ms=(10.0,) * 9, draft_ms=1.0, draft_catchup_ms=0.0)
    oracle = prompt_oracle(target, models["same_model"], seq, 6, costs, 8, (7, "qa"))
    assert oracle.draft_agreement == 1.0 and oracle.new_tokens == 12
    # the same-model draft is always right: 11 decode tokens in 2 steps (k=8, then k=1) at 18 ms and 11 ms
    assert oracle.tokens_per_s["draft"] == pytest.approx(1000.0 * 12 / (oracle.prefill_ms + 18.0 + 11.0))
    assert oracle.tokens_per_s["hybrid"] >= oracle.tokens_per_s["draft"] - 1e-9
    assert set(oracle.tokens_per_s) == {"draft", "lookup", "hybrid"}


def test_bench_oracle_charges_the_draft_only_for_prompt_tokens_it_did_not_reuse(models, one_thread):
    from hf_adaspec.bench.oracle_inputs import prompt_oracle
    from hf_adaspec.costs.table import CostTable

    target, prompt = models["target"], torch.tensor([[5, 6, 7, 8, 9, 10]])
    seq = target.generate(prompt, max_new_tokens=12, do_sample=False)  # [1, 18]
    costs = CostTable(verify_ms=(10.0,) * 9, draft_ms=1.0, draft_catchup_ms=5.0)
    for reused, ingest_ms in ((0, 30.0), (4, 10.0)):  # 6 or 2 prompt tokens at 5 ms
        oracle = prompt_oracle(target, models["same_model"], seq, 6, costs, 8, (7, "qa"), reused=reused)
        # k=8, then k=1: (8 + 10) + (1 + 10) ms
        assert oracle.tokens_per_s["draft"] == pytest.approx(1000.0 * 12 / (oracle.prefill_ms + 29.0 + ingest_ms))


def test_lookup_runs_count_the_matching_prefix():
    from hf_adaspec.bench.oracle_inputs import lookup_runs

    seq = torch.tensor([[1, 2, 3, 4, 1, 2, 3, 9, 1, 2]])  # prompt = first 4 tokens
    # generated tokens: 1 2 3 9 1 2 (positions 4..9); decode tokens start at position 5
    # pos 5 (prefix ..1): lookup continues [2,3,4,...] → 2,3 match, 4≠9 → 2; pos 6 (..1,2): [3,4,..] vs 3,9 → 1
    # pos 7 (..1,2,3): [4,1,2,3] vs 9 → 0; pos 8 (..3,9): 9 never seen before → 0; pos 9 (..9,1): [2,3,9,1] vs 2 → 1
    assert lookup_runs(seq, 4, k_max=8) == [2, 1, 0, 0, 1]


def test_costless_runs_take_the_better_of_lookup_and_suffix_per_position():
    from hf_adaspec.bench.oracle_inputs import costless_runs, lookup_runs

    seq = torch.tensor([[1, 2, 1, 1, 3, 2, 3, 3, 3, 1, 2, 1]])  # prompt = first 4 tokens
    assert lookup_runs(seq, 4, k_max=8) == [0, 0, 0, 1, 0, 0, 1]
    # at position 10 (..3, 1) prompt lookup proposes a wrong token, suffix drafting (its best-scoring
    # continuation in the sequence's suffix trie) the right one, 2
    assert costless_runs(seq, 4, k_max=8) == [0, 0, 0, 1, 0, 1, 1]


def test_summarize_reports_pct_of_oracle_acceptance_and_k():
    from hf_adaspec.bench.oracle_inputs import PromptOracle

    runs = [
        _run(1, "a", "plain", 10.0),
        Run(1, "a", "adaptive", 64, 3.2, 20.0, True, acceptance=0.5, mean_k=2.0, oracle_tokens_per_s=25.0),
    ]
    oracles = [PromptOracle(1, "a", 64, 100.0, 0.7, 0.2, {"draft": 25.0, "lookup": 12.0, "hybrid": 26.0})]
    summary = summarize(runs, ["plain", "adaptive"], oracles)
    cell = summary["table"]["a"]["adaptive"]
    assert cell["pct_oracle"] == pytest.approx(80.0) and cell["acceptance"] == 0.5 and cell["mean_k"] == 2.0
    assert summary["table"]["a"]["plain"]["pct_oracle"] is None
    assert summary["oracle"]["a"]["oracle_speedup"]["draft"] == pytest.approx(2.5)
    text = markdown(summary, ["plain", "adaptive"])
    assert (
        "| a | 80% |" in text
        and "| a | 0.50 / 2.00 |" in text
        and "| a | 0.70 | 0.20 | 2.50x | 2.60x | 1.20x |" in text
    )


def test_write_results_json_markdown_and_png(tmp_path):
    from hf_adaspec.bench.oracle_inputs import PromptOracle
    from hf_adaspec.bench.summary import write_results

    runs = [
        _run(1, "a", "plain", 10.0),
        _run(1, "a", "adaptive", 12.0),
        _run(2, "b", "plain", 9.0),
        _run(2, "b", "adaptive", 8.0),
    ]
    oracles = [PromptOracle(1, "a", 64, 100.0, 0.7, 0.2, {"draft": 25.0})]
    summary = summarize(runs, ["plain", "adaptive"], oracles)
    out = tmp_path / "r" / "bench.json"
    write_results(out, runs, summary, {"methods": ["plain", "adaptive"]}, oracles)
    data = json.loads(out.read_text())
    assert len(data["runs"]) == 4 and data["oracles"][0]["tokens_per_s"] == {"draft": 25.0}
    assert out.with_suffix(".md").read_text().startswith("tokens/s")
    assert out.with_suffix(".png").read_bytes()[:4] == b"\x89PNG"
    assert not list(out.parent.glob("*.tmp*"))


class _Tokenizer:
    """apply_chat_template → a fixed 6-token prompt (the bench's only use of the tokenizer here)."""

    def apply_chat_template(self, msgs, **kwargs):
        ids = torch.tensor([[3, 5, 7, 3, 5, 7]])
        return {"input_ids": ids, "attention_mask": torch.ones_like(ids)}


@pytest.mark.usefixtures("one_thread", "private_cache")
def test_run_prompt_methods_match_plain_learn_apart_and_get_an_oracle_bound(models, monkeypatch):
    costs = CostTable(verify_ms=(10.0,) * 9, draft_ms=1.0)
    calls = []
    original = models["target"].generate

    def with_costs(**kwargs):  # a fixed table instead of calibrating the tiny pair
        if "speculation" in kwargs:
            calls.append(kwargs)
            kwargs = {**kwargs, "speculation_costs": costs}
        return original(**kwargs)

    monkeypatch.setattr(models["target"], "generate", with_costs)
    methods = ["plain", "fixed-k", "pmin", "adaptive", "adaptive-lookup"]
    cfg = {"fixed_k": 3, "max_new_tokens": 8, "states": {}, "costs": lambda context: costs}
    result = run_prompt(models["target"], _Tokenizer(), models["noisy_copy"], Prompt(1, "qa", "hi"), methods, 2, cfg)
    assert [r.method for r in result.runs] == methods
    assert all(r.matches_plain and r.new_tokens == 8 for r in result.runs)  # greedy: every method equals plain
    by_method = {r.method: r for r in result.runs}
    assert by_method["plain"].mean_k is None and by_method["plain"].oracle_tokens_per_s is None
    assert by_method["fixed-k"].mean_k > 0 and by_method["adaptive"].oracle_tokens_per_s > 0
    assert [c.get("draft_p_min") for c in calls if c.get("num_speculative_tokens") == 8] == [0.75]  # pmin
    states = cfg["states"]
    assert set(states) == set(methods) - {"plain"} and len({id(s) for s in states.values()}) == 4
    assert result.oracle is not None and set(result.oracle.tokens_per_s) == {"draft", "lookup", "hybrid"}
    assert all(r.repeat_seconds == (r.seconds,) for r in result.runs)  # one repeat: its time is the median


def test_run_prompt_keeps_every_repeat_in_round_order_and_times_by_their_median(models, monkeypatch):
    durations = iter([5.0, 1.0, 2.0, 6.0, 3.0, 4.0])  # rounds: (plain, plain-again) × 3

    def scripted(generate, inputs, kwargs, max_new_tokens):
        out = generate(**inputs, **kwargs, max_new_tokens=max_new_tokens, do_sample=False, return_dict_in_generate=True)
        return out, next(durations)

    monkeypatch.setattr("hf_adaspec.bench.bench._timed", scripted)
    cfg = {"fixed_k": 3, "max_new_tokens": 4, "repeats": 3}
    result = run_prompt(models["target"], _Tokenizer(), None, Prompt(1, "qa", "hi"), ["plain", "plain-again"], 0, cfg)
    assert [r.repeat_seconds for r in result.runs] == [(5.0, 2.0, 3.0), (1.0, 6.0, 4.0)]
    assert [r.seconds for r in result.runs] == [3.0, 4.0]
