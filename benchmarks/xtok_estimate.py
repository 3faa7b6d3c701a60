"""Can a draft model with another tokenizer pay as a draft for the Qwen target on this CPU? (issue 57, item 3)

An estimate before building the drafter: the draft's acceptance measured teacher-forced along the target's
recorded greedy outputs (``benchmarks/traces``: held-out Spec-Bench, odd question ids, and the code workload),
and the models' costs timed here; then the goodput a policy using the draft could reach, as a ratio over plain.

Text-level re-tokenization (as transformers' universal assisted decoding): at each position i of the target's
greedy output, the committed text T (the target's tokens decoded, chat template included) is encoded with the
draft's tokenizer; the draft drafts kd tokens greedily from it; their text is encoded with the target's tokenizer
and compared with the target's next greedy tokens. Two ways to meet the boundary (the committed text may end
inside a word the draft would spell with one token): ``naive`` feeds the draft its tokenization of T as is;
``healed`` also asks, from the same catch-up forward's logits one position earlier, which
token whose text starts with the last token's text r the draft would have written there (token healing); where
that is a longer token, it replaces the last one and its remainder opens the proposal (no forward more). The draft's cache is rolled back to the common
prefix of what it holds and the new context each position, as the drafter would.

Predicted goodput (SmartSpec, arXiv 2406.14066, §4): per prompt the hindsight-optimal schedule (dynamic
programming over positions: a plain step t_v(1) advancing 1, or a proposal of the first m target tokens of kd
drafted tokens costing kd·t_draft + t_v(m + 1) and advancing its accepted length + 1) and the best fixed kd; the
0.5B same-tokenizer draft priced the same way from the traces' teacher-forced argmax, and prompt lookup
(costless) alone and beside each draft. Beside them, the closed form (Leviathan et al. 2023, eq. 1, with the
measured conditional rate of each proposal position instead of one alpha; ``_closed_form``) per workload and per
category, for the cross-tokenizer draft and for the 0.5B. All figures are predictions.

    python benchmarks/xtok_estimate.py costs --output benchmarks/results/xtok_costs.json
    python benchmarks/xtok_estimate.py accept --draft smollm2-135m --mode healed --output benchmarks/results/xtok_accept_smollm2-135m_healed.json
    python benchmarks/xtok_estimate.py report --costs benchmarks/results/xtok_costs.json benchmarks/results/xtok_accept_*.json
"""

from __future__ import annotations

import argparse
import bisect
import json
import statistics
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
TRACES = ROOT / "benchmarks" / "traces"
HELD_OUT = (81, 91, 101, 111, 121, 131, 141, 151, 161, 241, 321, 401, 481)  # the first odd id of each category
CODE = (10001, 10002, 10003, 10004, 10009, 10010, 10011, 10012)  # code.jsonl, 4 per category
K_DRAFT = 6  # draft tokens per position
N_VERIFY = 12  # target widths timed


def load_trace(qid: int) -> dict:
    return json.loads((TRACES / f"{qid}.json").read_text())


def _tokenizer(name: str):
    from transformers import AutoTokenizer

    from hf_adaspec.models.loading import resolve
    return AutoTokenizer.from_pretrained(resolve(name))


class Healer:
    """Token texts of a vocabulary sorted, so the tokens whose text starts with r are one range (bisect)."""

    def __init__(self, tok) -> None:
        texts = [tok.decode([i]) for i in range(len(tok))]
        order = sorted(range(len(texts)), key=lambda i: texts[i])
        self.sorted_texts = [texts[i] for i in order]
        self.ids = torch.tensor(order, dtype=torch.long)
        self.texts = texts

    def starting_with(self, r: str) -> torch.Tensor:
        lo = bisect.bisect_left(self.sorted_texts, r)
        hi = bisect.bisect_left(self.sorted_texts, r + "\U0010ffff")
        return self.ids[lo:hi]


def _common(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n


def _matched(proposal: list[int], truth: list[int]) -> int:
    return _common(proposal, truth)


@torch.no_grad()
def accept(args) -> None:
    """Per trace, per position: for kd = 1..K_DRAFT the target tokens the first kd drafted tokens map to (m) and
    how many of them equal the target's greedy continuation (L). Resumable per trace."""
    import hf_adaspec
    from hf_adaspec.backend import hf_compat
    from hf_adaspec.backend.caches import open_cache

    out = Path(args.output)
    done = json.loads(out.read_text()) if out.exists() else {"draft": args.draft, "mode": args.mode, "traces": {}}
    target_tok = _tokenizer("qwen2.5-coder-1.5b")
    draft = hf_adaspec.load(args.draft, quantize_lm_head=True)
    hf_compat.use_packed_attention(draft.model)
    tok = draft.tokenizer
    healer = Healer(tok) if args.mode == "healed" else None
    qids = [q for q in (HELD_OUT + CODE) if str(q) not in done["traces"]][: args.limit or None]
    for n, qid in enumerate(qids):
        tr = load_trace(qid)
        p, ids = tr["prompt_len"], tr["tokens"]
        cache, held = open_cache(draft.model, 1), []
        rows, tok_ms, fwd = [], [], 0
        t0 = time.perf_counter()
        for i in range(len(ids) - p):
            s = time.perf_counter()
            text = target_tok.decode(ids[: p + i])
            d_ids = tok(text, add_special_tokens=True)["input_ids"]
            r = tok.decode(d_ids[-1:]) if healer is not None and len(d_ids) > 1 else ""
            r = r if r and text.endswith(r) else ""
            tok_ms.append((time.perf_counter() - s) * 1e3)
            c = min(_common(held, d_ids), len(d_ids) - 2)  # the last two tokens are fed: logits at both
            cache.rollback(torch.tensor([c]))
            feed = torch.tensor([d_ids[c:]])
            both = cache.append(feed, torch.ones_like(feed, dtype=torch.bool), keep=2)[0]  # [2, V]
            held, drafted, logits = list(d_ids), [], both[-1]
            if r:  # healing without a forward more: would the draft spell the text's tail with a longer token?
                allowed = healer.starting_with(r)
                h = int(allowed[both[0][allowed].argmax()])
                if h != d_ids[-1]:
                    cache.rollback(torch.tensor([len(d_ids) - 1]))
                    held = held[:-1]
                    drafted.append(h)
                    logits = cache.append(torch.tensor([[h]]), torch.ones(1, 1, dtype=torch.bool), keep=1)[0, -1]
                    held.append(h)
                    fwd += 1
                else:
                    r = ""
            while len(drafted) < K_DRAFT:
                x = int(logits.argmax())
                drafted.append(x)
                fwd += 1
                if len(drafted) < K_DRAFT:
                    logits = cache.append(torch.tensor([[x]]), torch.ones(1, 1, dtype=torch.bool), keep=1)[0, -1]
                    held.append(x)
            s = time.perf_counter()
            truth = ids[p + i :]
            row = []
            for kd in range(1, K_DRAFT + 1):
                piece = tok.decode(drafted[:kd]).rstrip("\ufffd")
                if r:
                    piece = piece[len(r):] if piece.startswith(r) else ""
                e = target_tok(piece, add_special_tokens=False)["input_ids"] if piece else []
                row.append((len(e), _matched(e, truth)))
            tok_ms[-1] += (time.perf_counter() - s) * 1e3 / K_DRAFT
            rows.append(row)
        secs = time.perf_counter() - t0
        done["traces"][str(qid)] = {"category": tr["category"], "rows": rows,
                                    "tokenize_ms_median": statistics.median(tok_ms)}
        tmp = out.with_suffix(".tmp")
        tmp.write_text(json.dumps(done))
        tmp.replace(out)
        l1 = sum(r_[0][1] > 0 for r_ in rows) / max(len(rows), 1)
        print(f"[{n + 1}/{len(qids)}] {qid} {tr['category']}: {len(rows)} positions, {secs:.0f} s "
              f"({secs / max(fwd, 1) * 1e3:.1f} ms a draft forward, loop included), first token accepted {l1:.2f}",
              flush=True)


@torch.no_grad()
def costs(args) -> None:
    """Target forwards over n = 1..N_VERIFY new tokens and each draft's 1-token and 3-token forwards, at context
    ``--context``, interleaved over ``--repeats`` rounds after a warm-up (medians, ms)."""
    import hf_adaspec
    from hf_adaspec.backend import hf_compat
    from hf_adaspec.costs.table import ForwardProbe
    from hf_adaspec.machine import processor_name

    target = hf_adaspec.load("qwen2.5-coder-1.5b")
    hf_adaspec.enable(target.model)
    drafts = {}
    for name in args.drafts.split(","):
        d = hf_adaspec.load(name, quantize_lm_head=True)
        hf_compat.use_packed_attention(d.model)
        drafts[name] = d
    probes = {"target": ForwardProbe(target.model, args.context, N_VERIFY)}
    probes.update({n: ForwardProbe(d.model, args.context, 3) for n, d in drafts.items()})
    times: dict[str, list[float]] = {}
    for rnd in range(args.repeats + 1):
        for n in range(1, N_VERIFY + 1):
            times.setdefault(f"target:{n}", []).append(probes["target"].time_ms(n, keep=n))
        for name in drafts:
            for n in (1, 3):
                times.setdefault(f"{name}:{n}", []).append(probes[name].time_ms(n, keep=1))
    med = {k: statistics.median(v[1:]) for k, v in times.items()}
    result = {"context": args.context, "repeats": args.repeats, "processor": processor_name() + ", flags: " + _flags(),
              "threads": torch.get_num_threads(),
              "formats": {"qwen2.5-coder-1.5b": target.format_label,
                          **{n: d.format_label for n, d in drafts.items()}},
              "verify_ms": [med[f"target:{n}"] for n in range(1, N_VERIFY + 1)],
              "draft_ms": {n: {"1": med[f"{n}:1"], "3": med[f"{n}:3"]} for n in drafts}}
    Path(args.output).write_text(json.dumps(result, indent=1))
    print(json.dumps(result))


def _flags() -> str:
    """The processor's SIMD flags that matter here (from /proc/cpuinfo)."""
    try:
        line = next(x for x in Path("/proc/cpuinfo").read_text().splitlines() if x.startswith("flags"))
    except (OSError, StopIteration):
        return "unknown"
    have = set(line.split(":", 1)[1].split())
    return " ".join(f for f in ("avx", "avx2", "fma", "f16c", "avx512f", "avx512_bf16", "avx512_vnni", "amx_tile")
                    if f in have)


# ---- the predicted goodput --------------------------------------------------------------------------------

def _oracle(n: int, options) -> float:
    """Least total ms to emit positions 0..n-1: options(i) yields (ms, tokens advanced) from position i."""
    best = [0.0] * (n + 1)
    for i in range(n - 1, -1, -1):
        best[i] = min(ms + best[min(n, i + adv)] for ms, adv in options(i))
    return best[0]


def _greedy_fixed(n: int, option) -> float:
    """Total ms of always taking option(i) → (ms, advance)."""
    i, total = 0, 0.0
    while i < n:
        ms, adv = option(i)
        total, i = total + ms, i + adv
    return total


def _lookup_offers(tr: dict, k_max: int) -> list[tuple[int, int]]:
    """Per position: prompt lookup's offered length and how many of them equal the target's greedy tokens."""
    from hf_adaspec.proposers.prompt_lookup import find_continuation
    p, ids = tr["prompt_len"], tr["tokens"]
    t = torch.tensor(ids)
    offers = []
    for i in range(len(ids) - p):
        c = find_continuation(t[: p + i], 3, 1, k_max).tolist()
        offers.append((len(c), _matched(c, ids[p + i :])))
    return offers


def _same_tokenizer_runs(tr: dict) -> list[int]:
    """The 0.5B draft (same tokenizer): from each position, how many of its teacher-forced argmax tokens in a row
    equal the target's (exact for greedy drafting along the accepted path)."""
    p, ids, nxt = tr["prompt_len"], tr["tokens"], tr["draft_next"]
    gen = ids[p:]
    runs = [0] * (len(gen) + 1)
    for i in range(len(gen) - 1, -1, -1):
        runs[i] = runs[i + 1] + 1 if nxt[i] == gen[i] else 0
    return runs[:-1]


def _conditional_acceptance(rows: list, jmax: int) -> list[float]:
    """alpha_j for j = 1..jmax: the share of positions whose proposal (all K_DRAFT drafted tokens, re-tokenized)
    has its j-th target token accepted, among those whose first j - 1 were accepted and that offered a j-th."""
    out = []
    for j in range(1, jmax + 1):
        offered = sum(1 for r in rows if r[-1][0] >= j and r[-1][1] >= j - 1)
        out.append(sum(1 for r in rows if r[-1][0] >= j and r[-1][1] >= j) / max(offered, 1))
    return out


def _closed_form(rows: list, tv: list[float], td1: float, td3: float, tok_ms: float) -> dict:
    """Leviathan et al. 2023, eq. 1 with the measured per-position rates: E(k) = 1 + sum_j prod_{i<=j} alpha_i
    target tokens per step for a proposal of k target tokens (eq. 1 where every alpha_i = alpha), priced
    tok_ms + (k / rho) t_d + (E(k) - 1) c_up + t_v(k + 1) ms (rho: target tokens per drafted token; c_up: the
    draft's catch-up cost per extra accepted token, (t_d(3) - t_d(1)) / 2); goodput over plain = E(k) t_v(1) / cost."""
    kmax = min(K_DRAFT - 1, len(tv) - 1)
    alpha = _conditional_acceptance(rows, kmax)
    rho = sum(r[-1][0] for r in rows) / (K_DRAFT * len(rows))
    c_up, best = (td3 - td1) / 2, (0, 1.0)
    per_k = []
    for k in range(1, kmax + 1):
        e, run = 1.0, 1.0
        for a in alpha[:k]:
            run *= a
            e += run
        cost = tok_ms + k / rho * td1 + (e - 1) * c_up + tv[k]
        per_k.append(round(e * tv[0] / cost, 3))
        best = max(best, (k, per_k[-1]), key=lambda x: x[1])
    return {"positions": len(rows), "alpha": [round(a, 3) for a in alpha], "rho": round(rho, 3),
            "ratio_per_k": per_k, "best_k": best[0], "best_ratio": best[1]}


def _bootstrap(rows_by_prompt: list[list], tv: list[float], td1: float, td3: float, tok_ms: float,
               draws: int = 1000) -> list[float]:
    """5th, 50th and 95th percentiles of ``_closed_form``'s best ratio over k >= 1 (k = 0, plain, left out) with
    the prompts resampled with replacement (positions within a prompt are not independent)."""
    gen = torch.Generator().manual_seed(0)
    vals = []
    for _ in range(draws):
        pick = torch.randint(0, len(rows_by_prompt), (len(rows_by_prompt),), generator=gen).tolist()
        vals.append(max(_closed_form([r for j in pick for r in rows_by_prompt[j]], tv, td1, td3, tok_ms)
                        ["ratio_per_k"]))
    vals.sort()
    return [round(vals[int(f * (draws - 1))], 3) for f in (0.05, 0.5, 0.95)]


def report(args) -> None:
    c = json.loads(Path(args.costs).read_text())
    tv = c["verify_ms"]

    def t_verify(n: int) -> float:
        return tv[n - 1] if n <= len(tv) else tv[-1] + (tv[-1] - tv[0]) / (len(tv) - 1) * (n - len(tv))

    t1, kmax = tv[0], 8
    accepts = [json.loads(Path(p).read_text()) for p in args.accept]
    lines, out = [], {"costs": c, "rows": []}
    for workload, qids in (("held-out Spec-Bench", HELD_OUT), ("code", CODE)):
        traces = {q: load_trace(q) for q in qids}
        lookups = {q: _lookup_offers(traces[q], kmax) for q in qids}
        plain_ms = {q: t1 * (len(traces[q]["tokens"]) - traces[q]["prompt_len"]) for q in qids}

        def lookup_opts(q, i):
            k, acc = lookups[q][i]
            return [(t_verify(j + 1), min(acc, j) + 1) for j in range(1, k + 1)]

        def ratio(times: dict) -> float:  # geometric mean of per-prompt tokens/s over plain
            import math
            return math.exp(statistics.mean(math.log(plain_ms[q] / times[q]) for q in times))

        def row(name: str, times: dict, extra: str = "") -> None:
            r = ratio(times)
            out["rows"].append({"workload": workload, "method": name, "ratio_vs_plain": r})
            lines.append(f"| {workload} | {name} | {r:.3f}x | {extra} |")

        n_of = {q: len(traces[q]["tokens"]) - traces[q]["prompt_len"] for q in qids}
        row("prompt lookup, oracle", {q: _oracle(n_of[q], lambda i, q=q: [(t1, 1)] + lookup_opts(q, i))
                                      for q in qids})
        # the 0.5B draft, same tokenizer, priced with its own measured cost
        if "qwen2.5-coder-0.5b" in c["draft_ms"]:
            td = c["draft_ms"]["qwen2.5-coder-0.5b"]["1"]
            runs = {q: _same_tokenizer_runs(traces[q]) for q in qids}

            def same_opts(q, i, td=td):
                return [(k * td + t_verify(k + 1), min(runs[q][i], k) + 1) for k in range(1, kmax + 1)]

            alpha = sum(traces[q]["draft_next"][i] == traces[q]["tokens"][traces[q]["prompt_len"] + i]
                        for q in qids for i in range(n_of[q])) / sum(n_of.values())
            row("0.5B draft (same tokenizer), oracle",
                {q: _oracle(n_of[q], lambda i, q=q: [(t1, 1)] + same_opts(q, i)) for q in qids},
                f"α₁ {alpha:.2f}, t_draft {td:.1f} ms")
            best = max(range(1, kmax + 1), key=lambda k: ratio(
                {q: _greedy_fixed(n_of[q], lambda i, q=q, k=k: same_opts(q, i)[k - 1]) for q in qids}))
            row(f"0.5B draft, fixed k = {best}",
                {q: _greedy_fixed(n_of[q], lambda i, q=q: same_opts(q, i)[best - 1]) for q in qids})
            td3 = c["draft_ms"]["qwen2.5-coder-0.5b"]["3"]
            cats = {"all": [q for q in qids]}
            for q in qids:
                cats.setdefault(traces[q]["category"], []).append(q)
            for cat, qs in cats.items():  # rows in accept()'s shape: all K_DRAFT proposed, the run accepted
                rs = [[(K_DRAFT, min(r, K_DRAFT))] for q in qs for r in runs[q]]
                cf = _closed_form(rs, tv, td, td3, 0.0)
                if cat == "all":
                    cf["bootstrap_5_50_95"] = _bootstrap([[[(K_DRAFT, min(r, K_DRAFT))] for r in runs[q]]
                                                          for q in qs], tv, td, td3, 0.0)
                out.setdefault("closed_form", []).append({"workload": workload, "draft": "qwen2.5-coder-0.5b",
                                                          "category": cat, **cf})
                lines.append(f"| {workload} | 0.5B draft, Leviathan eq. 1, {cat} | {cf['best_ratio']:.3f}x at k = "
                             f"{cf['best_k']} | {cf['positions']} positions, alpha_j {cf['alpha']}, "
                             f"per k {cf['ratio_per_k']}, bootstrap {cf.get('bootstrap_5_50_95', '')} |")
            row("0.5B draft + prompt lookup, oracle",
                {q: _oracle(n_of[q], lambda i, q=q: [(t1, 1)] + same_opts(q, i) + lookup_opts(q, i)) for q in qids})
        for a in accepts:
            name, td = f"{a['draft']} ({a['mode']})", c["draft_ms"][a["draft"]]["1"]
            if not all(str(q) in a["traces"] for q in qids):
                continue
            rows = {q: a["traces"][str(q)]["rows"] for q in qids}
            tok_ms = statistics.median(a["traces"][str(q)]["tokenize_ms_median"] for q in qids)
            td3 = c["draft_ms"][a["draft"]]["3"]
            cats = {"all": [r for q in qids for r in rows[q]]}
            for q in qids:
                cats.setdefault(traces[q]["category"], []).extend(rows[q])
            for cat, rs in cats.items():
                cf = _closed_form(rs, tv, td, td3, tok_ms)
                if cat == "all":
                    cf["bootstrap_5_50_95"] = _bootstrap([rows[q] for q in qids], tv, td, td3, tok_ms)
                out.setdefault("closed_form", []).append({"workload": workload, "draft": name, "category": cat, **cf})
                lines.append(f"| {workload} | {name}, Leviathan eq. 1, {cat} | {cf['best_ratio']:.3f}x at k = "
                             f"{cf['best_k']} | {cf['positions']} positions, alpha_j {cf['alpha']}, rho {cf['rho']}, "
                             f"per k {cf['ratio_per_k']}, bootstrap {cf.get('bootstrap_5_50_95', '')} |")

            def x_opts(q, i, td=td, rows=rows, tok_ms=tok_ms):
                opts = []
                for kd, (m, acc) in enumerate(rows[q][i], start=1):
                    for mm in range(1, min(m, kmax) + 1):
                        opts.append((tok_ms + kd * td + t_verify(mm + 1), min(acc, mm) + 1))
                return opts

            def x_fixed(q, i, kd, rows=rows, td=td, tok_ms=tok_ms):
                m, acc = rows[q][i][kd - 1]
                m = min(m, kmax)
                return (t1, 1) if m == 0 else (tok_ms + kd * td + t_verify(m + 1), min(acc, m) + 1)

            first = [r[0] for q in qids for r in rows[q]]
            a1 = sum(acc > 0 for _, acc in first) / len(first)
            per_draft = sum(r[-1][1] for q in qids for r in rows[q]) / len(first)
            row(f"{name}, oracle", {q: _oracle(n_of[q], lambda i, q=q: [(t1, 1)] + x_opts(q, i)) for q in qids},
                f"first drafted token's target tokens accepted at {a1:.2f} of positions; {per_draft:.2f} target "
                f"tokens accepted of {K_DRAFT} drafted; t_draft {td:.1f} ms, tokenizers {tok_ms:.2f} ms a step")
            best = max(range(1, K_DRAFT + 1), key=lambda k: ratio(
                {q: _greedy_fixed(n_of[q], lambda i, q=q, k=k: x_fixed(q, i, k)) for q in qids}))
            row(f"{name}, fixed kd = {best}",
                {q: _greedy_fixed(n_of[q], lambda i, q=q: x_fixed(q, i, best)) for q in qids})
            row(f"{name}, best fixed kd per prompt (hindsight)",
                {q: min([plain_ms[q]] + [_greedy_fixed(n_of[q], lambda i, q=q, k=k: x_fixed(q, i, k))
                                         for k in range(1, K_DRAFT + 1)]) for q in qids}, "or plain")
            row(f"{name} + prompt lookup, oracle",
                {q: _oracle(n_of[q], lambda i, q=q: [(t1, 1)] + x_opts(q, i) + lookup_opts(q, i)) for q in qids})
    head = (f"costs: target t_v(1..4) {', '.join(f'{t:.1f}' for t in tv[:4])} ms; "
            f"drafts {json.dumps(c['draft_ms'])}; formats {c['formats']}; {c['processor']}, {c['threads']} threads")
    print(head)
    print("| workload | method | predicted goodput / plain | notes |\n|---|---|---|---|")
    print("\n".join(lines))
    if args.output:
        Path(args.output).write_text(json.dumps(out, indent=1))
    print(json.dumps({"rows": len(out["rows"]), "best": max(out["rows"], key=lambda r: r["ratio_vs_plain"])}))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    a = sub.add_parser("accept")
    a.add_argument("--draft", required=True)
    a.add_argument("--mode", choices=("naive", "healed"), default="healed")
    a.add_argument("--output", required=True)
    a.add_argument("--limit", type=int, default=0, help="at most this many traces this run (0: all left)")
    c = sub.add_parser("costs")
    c.add_argument("--drafts", default="smollm2-135m,gemma-3-270m,qwen2.5-coder-0.5b")
    c.add_argument("--context", type=int, default=384)
    c.add_argument("--repeats", type=int, default=9)
    c.add_argument("--output", required=True)
    r = sub.add_parser("report")
    r.add_argument("--costs", required=True)
    r.add_argument("accept", nargs="*")
    r.add_argument("--output", default="")
    args = ap.parse_args()
    {"accept": accept, "costs": costs, "report": report}[args.cmd](args)


if __name__ == "__main__":
    main()
