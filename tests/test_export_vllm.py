"""``hf-adaspec export-vllm``: traced acceptance + a cost profile → vLLM's speculative_config (no models run)."""

from __future__ import annotations

import itertools
import json

import pytest
import typer
from typer.testing import CliRunner

from hf_adaspec.cli import export_cli
from hf_adaspec.costs.predictors import ProfileCell
from hf_adaspec.costs.profile import assemble_profile
from hf_adaspec.costs.profile_files import save_profile
from hf_adaspec.policy.goodput import goodput
from hf_adaspec.replay.export_vllm import (
    acceptance_from_traces,
    best_k,
    head_prefix_acceptance,
    speculative_config,
)
from hf_adaspec.replay.trace import Trace, save_trace

# The keys vLLM's SpeculativeConfig accepts that this export may write: vllm/config/speculative.py
# (vllm-project/vllm, commit 002e77c1f0ef9b19cff8b9e21cfbd6feb3d6b443) and the docs
# https://docs.vllm.ai/en/latest/features/speculative_decoding/draft_model/ (method, model,
# num_speculative_tokens), .../n_gram/ (prompt_lookup_max, prompt_lookup_min) and
# https://docs.vllm.ai/en/v0.25.0/features/speculative_decoding/dynamic_speculative_decoding/
# (num_speculative_tokens_per_batch_size); https://docs.vllm.ai/en/latest/features/speculative_decoding/eagle/
# ("method": "eagle3", "model", "num_speculative_tokens"). No disable_by_batch_size: a V0 key, absent from V1's.
VLLM_SPECULATIVE_KEYS = {
    "method",
    "model",
    "num_speculative_tokens",
    "prompt_lookup_max",
    "prompt_lookup_min",
    "num_speculative_tokens_per_batch_size",
}
META = {
    "versions": {"torch": "x"},
    "machine": "m",
    "cpu": "c",
    "threads": 1,
    "created": "2025-01-01T00:00:00+00:00",
    "command": "test",
    "grid": {},
}
IDENTITY = {"profile_schema": 1, "target": {"name": "hand-target"}, "draft": {"name": "hand-draft"}}
BATCHES, CONTEXTS = (1, 2, 4, 8, 16), (128, 1024)


def _verify(b: int, c: int, n: int) -> float:
    """Target ms: linear in b·c and b·n (so the table and the fit agree); extra tokens cost more at large b."""
    return 0.001 * b * c + 2.0 * b * n + 20.0


def _profile(draft_scale: float = 1.0, with_draft: bool = True, head: bool = False):
    cells = {"target": [ProfileCell(b, c, n, _verify(b, c, n)) for b in BATCHES for c in CONTEXTS for n in (1, 3, 9)]}
    if with_draft:
        cells["draft"] = [
            ProfileCell(b, c, n, draft_scale * (0.0001 * b * c + 0.2 * b * n + 1.0))
            for b in BATCHES
            for c in CONTEXTS
            for n in (1, 32)
        ]
    identity = {**IDENTITY, "draft": {"name": "Eagle3Head"}} if head else IDENTITY
    return assemble_profile("hand", identity, cells, META)


def _trace(qid: int, prompt: list[int], generated: list[int], agree: bool = True) -> Trace:
    """A trace whose draft argmax agrees with every target token (agree) or with none."""
    tokens = prompt + generated
    nxt = [t if agree else t + 1000 for t in generated] + [0]  # draft_next[j] predicts tokens[prompt_len + j]
    return Trace(
        qid,
        "test",
        len(prompt),
        tuple(tokens),
        tuple(nxt),
        (0.5,) * len(nxt),
        (),
        10.0,
        len(generated),
        "hand-target",
        "hand-draft",
    )


def test_best_k_zero_when_drafting_is_expensive_and_positive_when_cheap():
    def verify(n: int) -> float:
        return 20.0 + n

    assert best_k(0.6, 50.0, verify, 8) == 0
    assert best_k(0.0, 0.0, lambda n: 10.0, 8) == 0  # every k ties with a plain step: no drafting
    k = best_k(0.9, 1.0, verify, 8)
    assert k > 0
    assert all(goodput(0.9, k, 1.0, verify) >= goodput(0.9, j, 1.0, verify) for j in range(9))


def test_best_k_shrinks_with_batch_and_ranges_merge():
    doc = speculative_config(_profile(), {"draft_model": 0.5}, "draft_model", "hand-draft", context=512)
    ranges = doc["hf_adaspec"]["per_batch_size"]
    assert [(r["batch_sizes"], r["num_speculative_tokens"]) for r in ranges] == [([1], 2), ([2, 4, 8], 1), ([16], 0)]
    config = doc["speculative_config"]
    assert config["num_speculative_tokens"] == 2
    assert config["num_speculative_tokens_per_batch_size"] == [[1, 1, 2], [2, 15, 1], [16, 16, 0]]
    first = ranges[0]
    assert first["predicted_goodput_tokens_per_s"][0] > first["plain_tokens_per_s"][0]


def _assert_valid_for_vllm(config: dict) -> None:
    """What vLLM's SpeculativeConfig and its Dynamic SD schedule validation require of these keys."""
    assert set(config) <= VLLM_SPECULATIVE_KEYS
    assert config["num_speculative_tokens"] > 0
    schedule = config.get("num_speculative_tokens_per_batch_size", [])
    if schedule:
        assert schedule[0][0] == 1
        assert all(lo <= hi for lo, hi, _ in schedule)
        assert all(a[1] < b[0] for a, b in itertools.pairwise(schedule))
        assert all(0 <= k <= config["num_speculative_tokens"] for _, _, k in schedule)


@pytest.mark.parametrize("method", ["draft_model", "ngram"])
def test_config_uses_only_documented_vllm_keys(method):
    doc = speculative_config(_profile(), {"draft_model": 0.8, "ngram": 0.7}, method, "hand-draft", context=512)
    config = doc["speculative_config"]
    _assert_valid_for_vllm(config)
    assert config["method"] == method
    if method == "draft_model":
        assert config["model"] == "hand-draft"
    else:
        assert (config["prompt_lookup_max"], config["prompt_lookup_min"]) == (3, 1) and "model" not in config


def test_no_speculation_when_it_never_pays():
    doc = speculative_config(_profile(draft_scale=100.0), {"draft_model": 0.5}, "draft_model", "d", context=512)
    assert doc["speculative_config"] is None
    assert [r["num_speculative_tokens"] for r in doc["hf_adaspec"]["per_batch_size"]] == [0]


def test_bad_arguments_raise_value_error():
    alphas = {"draft_model": 0.8, "ngram": 0.5}
    with pytest.raises(ValueError, match="unknown method"):
        speculative_config(_profile(), alphas, "eagle7", "d", context=512)
    with pytest.raises(ValueError, match="draft model's name"):
        speculative_config(_profile(), alphas, "draft_model", "", context=512)
    with pytest.raises(ValueError, match="no draft cells"):
        speculative_config(_profile(with_draft=False), alphas, "draft_model", "d", context=512)


def test_draft_acceptance_is_one_when_it_always_agrees_and_zero_when_never():
    assert acceptance_from_traces([_trace(0, [1, 2, 3], [4, 5, 6, 7])])["draft_model"] == 1.0
    assert acceptance_from_traces([_trace(0, [1, 2, 3], [4, 5, 6, 7], agree=False)])["draft_model"] == 0.0
    pooled = acceptance_from_traces([_trace(0, [1, 2], [4, 5, 6]), _trace(1, [1, 2], [4, 5, 6, 7, 8], agree=False)])
    assert pooled["draft_model"] == pytest.approx(2 / 6)  # positions j = 1..n-1: 2 agree, 4 not


def test_lookup_acceptance_counts_geometric_trials():
    assert acceptance_from_traces([_trace(0, [5, 6, 7, 8], [5, 6, 7, 8, 5, 6])])["ngram"] == 1.0  # pure repeat
    assert acceptance_from_traces([_trace(0, [1, 2, 3], [4, 5, 6, 7])])["ngram"] == 0.0  # nothing to look up
    # pos 4: lookup of [1,2,3,1] proposes [2,3,1] → 2 ok, 3≠9 fails; pos 5: [3,1,2] → 3≠9 fails
    assert acceptance_from_traces([_trace(0, [1, 2, 3], [1, 2, 9])])["ngram"] == pytest.approx(1 / 3)


def test_cli_writes_the_config_and_prints_it_last(tmp_path):
    traces = tmp_path / "traces"
    for i in range(2):
        save_trace(_trace(i, [5, 6, 7, 8], [5, 6, 7, 8, 5, 6], agree=i == 0), traces)
    profile = save_profile(_profile(), tmp_path / "profile.json")
    app = typer.Typer()
    app.command()(export_cli.export_vllm)
    out = tmp_path / "out" / "vllm.json"
    result = CliRunner().invoke(app, [str(traces), str(profile), "--method", "ngram", "--output", str(out)])
    assert result.exit_code == 0, result.output
    line = json.loads(result.output.strip().splitlines()[-1])
    written = json.loads(out.read_text())
    assert line == {"output": str(out), "speculative_config": written["speculative_config"]}
    _assert_valid_for_vllm(written["speculative_config"])
    assert written["hf_adaspec"]["alpha"] == 1.0 and written["hf_adaspec"]["prompts"] == 2
    assert not list(out.parent.glob("*.tmp"))


def _head_trace(qid: int, runs: list[int], depth: int = 4) -> Trace:
    """A trace of 12 new tokens whose head chain drafted at generated position j agrees for runs[j] tokens
    (0 at j = 0 and where runs is short), then misses."""
    prompt, generated = [1, 2, 3], list(range(10, 22))
    tokens = prompt + generated
    chains = []
    for j in range(len(generated) + 1):
        run = runs[j] if j < len(runs) else 0
        chains.append(tuple(tokens[3 + j + d] if d < run and 3 + j + d < len(tokens) else 99 for d in range(depth)))
    t = _trace(qid, prompt, generated)
    return Trace(
        **{
            **t.__dict__,
            "head": "hand-head",
            "head_next": tuple(chains),
            "head_q": tuple((0.5,) * depth for _ in chains),
        }
    )


def test_head_prefix_acceptance_counts_each_depth_where_tokens_remain():
    t = _head_trace(0, [0] + [4] * 12)  # every chain agrees as far as the output goes
    assert head_prefix_acceptance([t]) == (1.0, 1.0, 1.0, 1.0)
    half = _head_trace(1, [0] + [2, 1] * 6)  # alternating runs of 2 and 1
    p = head_prefix_acceptance([half])
    assert p[0] == 1.0 and p[1] == pytest.approx(5 / 10) and p[2] == 0.0  # depth 2: 5 of the 10 positions with 2 left
    assert acceptance_from_traces([half])["eagle3"] == 1.0 and head_prefix_acceptance([_trace(0, [1], [2, 3])]) == ()


def test_eagle3_names_the_head_and_takes_k_from_its_measured_depths():
    cheap = _profile(draft_scale=0.2, head=True)
    deep = speculative_config(cheap, {"eagle3": 0.9}, "eagle3", "my/head", 512, head_prefix=(0.9, 0.85, 0.8, 0.75))
    shallow = speculative_config(cheap, {"eagle3": 0.9}, "eagle3", "my/head", 512, head_prefix=(0.9, 0.05, 0.0, 0.0))
    config = deep["speculative_config"]
    _assert_valid_for_vllm(config)
    assert config["method"] == "eagle3" and config["model"] == "my/head" and config["num_speculative_tokens"] == 4
    assert shallow["speculative_config"]["num_speculative_tokens"] == 1  # past depth 1 the head misses
    assert deep["hf_adaspec"]["prefix_acceptance"] == [0.9, 0.85, 0.8, 0.75]
    with pytest.raises(ValueError, match="eagle3 needs the head's costs"):
        speculative_config(_profile(), {"eagle3": 0.9}, "eagle3", "h", 512, head_prefix=(0.9,))
    with pytest.raises(ValueError, match="hf-adaspec trace --head"):
        speculative_config(cheap, {"eagle3": 0.9}, "eagle3", "h", 512)
    with pytest.raises(ValueError, match="head's name or path"):
        speculative_config(cheap, {"eagle3": 0.9}, "eagle3", "", 512, head_prefix=(0.9,))
    with pytest.raises(ValueError, match="measured with a head; draft_model needs"):
        speculative_config(cheap, {"draft_model": 0.9}, "draft_model", "d", 512)


@pytest.mark.slow  # the fast suite keeps test_cli_writes_the_config_and_prints_it_last and eagle3's config test
def test_cli_exports_eagle3_with_the_head_model(tmp_path):
    traces = tmp_path / "traces"
    save_trace(_head_trace(0, [0] + [4] * 12), traces)
    profile = save_profile(_profile(draft_scale=0.2, head=True), tmp_path / "head_profile.json")
    app = typer.Typer()
    app.command()(export_cli.export_vllm)
    out = tmp_path / "vllm.json"
    base = [str(traces), str(profile), "--method", "eagle3", "--output", str(out)]
    refused = CliRunner().invoke(app, base)
    assert refused.exit_code == 2 and "--head-model" in refused.output
    result = CliRunner().invoke(app, [*base, "--head-model", "org/qwen-eagle3"])
    assert result.exit_code == 0, result.output
    config = json.loads(out.read_text())["speculative_config"]
    _assert_valid_for_vllm(config)
    assert config["method"] == "eagle3" and config["model"] == "org/qwen-eagle3"
    assert config["num_speculative_tokens"] >= 1
