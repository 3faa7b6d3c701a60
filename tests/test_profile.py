"""Cost profiles: synthetic caches, measuring on tiny Llamas, predictor maths, files, engine lookup, CLI."""

from __future__ import annotations

import json

import pytest
import torch
from typer.testing import CliRunner

from hf_adaspec import CostTable, LoadedModel
from hf_adaspec.backend import hf_compat
from hf_adaspec.cli import cli, profile_cli
from hf_adaspec.costs import cache as cost_cache
from hf_adaspec.costs.cache import CostCache
from hf_adaspec.costs.measure import ProfileGrid, measure_profile, pair_name
from hf_adaspec.costs.predictors import (
    QUANTITIES,
    CostFit,
    ProfileCell,
    choose_predictor,
    fit_costs,
    interp1,
    table_predict,
)
from hf_adaspec.costs.profile import assemble_profile
from hf_adaspec.costs.profile_files import (
    PROFILE_ENV,
    default_profile_path,
    find_profile,
    load_profile,
    profile_identity,
    profile_key,
    save_profile,
)
from hf_adaspec.files import write_json_verified
from hf_adaspec.machine import processor_name
from hf_adaspec.models.eagle3_format import random_head

pytestmark = pytest.mark.usefixtures("one_thread", "private_cache")
TINY_GRID = ProfileGrid(
    new_tokens=(1, 2, 4), batch_sizes=(1, 2), contexts=(16, 48), repeats=1, max_tokens_per_forward=6
)
META = {
    "versions": {"torch": "x"},
    "machine": "m",
    "cpu": processor_name(),
    "threads": 1,
    "created": "2025-01-01T00:00:00+00:00",
    "command": "test",
    "grid": {},
}
HAND_IDENTITY = {"profile_schema": 1, "target": {"name": "hand-target"}, "draft": {"name": "hand-draft"}}
# target ms at (batch, context) for n = 1 and n = 3; draft ms for n = 1 and the 32-token chunk
TARGET = {(1, 100): (10.0, 14.0), (1, 300): (20.0, 30.0), (4, 100): (40.0, 44.0), (4, 300): (60.0, 100.0)}
DRAFT = {(1, 100): (3.0, 16.0), (1, 300): (5.0, 32.0), (4, 100): (9.0, 64.0), (4, 300): (11.0, 96.0)}


def _cells(table: dict, ns: tuple[int, int]) -> list[ProfileCell]:
    return [ProfileCell(b, c, n, t) for (b, c), ts in table.items() for n, t in zip(ns, ts, strict=True)]


def _hand_profile(identity=HAND_IDENTITY, held_out=()):
    cells = {"target": _cells(TARGET, (1, 3)), "draft": _cells(DRAFT, (1, 32)), "held_out_target": list(held_out)}
    return assemble_profile("hand", identity, cells, META)


def test_synthetic_cache_has_the_length_and_a_forward_runs_on_it(tiny_factory):
    model = tiny_factory(0)
    cache = hf_compat.synthetic_cache(model, batch=3, length=40)
    assert hf_compat.cache_length(cache) == 40
    assert tuple(cache.layers[0].keys.shape) == (3, 2, 40, 8)  # [batch, kv_heads, length, head_dim]
    with torch.no_grad():
        logits = hf_compat.forward_logits(model, torch.ones(3, 5, dtype=torch.long), cache, keep=5)
    assert logits.shape == (3, 5, 64) and torch.isfinite(logits).all()
    assert hf_compat.cache_length(cache) == 45
    with pytest.raises(ValueError, match="length >= 1"):
        hf_compat.synthetic_cache(model, batch=1, length=0)


def test_interp1_exact_values():
    assert interp1([1, 2, 4], [1.0, 3.0, 4.0], 3) == 3.5
    assert interp1([1, 2, 4], [1.0, 3.0, 4.0], 2) == 3.0
    assert interp1([1, 2, 4], [1.0, 3.0, 4.0], 8) == 6.0  # along the last segment, slope 0.5
    assert interp1([1, 2, 4], [1.0, 3.0, 4.0], 0) == 1.0  # flat below the grid
    assert interp1([1, 2], [5.0, 3.0], 4) == 3.0  # never extrapolated downwards
    assert interp1([7], [2.0], 100) == 2.0


def test_table_predict_interpolates_n_then_context_then_batch():
    cells = _cells(TARGET, (1, 3))
    for cell in cells:
        assert table_predict(cells, cell.batch, cell.context, cell.new_tokens) == cell.median_ms
    assert table_predict(cells, 1, 100, 2) == 12.0
    assert table_predict(cells, 1, 200, 2) == 18.5  # (12 + 25) / 2
    assert table_predict(cells, 1, 200, 5) == 29.0  # n extrapolated: (18 + 40) / 2
    assert table_predict(cells, 2, 100, 1) == 20.0  # a third of the way from batch 1 to 4
    assert table_predict(cells, 8, 100, 1) == 80.0  # batch extrapolated along 1 → 4
    assert table_predict(cells, 1, 50, 1) == 10.0  # context below the grid: flat
    with pytest.raises(ValueError, match="no measured cells"):
        table_predict([], 1, 1, 1)


def test_profile_cost_table_from_the_table_predictor():
    profile = _hand_profile()
    assert all(
        profile.predictor(q) == "table" and profile.scores[q].table_mape is None  # no held-out cells
        for q in QUANTITIES
    )
    table = profile.cost_table(batch=1, context=200, n_max=4)
    assert table.verify_ms == (15.0, 18.5, 22.0, 25.5)
    assert table.draft_ms == 4.0 and table.draft_catchup_ms == 0.75 and table.context == 200
    assert table.key == profile.key
    with pytest.raises(ValueError, match="n_max"):
        profile.cost_table(1, 200, 0)


def test_fit_recovers_known_coefficients():
    truth = CostFit(alpha=0.002, gamma=1.5, delta=7.0)
    cells = [ProfileCell(b, c, n, truth.predict(b, c, n)) for b in (1, 2, 8) for c in (128, 1024) for n in (1, 4, 9)]
    fit = fit_costs(cells)
    assert (fit.alpha, fit.gamma, fit.delta) == pytest.approx((0.002, 1.5, 7.0), rel=1e-9)


def test_choose_predictor_prefers_the_lower_held_out_error():
    assert choose_predictor(5.0, 3.0) == "fit"
    assert choose_predictor(3.0, 5.0) == "table"
    assert choose_predictor(3.0, 3.0) == "table"
    assert choose_predictor(None, None) == "table"


def test_assemble_picks_fit_when_the_table_interpolates_noise():
    truth = CostFit(alpha=0.01, gamma=2.0, delta=20.0)
    wobble = lambda i: 1.15 if i % 2 else 0.85  # noqa: E731  grid medians off the true line by ±15%
    grid = [(b, c, n) for b in (1, 4) for c in (100, 300, 500) for n in (1, 2, 3, 4)]
    cells = [ProfileCell(b, c, n, truth.predict(b, c, n) * wobble(i)) for i, (b, c, n) in enumerate(grid)]
    held = [ProfileCell(b, c, n, truth.predict(b, c, n)) for b in (1, 4) for c in (200, 400) for n in (2, 3)]
    profile = assemble_profile("p", HAND_IDENTITY, {"target": cells, "held_out_target": held}, META)
    score = profile.scores["verify"]
    assert score.fit_mape < score.table_mape and profile.predictor("verify") == "fit"
    assert profile.verify_ms(2, 250, 3) == profile.target_fit.predict(2, 250, 3)
    assert profile.draft_ms(1, 100) == 0.0 and profile.catchup_ms(1, 100) == 0.0  # no draft measured


def test_assemble_picks_table_for_a_flat_then_linear_curve():
    curve = lambda b, c, n: 50.0 * b + 0.01 * c + 10.0 * max(0, n - 4) * b  # noqa: E731  flat up to 4 tokens
    cells = [ProfileCell(b, c, n, curve(b, c, n)) for b in (1, 2) for c in (128, 512) for n in (1, 2, 3, 4, 6, 8)]
    held = [ProfileCell(b, c, n, curve(b, c, n)) for b in (1, 2) for c in (256,) for n in (1, 3, 5, 7)]
    profile = assemble_profile("p", HAND_IDENTITY, {"target": cells, "held_out_target": held}, META)
    score = profile.scores["verify"]
    assert score.table_mape < score.fit_mape and profile.predictor("verify") == "table"
    assert profile.verify_ms(1, 256, 3) == pytest.approx(curve(1, 256, 3))


def _split_draft_profile():
    """Draft 1-token forwards flat at 30 ms (the table is exact) and catch-up chunks on a line with the grid
    medians off it by ±15% (the table interpolates noise); held-out cells near the grid's ends."""
    wobble = (0.85, 1.15, 0.85)
    draft = [ProfileCell(1, c, 1, 30.0) for c in (100, 300, 500)]
    draft += [ProfileCell(1, c, 32, (0.1 * c + 100.0) * w) for c, w in zip((100, 300, 500), wobble, strict=True)]
    held = [ProfileCell(1, c, 1, 30.0) for c in (110, 490)]
    held += [ProfileCell(1, c, 32, 0.1 * c + 100.0) for c in (110, 490)]
    target = [ProfileCell(1, c, n, 10.0 + n) for c in (100, 500) for n in (1, 2)]
    return assemble_profile("p", HAND_IDENTITY, {"target": target, "draft": draft, "held_out_draft": held}, META)


def test_each_quantity_uses_the_predictor_with_its_lower_held_out_error():
    profile = _split_draft_profile()
    draft, catchup = profile.scores["draft"], profile.scores["catchup"]
    assert draft.table_mape == 0.0 < draft.fit_mape and profile.predictor("draft") == "table"
    assert catchup.fit_mape < catchup.table_mape and profile.predictor("catchup") == "fit"
    assert profile.scores["verify"].table_mape is None and profile.predictor("verify") == "table"  # no held-out
    assert profile.draft_ms(1, 200) == 30.0  # the table, where the joint fit would say otherwise
    assert profile.draft_fit.predict(1, 200, 1) != pytest.approx(30.0, rel=0.05)
    assert profile.catchup_ms(1, 200) == pytest.approx(profile.draft_fit.predict(1, 200, 32) / 32)
    table = profile.cost_table(1, 200, 2)
    assert (table.draft_ms, table.draft_catchup_ms) == (30.0, profile.catchup_ms(1, 200))


def test_a_forced_predictor_prices_every_quantity_with_it():
    profile = _split_draft_profile()
    fit = profile.cost_table(1, 200, 2, forced="fit")
    assert fit.verify_ms == (profile.target_fit.predict(1, 200, 1), profile.target_fit.predict(1, 200, 2))
    assert fit.draft_ms == profile.draft_fit.predict(1, 200, 1)
    assert profile.cost_table(1, 200, 2, forced="table").draft_catchup_ms == pytest.approx(
        table_predict(profile.draft_cells, 1, 200, 32) / 32
    )
    with pytest.raises(ValueError, match="forced predictor must be one of"):
        profile.cost_table(1, 200, 2, forced="median")


def _rewrite(path, data):
    """Write ``data`` with a fresh digest: the document is what a writer wrote, so its values are checked."""
    write_json_verified(path, {k: v for k, v in data.items() if k != "digest"})


def test_a_profile_of_another_schema_is_refused_naming_the_fix(tmp_path):
    data = _split_draft_profile().to_json()
    path = tmp_path / "old.json"
    _rewrite(path, {**data, "schema": 2})
    with pytest.raises(ValueError, match=r"schema 2, this version reads 3.*re-run `hf-adaspec profile`"):
        load_profile(path)
    path.write_text(json.dumps(data))  # a schema-2 file: no digest
    with pytest.raises(ValueError, match=r"no digest.*re-run `hf-adaspec profile`"):
        load_profile(path)


def test_measure_on_tiny_models_saves_atomically_and_round_trips(tiny_factory, tmp_path):
    target, draft = tiny_factory(0), tiny_factory(1)
    profile = measure_profile(target, draft, TINY_GRID, pair="tiny", command="test")
    measured = {(c.batch, c.context, c.new_tokens) for c in profile.target_cells}
    assert measured == {(b, c, n) for b in (1, 2) for c in (16, 48) for n in (1, 2, 4) if b * n <= 6}
    assert {(c.batch, c.context, c.new_tokens) for c in profile.held_out_target} == set(TINY_GRID.held_out())
    assert not measured & set(TINY_GRID.held_out())
    assert {c.new_tokens for c in profile.draft_cells} == {1, 32}
    assert all(len(c.samples) == 1 and c.median_ms > 0 for c in profile.target_cells)
    path = save_profile(profile, tmp_path / "pair" / "profile.json")
    assert sorted(p.name for p in path.parent.iterdir()) == ["profile.json"]  # no temp file left behind
    assert load_profile(path) == profile
    data = json.loads(path.read_text())
    for name in (
        "schema",
        "pair",
        "identity",
        "versions",
        "machine",
        "cpu",
        "threads",
        "created",
        "command",
        "grid",
        "target_cells",
        "draft_cells",
        "held_out_target",
        "held_out_draft",
        "fit",
        "held_out_mape_pct",
    ):
        assert name in data, name
    assert set(data["identity"]["target"]) == {"name", "params", "dtype", "quantization", "device"}
    assert data["grid"]["max_tokens_per_forward"] == 6 and "skip_rule" in data["grid"]
    assert set(data["predictors"]) == set(QUANTITIES) and set(data["predictors"].values()) <= {"table", "fit"}
    assert data["schema"] == 3 and len(data["digest"]) == 64
    assert data["identity"]["profile_schema"] == 1  # what the cells mean is unchanged, so is the key
    table = profile.cost_table(batch=2, context=30, n_max=6)
    assert len(table.verify_ms) == 6 and all(t > 0 for t in table.verify_ms) and table.draft_ms > 0
    assert table.t_verify(9) >= table.t_verify(6)


def test_target_only_profile_for_prompt_lookup(tiny_factory, tmp_path):
    profile = measure_profile(tiny_factory(0), None, TINY_GRID)
    assert profile.draft_cells == () and profile.draft_fit is None and profile.identity["draft"] is None
    table = profile.cost_table(batch=1, context=16, n_max=3)
    assert table.draft_ms == 0.0 and table.draft_catchup_ms == 0.0
    assert load_profile(save_profile(profile, tmp_path / "lookup.json")) == profile


def test_load_profile_rejects_corrupt_files_naming_the_fix(tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    with pytest.raises(ValueError, match=r"bad\.json.*hf-adaspec profile"):
        load_profile(bad)
    good = save_profile(_hand_profile(), tmp_path / "good.json")
    data = json.loads(good.read_text())
    data["target_cells"][0]["median_ms"] *= 2
    bad.write_text(json.dumps(data))
    with pytest.raises(ValueError, match=r"digest does not match.*hf-adaspec profile"):
        load_profile(bad)
    data = json.loads(good.read_text())
    del data["fit"]
    _rewrite(bad, data)
    with pytest.raises(ValueError, match=r"missing fields \['fit'\].*hf-adaspec profile"):
        load_profile(bad)
    for value in (-1.0, float("nan"), 1e9):
        data = json.loads(good.read_text())
        data["target_cells"][0]["median_ms"] = value
        _rewrite(bad, data)
        with pytest.raises(ValueError, match="must be finite and in"):
            load_profile(bad)
    data = json.loads(good.read_text())
    data["identity"]["target"]["name"] = "edited"
    _rewrite(bad, data)
    with pytest.raises(ValueError, match="does not match its identity"):
        load_profile(bad)
    with pytest.raises(ValueError, match="run `hf-adaspec profile --output"):
        load_profile(tmp_path / "missing.json")
    with pytest.raises(ValueError, match=r"unreadable.*hf-adaspec profile"):
        load_profile(tmp_path)  # a folder


def _matching_profile(models, tmp_path, name="match.json"):
    identity = profile_identity(models["target"], models["noisy_copy"])
    return save_profile(_hand_profile(identity), tmp_path / name)


def _no_calibration(monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("calibrated although a matching profile was given")

    monkeypatch.setattr(cost_cache, "measure", refuse)


def _greedy(models, **kwargs):
    prompt = torch.tensor([[5, 6, 7, 8, 9, 10, 5, 6, 7]])
    return models["target"].generate(prompt, do_sample=False, max_new_tokens=20, **kwargs)


def test_engine_uses_a_matching_profile_and_greedy_output_is_unchanged(models, tmp_path, capsys, monkeypatch):
    path = _matching_profile(models, tmp_path)
    _no_calibration(monkeypatch)
    out = _greedy(models, speculation="adaptive", assistant_model=models["noisy_copy"], speculation_profile=str(path))
    chosen = "verify: table, draft: table, catchup: table"
    assert f"hf-adaspec: using cost profile {path} ({chosen})" in capsys.readouterr().err
    assert torch.equal(out, _greedy(models))


def test_engine_finds_a_profile_by_env_var_and_in_the_cache(models, tmp_path, monkeypatch, capsys):
    _no_calibration(monkeypatch)
    path = _matching_profile(models, tmp_path, "env.json")
    monkeypatch.setenv(PROFILE_ENV, str(path))
    _greedy(models, speculation="adaptive", assistant_model=models["noisy_copy"])
    assert f"using cost profile {path}" in capsys.readouterr().err
    monkeypatch.delenv(PROFILE_ENV)
    cached = default_profile_path(json.loads(path.read_text())["key"])
    save_profile(load_profile(path), cached)
    assert cached.is_relative_to(tmp_path)  # private_cache: HF_ADASPEC_CACHE is tmp_path
    _greedy(models, speculation="adaptive", assistant_model=models["noisy_copy"])
    assert f"using cost profile {cached}" in capsys.readouterr().err


def test_batch_costs_come_from_the_profile_at_each_batch_size(models, tmp_path, monkeypatch):
    path = _matching_profile(models, tmp_path)
    _no_calibration(monkeypatch)
    costs_for = CostCache().costs_for(
        models["target"], models["noisy_copy"], 5, print, batch=4, context=200, profile=path
    )
    profile = load_profile(path)
    for b in (1, 2, 3, 4):
        assert costs_for(b) == profile.cost_table(b, 200, 5)
    assert costs_for(3).verify_ms[0] == pytest.approx(15.0 + 2 / 3 * 35.0)  # 2/3 of the way from batch 1 to 4


@pytest.mark.slow  # the fast suite keeps test_a_pair_profile_serves_the_target_alone_but_not_another_target
def test_mismatched_profile_warns_and_falls_back_to_calibration(models, tmp_path, capsys):
    path = save_profile(_hand_profile(), tmp_path / "other.json")
    out = _greedy(models, speculation="adaptive", assistant_model=models["noisy_copy"], speculation_profile=path)
    err = capsys.readouterr().err
    assert f"cost profile {path} was measured for other models/versions" in err
    assert "differs in:" in err and "target.name" in err
    assert "calibrating step costs" in err and "run `hf-adaspec profile` for context-aware costs" in err
    assert torch.equal(out, _greedy(models))
    assert find_profile(models["target"], models["noisy_copy"], path, print) is None


def test_a_profile_measured_on_another_processor_falls_back_naming_both(models, tmp_path, capsys):
    other = f"not {processor_name()}"  # differs from whatever processor runs the test
    identity = profile_identity(models["target"], models["noisy_copy"])
    cells = {"target": _cells(TARGET, (1, 3)), "draft": _cells(DRAFT, (1, 32))}
    path = save_profile(assemble_profile("hand", identity, cells, {**META, "cpu": other}), tmp_path / "other_cpu.json")
    assert load_profile(path).key == profile_key(models["target"], models["noisy_copy"])  # same key: cpu is not in it
    assert find_profile(models["target"], models["noisy_copy"], path, print) is None
    assert find_profile(models["target"], None, path, print) is None
    out = capsys.readouterr().out
    assert f"measured on another processor ({other}; this one is {processor_name()})" in out
    assert "run `hf-adaspec profile` here" in out


def test_a_pair_profile_serves_the_target_alone_but_not_another_target(models, tiny_factory, tmp_path, capsys):
    path = _matching_profile(models, tmp_path)
    assert find_profile(models["target"], None, path, print).key == load_profile(path).key
    assert "using the target's cells" in capsys.readouterr().out
    assert find_profile(tiny_factory(0, vocab_size=80), None, path, print) is None  # another target: refused
    assert "measured for other models" in capsys.readouterr().out


def test_explicit_corrupt_profile_raises_and_a_corrupt_cached_one_is_ignored(models, tmp_path, capsys):
    bad = tmp_path / "bad.json"
    bad.write_text("[]")
    with pytest.raises(ValueError, match="hf-adaspec profile"):
        _greedy(models, speculation="adaptive", assistant_model=models["noisy_copy"], speculation_profile=bad)
    cached = default_profile_path(profile_key(models["target"], models["noisy_copy"]))
    cached.parent.mkdir(parents=True, exist_ok=True)
    cached.write_text("{")
    assert find_profile(models["target"], models["noisy_copy"], None, print) is None
    assert f"ignoring the cached cost profile: cost profile {cached} is unreadable" in capsys.readouterr().out


def test_an_explicit_cost_table_takes_precedence_over_any_profile(models, tmp_path, capsys):
    table = CostTable(verify_ms=(10.0,) * 9, draft_ms=1.0)
    out = _greedy(
        models,
        speculation="adaptive",
        assistant_model=models["noisy_copy"],
        speculation_costs=table,
        speculation_profile=tmp_path / "never-read.json",
    )
    assert "cost profile" not in capsys.readouterr().err
    assert torch.equal(out, _greedy(models))


def test_default_grid_skips_wide_cells_and_holds_out_off_grid_cells():
    grid = ProfileGrid()
    assert grid.target_ns(16) == (1, 2, 3, 4)  # 16 · 5 > 64
    assert grid.target_ns(8) == (1, 2, 3, 4, 5, 6, 7, 8)
    assert grid.target_ns(1) == grid.new_tokens
    held = set(grid.held_out())
    assert {c for _, c, _ in held} == {320, 768, 1536, 1024}
    assert {n for _, c, n in held if c == 1024} == {10, 14, 20, 28}
    assert all(b * n <= 64 and (c not in grid.contexts or n not in grid.new_tokens) for b, c, n in held)
    with pytest.raises(ValueError, match="increasing"):
        ProfileGrid(contexts=(512, 128))
    with pytest.raises(ValueError, match="repeats"):
        ProfileGrid(repeats=0)


def test_pair_name():
    assert pair_name("qwen2.5-coder-1.5b", "qwen2.5-coder-0.5b") == "qwen2.5-coder-1.5b_0.5b"
    assert pair_name("/models/big.gguf", "none") == "big_none"


def test_cli_profile_writes_json_png_and_a_last_json_line(models, tmp_path, monkeypatch):
    loaded = {"t": LoadedModel(models["target"], None, "t"), "d": LoadedModel(models["other_seed"], None, "d")}
    monkeypatch.setattr(
        profile_cli,
        "_load_pair",
        lambda target, draft, quantization, dtype, device="cpu": (loaded[target], loaded.get(draft)),
    )
    output = tmp_path / "cards" / "profile.json"
    args = [
        "profile",
        "--target",
        "t",
        "--draft",
        "d",
        "--contexts",
        "16,32",
        "--batch-sizes",
        "1,2",
        "--new-tokens",
        "1,2,3",
        "--repeats",
        "1",
        "--output",
        str(output),
    ]
    result = CliRunner().invoke(cli.app, args)
    assert result.exit_code == 0, result.output
    summary = json.loads(result.stdout.strip().splitlines()[-1])
    assert summary["output"] == str(output) and set(summary["predictors"]) == set(QUANTITIES)
    assert summary["cells_measured"] == len(load_profile(output).target_cells) + 4 * 2 + summary["held_out_cells"]
    assert (tmp_path / "cards" / "cost_curves.png").read_bytes()[:4] == b"\x89PNG"
    assert load_profile(summary["cache_copy"]) == load_profile(output)
    assert "--contexts 16,32" in load_profile(output).meta["command"]


@pytest.mark.slow  # the fast suite keeps test_cli_profile_writes_json_png_... and the head spec's parse test
def test_cli_profile_measures_a_random_head_of_the_targets_shape(models, tmp_path, monkeypatch):
    loaded = {"t": LoadedModel(models["target"], None, "t")}
    monkeypatch.setattr(
        profile_cli, "_load_pair", lambda target, draft, quantization, dtype, device="cpu": (loaded[target], None)
    )
    output = tmp_path / "profile.json"
    args = [
        "profile",
        "--target",
        "t",
        "--head",
        "random:20:16",
        "--contexts",
        "16,32",
        "--batch-sizes",
        "1",
        "--new-tokens",
        "1,2",
        "--repeats",
        "1",
        "--output",
        str(output),
    ]
    result = CliRunner().invoke(cli.app, args)
    assert result.exit_code == 0, result.output
    profile = load_profile(output)
    assert (
        profile.identity["draft"]["name"] == "Eagle3Head"
        and profile.draft_cells
        and "--head random:20:16" in profile.meta["command"]
    )
    narrow = random_head(models["target"], 20, intermediate_size=16)
    assert profile.identity["draft"]["params"] == sum(p.numel() for p in narrow.parameters())
    missing = CliRunner().invoke(cli.app, args[:3] + ["--head", str(tmp_path / "nope")] + args[5:])
    assert missing.exit_code == 2 and "speculators-format folder" in missing.output


def test_the_random_head_spec_parses_and_malformed_ones_name_the_form():
    assert profile_cli.parse_random_head("random") == (32000, None)
    assert profile_cli.parse_random_head("random:8000") == (8000, None)
    assert profile_cli.parse_random_head("random:8000:2048") == (8000, 2048)
    assert profile_cli.parse_random_head("some/folder") is None
    for bad in ("random:", "random:abc", "random:0", "random:8000:", "random:8000:0", "random:1:2:3", "random:-5"):
        with pytest.raises(ValueError, match=r"random\[:V\[:I\]\] with V the draft vocabulary"):
            profile_cli.parse_random_head(bad)
    text = _error_text(["profile", "--head", "random:32k"])
    assert "--head 'random:32k': use random[:V[:I]]" in text and "e.g. random:32000 or random:16000:2048" in text


def _error_text(args: list[str]) -> str:
    """The CLI's error message with the rich panel's borders and line wrapping removed."""
    result = CliRunner().invoke(cli.app, args)
    assert result.exit_code != 0
    return " ".join(result.output.replace("│", " ").split())


def test_cli_profile_rejects_bad_grids():
    assert "--contexts 'a,b': comma-separated integers" in _error_text(["profile", "--contexts", "a,b"])
    text = _error_text(["profile", "--batch-sizes", "1,64", "--max-tokens-per-forward", "32"])
    assert "raise it to at least 64" in text


@pytest.mark.slow
def test_cli_profile_quick_on_smollm2(tmp_path):
    output = tmp_path / "profile.json"
    args = [
        "profile",
        "--target",
        "smollm2-135m",
        "--draft",
        "smollm2-135m",
        "--quantization",
        "none",
        "--dtype",
        "float32",
        "--quick",
        "--output",
        str(output),
    ]
    result = CliRunner().invoke(cli.app, args)
    assert result.exit_code == 0, result.output
    profile = load_profile(output)
    predictors = json.loads(result.stdout.strip().splitlines()[-1])["predictors"]
    assert predictors == {q: profile.predictor(q) for q in QUANTITIES}
    assert {c.context for c in profile.target_cells} == {128, 256}
