"""The GPU check (issue 36, ``make gpu-check``) proven on the CPU before GPU time is spent on it: the whole
check with ``--device cpu --tiny`` (shrunk copies of the presets' configs, tiny grids, one repeat) runs every
step and passes, its results file is valid JSON after every step, a spent budget skips the rest but still
leaves a valid file, a failing or raising step is recorded and the next one runs, bitsandbytes failing to
load is recorded as a bf16 fallback, and the replay can be run later from the profiles a run left. Also:
the 7B architecture ships and its output head is wider than the draft's (which ``generate`` refuses)."""

from __future__ import annotations

import json
import sys

import pytest
import torch
import transformers

from hf_adaspec.costs.profile_files import load_profile
from hf_adaspec.gpu_check import gpu_check, profiles, quantized, speed, timing
from hf_adaspec.gpu_check import steps as cs
from hf_adaspec.gpu_check.gpu_check import RESULTS, SUMMARY, Step
from hf_adaspec.models import architecture


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory):
    """The whole check, --device cpu --tiny, with the results file parsed after every write."""
    out, cache = tmp_path_factory.mktemp("gpu"), tmp_path_factory.mktemp("cache")
    seen: list[dict] = []
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("HF_ADASPEC_CACHE", str(cache))
        original = gpu_check.write_results

        def write_and_read(folder, doc):
            original(folder, doc)
            seen.append(json.loads((folder / RESULTS).read_text()))  # valid JSON at every point

        mp.setattr(gpu_check, "write_results", write_and_read)
        status = gpu_check.main(["--device", "cpu", "--tiny", "--kv-cache", "static", "--out", str(out)])
    return status, out, seen


@pytest.mark.slow  # the whole check through its CLI entry point (24 steps, ~85 s on 2 cores; make test runs it)
def test_tiny_check_runs_every_step_and_passes(tiny_run):
    status, out, _ = tiny_run
    doc = json.loads((out / RESULTS).read_text())
    steps = doc["steps"]
    assert status == 0 and doc["finished"] and list(steps) == [s.name for s in gpu_check.plan()]
    assert {n: e["status"] for n, e in steps.items()} == dict.fromkeys(steps, "ok")
    assert "bitsandbytes" in steps["environment"]["nf4"]  # loads here: NF4 ran (else a FALLBACK line)
    for name in ("graphs", "head-graphs", "greedy-bf16", "greedy-nf4", "self-draft-bf16", "self-draft-nf4", "sampling"):
        assert steps[name]["passed"] is True, name
    assert steps["environment"]["kv_cache"] == "static" and steps["graphs"]["records"]  # the arenas' path ran
    assert all(r["kept"] for r in steps["graphs"]["records"])
    assert len(steps["head-graphs"]["capture_ms"]) == 1  # the head's column recorded once, then replayed
    cases = steps["greedy-nf4"]["cases"]
    assert len(cases) == 10 and {"draft_model", "prompt_lookup", "suffix"} <= {
        d for c in cases.values() for d in c["drafters"]
    }
    judged = [
        c["acceptance_clear"] for c in steps["self-draft-nf4"]["cases"].values() if c["acceptance_clear"] is not None
    ]
    assert judged and min(judged) >= 0.9 and steps["self-draft-nf4"]["ties"]["drafted_clear"] > 0
    ties = steps["self-draft-bf16"]["ties"]
    assert ties["drafted_clear"] + ties["drafted_tie"] == sum(
        c["drafted"] for c in steps["self-draft-bf16"]["cases"].values()
    )
    for name in ("profile-1.5b-bf16", "profile-1.5b-nf4", "profile-7b-nf4", "profile-7b-bf16"):
        profile = load_profile(steps[name]["path"])
        assert "--random-weights" in profile.meta["command"] and profile.draft_cells
    assert "generate takes the pair" in steps["profile-7b-nf4"]["summary"]  # the 7B head is wider: the draft is padded
    assert steps["engine-bf16"]["runs"]["adaptive"]["steps"] > 0 and len(steps["engine-bf16"]["overheads_ms"]) == 2
    for name in ("speed-bf16", "speed-nf4"):
        assert steps[name]["passed"] is None  # tiny timings are not judged
    assert {"hf-plain", "hf-compiled", "plain", "adaptive", "fixed-self"} <= set(steps["speed-bf16"]["tokens_per_s"])
    assert "hf-compiled" not in steps["speed-nf4"]["tokens_per_s"]  # transformers compiles bf16 only here
    for name in ("never-loses-bf16", "never-loses-nf4"):
        entry = steps[name]
        assert entry["passed"] is None and set(entry["tokens_per_s"]) == {"plain", "plain-again", "adaptive"}
        assert set(entry["bars"]) == {"never_loses"} and all(len(v) == 1 for v in entry["per_round"].values())
        assert sum(entry["adaptive_random_draft_steps"]["steps"].values()) > 0
    formats = steps["formats-7b"]
    assert formats["chosen_4bit"] in ("nf4", "q4") and [m["format"] for m in formats["measures"]][0] == "none"
    four_bit = steps["profile-7b-4bit"]
    assert four_bit["format"] == formats["chosen_4bit"] and four_bit["path"].endswith("-compiled-draft/profile.json")
    assert four_bit["passed"] is None and set(four_bit["bars"]) == {"verify_5_over_1", "step_vs_bf16"}
    assert "--quantization " + four_bit["format"] in load_profile(four_bit["path"]).meta["command"]
    compiled = steps["compile-target"]
    assert {"hf-compiled", "plain", "plain-compiled", "adaptive-compiled"} <= set(compiled["tokens_per_s"])
    assert compiled["passed"] is None and set(compiled["bars"]) == {"plain_vs_hf_compiled", "never_loses"}
    assert all(len(r["top"]) > 0 and r["steps"] > 0 for r in steps["engine-profile-bf16"]["runs"].values())
    tables = steps["replay"]["tables"]
    assert len(tables) == 6 and all(set(t) == {"b1", "b2"} for t in tables.values())
    assert all("spec_bench" in t["b1"]["workloads"] for t in tables.values())
    assert steps["replay"]["four_bit_profile"] == four_bit["path"].split("/")[-2]
    summary = (out / SUMMARY).read_text()
    assert all(f"| {name} | ok |" in summary for name in steps) and "Projections" in summary


@pytest.mark.slow  # the whole check through its CLI entry point (24 steps, ~85 s on 2 cores; make test runs it)
def test_results_are_valid_after_every_step(tiny_run):
    _, _, seen = tiny_run
    done = [len(doc["steps"]) for doc in seen]
    assert done[0] == 0 and done[-1] == len(gpu_check.plan())
    assert sorted(set(done)) == list(range(len(gpu_check.plan()) + 1))  # one write per step
    assert not seen[-2]["finished"] and seen[-1]["finished"]


@pytest.mark.slow  # on top of the whole check (tiny_run), the replay step again: ~13 s on 2 cores
def test_replay_runs_later_and_merges_into_the_results(tiny_run):
    _, out, _ = tiny_run
    before = json.loads((out / RESULTS).read_text())["steps"]
    assert gpu_check.main(["--device", "cpu", "--tiny", "--out", str(out), "--steps", "replay"]) == 0
    doc = json.loads((out / RESULTS).read_text())
    after = doc["steps"]
    assert list(after) == list(before) and after["greedy-nf4"] == before["greedy-nf4"]
    assert doc["device_label"] == "cpu" and doc["finished"] and after["replay"]["ran_on"] == "cpu"
    assert after["replay"]["overheads_ms"] == before["engine-bf16"]["overheads_ms"]  # the engine's, from the file


def test_a_spent_budget_skips_every_step_and_leaves_valid_results(tmp_path):
    assert gpu_check.main(["--device", "cpu", "--tiny", "--out", str(tmp_path), "--budget-s", "0"]) == 0
    doc = json.loads((tmp_path / RESULTS).read_text())
    assert doc["finished"] and {e["status"] for e in doc["steps"].values()} == {"skipped: budget"}
    assert "skipped: budget" in (tmp_path / SUMMARY).read_text()


def test_failing_and_raising_steps_are_recorded_and_the_rest_run(tmp_path, monkeypatch):
    def boom(check):
        raise RuntimeError("kernel not found")

    steps = [
        Step("boom", boom),
        Step("wrong", lambda c: {"passed": False, "summary": "a check failed"}),
        Step("fine", lambda c: {"passed": True, "summary": "all good"}),
    ]
    monkeypatch.setattr(gpu_check, "plan", lambda: steps)
    assert gpu_check.main(["--device", "cpu", "--out", str(tmp_path)]) == 1
    entries = json.loads((tmp_path / RESULTS).read_text())["steps"]
    assert [e["status"] for e in entries.values()] == ["error", "failed", "ok"]
    assert "RuntimeError: kernel not found" in entries["boom"]["error"] and "Traceback" in entries["boom"]["traceback"]


def test_without_bitsandbytes_the_nf4_steps_fall_back_to_bf16(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "bitsandbytes", None)  # import bitsandbytes raises ImportError
    names = "environment,greedy-nf4,self-draft-nf4,profile-1.5b-nf4"
    assert gpu_check.main(["--device", "cpu", "--tiny", "--out", str(tmp_path), "--steps", names]) == 0
    steps = json.loads((tmp_path / RESULTS).read_text())["steps"]
    assert steps["environment"]["nf4"].startswith("FALLBACK: bitsandbytes did not load")
    for name in names.split(",")[1:]:
        assert steps[name]["status"] == "ok" and steps[name]["fallback"] and "FALLBACK" in steps[name]["summary"]


def test_command_line_errors(tmp_path, capsys):
    with pytest.raises(SystemExit):
        gpu_check.main(["--device", "cpu", "--out", str(tmp_path), "--steps", "nonsense"])
    assert "choose from environment, graphs, head-graphs, sampling" in capsys.readouterr().err
    if not torch.cuda.is_available():
        with pytest.raises(SystemExit):
            gpu_check.main(["--out", str(tmp_path)])
        assert "torch sees no CUDA device" in capsys.readouterr().err


def test_the_7b_architecture_ships_with_a_wider_head_than_the_draft():
    config = transformers.AutoConfig.from_pretrained(architecture.config_path("qwen2.5-7b"))
    assert (config.hidden_size, config.intermediate_size, config.num_hidden_layers) == (3584, 18944, 28)
    assert (config.num_attention_heads, config.num_key_value_heads, config.tie_word_embeddings) == (28, 4, False)
    draft = transformers.AutoConfig.from_pretrained(architecture.config_path("qwen2.5-coder-0.5b"))
    assert (config.vocab_size, draft.vocab_size) == (152064, 151936)
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(config)
    assert 7.6e9 < sum(p.numel() for p in model.parameters()) < 7.7e9  # Qwen2.5-7B's 7.62B parameters


def test_on_a_gpu_cpu_work_and_steps_the_budget_cannot_fit_are_skipped(tmp_path):
    ran = []
    steps = [
        Step("replay-like", lambda c: ran.append("cpu work") or {}, on_gpu=False),
        Step("big", lambda c: ran.append("big") or {}, needs_s=1000.0),
        Step("small", lambda c: ran.append("small") or {"passed": True}, needs_s=1.0),
    ]
    doc = gpu_check.run_steps(gpu_check.Check("cuda", False, tmp_path), steps, budget_s=60.0)
    assert [e["status"] for e in doc["steps"].values()] == ["skipped: CPU work", "skipped: budget", "ok"]
    assert ran == ["small"] and "--steps replay-like" in doc["steps"]["replay-like"]["summary"]


def test_timed_rounds_interleave_per_request_alternate_order_and_drop_the_warm_up(monkeypatch):
    calls, clock = [], iter(range(10_000))
    monkeypatch.setattr(
        timing, "generate", lambda target, prompt, new, kwargs, state: calls.append((kwargs["m"], prompt))
    )
    monkeypatch.setattr(timing, "sync", lambda target: None)
    monkeypatch.setattr(timing.time, "perf_counter", lambda: float(next(clock)))  # every request takes 1 s
    methods = {"a": {"m": "a"}, "b": {"m": "b"}, "c": {"m": "c"}}
    seconds = timing.timed_seconds(None, methods, [[1], [2]], new=8, repeats=2)
    assert [m for m, _ in calls[:6]] == ["a", "b", "c", "c", "b", "a"]  # per request, the order reversed
    assert [m for m, _ in calls[6:9]] == ["c", "b", "a"]  # round 1 starts where round 0's second prompt did
    assert len(calls) == 3 * 2 * 3 and seconds == {m: [[1.0, 1.0], [1.0, 1.0]] for m in methods}  # warm-up dropped


def test_tokens_per_s_is_the_geometric_mean_over_prompts_of_the_median_round():
    rounds = [[1.0, 4.0], [2.0, 2.0], [9.0, 1.0]]  # [round][prompt] seconds; medians 2 s and 2 s
    assert timing.tokens_per_s(rounds, new=8) == pytest.approx(4.0)
    assert timing.tokens_per_s([[1.0, 4.0]], new=8) == pytest.approx((8.0 * 2.0) ** 0.5)
    assert speed.speedup([1.0, 4.0], [2.0, 2.0]) == pytest.approx(1.0)  # 0.5x and 2x


def test_a_merged_run_carries_the_facts_later_steps_use():
    steps = {
        "engine-bf16": {"overheads_ms": [1.2, 0.8]},
        "formats-7b": {"chosen_4bit": "int4"},
        "profile-7b-4bit": {"path": "out/qwen2.5-7b_coder-0.5b-int4-compiled-draft/profile.json"},
        "profile-7b-bf16": {"costs": {"b1": {"verify_ms_n1": 7.4, "verify_ms_n5": 8.6}}},
    }
    assert gpu_check.carried_facts(steps) == {
        "overheads": (1.2, 0.8),
        quantized.FOUR_BIT: "int4",
        profiles.FOUR_BIT_PROFILE: "qwen2.5-7b_coder-0.5b-int4-compiled-draft",
        "verify_ms_n1 qwen2.5-7b none": 7.4,
    }
    assert gpu_check.carried_facts({}) == {}


@pytest.mark.parametrize("n5,bf16,passed", [(6.0, 7.4, True), (7.0, 7.4, False), (6.0, 4.0, False), (6.0, None, None)])
def test_the_7bs_4bit_profile_is_held_to_the_verification_and_step_bars(tmp_path, monkeypatch, n5, bf16, passed):
    """t_verify(5) / t_verify(1) ≤ 1.3 and the 1-token step ≤ bf16's (from this run's facts; else not judged)."""

    def fake_profile(check, target, quantization, compiled_draft, draft_quantization):
        assert (target, compiled_draft, draft_quantization) == (cs.BIG, True, "none")
        return {
            "costs": {"b1": {"verify_ms_n1": 5.0, "verify_ms_n5": n5, "draft_ms": 1.7}},
            "summary": "measured",
            "path": str(tmp_path / f"qwen2.5-7b_coder-0.5b-{quantization}-compiled-draft" / "profile.json"),
        }

    monkeypatch.setattr(quantized, "profile_pair", fake_profile)
    facts = {quantized.FOUR_BIT: "int4", **({"verify_ms_n1 qwen2.5-7b none": bf16} if bf16 else {})}
    check = cs.Check("cuda", False, tmp_path, facts=facts)
    entry = quantized.profile_7b_4bit(check)
    assert entry["passed"] is passed and entry["verify_5_over_1"] == round(n5 / 5.0, 3)
    assert check.facts[profiles.FOUR_BIT_PROFILE] == "qwen2.5-7b_coder-0.5b-int4-compiled-draft"
    with pytest.raises(RuntimeError, match="run the formats-7b step first"):
        quantized.profile_7b_4bit(cs.Check("cuda", False, tmp_path))


# the fast suite keeps test_the_7bs_4bit_profile_is_held_to_the_verification_and_step_bars (a 4-bit step)
@pytest.mark.slow  # a format probe
def test_the_format_step_names_a_missing_kernel_and_chooses_among_the_4bit_formats_that_load(tmp_path, monkeypatch):
    monkeypatch.setattr(quantized, "probed_for", lambda device: ("nf4", "none", "int4"))
    # injected timings (the choice here does not hang on them: nf4 is the only 4-bit format that loads)
    monkeypatch.setattr(quantized.fc, "forward_ms", lambda model, fmt, n: {"none": 40.0}.get(fmt, 30.0) * n)
    check = cs.Check("cpu", True, tmp_path)
    entry = quantized.formats_7b(check)
    rows = {m["format"]: m for m in entry["measures"]}
    assert rows["int4"]["error"] == "torch's int4 kernel: CUDA only, not cpu" and rows["int4"]["ms_1"] is None
    assert entry["chosen_4bit"] == "nf4" == check.facts[quantized.FOUR_BIT] and entry["passed"]
    assert rows["none"]["top1"] is None and "int4 skipped (torch's int4 kernel" in entry["summary"]


@pytest.mark.slow  # two child processes, each importing torch: ~4 s on 2 cores
def test_isolated_steps_each_run_in_a_process_of_their_own_and_a_dead_one_is_recorded(tmp_path, monkeypatch):
    """--isolation process: the environment step runs in a child process that merges its entry (with the run's
    provenance) into the results; a step whose process dies without recording is that step's error, and the
    run goes on."""
    real = gpu_check.processes.child_command

    def command(device, out, name, budget_s, kv_cache, tiny):
        if name == "sampling":
            return [sys.executable, "-c", "import sys; sys.exit(3)"]  # as a process a CUDA fault kills
        return real(device, out, name, budget_s, kv_cache, tiny)

    monkeypatch.setattr(gpu_check.processes, "child_command", command)
    monkeypatch.setenv(gpu_check.processes.COMMIT_ENV, "abc1234")
    status = gpu_check.main(
        [
            "--device",
            "cpu",
            "--tiny",
            "--isolation",
            "process",
            "--out",
            str(tmp_path),
            "--steps",
            "environment,sampling",
        ]
    )
    doc = json.loads((tmp_path / RESULTS).read_text())
    env, dead = doc["steps"]["environment"], doc["steps"]["sampling"]
    assert status == 1 and doc["finished"] and env["status"] == "ok" and dead["status"] == "error"
    assert "exited with status 3 without recording the step" in dead["error"]
    assert env["commit"] == doc["provenance"]["commit"] == "abc1234"
    assert {"torch", "cuda", "driver", "transformers"} <= set(doc["provenance"]) and env["torch"] == torch.__version__
