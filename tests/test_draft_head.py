"""EAGLE-3 draft heads: the target's features, the head drafter (rollback to target-built entries, batch
rows, the draft vocabulary), the speculators checkpoint format as vLLM reads it, and the errors a user meets.
Greedy equality and lossless sampling with a head are in test_invariants.py's matrix."""

from __future__ import annotations

import json
import math

import pytest
import torch
from conftest import HEAD_PROMPTS, build_tiny_llama, left_padded
from safetensors.torch import load_file, save_file
from transformers import LogitsProcessorList

import hf_adaspec
from hf_adaspec import CostTable, SpeculationState
from hf_adaspec.backend import hf_compat
from hf_adaspec.backend.caches import open_head_cache
from hf_adaspec.models.eagle3_format import default_aux_layers, load_head, random_head, save_head, to_speculators
from hf_adaspec.proposers import Rows
from hf_adaspec.proposers.draft_head import DraftHeadProposer

pytestmark = pytest.mark.usefixtures("one_thread", "private_cache")
COSTS = CostTable(verify_ms=(10.0,) * 9, draft_ms=1.0)


def test_the_target_returns_the_features_of_the_layers_asked_for(models):
    target, ids = models["target"], torch.tensor([HEAD_PROMPTS[0]])
    logits, features = hf_compat.forward(target, ids, hf_compat.new_cache(target), 1, feature_layers=(0, 1, 1))
    with torch.no_grad():
        out = target(ids, output_hidden_states=True)
    assert features.shape == (1, ids.shape[1], 96) and logits.shape == (1, 1, 64)
    torch.testing.assert_close(features, torch.cat([out.hidden_states[i] for i in (0, 1, 1)], dim=-1))


def _features(target, ids: torch.Tensor) -> torch.Tensor:
    """The tiny target's features [T, 96] over a whole sequence ids [T]."""
    return hf_compat.forward(target, ids[None], hf_compat.new_cache(target), 1, feature_layers=(0, 1, 1))[1][0]


def _proposer(head, batch: int = 1) -> DraftHeadProposer:
    return DraftHeadProposer(head, batch, open_head_cache(head, batch), LogitsProcessorList(), False, 0)


def test_the_head_keeps_only_entries_built_on_target_features(models, tiny_head):
    """After a step's drafted entries are dropped and the confirmed positions' features queued, the head
    proposes exactly what a fresh head that ingests the whole sequence at once proposes."""
    target, seq = models["target"], torch.tensor(HEAD_PROMPTS[2] + [9, 10, 11, 12])  # prompt 11, then 4 tokens
    feats = _features(target, seq)
    stepped = _proposer(tiny_head)
    stepped.commit(torch.tensor([11]), features=[feats[:11]])  # the prefill: the prompt's features
    rows = Rows((seq[:12],), (0,), prompt_width=11)  # the prompt and the prefill's token
    stepped.propose(rows, stepped.offer(rows, 4), [4])
    stepped.commit(torch.tensor([14]), features=[feats[11:14]])  # a step confirmed 3 more positions
    fresh = _proposer(tiny_head)
    fresh.commit(torch.tensor([14]), features=[feats[:14]])
    rows = Rows((seq[:15],), (0,), prompt_width=11)
    assert stepped.offer(rows, 3).catchup == 1 and fresh.offer(rows, 3).catchup == 14 - 2
    (a,), (b,) = stepped.propose(rows, stepped.offer(rows, 3), [3]), fresh.propose(rows, fresh.offer(rows, 3), [3])
    assert torch.equal(a.tokens, b.tokens) and int(stepped.cache.lengths[0]) == int(fresh.cache.lengths[0]) == 16


def test_rows_of_a_batch_draft_independently_and_leave(models, tiny_head):
    target = models["target"]
    seqs = [torch.tensor(HEAD_PROMPTS[i]) for i in (1, 2)]
    feats = [_features(target, s) for s in seqs]
    batch = _proposer(tiny_head, 2)
    batch.commit(torch.tensor([len(s) - 1 for s in seqs]), features=[f[:-1] for f in feats])
    width = max(len(s) for s in seqs)
    rows = Rows(
        tuple(torch.cat([torch.zeros(width - len(s), dtype=torch.long), s]) for s in seqs),
        tuple(width - len(s) for s in seqs),
        prompt_width=width - 1,
    )
    together = batch.propose(rows, batch.offer(rows, 3), [3, 3])
    for i, s in enumerate(seqs):
        alone = _proposer(tiny_head)
        alone.commit(torch.tensor([len(s) - 1]), features=[feats[i][:-1]])
        one = Rows((s,), (0,), prompt_width=len(s) - 1)
        (proposal,) = alone.propose(one, alone.offer(one, 3), [3])
        assert torch.equal(together[i].tokens, proposal.tokens), f"row {i}"
    batch.commit(torch.tensor([len(s) - 1 for s in seqs]), keep=torch.tensor([1]), features=[f[:0] for f in feats])
    assert batch.cache.lengths.tolist() == [len(seqs[1]) - 1] and len(batch.pending) == 1


def test_proposals_stay_in_the_draft_vocabulary_and_q_is_zero_outside(models, tiny_head):
    target, seq = models["target"], torch.tensor(HEAD_PROMPTS[4])
    drafter = DraftHeadProposer(
        tiny_head,
        1,
        open_head_cache(tiny_head, 1),
        LogitsProcessorList(),
        True,
        0,
        generator=torch.Generator().manual_seed(0),
    )
    drafter.commit(torch.tensor([len(seq) - 1]), features=[_features(target, seq)[:-1]])
    rows = Rows((seq,), (0,), prompt_width=len(seq) - 1)
    (proposal,) = drafter.propose(rows, drafter.offer(rows, 6), [6])
    assert proposal.k == 6 and bool(tiny_head.t2d[proposal.tokens[0]].all())
    assert float(proposal.q[0][:, ~tiny_head.t2d].abs().sum()) == 0.0
    torch.testing.assert_close(proposal.q[0].sum(-1), torch.ones(6))


def test_a_head_round_trips_through_the_speculators_format(models, tiny_head, tmp_path):
    folder = save_head(tiny_head, tmp_path / "head", speculative_tokens=4)
    loaded = load_head(folder, models["target"])
    assert loaded.config == tiny_head.config and loaded.embed_tokens is models["target"].get_input_embeddings()
    for key, value in tiny_head.state_dict().items():
        assert torch.equal(loaded.state_dict()[key], value), key
    out = [
        models["target"].generate(
            torch.tensor([HEAD_PROMPTS[1]]),
            assistant_model=head,
            speculation="adaptive",
            speculation_costs=COSTS,
            speculation_state=SpeculationState(),
            max_new_tokens=12,
            do_sample=False,
            return_dict_in_generate=True,
            rest=False,
        )
        for head in (tiny_head, loaded)
    ]
    assert torch.equal(out[0].sequences, out[1].sequences)
    assert [(s.k, s.accepted, s.drafter) for s in out[0].speculation.steps] == [
        (s.k, s.accepted, s.drafter) for s in out[1].speculation.steps
    ]


def test_a_narrow_random_head_round_trips_with_its_own_sizes(models, tmp_path):
    target = models["target"]
    head = random_head(target, draft_vocab_size=20, intermediate_size=16)
    assert (head.config.draft_vocab_size, head.config.intermediate_size) == (20, 16)
    assert head.lm_head.weight.shape == (20, 32) and head.layers[0].mlp.gate_proj.weight.shape == (16, 32)
    assert random_head(target).config.intermediate_size == target.config.intermediate_size
    loaded = load_head(save_head(head, tmp_path / "narrow"), target)
    assert loaded.config == head.config
    for key, value in head.state_dict().items():
        assert torch.equal(loaded.state_dict()[key], value), key
    with pytest.raises(ValueError, match="intermediate_size must be >= 1"):
        random_head(target, intermediate_size=0)


def _vllm_parameters(config: dict) -> dict[str, tuple[int, ...]]:
    """The parameters vLLM's Eagle3LlamaForCausalLM holds for a config.json (vllm/model_executor/models/
    llama_eagle3.py: q/k/v stacked as qkv_proj, gate/up as gate_up_proj, fc without a bias, lm_head over the
    draft vocabulary, d2t as draft_id_to_target_id), named as its loader names the checkpoint's tensors."""
    layer = config["transformer_layer_config"]
    h, heads, d = layer["hidden_size"], layer["num_attention_heads"], layer["head_dim"]
    kv = layer["num_key_value_heads"]
    inter, vd, th = layer["intermediate_size"], config["draft_vocab_size"], config["target_hidden_size"]
    p = "model.layers.0."
    return {
        "model.fc.weight": (h, 3 * th),
        p + "self_attn.qkv_proj.weight": ((heads + 2 * kv) * d, 2 * h),
        p + "self_attn.o_proj.weight": (h, heads * d),
        p + "mlp.gate_up_proj.weight": (2 * inter, h),
        p + "mlp.down_proj.weight": (h, inter),
        p + "input_layernorm.weight": (h,),
        p + "hidden_norm.weight": (h,),
        p + "post_attention_layernorm.weight": (h,),
        "model.norm.weight": (h,),
        "lm_head.weight": (vd, h),
        "draft_id_to_target_id": (vd,),
    }


def _as_vllm_loads(weights: dict[str, torch.Tensor]) -> dict[str, tuple[int, ...]]:
    """The checkpoint as vLLM's Eagle3LlamaForCausalLM.load_weights maps it: t2d skipped, d2t renamed,
    "model." before all but lm_head, q/k/v and gate/up stacked (their shapes concatenated on dim 0)."""
    out: dict[str, list[torch.Size]] = {}
    for name, w in weights.items():
        if name == "t2d":
            continue
        name = "draft_id_to_target_id" if name == "d2t" else name if name.startswith("lm_head") else "model." + name
        for part, whole in (
            (".q_proj", ".qkv_proj"),
            (".k_proj", ".qkv_proj"),
            (".v_proj", ".qkv_proj"),
            (".gate_proj", ".gate_up_proj"),
            (".up_proj", ".gate_up_proj"),
        ):
            name = name.replace(part, whole)
        out.setdefault(name, []).append(w.shape)
    return {n: (sum(s[0] for s in shapes), *shapes[0][1:]) for n, shapes in out.items()}


def test_the_files_are_what_vllm_loads(tiny_head, tmp_path):
    folder = save_head(tiny_head, tmp_path / "head", speculative_tokens=3)
    config = json.loads((folder / "config.json").read_text())
    # vllm/transformers_utils/configs/speculators/base.py validate_speculators_config + algos.py update_eagle3
    assert config["speculators_model_type"] == "eagle3" and isinstance(config["transformer_layer_config"], dict)
    assert config["speculators_config"]["proposal_methods"][0]["speculative_tokens"] == 3
    assert config["speculators_config"]["verifier"]["name_or_path"] == "tiny-llama"
    assert config["eagle_aux_hidden_state_layer_ids"] == [0, 1, 1] and config["norm_before_residual"] is False
    assert config["draft_vocab_size"] == 48 and config["target_hidden_size"] == 32
    weights = load_file(str(folder / "model.safetensors"))
    assert weights["d2t"].dtype == torch.int64 and weights["t2d"].dtype == torch.bool and "fc.bias" not in weights
    assert _as_vllm_loads(weights) == _vllm_parameters(config)


def test_a_checkpoint_naming_its_layer_midlayer_loads(models, tiny_head, tmp_path):
    folder = save_head(tiny_head, tmp_path / "head")
    weights = load_file(str(folder / "model.safetensors"))
    save_file({k.replace("layers.0.", "midlayer."): v for k, v in weights.items()}, str(folder / "model.safetensors"))
    assert torch.equal(load_head(folder, models["target"]).fc.weight, tiny_head.fc.weight)


def test_loading_errors_name_the_fix(models, tiny_head, tmp_path):
    with pytest.raises(FileNotFoundError, match="speculators-format folder"):
        load_head(tmp_path, models["target"])
    folder = save_head(tiny_head, tmp_path / "head")
    other = build_tiny_llama(0, vocab_size=80)
    with pytest.raises(ValueError, match="vocabulary of 64 tokens, the target has 80"):
        load_head(folder, other)
    doc = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**doc, "speculators_model_type": "eagle"}))
    with pytest.raises(ValueError, match="not an EAGLE-3 head"):
        load_head(folder, models["target"])
    (folder / "config.json").write_text(json.dumps(doc))
    weights = load_file(str(folder / "model.safetensors"))
    save_file({**weights, "fc.weight": weights["fc.weight"][:, :10].contiguous()}, str(folder / "model.safetensors"))
    with pytest.raises(ValueError, match=r"fc.weight \(32, 10\)"):
        load_head(folder, models["target"])


def test_generate_refuses_a_head_of_another_vocabulary(tiny_head):
    other = hf_adaspec.enable(build_tiny_llama(0, vocab_size=80))
    with pytest.raises(ValueError, match="load a head trained for this target"):
        other.generate(
            torch.tensor([[1, 2, 3]]),
            assistant_model=tiny_head,
            speculation="adaptive",
            speculation_costs=COSTS,
            max_new_tokens=4,
        )


def test_a_head_without_given_costs_is_calibrated(models, tiny_head):
    out = models["target"].generate(
        torch.tensor([HEAD_PROMPTS[0]]),
        assistant_model=tiny_head,
        speculation="adaptive",
        speculation_state=SpeculationState(),
        max_new_tokens=8,
        do_sample=False,
        return_dict_in_generate=True,
    )
    assert out.speculation.new_tokens == 8


def test_rows_stop_at_eos_at_different_times_with_a_head(models, tiny_head):
    prompts = [HEAD_PROMPTS[1], HEAD_PROMPTS[2], HEAD_PROMPTS[3]]
    plain = [
        models["target"].generate(torch.tensor([p]), max_new_tokens=20, do_sample=False)[0, len(p) :] for p in prompts
    ]
    eos = int(plain[1][5])
    out = models["target"].generate(
        **left_padded(prompts),
        assistant_model=tiny_head,
        speculation="adaptive",
        speculation_costs=COSTS,
        speculation_state=SpeculationState(),
        max_new_tokens=20,
        do_sample=False,
        eos_token_id=eos,
        pad_token_id=0,
        return_dict_in_generate=True,
        max_slowdown=math.inf,
    )  # the head drafts from the first step
    width = max(len(p) for p in prompts)
    for i, row in enumerate(plain):
        cut = (row == eos).nonzero()
        expected = row[: int(cut[0]) + 1] if cut.numel() else row
        assert out.sequences[i, width : width + len(expected)].tolist() == expected.tolist(), f"row {i}"
    assert any(s.drafter == "draft_head" and s.accepted for s in out.speculation.steps)


def test_default_feature_layers_follow_vllm():
    assert default_aux_layers(28) == (2, 14, 25) and default_aux_layers(2) == (1, 1, 0)
    doc = to_speculators(hf_adaspec.models.eagle3.HeadConfig(32, 4, 2, 64, 32, 48, 64, (2, 14, 25)))
    assert doc["transformer_layer_config"]["num_hidden_layers"] == 1


def test_a_profile_measures_the_heads_draft_token_and_ingest(models, tiny_head):
    from hf_adaspec.costs.measure import ProfileGrid, measure_profile

    grid = ProfileGrid(new_tokens=(1, 2), batch_sizes=(1, 2), contexts=(16, 48), repeats=1, max_tokens_per_forward=4)
    profile = measure_profile(models["target"], tiny_head, grid, pair="tiny+head")
    assert {c.new_tokens for c in profile.draft_cells} == {1, 32} and all(c.median_ms > 0 for c in profile.draft_cells)
    assert profile.identity["draft"]["name"] == "Eagle3Head" and profile.cost_table(1, 16, 3).draft_ms > 0
