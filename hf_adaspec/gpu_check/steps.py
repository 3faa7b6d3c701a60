"""The GPU check's context (models with the presets' architectures and random weights), its greedy
correctness steps (against plain greedy, the self-draft); ``gpu_check`` runs them, with ``sampling``, and
``timing`` holds the clocks.

Greedy: each row of a speculative ``generate`` is compared with the target's own batch-1 plain greedy
output: equal, or first differing where the target's top-2 logit gap is at most ``NEAR_TIE`` (bf16 and NF4
forwards over 1 and k+1 tokens differ in the last bits). Random weights make near-ties common (150,000
logits of one scale), and after a first divergence plain greedy says nothing more, so every emitted token
is also checked in one teacher-forced forward over the row's own output: its logit must be within
``NEAR_TIE`` of the largest (``max_deficit``; plain's own output gives the noise floor), so a wrongly
accepted token anywhere fails.
"""

from __future__ import annotations

import gc
import json
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import torch

from ..api.generate import enable
from ..bench.bench import divergence_gap
from ..costs.table import CostTable
from ..engine.run import SpeculationState
from ..models.architecture import config_path, load_random, random_weights
from ..models.formats import missing_kernel

TARGET, DRAFT, BIG = "qwen2.5-coder-1.5b", "qwen2.5-coder-0.5b", "qwen2.5-7b"
SEEDS = {TARGET: 0, DRAFT: 1, BIG: 2}
# --tiny: the presets' configs shrunk (the architecture and its options stay); the 7B's head wider than the
# draft's, as 152,064 is wider than 151,936
TINY = {
    TARGET: {"hidden_size": 64, "num_hidden_layers": 2, "vocab_size": 256},
    DRAFT: {"hidden_size": 64, "num_hidden_layers": 1, "vocab_size": 256},
    BIG: {"hidden_size": 128, "num_hidden_layers": 2, "vocab_size": 384},
}
NEAR_TIE = 0.25  # top-2 logit gap (README: greedy can diverge from plain at a near-tie)
COSTS = CostTable(verify_ms=(10.0,) * 9, draft_ms=1.0)  # given costs: speculation every step, no calibration
MODES = {"adaptive": {"speculation": "adaptive"}, "fixed": {"speculation": "fixed", "num_speculative_tokens": 4}}
QUANT_LABEL = {"none": "bf16", "nf4": "nf4"}  # folder and summary names; a GPU 4-bit format is named as is


def label(quantization: str) -> str:
    """How results name a quantization: bf16 for dense weights, else the format's name."""
    return QUANT_LABEL.get(quantization, quantization)


@dataclass
class Check:
    """What the steps share: the device, --tiny, the output folder, where speculation keeps its caches
    (``kv_cache``: on a GPU by default an arena whose narrow forwards replay CUDA graphs), the quantizations
    that load here (the environment step drops nf4 without bitsandbytes, saying why in ``fallback``), random
    weights (in memory) and loaded models, and ``facts`` later steps use (the GPU's name, measured overheads)."""

    device: str
    tiny: bool
    out: Path
    kv_cache: str = "auto"
    quantizations: tuple[str, ...] = ("none", "nf4")
    fallback: str = ""
    facts: dict = field(default_factory=dict)
    weights: dict = field(default_factory=dict)
    models: dict = field(default_factory=dict)

    def arch(self, name: str) -> str:
        """What ``name``'s models are built from: its shipped config, or with --tiny a shrunk copy of it."""
        if not self.tiny:
            return name
        folder = self.out / "tiny-configs" / name
        folder.mkdir(parents=True, exist_ok=True)
        (folder / "config.json").write_text(json.dumps(shrunk_config(name, **TINY[name])))
        return str(folder)

    def model(self, name: str, quantization: str, head: bool = False, keep_others: bool = False) -> torch.nn.Module:
        """``name``'s random-weight model (seed ``SEEDS[name]``) in a weight format (``head``: its output head
        quantized too, as for a draft), built once (on the device) and loaded once per format, enabled; on a GPU the
        other formats' models are dropped first unless ``keep_others``. No EOS (greedy runs to its length), pad
        id 0."""
        key = (name, quantization, head)
        if key not in self.models:
            if self.device != "cpu" and not keep_others:
                self.drop(keep=[k for k in self.models if k[1] == quantization])
            if name not in self.weights:
                self.weights[name] = random_weights(self.arch(name), "bfloat16", SEEDS[name], self.device)
            model = load_random(self.weights[name], quantization, "bfloat16", self.device, head)
            model.generation_config.eos_token_id, model.generation_config.pad_token_id = None, 0
            self.models[key] = enable(model)
        return self.models[key]

    def spec(self, **kwargs) -> dict:
        """``generate`` keywords of a speculative run: ``kwargs`` and the check's ``kv_cache``."""
        return {**kwargs, "kv_cache": self.kv_cache}

    def drop(self, keep=()) -> None:
        """Free every loaded model but ``keep`` (keys), and the GPU's cached blocks."""
        for key in [k for k in self.models if k not in keep]:
            del self.models[key]
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()


def unusable(check: Check, quantization: str) -> str | None:
    """None where ``quantization`` runs in this check; else why not: NF4 without bitsandbytes (the environment
    step's fallback line), a GPU format whose kernel is missing (``formats.missing_kernel``)."""
    if quantization in ("none", "nf4"):
        return None if quantization in check.quantizations else check.fallback
    return missing_kernel(quantization, check.device)


def shrunk_config(name: str, **sizes) -> dict:
    """``name``'s shipped config.json made tiny: 4 heads (2 for keys and values), 128-wide MLPs, ``sizes``
    (hidden_size, num_hidden_layers, vocab_size), token ids 0–2, peaked random logits."""
    config = {
        **json.loads(config_path(name).read_text()),
        "intermediate_size": 128,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "initializer_range": 0.5,
        "pad_token_id": 0,
        "bos_token_id": 1,
        "eos_token_id": 2,
        **sizes,
    }
    config.pop("layer_types", None)
    return {**config, "max_window_layers": config["num_hidden_layers"]}


def check_prompts(vocab: int, seed: int = 0) -> list[list[int]]:
    """Three prompts of 24, 5 and 13 tokens (ids ≥ 1, 0 pads), two with repeats for prompt lookup to find."""
    gen = torch.Generator().manual_seed(seed)
    a, b, c, d = (torch.randint(1, vocab, (n,), generator=gen).tolist() for n in (6, 5, 5, 3))
    return [a * 4, b, c + c + d]


def speed_prompts(vocab: int, length: int, seed: int = 7) -> list[list[int]]:
    """Three prompts of ``length`` tokens (ids ≥ 1): a 6-token phrase repeated, a 4-token one repeated, and
    random ids."""
    gen = torch.Generator().manual_seed(seed)
    a, b, c = (torch.randint(1, vocab, (n,), generator=gen).tolist() for n in (6, 4, length))
    return [(a * length)[:length], (b * length)[:length], c]


def drafter_use(target, prompt: list[int], new: int, kwargs: dict) -> dict:
    """One greedy request with ``kwargs``: per drafter ("plain" for k = 0; "rested" for a plain step the
    controller did not decide) its steps and the tokens it drafted and had accepted (what a never-loses
    shortfall would come from: decided plain steps cost the engine's time, rejected drafts a wider
    verification)."""
    steps = [(s.drafter if s.decided else "rested", s) for s in generate(target, prompt, new, kwargs).speculation.steps]
    drafters = sorted({d for d, _ in steps})
    return {
        "steps": dict(Counter(d for d, _ in steps)),
        "drafted": {d: sum(s.k for e, s in steps if e == d) for d in drafters},
        "accepted": {d: sum(s.accepted for e, s in steps if e == d) for d in drafters},
    }


def left_padded(prompts: list[list[int]]) -> dict[str, torch.Tensor]:
    """input_ids and attention_mask [B, T], rows right-aligned, padded with 0."""
    width = max(len(p) for p in prompts)
    ids, mask = torch.zeros(len(prompts), width, dtype=torch.long), torch.zeros(len(prompts), width, dtype=torch.long)
    for i, p in enumerate(prompts):
        ids[i, width - len(p) :], mask[i, width - len(p) :] = torch.tensor(p), 1
    return {"input_ids": ids, "attention_mask": mask}


def generate(model, prompt: list[int], new: int, kwargs: dict, state: SpeculationState | None = None):
    """One greedy ``generate`` at batch 1 (plain without ``speculation`` in ``kwargs``), prompt on the device."""
    ids = torch.tensor([prompt], device=model.device)
    extra = {"speculation_state": state or SpeculationState()} if "speculation" in kwargs else {}
    return model.generate(
        input_ids=ids,
        attention_mask=torch.ones_like(ids),
        max_new_tokens=new,
        do_sample=False,
        return_dict_in_generate=True,
        **kwargs,
        **extra,
    )


@torch.no_grad()
def teacher_forced(model, prompt: list[int], got: list[int]) -> torch.Tensor:
    """float32 logits [len(got), V] predicting each token of ``got`` after ``prompt`` (one forward)."""
    return model(torch.tensor([prompt + got], device=model.device)).logits[0, len(prompt) - 1 : -1].float()


@torch.no_grad()
def row_check(model, prompt: list[int], got: list[int], plain: list[int]) -> dict:
    """One row against plain greedy: where it first differs and the top-2 gap there; the largest deficit of an
    emitted token's logit below the top one in a teacher-forced forward over the row's own output."""
    diverged = next((i for i, (a, b) in enumerate(zip(got, plain, strict=False)) if a != b), None)
    gap = divergence_gap(model, torch.tensor([prompt + plain]), torch.tensor([prompt + got]))
    logits = teacher_forced(model, prompt, got)
    emitted = logits.gather(1, torch.tensor(got, device=logits.device)[:, None])[:, 0]
    deficit = float((logits.max(-1).values - emitted).max())
    ok = len(got) == len(plain) and (gap is None or gap <= NEAR_TIE) and deficit <= NEAR_TIE
    return {
        "ok": ok,
        "equal": got == plain,
        "diverged_at": diverged,
        "gap": gap,
        "max_deficit": round(deficit, 4),
        "logit_std": round(float(logits.std()), 3),
    }


@torch.no_grad()
def tie_split(model, prompt: list[int], got: list[int], steps) -> dict[str, int]:
    """A row's drafted tokens split by the target's top-2 logit gap at their position (teacher-forced over its
    own output): at a near-tie (gap ≤ ``NEAR_TIE``) a 1-token and a (k+1)-token forward may rank the top two
    differently, elsewhere they agree. → drafted and accepted counts at near-ties and elsewhere. ``steps``: the
    row's ``StepRecord``s in order (the prefill emitted token 0)."""
    top2 = teacher_forced(model, prompt, got).topk(2, dim=-1).values
    tie = ((top2[:, 0] - top2[:, 1]) <= NEAR_TIE).tolist()  # [len(got)]
    out = dict.fromkeys(("drafted_tie", "accepted_tie", "drafted_clear", "accepted_clear"), 0)
    at = 1
    for s in steps:
        for j in range(min(s.k, len(got) - at)):
            kind = "tie" if tie[at + j] else "clear"
            out[f"drafted_{kind}"] += 1
            out[f"accepted_{kind}"] += int(j < s.accepted)
            if j >= s.accepted:
                break  # the positions after the first rejection were never judged
        at += s.emitted
    return out


def greedy_case(
    check: Check, target, draft, prompts, plain: dict, mode: str, new: int, state=None, ties: bool = False
) -> dict:
    """One speculative greedy ``generate`` of ``prompts`` (a batch), checked row by row (``row_check``);
    ``ties``: each row's drafted tokens also split by near-ties (``tie_split``)."""
    extra = {"assistant_model": draft} if draft is not None else {}
    out = target.generate(
        **left_padded(prompts),
        **extra,
        **check.spec(**MODES[mode]),
        speculation_costs=COSTS,
        speculation_state=state or SpeculationState(),
        max_new_tokens=new,
        do_sample=False,
        return_dict_in_generate=True,
    )
    width, stats = max(len(p) for p in prompts), out.speculation
    got = [out.sequences[i, width : width + stats.row_tokens[i]].tolist() for i in range(len(prompts))]
    rows = [row_check(target, p, got[i], plain[tuple(p)]) for i, p in enumerate(prompts)]
    case = {
        "passed": all(r["ok"] for r in rows),
        "rows": rows,
        "drafted": sum(s.k for s in stats.steps),
        "accepted": sum(s.accepted for s in stats.steps),
        "drafters": dict(Counter(s.drafter for s in stats.steps)),
    }
    if ties:
        split = [tie_split(target, p, got[i], stats.row(i).steps) for i, p in enumerate(prompts)]
        case["ties"] = {k: sum(r[k] for r in split) for k in split[0]}
    return case


def _summarize(cases: dict, needed: set[str], extra: str = "") -> dict:
    """Pass when every case passes and every drafter in ``needed`` made a proposal in some case."""
    failed = [name for name, c in cases.items() if not c["passed"]]
    missing = sorted(needed - {d for c in cases.values() for d, n in c["drafters"].items() if n})
    rows = [r for c in cases.values() for r in c["rows"]]
    equal, deficit = sum(r["equal"] for r in rows), max(r["max_deficit"] for r in rows)
    line = (
        f"{len(cases) - len(failed)}/{len(cases)} cases pass; {equal}/{len(rows)} rows equal plain"
        + (" (the others first differ at a near-tie)" if equal < len(rows) and not failed else "")
        + f"; largest deficit {deficit:.3f}{extra}"
        + (f"; never exercised: {', '.join(missing)}" if missing else "")
    )
    return {"passed": not failed and not missing, "failed": failed, "summary": line, "cases": cases}


def _setup(check: Check, quantization: str):
    """The target, prompts, length and plain greedy outputs of a greedy step (random-weight outputs repeat a
    token within 48 tokens (at 4 to 45 on a CPU), which prompt lookup, matching down to 1-grams, proposes from)."""
    target, new = check.model(TARGET, quantization), 16 if check.tiny else 48
    prompts = check_prompts(target.config.vocab_size)
    plain = {tuple(p): generate(target, p, new, {}).sequences[0, len(p) :].tolist() for p in prompts}
    return target, prompts, new, plain


def greedy_matrix(check: Check, quantization: str) -> dict:
    """adaptive and fixed (k = 4) × the draft model, prompt lookup (adaptive: with suffix drafting), suffix
    drafting (adaptive again, on a state holding the first call's responses) × batch 1 and 3."""
    if quantization not in check.quantizations:
        return {"passed": None, "fallback": True, "summary": check.fallback}
    target, prompts, new, plain = _setup(check, quantization)
    draft, cases = check.model(DRAFT, quantization, head=True), {}
    for batch in (1, 3):
        for mode in MODES:
            for drafter, model in (("draft_model", draft), ("lookup", None)):
                cases[f"{mode} {drafter} b{batch}"] = greedy_case(
                    check, target, model, prompts[:batch], plain, mode, new
                )
        state = SpeculationState()
        greedy_case(check, target, None, prompts[:batch], plain, "adaptive", new, state)  # fills suffix's memory
        cases[f"adaptive suffix b{batch}"] = greedy_case(
            check, target, None, prompts[:batch], plain, "adaptive", new, state
        )
    floor = max(row_check(target, p, plain[tuple(p)], plain[tuple(p)])["max_deficit"] for p in prompts)
    return {
        **_summarize(cases, {"draft_model", "prompt_lookup", "suffix"}, f" (plain's own {floor:.3f})"),
        "plain_deficit": floor,
    }


def _ratio(part: int, whole: int) -> float | None:
    """``part / whole``, or None where ``whole`` is 0 (a case that drafted no such token has no rate to judge:
    whether adaptive drafts at all depends on the machine's numerics and the cost table)."""
    return part / whole if whole else None


def self_draft(check: Check, quantization: str) -> dict:
    """The target drafts for itself: every draft token is its argmax but at near-ties between a 1-token and a
    (k+1)-token forward, so the accept path and bonus tokens run. Each drafted token is classed by the target's
    top-2 gap at its position (``tie_split``): the bar is 90% accepted away from near-ties in every case that
    drafted such a token, and some case must (whether ``adaptive`` drafts at all with a draft as costly as the
    target depends on the machine's numerics); the acceptance at near-ties and their share of the drafted tokens
    explain the overall acceptance."""
    if quantization not in check.quantizations:
        return {"passed": None, "fallback": True, "summary": check.fallback}
    target, prompts, new, plain = _setup(check, quantization)
    cases = {
        f"{mode} b{batch}": greedy_case(check, target, target, prompts[:batch], plain, mode, new, ties=True)
        for batch in (1, 3)
        for mode in MODES
    }
    for case in cases.values():
        t = case["ties"]
        case["acceptance"] = case["accepted"] / max(case["drafted"], 1)
        case["acceptance_clear"] = _ratio(t["accepted_clear"], t["drafted_clear"])
        case["acceptance_tie"] = _ratio(t["accepted_tie"], t["drafted_tie"])
        case["passed"] = case["passed"] and (case["acceptance_clear"] is None or case["acceptance_clear"] >= 0.9)
    t = {k: sum(c["ties"][k] for c in cases.values()) for k in next(iter(cases.values()))["ties"]}
    line = (
        f"; acceptance {min(c['acceptance'] for c in cases.values()):.3f} lowest overall, away from near-ties "
        f"{t['accepted_clear']}/{t['drafted_clear']}, at near-ties (gap <= {NEAR_TIE}) {t['accepted_tie']}/"
        f"{t['drafted_tie']}"
    )
    result = _summarize(cases, {"draft_model"}, line)
    result["passed"] = result["passed"] and t["drafted_clear"] > 0  # else the accept path was never judged
    return {**result, "ties": t}
