"""The pair's learned state across processes (``engine.persist``, ``SpeculationState.save``/``load``): a round trip
decides the next request as the in-process statistics would, the file holds counts and never a prompt's tokens,
a damaged or another pair's file is refused with its fix, writes are atomic, ``hf-adaspec generate`` keeps a file
per pair, and no benchmark reads one. Tiny random models, predicted step times: nothing depends on the machine."""

from __future__ import annotations

import ast
import copy
import json
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from hf_adaspec import CostTable, LoadedModel, SpeculationState
from hf_adaspec.cli import cli
from hf_adaspec.engine import persist
from hf_adaspec.engine.persist import LearnedStateError, PairKey
from hf_adaspec.files import TMP_MARK
from hf_adaspec.policy.confidence import CalibratorMemory, ConfidenceCalibrator
from hf_adaspec.policy.match import MatchMemory, MatchTable

pytestmark = pytest.mark.usefixtures("one_thread", "private_cache")
ROOT = Path(__file__).resolve().parent.parent
FIRST = torch.tensor([[5, 6, 7, 8, 9, 10] * 4])  # [1, 24]: the request the state learns from
NEXT = torch.tensor([[40, 41, 42, 43, 11, 40, 41, 42, 43, 12, 40, 41]])  # [1, 12]: the next request
COSTS = CostTable(verify_ms=(10.0, 10.5, 11.0, 11.5, 12.0, 12.5, 13.0, 13.5, 14.0), draft_ms=2.0)


def _generate(model, draft, prompt: torch.Tensor, state: SpeculationState, tokens: int = 16):
    """A greedy ``adaptive`` request priced by ``COSTS`` and deciding every step (``rest=False``: the ledger books
    predicted times), so its decisions depend on the learned state alone."""
    return model.generate(
        inputs=prompt,
        speculation="adaptive",
        assistant_model=draft,
        speculation_state=state,
        speculation_costs=COSTS,
        rest=False,
        adapt_threads=False,
        max_new_tokens=tokens,
        do_sample=False,
        return_dict_in_generate=True,
    )


def _decisions(out) -> list[tuple[str, int, int]]:
    return [(s.drafter, s.k, s.accepted) for s in out.speculation.steps]


def _document(state: SpeculationState) -> dict:
    return {"calibrators": state.calibrators.counts(), "matches": state.matches.counts()}


def test_a_saved_state_decides_the_next_request_as_the_in_process_statistics_do(models, tmp_path):
    target, draft = models["target"], models["noisy_copy"]
    learned = SpeculationState()
    _generate(target, draft, FIRST, learned, tokens=24)
    assert learned.suffixes.tokens > 0  # it holds the first answer, which no file may carry
    in_process = SpeculationState(copy.deepcopy(learned.calibrators), copy.deepcopy(learned.matches))
    path = learned.save(tmp_path / "pair.json", target, draft)
    loaded = SpeculationState.load(path, target, draft)
    assert _document(loaded) == _document(learned)  # counts round-trip exactly
    assert loaded.suffixes.tokens == 0 and not loaded.draft_prefixes.entries and learned.draft_prefixes.entries
    here, there = _generate(target, draft, NEXT, in_process), _generate(target, draft, NEXT, loaded)
    assert _decisions(here) == _decisions(there) and torch.equal(here.sequences, there.sequences)
    assert any(d == "draft_model" and k > 0 for d, k, _ in _decisions(there))
    assert _document(in_process) == _document(loaded)  # and they learn alike from it
    fresh = _generate(target, draft, NEXT, SpeculationState())
    assert _decisions(fresh) != _decisions(there)  # the saved state is what decided (not a vacuous check)


def _leaves(value, path=()):
    if isinstance(value, dict):
        for k, v in value.items():
            yield from _leaves(v, (*path, k))
    elif isinstance(value, list):
        for v in value:
            yield from _leaves(v, (*path, "[]"))
    else:
        yield path, value


def test_the_file_holds_counts_of_fixed_size_and_no_token_of_the_prompt_or_answer(models, tmp_path):
    target, draft = models["target"], models["noisy_copy"]
    state = SpeculationState()
    out = _generate(target, draft, FIRST, state, tokens=24)
    path = state.save(tmp_path / "pair.json", target, draft)
    document = json.loads(path.read_text())
    allowed = {"format", "version", "library", "pair", "calibrators", "matches", "digest"}
    assert set(document) == allowed
    counts = ConfidenceCalibrator().counts().keys() | MatchTable().counts().keys()
    for where, value in _leaves({"calibrators": document["calibrators"], "matches": document["matches"]}):
        assert where[2] in counts, where  # (kind, drafter key, field[, []]): only the tables' own fields
        if where[2] not in ("n_bins", "tokens_seen", "edges"):
            assert isinstance(value, float), where  # a count, never a token id
    for table in document["calibrators"].values():
        assert len(table["trials"]) == table["n_bins"]  # sized by the settings, not by the request
    for table in document["matches"].values():
        assert len(table["trials"]) == len(table["edges"])
    tokens = [*FIRST[0].tolist(), *out.sequences[0, FIRST.shape[1] :].tolist()]
    assert len(tokens) > FIRST.shape[1]
    text = path.read_text()
    for i in range(len(tokens) - 2):  # no run of three of the request's ids, in any JSON spelling of a list
        assert json.dumps(tokens[i : i + 3])[1:-1] not in text and ",".join(map(str, tokens[i : i + 3])) not in text


def _saved(tmp_path, models) -> Path:
    state = SpeculationState()
    state.calibrators.calibrator_for("draft_model:x").update([0.9, 0.8], 1)
    state.matches.table_for("prompt_lookup:0").observe(3, 4, 2)
    return state.save(tmp_path / "pair.json", models["target"], models["noisy_copy"])


def test_a_damaged_file_is_refused_with_its_fix(models, tmp_path):
    path = _saved(tmp_path, models)
    text = path.read_text()
    path.write_text(text.replace('"trials": [', '"trials": [1.5, ', 1))  # edited: the digest no longer matches
    with pytest.raises(LearnedStateError, match="not an intact learned state.*digest.*delete it to start fresh"):
        SpeculationState.load(path, models["target"], models["noisy_copy"])
    path.write_text(text[: len(text) // 2])  # cut short
    with pytest.raises(LearnedStateError, match="not an intact learned state"):
        SpeculationState.load(path, models["target"], models["noisy_copy"])
    with pytest.raises(FileNotFoundError):
        SpeculationState.load(tmp_path / "nothing.json", models["target"])


def test_another_pairs_or_versions_file_is_refused_and_bad_counts_restore_nothing(models, tmp_path):
    path = _saved(tmp_path, models)
    with pytest.raises(LearnedStateError, match="another pair.*pass the models it was saved with"):
        SpeculationState.load(path, models["target"], models["other_seed"])
    with pytest.raises(LearnedStateError, match="another pair"):
        SpeculationState.load(path, models["other_seed"], models["noisy_copy"])
    pair = PairKey.of(models["target"], models["noisy_copy"])
    document = persist.learned_document(pair, CalibratorMemory(), MatchMemory())
    persist.write_json_verified(path, {**document, "version": persist.VERSION + 1})
    with pytest.raises(LearnedStateError, match="version"):
        SpeculationState.load(path, models["target"], models["noisy_copy"])
    bad = {"prompt_lookup:0": {**MatchTable().counts(), "successes": [2.0] * len(MatchTable().trials)}}
    persist.write_json_verified(path, {**document, "matches": bad})  # successes above trials
    calibrators, matches = CalibratorMemory(), MatchMemory()
    matches.table_for("suffix:0").observe(2, 3, 3)
    before = matches.counts()
    with pytest.raises(LearnedStateError, match="refuses.*out of range"):
        persist.read_learned(path, pair, calibrators, matches)
    assert matches.counts() == before and calibrators.counts() == {}  # all or nothing


def test_writes_are_atomic_and_leave_no_temporary(models, tmp_path, monkeypatch):
    path = _saved(tmp_path, models)
    good = path.read_bytes()

    def fail(*args, **kwargs):
        raise OSError("disk full")

    monkeypatch.setattr("hf_adaspec.files.os.replace", fail)  # written and synced beside it, the rename fails
    with pytest.raises(OSError, match="disk full"):
        SpeculationState().save(path, models["target"], models["noisy_copy"])
    assert path.read_bytes() == good and not [p for p in tmp_path.iterdir() if TMP_MARK in p.name]
    monkeypatch.undo()
    with pytest.raises(IsADirectoryError, match="directory"):
        SpeculationState().save(tmp_path, models["target"])


class _Tokenizer:
    def apply_chat_template(self, messages, **kwargs) -> dict:
        return {"input_ids": FIRST, "attention_mask": torch.ones_like(FIRST)}

    def decode(self, ids, **kwargs) -> str:
        return "".join(chr(97 + int(i) % 26) for i in ids)


@pytest.fixture
def cli_pair(models, monkeypatch, private_cache):
    target, draft = LoadedModel(models["target"], _Tokenizer(), "t"), LoadedModel(models["noisy_copy"], None, "d")
    monkeypatch.setattr(cli, "_load_pair", lambda *args: (target, draft))
    return PairKey.of(models["target"], models["noisy_copy"]).cache_path()


def _run(*args: str):
    return CliRunner().invoke(cli.app, ["generate", "--max-new-tokens", "8", *args, "hi"])


def test_generate_keeps_the_pairs_state_in_the_cache_and_fresh_touches_none(cli_pair, tmp_path, monkeypatch):
    assert not cli_pair.exists() and cli_pair.is_relative_to(tmp_path)  # the private cache
    assert _run("--fresh").exit_code == 0 and not cli_pair.exists()
    first = _run()
    assert first.exit_code == 0, first.output
    saved = json.loads(cli_pair.read_text())
    assert saved["matches"] and saved["calibrators"]
    started = []
    load = SpeculationState.load.__func__
    monkeypatch.setattr(SpeculationState, "load", classmethod(lambda *a: started.append(load(*a)) or started[-1]))
    assert _run().exit_code == 0
    (state,) = started  # the second run started from what the first saved
    assert _document(state) == {k: saved[k] for k in ("calibrators", "matches")}
    cli_pair.write_text("{ not json")
    damaged = _run()
    assert damaged.exit_code == 0 and "starting fresh, the pair's learned state is not usable" in damaged.stderr
    assert json.loads(cli_pair.read_text())["format"] == persist.FORMAT  # replaced by the run's
    named = tmp_path / "mine.json"
    named.write_text("{ not json")
    refused = _run("--learned-state", str(named))
    assert refused.exit_code == 2 and "--fresh" in refused.output and "Traceback" not in refused.output


# learned_prior.py measures the persisted state itself: it learns on the tune split only (asserted) and times the
# held-out prompts from it, the one benchmark that must read a file.
BENCH_SOURCES = [
    *sorted((ROOT / "hf_adaspec" / "bench").glob("*.py")),
    *(p for p in sorted((ROOT / "benchmarks").glob("*.py")) if p.name != "learned_prior.py"),
]
PERSISTENCE = {"load", "read_learned", "persist", "cache_path", "open_state", "learned"}


@pytest.mark.parametrize("source", BENCH_SOURCES, ids=lambda p: p.name)
def test_no_benchmark_starts_from_a_persisted_state(source):
    """A timed run must not start from a state that has seen its prompts: the bench and the benchmark scripts
    build fresh ``SpeculationState()``s and never name the persistence (``SpeculationState.load``, ``engine.persist``,
    ``cli.learned``)."""
    tree = ast.parse(source.read_text())
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and node.attr in PERSISTENCE:
            base = node.value
            assert not (isinstance(base, ast.Name) and base.id in ("SpeculationState", "state_cls")), ast.unparse(node)
        if isinstance(node, ast.ImportFrom):
            names = {a.name for a in node.names}
            assert not (names & {"persist", "learned"}) and "persist" not in (node.module or ""), ast.unparse(node)


def test_a_new_speculation_state_never_reads_a_file(models):
    target, draft = models["target"], models["noisy_copy"]
    state = SpeculationState()
    state.calibrators.calibrator_for("draft_model:x").update([0.9], 1)
    state.save(PairKey.of(target, draft).cache_path(), target, draft)  # the CLI's file for this pair exists
    assert SpeculationState().calibrators.counts() == {} and SpeculationState().matches.counts() == {}


def test_restored_tables_predict_as_the_originals_and_refuse_other_settings():
    calibrator, table = ConfidenceCalibrator(), MatchTable()
    for q, n in (([0.9, 0.8, 0.6], 2), ([0.5], 0), ([0.95, 0.9], 2)):
        calibrator.update(q, n)
    for m, c, a in ((1, 3, 1), (5, 4, 4), (12, 2, 0)):
        table.observe(m, c, a)
    again, other = ConfidenceCalibrator(), MatchTable()
    again.restore(calibrator.counts())
    other.restore(table.counts())
    grid = [i / 20 for i in range(21)]
    assert [again.predict(c) for c in grid] == [calibrator.predict(c) for c in grid]
    assert [again.predict_lower(c) for c in grid] == [calibrator.predict_lower(c) for c in grid]
    assert again.token_mean == calibrator.token_mean and other.path(3, 6) == table.path(3, 6)
    with pytest.raises(ValueError, match="bins"):
        ConfidenceCalibrator(n_bins=5).restore(calibrator.counts())
    with pytest.raises(ValueError, match="finite"):
        ConfidenceCalibrator().restore({**calibrator.counts(), "trials": [float("nan")] * 10})
    with pytest.raises(ValueError, match="buckets"):
        MatchTable().restore({**table.counts(), "edges": [1, 2]})
