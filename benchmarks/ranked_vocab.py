"""The draft's head over a frequency-ranked vocabulary (FR-Spec, arXiv 2502.14856; issue 71): its cost and acceptance.

``rank`` makes the ranking (``models.vocab_rank``) from text no benchmark is built from, three sources weighed
alike (each by its own frequencies): the installed transformers and torch packages' Python source
(``training.head_data.source_files``: no vendored copies, no tests; the first ``--code-chars`` characters in its
fixed order); English prose: every installed distribution's description (its METADATA) and the ``.md``/``.rst``
files in site-packages (no tests, no vendored copies); with ``--words``, English word frequencies (wordfreq's
``large_en`` list: Wikipedia, subtitles, news, books, web text, aggregated over billions of words). Not Spec-Bench,
not CPython's standard library (the code workload's source).

Two measurements, on the draft as the pair loads it (``q4``, head in q4 on the GGUF file's blocks):

- ``cost``: one-token draft forwards at context ``--context`` (a synthetic cache, each forward rolled back), the
  full head against ``RankedHead`` over the ``--sizes`` most frequent tokens of the shipped ranking
  (``models.vocab_rank``), heads swapped in place and interleaved round by round (order rotating); the full head
  is timed twice (``full-again``: the A/A spread). Medians and p10 per head, ms.
- ``ab``: wall clock of ``adaptive`` with the full-head draft and with ranked ones, plain and plain again (A/A),
  interleaved per prompt, held-out Spec-Bench (``--per-category``), ``--max-new-tokens``; greedy checked vs plain.
- ``acceptance``: along the target's greedy outputs in ``--traces`` (held-out split only, ``bench.prompts.split_of``),
  one teacher-forced draft forward per trace; at each output position the draft's argmax over the full vocabulary
  and over each S, scored against the target's next token: top-1 agreement, and the mean accepted run of a k = 5
  proposal from every position (greedy: accepted while the argmaxes agree).

    pip download wordfreq==3.1.1 --no-deps -d /tmp/wf && unzip -o /tmp/wf/*.whl -d /tmp/wf && pip install msgpack
    python benchmarks/ranked_vocab.py rank --code-chars 40000000 --words /tmp/wf/wordfreq/data/large_en.msgpack.gz
    python benchmarks/ranked_vocab.py cost --sizes 16384 32768 65536 --rounds 15
    python benchmarks/ranked_vocab.py acceptance --sizes 16384 32768 65536
    python benchmarks/ranked_vocab.py ab --sizes 65536 --offset 0   # wall clock, held-out Spec-Bench, 128 tokens

Last line: one JSON object.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import math
import statistics
import time
from pathlib import Path

import torch
import transformers

from hf_adaspec import load
from hf_adaspec.backend import hf_compat
from hf_adaspec.bench.prompts import split_of
from hf_adaspec.machine import processor_name
from hf_adaspec.models.ranked_head import ranked_head
from hf_adaspec.models.vocab_rank import count_tokens, package_path, rank, ranking, save_ranking, special_ids
from hf_adaspec.replay.trace import load_traces
from hf_adaspec.training.head_data import EXCLUDED_PARTS, source_files

SITE = Path(transformers.__file__).parent.parent  # site-packages


def _code(limit: int):
    from hf_adaspec.cli.train_head_cli import default_sources

    left = limit
    for path in source_files(default_sources()):
        if left <= 0:
            return
        text = path.read_text(errors="replace")[:left]
        left -= len(text)
        yield text


def _prose():
    for dist in importlib.metadata.distributions():
        text = dist.metadata.get_payload() or dist.metadata.get("Description") or ""
        if text:
            yield text
    for path in sorted(p for p in SITE.rglob("*") if p.suffix in (".md", ".rst") and p.is_file()):
        parts = {part.lower() for part in path.relative_to(SITE).parts[:-1]}
        if not parts & set(EXCLUDED_PARTS) and "hf_adaspec" not in str(path):
            yield path.read_text(errors="replace")


def _word_weights(tokenizer, path: Path) -> torch.Tensor:
    """Token frequencies [V] float64 (sum 1) of English words as running text: wordfreq's ``large_en`` list (msgpack,
    cBpack: bucket i holds the words of frequency 10^(-i/100)), each word " w" at its frequency and " W"
    (capitalized) at a tenth of it, every token of its tokenization counted."""
    import gzip

    import msgpack  # pip install msgpack (only for making a ranking)
    import numpy as np

    with gzip.open(path) as f:
        buckets = msgpack.load(f, raw=False)[1:]
    texts, weights = [], []
    for i, words in enumerate(buckets):
        for w in words:
            texts += [" " + w, " " + w.capitalize()]
            weights += [10 ** (-i / 100), 10 ** (-i / 100) / 10]
    counts = np.zeros(len(tokenizer))
    for ids, weight in zip(tokenizer(texts, add_special_tokens=False)["input_ids"], weights):
        np.add.at(counts, np.asarray(ids, dtype=np.int64), weight)
    return torch.from_numpy(counts / counts.sum())


def make_ranking(tokenizer, code_chars: int, words: Path | None, output: Path) -> dict:
    code_counts, code_tokens = count_tokens(tokenizer, _code(code_chars), len(tokenizer))
    prose_counts, prose_tokens = count_tokens(tokenizer, _prose(), len(tokenizer))
    weights = code_counts / max(1, code_tokens) + prose_counts / max(1, prose_tokens)  # each source weighs alike
    if words is not None:
        weights = weights + _word_weights(tokenizer, words)
    ids = rank(weights, special_ids(tokenizer))
    source = (
        f"transformers {transformers.__version__} and torch {torch.__version__} Python source (first {code_chars} "
        f"characters, {code_tokens} tokens); installed distributions' descriptions and site-packages .md/.rst "
        f"({prose_tokens} tokens)"
        + ("" if words is None else f"; English word frequencies ({words.name} of wordfreq 3.1.1, CC-BY-SA 4.0 data)")
        + "; each source weighed alike"
    )
    save_ranking(output, tokenizer, ids, source, code_tokens + prose_tokens)
    seen = int(((code_counts + prose_counts) > 0).sum())
    return {"output": str(output), "ranked": len(ids), "distinct_seen": seen, "source": source}


def _heads(model, tokenizer, sizes: list[int]) -> dict[str, torch.nn.Module]:
    full = model.get_output_embeddings()
    ranked = ranking(tokenizer)
    heads = {"full": full, "full-again": full}
    heads.update({f"ranked-{n}": ranked_head(full, ranked[:n]) for n in sizes})
    return heads


@torch.no_grad()
def cost(model, tokenizer, sizes: list[int], context: int, rounds: int) -> dict:
    heads = _heads(model, tokenizer, sizes)
    cache = hf_compat.synthetic_cache(model, 1, context)
    token = torch.tensor([[198]])
    times: dict[str, list[float]] = {name: [] for name in heads}
    names = list(heads)
    for r in range(rounds + 2):  # two warm-up rounds
        order = names[r % len(names) :] + names[: r % len(names)]
        for name in order:
            model.set_output_embeddings(heads[name])
            for _ in range(3):
                start = time.perf_counter()
                hf_compat.forward_logits(model, token, cache, 1)
                elapsed = (time.perf_counter() - start) * 1e3
                hf_compat.rollback(cache, context)
                if r >= 2:
                    times[name].append(elapsed)
    model.set_output_embeddings(heads["full"])
    return {
        name: {"median_ms": round(statistics.median(t), 3), "p10_ms": round(sorted(t)[len(t) // 10], 3), "n": len(t)}
        for name, t in times.items()
    }


def _runs(agree: torch.Tensor, k: int) -> float:
    """Mean accepted tokens of a k-token greedy proposal from every position: the run of agreements from there."""
    a = agree.tolist()
    total = 0
    for i in range(len(a)):
        run = 0
        while run < k and i + run < len(a) and a[i + run]:
            run += 1
        total += run
    return total / max(1, len(a))


@torch.no_grad()
def acceptance(model, tokenizer, sizes: list[int], traces_dir: Path, k: int) -> dict:
    ranked = ranking(tokenizer)
    traces = [t for t in load_traces(traces_dir) if split_of(t.question_id) == "held-out"]
    groups: dict[str, dict[str, list]] = {}
    for tr in traces:
        seq = torch.tensor([tr.tokens])
        logits = hf_compat.forward_logits(model, seq, hf_compat.new_cache(model), seq.shape[1])[0]  # [T, V]
        out = logits[tr.prompt_len - 1 : -1]  # predicts tokens[prompt_len:]
        want = torch.tensor(tr.tokens[tr.prompt_len :])
        group = groups.setdefault("code" if tr.source != "spec_bench" else "spec_bench", {})
        group.setdefault("full", []).append(out.argmax(-1) == want)
        for n in sizes:
            mask = torch.full((logits.shape[-1],), float("-inf"))
            mask[ranked[:n]] = 0
            group.setdefault(f"ranked-{n}", []).append((out + mask).argmax(-1) == want)
    report = {}
    for source, rows in groups.items():
        report[source] = {
            name: {
                "top1": round(torch.cat(a).float().mean().item(), 4),
                f"mean_accepted_k{k}": round(statistics.mean(_runs(x, k) for x in a), 4),
                "positions": int(sum(x.numel() for x in a)),
            }
            for name, a in rows.items()
        }
        report[source]["prompts"] = len(rows["full"])
    return report


def _tokens_per_s(model, inputs: dict, kwargs: dict, max_new_tokens: int) -> tuple[float, torch.Tensor]:
    start = time.perf_counter()
    out = model.generate(**inputs, **kwargs, max_new_tokens=max_new_tokens, do_sample=False)
    elapsed = time.perf_counter() - start
    return (out.shape[1] - inputs["input_ids"].shape[1]) / elapsed, out


def _controlled_costs(target, drafts: dict, paths: dict, rounds: int) -> dict:
    """Each pair's cost table (``paths``: calibrated by its warm-up run) measured again ``rounds`` times, the pairs
    interleaved: every table gets the median of all rounds' target costs (the same target) and its draft's median
    draft and catch-up costs, so calibration noise does not price one draft against the other."""
    from dataclasses import asdict

    from hf_adaspec.config import SpeculationConfig
    from hf_adaspec.costs.table import measure
    from hf_adaspec.files import read_json_verified, write_json_verified

    n_max = SpeculationConfig().max_speculative_tokens + 1
    runs: dict[str, list] = {m: [] for m in drafts}
    for _ in range(rounds):
        for m, lm in drafts.items():
            runs[m].append(measure(target, lm.model, n_max))
    every = [t for tables in runs.values() for t in tables]
    verify = [statistics.median(t.verify_ms[i] for t in every) for i in range(len(every[0].verify_ms))]
    report = {}
    for m in drafts:
        table = {**asdict(runs[m][0]), "verify_ms": verify, "key": read_json_verified(paths[m])["key"]}
        table["draft_ms"] = statistics.median(t.draft_ms for t in runs[m])
        table["draft_catchup_ms"] = statistics.median(t.draft_catchup_ms for t in runs[m])
        write_json_verified(paths[m], table)
        report[m] = {"draft_ms": round(table["draft_ms"], 3), "verify_1_ms": round(verify[0], 3)}
    return report


def ab(
    target: str, draft: str, sizes: list[int], max_new_tokens: int, per_category: int, offset: int, rounds: int
) -> dict:
    """``adaptive`` with the full-head draft and with each ranked one, plain and plain again (A/A), interleaved per
    prompt (order rotating from ``offset``), one learned state per method across the prompts; after one short
    ``adaptive`` run per draft on another prompt (each draft's costs are calibrated then), and the tables measured
    again ``rounds`` times interleaved (``_controlled_costs``)."""
    from hf_adaspec import SpeculationState, enable
    from hf_adaspec.bench.bench import divergence_gap
    from hf_adaspec.bench.prompts import SPEC_BENCH, load_prompts

    tgt = load(target, quantization="q4", quantize_lm_head=True)  # what `auto` chooses on these CPUs
    drafts = {"adaptive": load(draft, quantization="q4", quantize_lm_head=True)}
    drafts.update(
        {f"adaptive-ranked-{n}": load(draft, quantization="q4", quantize_lm_head=True, ranked_vocab=n) for n in sizes}
    )
    enable(tgt.model)
    warm = tgt.tokenizer.apply_chat_template(
        [{"role": "user", "content": "Write a Python function that reverses a list."}],
        add_generation_prompt=True,
        return_tensors="pt",
        return_dict=True,
    )
    from hf_adaspec.costs.cache import CostCache

    paths = {}
    for m, lm in drafts.items():  # each pair's first use calibrates its table: the file it adds is its own
        before = set(CostCache().root.glob("*.json"))
        tgt.model.generate(**warm, assistant_model=lm.model, speculation="adaptive", max_new_tokens=32)
        new = set(CostCache().root.glob("*.json")) - before
        if len(new) != 1:
            raise RuntimeError(f"{m}'s warm-up added {len(new)} cost tables; run with an empty $HF_ADASPEC_CACHE/costs")
        paths[m] = new.pop()
    costs = _controlled_costs(tgt.model, drafts, paths, rounds)
    print("costs", costs, flush=True)
    methods = ["plain", "plain-again", *drafts]
    states = {m: SpeculationState() for m in drafts}
    rates: dict[str, list[float]] = {m: [] for m in methods}
    gaps: dict[str, list] = {m: [] for m in drafts}
    prompts = load_prompts(SPEC_BENCH, per_category, split="held-out")
    for i, prompt in enumerate(prompts):
        inputs = tgt.tokenizer.apply_chat_template(
            prompt.messages(), add_generation_prompt=True, return_tensors="pt", return_dict=True
        )
        r = (i + offset) % len(methods)
        outs = {}
        for m in methods[r:] + methods[:r]:
            kwargs = {} if m not in drafts else {"assistant_model": drafts[m].model, "speculation": "adaptive"}
            if m in drafts:
                kwargs["speculation_state"] = states[m]
            rate, outs[m] = _tokens_per_s(tgt.model, inputs, kwargs, max_new_tokens)
            rates[m].append(rate)
        for m in drafts:
            gaps[m].append(divergence_gap(tgt.model, outs["plain"], outs[m]))
        print(prompt.category, {m: round(v[-1], 2) for m, v in rates.items()}, flush=True)
    geo = {m: math.exp(statistics.fmean(math.log(a / b) for a, b in zip(v, rates["plain"]))) for m, v in rates.items()}
    return {
        "formats": {m: lm.format_label for m, lm in drafts.items()},
        "costs": costs,
        "prompts": len(prompts),
        "max_new_tokens": max_new_tokens,
        "vs_plain_geomean": {m: round(v, 4) for m, v in geo.items()},
        "tokens_per_s": {m: [round(x, 3) for x in v] for m, v in rates.items()},
        "greedy_gaps_vs_plain": gaps,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("what", choices=("rank", "cost", "acceptance", "ab"))
    ap.add_argument("--target", default="qwen2.5-coder-1.5b")
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--per-category", type=int, default=1)
    ap.add_argument("--offset", type=int, default=0, help="ab: the first prompt's rotation of the methods")
    ap.add_argument("--model", "--draft", dest="draft", default="qwen2.5-coder-0.5b")
    ap.add_argument("--code-chars", type=int, default=4_000_000)
    ap.add_argument("--output", type=Path, default=None, help="rank: where (default: package data)")
    ap.add_argument("--words", type=Path, default=None, help="rank: wordfreq's data/large_en.msgpack.gz")
    ap.add_argument("--sizes", type=int, nargs="+", default=[16384, 32768, 65536])
    ap.add_argument("--context", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=15, help="cost: timed rounds; ab: cost-table rounds")
    ap.add_argument("--traces", type=Path, default=Path("benchmarks/traces"))
    ap.add_argument("--k", type=int, default=5)
    args = ap.parse_args()
    if args.what == "rank":
        from hf_adaspec.models.loading import source

        tokenizer = transformers.AutoTokenizer.from_pretrained(source(args.draft).meta())
        print(json.dumps(make_ranking(tokenizer, args.code_chars, args.words, args.output or package_path(tokenizer))))
        return
    if args.what == "ab":
        result = ab(
            args.target, args.draft, args.sizes, args.max_new_tokens, args.per_category, args.offset, args.rounds
        )
        print(json.dumps({"what": "ab", "processor": processor_name(), "offset": args.offset, "result": result}))
        return
    lm = load(args.draft, quantization="q4", quantize_lm_head=True)
    if args.what == "cost":
        result = cost(lm.model, lm.tokenizer, args.sizes, args.context, args.rounds)
    else:
        result = acceptance(lm.model, lm.tokenizer, args.sizes, args.traces, args.k)
    meta = {"what": args.what, "draft": args.draft, "processor": processor_name(), "threads": torch.get_num_threads()}
    print(json.dumps({**meta, "context": args.context, "result": result}))


if __name__ == "__main__":
    main()
