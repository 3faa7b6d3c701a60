"""The GPU check's lossless-sampling step: the Pearson chi-square test (p = 0.001) that speculative sampling
reproduces the target's distribution (Leviathan et al. 2023, Alg. 1; Chen et al. 2023), run on the device —
on the verification function with the device's generator, with a negative control that must be rejected, and
through ``generate`` against the exact marginals of a tiny model. tests/test_invariants.py runs the same test.
"""

from __future__ import annotations

import copy
import math

import torch

from ..api.generate import enable
from ..costs.table import CostTable
from ..engine.run import SpeculationState
from ..engine.verification import speculative_sample
from .steps import COSTS, DRAFT, Check, left_padded, shrunk_config

STEEP = CostTable(verify_ms=tuple(10.0 + 4.0 * n for n in range(9)), draft_ms=2.0)  # the confidence stop acts
SAMPLED = ([11, 12, 13], list(range(1, 41)))  # the second: 40 distinct ids, so prompt lookup matches often
COPIES = 1000


def chi2_ratio(tokens: torch.Tensor, probs: torch.Tensor) -> float:
    """Pearson chi-square of the counts of ``tokens`` [N] against ``probs`` [V], cells with expectation < 5
    pooled, over its p = 0.001 critical value (Wilson–Hilferty): < 1 passes (tests/test_invariants.py's)."""
    tokens, probs = tokens.cpu(), probs.cpu()
    counts, expected = torch.bincount(tokens, minlength=probs.shape[0]).double(), probs.double() * tokens.shape[0]
    big = expected >= 5
    obs = torch.cat([counts[big], counts[~big].sum()[None]])
    exp = torch.cat([expected[big], expected[~big].sum()[None]])
    keep = exp > 0
    stat, df = float((((obs - exp) ** 2)[keep] / exp[keep]).sum()), int(keep.sum()) - 1
    return stat / (df * (1 - 2 / (9 * df) + 3.0902 * (2 / (9 * df)) ** 0.5) ** 3)


def _sampler(device: str):
    """A 2-layer Qwen2 from the draft's config with 64 token ids (fp32, peaked logits), enabled, and a
    perturbed copy of it as its draft (0 < acceptance < 1)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    spec = shrunk_config(DRAFT, hidden_size=32, num_hidden_layers=2, vocab_size=64)
    torch.manual_seed(3)
    model = (
        AutoModelForCausalLM.from_config(AutoConfig.for_model(spec.pop("model_type"), **spec), dtype=torch.float32)
        .to(device)
        .eval()
    )
    model.generation_config.eos_token_id, model.generation_config.pad_token_id = None, 0
    noisy, gen = copy.deepcopy(model), torch.Generator().manual_seed(2)
    with torch.no_grad():
        for p in noisy.parameters():
            p.add_((0.05 * p.std().item() * torch.randn(p.shape, generator=gen)).to(p.device))
    return enable(model), noisy


@torch.no_grad()
def exact_marginals(model, prompts) -> list[list[torch.Tensor]]:
    """Per prompt the exact marginals [V] of its first three sampled tokens (temperature 1): p(x1),
    p(x2) = Σ p(x1) p(x2 | x1), p(x3) = Σ p(x1, x2) p(x3 | x1, x2)."""
    dev, out = model.device, []
    for prompt in prompts:
        p1 = torch.softmax(model(torch.tensor([prompt], device=dev)).logits[0, -1].double(), dim=-1)  # [V]
        vocab = p1.shape[0]
        ctx = torch.cat([torch.tensor([prompt] * vocab), torch.arange(vocab)[:, None]], dim=1).to(dev)
        p2_given = torch.softmax(model(ctx).logits[:, -1].double(), dim=-1)  # [V, V]
        pairs = torch.cartesian_prod(torch.arange(vocab), torch.arange(vocab)).to(dev)  # [V*V, 2]
        cache = model(torch.tensor([prompt], device=dev), use_cache=True).past_key_values
        cache.batch_repeat_interleave(vocab * vocab)
        p3_given = torch.softmax(model(pairs, past_key_values=cache, logits_to_keep=1).logits[:, -1].double(), -1)
        out.append([p1, p1 @ p2_given, (p1[:, None] * p2_given).reshape(-1) @ p3_given])
    return out


def _sampled_case(model, draft, costs: CostTable, kwargs: dict, marginals) -> dict:
    """COPIES copies of each SAMPLED prompt in one batch, 4 sampled tokens; chi2_ratio per prompt of tokens
    1–3 (the 1st is the prefill's; the 2nd and 3rd go through acceptance, residual and bonus)."""
    inputs = left_padded([SAMPLED[0]] * COPIES + [SAMPLED[1]] * COPIES)
    extra = {"assistant_model": draft} if draft is not None else {}
    torch.manual_seed(0)
    out = model.generate(
        **inputs,
        **extra,
        **kwargs,
        speculation_costs=costs,
        speculation_state=SpeculationState(),
        max_new_tokens=4,
        do_sample=True,
        temperature=1.0,
        top_k=0,
        top_p=1.0,
        return_dict_in_generate=True,
    )
    new = out.sequences[:, inputs["input_ids"].shape[1] :]
    ratios = [
        [round(chi2_ratio(new[j * COPIES : (j + 1) * COPIES, pos], marginals[j][pos]), 3) for pos in range(3)]
        for j in range(len(SAMPLED))
    ]
    first = [s for s in out.speculation.steps if s.step == 0]
    drafted, accepted = sum(s.k for s in first), sum(s.accepted for s in first)
    both = 0 < accepted < drafted if draft is not None else drafted > 0  # acceptance and rejection both ran
    return {"passed": max(map(max, ratios)) < 1.0 and both, "ratios": ratios, "drafted": drafted, "accepted": accepted}


def _verification_on_device(device: str, k: int = 3, vocab: int = 6, rows: int = 100_000) -> dict:
    """``speculative_sample`` on the device with its generator: the first emitted token follows p, and the
    negative control (the draft's tokens, unverified) is rejected."""
    gen = torch.Generator(device=device).manual_seed(10)
    p = torch.softmax(1.5 * torch.randn(k + 1, vocab, generator=gen, device=device), dim=-1)
    q = torch.softmax(1.5 * torch.randn(k, vocab, generator=gen, device=device), dim=-1)
    draft = torch.stack(
        [torch.multinomial(q[i].expand(rows, vocab).contiguous(), 1, generator=gen)[:, 0] for i in range(k)], 1
    )
    result = speculative_sample(draft, q.expand(rows, k, vocab), p.expand(rows, k + 1, vocab), generator=gen)
    first = torch.where(result.num_accepted > 0, draft[:, 0], result.next_token)
    ratio, control = chi2_ratio(first, p[0]), chi2_ratio(draft[:, 0], p[0])
    return {"passed": ratio < 1.0 and control > 10.0, "ratio": round(ratio, 3), "negative_control": round(control, 1)}


def sampling(check: Check) -> dict:
    """Lossless sampling on the device: the verification function, then ``generate`` with fixed k = 2 from a
    perturbed copy and from prompt lookup (one-hot q), and adaptive under steep costs (the draft's confidence
    stop), each against the exact marginals at p = 0.001."""
    model, noisy = _sampler(check.device)
    marginals, fixed = exact_marginals(model, SAMPLED), {"speculation": "fixed", "num_speculative_tokens": 2}
    cases = {
        "fixed k=2, draft model": _sampled_case(model, noisy, COSTS, fixed, marginals),
        "fixed k=2, prompt lookup": _sampled_case(model, None, COSTS, fixed, marginals),
        "adaptive, confidence stop": _sampled_case(
            model, noisy, STEEP, {"speculation": "adaptive", "max_slowdown": math.inf}, marginals
        ),
        "verification function": _verification_on_device(check.device),
    }
    worst = max(max(map(max, c["ratios"])) for c in cases.values() if "ratios" in c)
    return {
        "passed": all(c["passed"] for c in cases.values()),
        "cases": cases,
        "summary": f"largest chi2/critical {worst:.3f} (< 1 passes); negative control "
        f"{cases['verification function']['negative_control']} (> 10 rejects)",
    }
