"""Training a draft head here: the training-time test's forward is what drafting computes, soft labels,
recording shards that resume to identical files, and a training run that learns, resumes and saves a
head that loads."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from conftest import HEAD_LAYERS, HEAD_PROMPTS, build_tiny_tokenizer

from hf_adaspec.backend import hf_compat
from hf_adaspec.models.eagle3_format import load_head
from hf_adaspec.models.eagle3_train import (
    draft_index,
    soft_labels,
    ttt_forward,
    ttt_mask,
)
from hf_adaspec.replay.trace import head_along
from hf_adaspec.training import head_data, train_head

pytestmark = pytest.mark.usefixtures("one_thread", "private_cache")


def test_the_mask_lets_a_step_see_its_chain_only():
    allowed = ttt_mask(4, 2)  # entries j = 0..3; keys: step 1's four, then step 2's four
    assert allowed.tolist() == [
        [False, False, False, False, True, False, False, False],  # no chain, unscored
        [True, False, False, False, False, True, False, False],
        [True, True, False, False, False, False, True, False],
        [True, True, True, False, False, False, False, True],
    ]


def _true_path_chain(head, seq: torch.Tensor, features: torch.Tensor, s: int, depth: int) -> list[int]:
    """The head's argmaxes drafting step by step after the true entries 1..s (entry p: x_p, g_{p−1}) when
    its earlier drafted tokens are the true ones (the training-time test's inputs)."""
    from hf_adaspec.models.eagle3 import HeadCache

    cache, chain = HeadCache(1), []
    out = head.step(seq[:, 1 : s + 1], head.fuse(features[:, :s]), torch.ones(1, s, dtype=torch.bool), cache)[:, -1]
    for d in range(depth):
        chain.append(int(head.logits(out).argmax()))
        if d + 1 < depth:
            out = head.step(seq[:, s + d + 1 : s + d + 2], out[:, None], torch.ones(1, 1, dtype=torch.bool), cache)[
                :, -1
            ]
    return chain


def test_the_training_forward_is_what_drafting_computes(models, tiny_head):
    """Step s at entry j equals the s-th token the head drafts after the true entries up to j − s + 1 when its
    tokens before were the true ones; ``head_along`` (which feeds back its own tokens) drafts the same there."""
    target, seq = models["target"], torch.tensor([HEAD_PROMPTS[4][:24]])
    features = hf_compat.forward(target, seq, hf_compat.new_cache(target), 1, feature_layers=HEAD_LAYERS)[1]
    with torch.no_grad():
        outs = ttt_forward(tiny_head, seq, features, 3)  # 3 × [1, 23, H]
    prompt_len = 4
    chains, _ = head_along(target, tiny_head, seq, prompt_len, depth=3)  # [n + 1][3]
    checked = same = 0
    for j, chain in enumerate(chains):
        last = prompt_len + j - 2  # entry index of the last true entry before drafting
        with torch.no_grad():
            true_path = _true_path_chain(tiny_head, seq, features, last + 1, min(3, seq.shape[1] - last - 1))
        truth = seq[0, prompt_len + j : prompt_len + j + 3].tolist()
        for d, token in enumerate(true_path):
            if last + d < outs[d].shape[1]:
                assert int(tiny_head.logits(outs[d][:, last + d]).argmax()) == token
                checked += 1
            if chain[:d] == truth[:d]:
                assert chain[d] == token
                same += 1
    assert checked > 40 and same > 20


def test_soft_labels_keep_the_draft_vocabulary_and_renormalise():
    index = torch.tensor([-1, 0, 1, -1])  # target ids 1, 2 are draft ids 0, 1
    ids, p = soft_labels(
        torch.tensor([[2, 0, 1], [0, 3, 0]]), torch.tensor([[0.5, 0.3, 0.2], [0.6, 0.4, 0.0]]).log(), index
    )
    assert ids.tolist() == [[1, 0, 0], [0, 0, 0]]
    torch.testing.assert_close(p, torch.tensor([[0.5 / 0.7, 0.0, 0.2 / 0.7], [0.0, 0.0, 0.0]]))


def _source(tmp_path):
    folder = tmp_path / "src"
    gen = torch.Generator().manual_seed(3)
    for i in range(6):
        (folder / ("tests" if i == 5 else "pkg")).mkdir(parents=True, exist_ok=True)
        words = [f"w{int(t)}" for t in torch.randint(3, 64, (120,), generator=gen)]
        (folder / ("tests" if i == 5 else "pkg") / f"m{i}.py").write_text(" ".join(words))
    return folder


def test_recording_resumes_to_identical_shards_and_skips_tests(models, tmp_path):
    target, tok, src = models["target"], build_tiny_tokenizer(), _source(tmp_path)
    out = tmp_path / "data"
    paths = head_data.record(target, tok, [src], out, 96, HEAD_LAYERS, seq_len=16, shard_seqs=2, batch=2)
    assert len(paths) == 3 and all(p.exists() for p in paths)
    first = paths[1].read_bytes()
    paths[1].unlink()
    head_data.record(target, tok, [src], out, 96, HEAD_LAYERS, seq_len=16, shard_seqs=2, batch=2)
    assert paths[1].read_bytes() == first
    files = json.loads((out / "sources.json").read_text())["files_in_order"]
    assert len(files) == 5 and not any("/tests/" in f for f in files)
    data = head_data.read_shards(paths)
    assert data.tokens.shape == (6, 16) and data.features.shape == (6, 16, 96) and data.top_ids.shape == (6, 16, 8)


@pytest.mark.slow  # trains a head three times (learn, resume, compare): ~1.4 s on 2 cores
def test_a_training_run_learns_resumes_and_saves_a_head_that_loads(models, tmp_path):
    target, tok = models["target"], build_tiny_tokenizer()
    paths = head_data.record(
        target, tok, [_source(tmp_path)], tmp_path / "data", 160, (1, 1, 0), seq_len=16, shard_seqs=5, batch=5
    )
    data = head_data.read_shards(paths)
    config = train_head.TrainConfig(
        160, train_steps=150, lr=3e-3, warmup=2, batch=2, draft_vocab=48, intermediate=64, eval_every=25
    )
    folder = train_head.train(target, data, {"train": data}, config, tmp_path / "run")
    curve = [json.loads(line) for line in (tmp_path / "run" / "curve.jsonl").read_text().splitlines()]
    assert curve[-1]["step"] == 150 and curve[-1]["alpha"]["train"][0] > curve[0]["alpha"]["train"][0] + 0.2
    again = train_head.train(target, data, {"train": data}, config, tmp_path / "run")  # resumes at the end
    assert again == folder and (tmp_path / "run" / "curve.jsonl").read_text().count("\n") == len(curve)
    head = load_head(folder, target, dtype=torch.float32)
    assert train_head.agreement(head, data, draft_index(head), 3)[0] == pytest.approx(
        curve[-1]["alpha"]["train"][0], abs=0.05
    )  # saved in bf16
    other = train_head.TrainConfig(160, epochs=31, lr=3e-3, warmup=2, batch=2, draft_vocab=48, intermediate=64)
    with pytest.raises(ValueError, match="another --out"):
        train_head.train(target, data, {"train": data}, other, tmp_path / "run")


def test_bad_training_options_are_refused():
    with pytest.raises(ValueError, match="must be positive"):
        train_head.TrainConfig(0)
    with pytest.raises(ValueError, match="train_steps"):
        train_head.TrainConfig(100, train_steps=-1)


def test_the_predicted_speedup_is_plain_without_agreement_and_grows_with_it():
    from hf_adaspec.cli.train_head_cli import predicted_speedup
    from hf_adaspec.costs.profile_files import load_profile

    profile = load_profile(Path(__file__).parent.parent / "model_cards" / "qwen2.5-coder-1.5b_0.5b" / "profile.json")
    assert predicted_speedup([0.0, 0.0, 0.0], 5.0, profile) == 1.0  # k = 0: a plain step
    low, high = predicted_speedup([0.5] * 3, 5.0, profile), predicted_speedup([0.9] * 3, 5.0, profile)
    assert 1.0 < low < high < 4.0
    assert predicted_speedup([0.9] * 3, 50.0, profile) < high  # a dearer drafter gains less
