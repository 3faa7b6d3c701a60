"""The engine's own time per decoding step, outside the model forwards, against a base commit (issue 70's yardstick).

What is measured (all on a CPU, one torch thread, float32, greedy, batch size 1):

- ``overhead_ms_per_step``: per step, the wall time between two consecutive ``speculation_callback`` calls minus
  the time spent inside the target's and the draft's forwards in between (forward pre/post hooks on the top-level
  modules, which the engine calls as ``model(...)`` in ``hf_compat.raw_forward``), in ms; the median over the
  steps of a worker's requests (the first ``--skip-steps`` steps of each request left out), then the median over
  rounds. The clock (``--clock``) is the worker's CPU time by default: with one torch thread every step's work is
  on that thread, and other processes on a shared machine move CPU time far less than wall time. Two kinds of step:
  ``plain``: the k = 0 steps of ``speculation="adaptive"`` with a draft that never agrees (most steps plain: what
  the never-loses case runs; decisions, resting and the slowdown ledger included);
  ``speculative``: the steps of ``speculation="fixed", num_speculative_tokens=4`` with a draft that always agrees
  (a copy of the target's weights: every step drafts 4 tokens and emits 5).
  Also reported, not part of the bar: ``plain_no_draft`` (``speculation="fixed", num_speculative_tokens=0``
  without a draft: the loop's plain step with no decision) and each kind's forward ms and step wall ms.
- ``never_agree_vs_transformers``: the wall time of transformers' own ``generate`` (``do_sample=False``, on a
  module that was never ``enable``d and holds the target's own weight tensors: the same weights in the same memory,
  as a user's one model with and without speculation; two copies of the weights run at speeds that differ by where
  their memory landed) divided by that of the enabled target's
  ``generate(..., assistant_model=<never-agreeing draft>, speculation="adaptive")`` (no hooks on either), the two
  interleaved ``--ratio-repeats`` times per worker (order alternating), medians; then the median over rounds.
  Above 1: ``adaptive`` is faster. Issue 70's bar: >= 0.98. (Also reported: the median of the pairs' own ratios,
  ``never_agree_vs_transformers_pairwise``, which a slow drift of the machine's speed moves less.)
- ``adaptive_request_ms``: where a never-agreeing ``adaptive`` request's time goes (the mean over the worker's
  timed requests of the ``plain`` kind, with hooks, then the median over rounds): ``total``, ``to_first_token``
  (generate's start to the prefill token's callback) and the ``..._forwards`` in it, the sums over every step of
  the time outside and inside forwards, and ``after_last_step``; to compare with ``transformers_ms``.
- ``never_draft_acceptance``: the never-agreeing draft's acceptance rate in one untimed request of
  ``speculation="fixed", num_speculative_tokens=4`` (``adaptive`` itself rarely drafts with it, so its own
  records seldom say); per worker, then the median over rounds.

The pair, built in each worker from configs with fixed seeds (no downloads): the target a Llama (32,000-token
vocabulary, 4 layers, 256 wide, 4 heads / 2 key-value heads, weights N(0, 0.5) so greedy text varies), the draft
the same family with 2 layers, 128 wide and another seed (its measured acceptance is reported). No EOS: every
request generates exactly ``--max-new-tokens``. The prompt: 64 random ids (fixed seed). Every timed request starts
from a fresh ``SpeculationState``; one untimed request per configuration comes first in each worker, so the cost
calibration the library runs at a pair's first use (cached under ``$HF_ADASPEC_CACHE``, one temporary folder per
version shared by its rounds; its time is reported as ``warmup_s``) is not timed.

Versions: ``head`` is this checkout's ``hf_adaspec/`` as it is on disk (uncommitted edits included), copied to a
temporary folder when the run starts so that edits made while it runs do not reach it (``--head <commit>``: that
commit's tree instead); ``base`` is commit ``--base`` extracted with ``git archive``. Each measurement is one fresh
worker process (``<python> <this file> --worker``) with the version's folder first on ``PYTHONPATH``; the worker
checks ``hf_adaspec.__file__``. Rounds interleave the versions (base then head, the order alternating each round).
Only ``speculation`` and ``num_speculative_tokens`` are passed (both versions' ``SpeculationConfig`` have them; a
worker stops, naming it, at a keyword its version lacks); the head's ``max_slowdown`` is left at its default.

Output: one line per worker result while it runs; the full result (per-round values, machine facts, commits) in
``benchmarks/results/engine_overhead/<UTC time>-<head commit>.json`` (``--output`` to change), and as the last
stdout line one JSON object.

    python benchmarks/engine_overhead.py --base 7736f8b
    python benchmarks/engine_overhead.py --base 7736f8b --rounds 2 --max-new-tokens 64   # a quick check
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import UTC, datetime
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results" / "engine_overhead"
CPU_FLAGS = ("avx2", "avx512f", "avx512_vnni", "avx_vnni", "avx512_bf16", "amx_tile")
SPEC_K = 4  # proposal length of the speculative measurement


# ----------------------------------------------------------------------------------------------------- worker


def _models(job: dict):
    """(target, hf_target, never_draft, agree_draft): float32, eval, built from configs with fixed seeds."""
    import copy

    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    def build(seed: int, layers: int, hidden: int, intermediate: int):
        config = LlamaConfig(
            vocab_size=32000,
            hidden_size=hidden,
            intermediate_size=intermediate,
            num_hidden_layers=layers,
            num_attention_heads=4,
            num_key_value_heads=2,
            max_position_embeddings=1024,
            initializer_range=job["init_std"],
            eos_token_id=None,
            bos_token_id=None,
            pad_token_id=0,
            tie_word_embeddings=False,
        )
        config._attn_implementation = "sdpa"
        torch.manual_seed(seed)
        model = LlamaForCausalLM(config).float().eval()
        model.generation_config.eos_token_id = None
        model.generation_config.bos_token_id = None
        model.generation_config.pad_token_id = 0
        return model

    target = build(job["seed"], 4, 256, 688)
    never = build(job["seed"] + 1, 2, 128, 344)
    agree = copy.deepcopy(target)  # α = 1: the same weights, its own storage
    hf_target = build(job["seed"], 4, 256, 688)  # transformers' generate: its own modules, never enabled,
    hf_target.load_state_dict(target.state_dict(), assign=True)  # over the target's weight tensors
    assert all(a.data_ptr() == b.data_ptr() for a, b in zip(hf_target.parameters(), target.parameters(), strict=True))
    return target, hf_target, never, agree


_CLOCKS = {"thread": time.thread_time, "wall": time.perf_counter}
_now = time.thread_time  # the step clock; the worker sets it from --clock


class _ForwardClock:
    """Seconds spent inside the forwards of the hooked top-level modules (pre/post forward hooks), by ``_now``."""

    def __init__(self, models) -> None:
        self.inside = 0.0
        self._start: list[float] = []
        self._handles = []
        for m in models:
            self._handles.append(m.register_forward_pre_hook(self._pre))
            self._handles.append(m.register_forward_hook(self._post))

    def _pre(self, module, args) -> None:
        self._start.append(_now())

    def _post(self, module, args, output) -> None:
        self.inside += _now() - self._start.pop()

    def remove(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles = []


class _StepTimer:
    """A ``speculation_callback``: each step's wall time (between consecutive callbacks, the callback's own time
    left out), its time inside forwards, and its record."""

    def __init__(self, clock: _ForwardClock) -> None:
        self.clock = clock
        self.steps: list[tuple[float, float, object]] = []  # (wall s, forward s, record)
        self._t = None
        self._inside = 0.0
        self.start = self.end = self.first = 0.0  # generate's start and return, the prefill token's callback
        self.start_inside = self.first_inside = 0.0

    def __call__(self, record, tokens) -> None:
        now = _now()
        if record is not None and self._t is not None:
            self.steps.append((now - self._t, self.clock.inside - self._inside, record))
        elif record is None:
            self.first, self.first_inside = now, self.clock.inside
        self._inside = self.clock.inside
        self._t = _now()

    def breakdown(self) -> dict[str, float]:
        """One request's ms: all of it, up to the prefill token's callback (and the forwards in it), the steps'
        time outside and inside forwards (every step), and from the last callback to generate's return."""
        return {
            "total": 1000.0 * (self.end - self.start),
            "to_first_token": 1000.0 * (self.first - self.start),
            "to_first_token_forwards": 1000.0 * (self.first_inside - self.start_inside),
            "steps_outside_forwards": 1000.0 * sum(w - f for w, f, _ in self.steps),
            "steps_forwards": 1000.0 * sum(f for _, f, _ in self.steps),
            "after_last_step": 1000.0 * (self.end - self._t),
        }


def _median(xs):
    return statistics.median(xs) if xs else float("nan")


def _worker(job: dict) -> dict:
    global _now
    import torch

    _now = _CLOCKS[job["clock"]]
    torch.set_num_threads(1)
    import hf_adaspec

    file = Path(hf_adaspec.__file__).resolve()
    if not file.is_relative_to(Path(job["tree"]).resolve()):
        raise SystemExit(f"worker for {job['tree']} imported hf_adaspec from {file}: wrong tree")
    fields = {f.name for f in dataclasses.fields(hf_adaspec.SpeculationConfig)}
    state_cls = getattr(hf_adaspec, "SpeculationState", None)
    if state_cls is None:
        from hf_adaspec.engine.run import SpeculationState as state_cls

    target, hf_target, never, agree = _models(job)
    hf_adaspec.enable(target)
    gen = torch.Generator().manual_seed(job["seed"] + 100)
    input_ids = torch.randint(3, 32000, (1, job["prompt_tokens"]), generator=gen)
    base_kwargs = {
        "input_ids": input_ids,
        "attention_mask": torch.ones_like(input_ids),
        "do_sample": False,
        "max_new_tokens": job["max_new_tokens"],
    }

    def spec(**kw):
        missing = [k for k in kw if k not in fields and k not in ("speculation", "assistant_model")]
        if missing:
            raise SystemExit(f"this version's SpeculationConfig has no {missing}")
        return kw

    configs = {
        "plain": spec(speculation="adaptive", assistant_model=never),
        "speculative": spec(speculation="fixed", num_speculative_tokens=SPEC_K, assistant_model=agree),
        "plain_no_draft": spec(speculation="fixed", num_speculative_tokens=0),
    }

    def run(model, kw, callback=None):
        extra = {}
        if "speculation" in kw:
            extra["speculation_state"] = state_cls()
            if callback is not None:
                extra["speculation_callback"] = callback
        if callback is not None:
            callback.start_inside = callback.clock.inside
        start, step_start = time.perf_counter(), _now()
        out = model.generate(**base_kwargs, **kw, **extra)
        end, step_end = time.perf_counter(), _now()
        if callback is not None:
            callback.start, callback.end = step_start, step_end  # the breakdown is on the step clock
        return end - start, out  # wall seconds: what the ratio against transformers compares

    warm = {}
    outputs = {}
    for name, kw in {"transformers": {}, **configs}.items():  # calibration and first calls, untimed
        start = time.perf_counter()
        _, out = run(hf_target if name == "transformers" else target, kw)
        warm[name] = round(time.perf_counter() - start, 3)
        outputs[name] = out[0, input_ids.shape[1] :].tolist()
    probe = _StepTimer(_ForwardClock([]))  # the never-agreeing draft's acceptance, where it drafts every step
    run(target, spec(speculation="fixed", num_speculative_tokens=SPEC_K, assistant_model=never), probe)
    drafted = sum(rec.k for _, _, rec in probe.steps)
    never_acceptance = sum(rec.accepted for _, _, rec in probe.steps) / drafted
    new = outputs["transformers"]
    if len(new) != job["max_new_tokens"]:
        raise SystemExit(f"transformers generated {len(new)} tokens, not {job['max_new_tokens']}")
    same = {name: outputs[name] == new for name in configs}

    clock = _ForwardClock([target, never, agree])
    steps = {name: [] for name in configs}
    requests = []  # the "plain" (never-agreeing adaptive) requests' breakdowns
    for r in range(job["requests"]):
        for name in list(configs) if r % 2 == 0 else list(reversed(configs)):
            timer = _StepTimer(clock)
            run(target, configs[name], timer)
            steps[name].extend(timer.steps[job["skip_steps"] :])
            if name == "plain":
                requests.append(timer.breakdown())
    clock.remove()

    result = {
        "file": str(file),
        "warmup_s": warm,
        "never_draft_acceptance": never_acceptance,
        "greedy_equal_to_transformers": same,
        "distinct_tokens": len(set(new)),
        "overhead_ms_per_step": {},
        "forward_ms_per_step": {},
        "step_ms": {},
        "steps": {},
        "acceptance": {},
        "adaptive_request_ms": {key: statistics.fmean(b[key] for b in requests) for key in requests[0]},
    }
    for name, rows in steps.items():
        kind = [s for s in rows if (s[2].k == 0) == (name != "speculative")]
        result["overhead_ms_per_step"][name] = 1000.0 * _median([w - f for w, f, _ in kind])
        result["forward_ms_per_step"][name] = 1000.0 * _median([f for _, f, _ in kind])
        result["step_ms"][name] = 1000.0 * _median([w for w, _, _ in kind])
        result["steps"][name] = {"counted": len(kind), "all": len(rows)}
        by_drafter: dict[str, list[int]] = {}
        for _, _, rec in rows:
            if rec.k > 0:
                acc = by_drafter.setdefault(rec.drafter, [0, 0])
                acc[0] += rec.accepted
                acc[1] += rec.k
        result["acceptance"][name] = {
            d: {"accepted": a, "drafted": k, "rate": a / k} for d, (a, k) in by_drafter.items()
        }

    hf_ms, ad_ms = [], []
    for r in range(job["ratio_repeats"]):
        order = ("transformers", "adaptive") if r % 2 == 0 else ("adaptive", "transformers")
        for name in order:
            if name == "transformers":
                hf_ms.append(1000.0 * run(hf_target, {})[0])
            else:
                ad_ms.append(1000.0 * run(target, configs["plain"])[0])
    result["transformers_ms"] = _median(hf_ms)
    result["adaptive_never_agree_ms"] = _median(ad_ms)
    result["never_agree_vs_transformers"] = result["transformers_ms"] / result["adaptive_never_agree_ms"]
    result["never_agree_vs_transformers_pairwise"] = _median([h / a for h, a in zip(hf_ms, ad_ms)])
    return result


# ------------------------------------------------------------------------------------------------------- driver


def _git(*args: str) -> str:
    return subprocess.run(["git", "-C", str(ROOT), *args], check=True, capture_output=True, text=True).stdout


def _snapshot_head(dest: Path, source: Path | None) -> str:
    """Copy ``source``'s ``hf_adaspec/`` to ``dest`` (None: it is there already); return a short hash of the
    contents of the files of ``dest/hf_adaspec``."""
    if source is not None:
        shutil.copytree(
            source / "hf_adaspec", dest / "hf_adaspec", ignore=shutil.ignore_patterns("__pycache__", "*.pyc")
        )
    digest = hashlib.sha256()
    for path in sorted((dest / "hf_adaspec").rglob("*")):
        if path.is_file():
            digest.update(str(path.relative_to(dest)).encode() + b"\0" + path.read_bytes())
    return digest.hexdigest()[:12]


def _extract(commit: str, dest: Path) -> None:
    """Commit ``commit``'s tree into ``dest`` (``git archive | tar -x``)."""
    dest.mkdir(parents=True)
    archive = subprocess.Popen(["git", "-C", str(ROOT), "archive", commit], stdout=subprocess.PIPE)
    subprocess.run(["tar", "-x", "-C", str(dest)], stdin=archive.stdout, check=True)
    if archive.wait() != 0:
        raise SystemExit(f"git archive {commit} failed")


def _machine() -> dict:
    facts = {"python": platform.python_version(), "cpu_count": os.cpu_count()}
    try:
        text = Path("/proc/cpuinfo").read_text()
        facts["cpu"] = next(
            (line.split(":", 1)[1].strip() for line in text.splitlines() if line.startswith("model name")),
            platform.processor(),
        )
        flags = next((line.split(":", 1)[1].split() for line in text.splitlines() if line.startswith("flags")), [])
        facts["cpu_flags"] = [f for f in CPU_FLAGS if f in flags]
    except OSError:
        facts["cpu"] = platform.processor()
    versions = subprocess.run(
        [sys.executable, "-c", "import torch, transformers; print(torch.__version__, transformers.__version__)"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.split()
    facts["torch"], facts["transformers"] = versions
    return facts


def _run_worker(tree: Path, cache: Path, job: dict) -> dict:
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(tree), *filter(None, [os.environ.get("PYTHONPATH")])]),
        "HF_ADASPEC_CACHE": str(cache),
        "OMP_NUM_THREADS": "1",
        "MKL_NUM_THREADS": "1",
        "TOKENIZERS_PARALLELISM": "false",
    }
    env.pop("HF_ADASPEC_PROFILE", None)
    done = subprocess.run(
        [sys.executable, str(Path(__file__).resolve()), "--worker", json.dumps({**job, "tree": str(tree)})],
        cwd=tree,
        env=env,
        capture_output=True,
        text=True,
    )
    if done.returncode != 0:
        sys.stderr.write(done.stderr[-4000:])
        raise SystemExit(f"worker in {tree} failed (exit {done.returncode})")
    return json.loads(done.stdout.strip().splitlines()[-1])


def _summary(rounds: list[dict]) -> dict:
    med = lambda key, name: round(_median([r[key][name] for r in rounds]), 4)  # noqa: E731
    return {
        "overhead_ms_per_step": {n: med("overhead_ms_per_step", n) for n in ("plain", "speculative", "plain_no_draft")},
        "forward_ms_per_step": {n: med("forward_ms_per_step", n) for n in ("plain", "speculative", "plain_no_draft")},
        "step_ms": {n: med("step_ms", n) for n in ("plain", "speculative", "plain_no_draft")},
        "never_agree_vs_transformers": round(_median([r["never_agree_vs_transformers"] for r in rounds]), 4),
        "never_agree_vs_transformers_pairwise": round(
            _median([r["never_agree_vs_transformers_pairwise"] for r in rounds]), 4
        ),
        "never_draft_acceptance": round(_median([r["never_draft_acceptance"] for r in rounds]), 4),
        "transformers_ms": round(_median([r["transformers_ms"] for r in rounds]), 2),
        "adaptive_never_agree_ms": round(_median([r["adaptive_never_agree_ms"] for r in rounds]), 2),
        "adaptive_request_ms": {k: med("adaptive_request_ms", k) for k in rounds[0]["adaptive_request_ms"]},
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "--base",
        default="7736f8b",
        help="the commit to compare this checkout with (default: "
        "7736f8b, issue 70's base); extracted with git archive into a temporary folder",
    )
    parser.add_argument(
        "--head",
        help="a commit to measure as the head instead of this checkout's hf_adaspec/ as "
        "it is on disk (default: the working tree, copied when the run starts)",
    )
    parser.add_argument(
        "--rounds",
        type=int,
        default=5,
        help="rounds; each runs one worker per version, base and "
        "head alternating who goes first (default 5); figures are medians over rounds",
    )
    parser.add_argument(
        "--max-new-tokens",
        type=int,
        default=128,
        help="tokens each request generates (no EOS: exactly this many; default 128)",
    )
    parser.add_argument("--prompt-tokens", type=int, default=64, help="random prompt ids (default 64)")
    parser.add_argument(
        "--requests",
        type=int,
        default=3,
        help="timed requests per step kind per worker, the step kinds interleaved (default 3)",
    )
    parser.add_argument(
        "--ratio-repeats",
        type=int,
        default=5,
        help="timed transformers/adaptive pairs per worker for never_agree_vs_transformers (default 5)",
    )
    parser.add_argument(
        "--skip-steps",
        type=int,
        default=4,
        help="first steps of each request left out of the per-step figures (default 4)",
    )
    parser.add_argument(
        "--seed",
        type=int,
        default=0,
        help="the target's weight seed; the draft's is seed + 1, the prompt's seed + 100 (default 0)",
    )
    parser.add_argument(
        "--init-std",
        type=float,
        default=0.5,
        help="weights' initializer_range: large enough that greedy text of the random target varies (default 0.5)",
    )
    parser.add_argument(
        "--output",
        type=Path,
        help="where the full JSON goes (default: benchmarks/results/engine_overhead/<UTC time>-<head commit>.json)",
    )
    parser.add_argument(
        "--clock",
        choices=sorted(_CLOCKS),
        default="thread",
        help="the clock of a step's time and its forwards: thread (the worker's CPU time: one torch thread does "
        "all the work, and other processes on the machine move it far less than wall time) or wall (default thread)",
    )
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        print(json.dumps(_worker(json.loads(args.worker))))
        return

    started = time.perf_counter()
    job = {
        "seed": args.seed,
        "init_std": args.init_std,
        "prompt_tokens": args.prompt_tokens,
        "max_new_tokens": args.max_new_tokens,
        "requests": args.requests,
        "ratio_repeats": args.ratio_repeats,
        "skip_steps": args.skip_steps,
        "clock": args.clock,
    }
    head_commit = _git("rev-parse", "--verify", (args.head or "HEAD") + "^{commit}").strip()
    base_commit = _git("rev-parse", "--verify", args.base + "^{commit}").strip()
    dirty = [] if args.head else [line[3:] for line in _git("status", "--porcelain", "--", "hf_adaspec").splitlines()]
    rounds: dict[str, list[dict]] = {"base": [], "head": []}
    with tempfile.TemporaryDirectory(prefix="engine_overhead_") as tmp:
        trees = {"base": Path(tmp) / "base", "head": Path(tmp) / "head"}
        _extract(base_commit, trees["base"])
        if args.head:
            _extract(head_commit, trees["head"])
        head_hash = _snapshot_head(trees["head"], ROOT if not args.head else None)
        caches = {v: Path(tmp) / f"cache_{v}" for v in trees}
        where = "its tree" if args.head else f"hf_adaspec/ as on disk, {len(dirty)} paths differ from the commit"
        print(f"head {head_commit[:9]} ({where}, content {head_hash}); base {base_commit[:9]}", flush=True)
        for r in range(args.rounds):
            for v in ("base", "head") if r % 2 == 0 else ("head", "base"):
                t0 = time.perf_counter()
                out = _run_worker(trees[v], caches[v], job)
                out["worker_s"] = round(time.perf_counter() - t0, 1)
                rounds[v].append(out)
                o = out["overhead_ms_per_step"]
                print(
                    f"round {r} {v}: overhead ms/step plain {o['plain']:.3f} speculative {o['speculative']:.3f} "
                    f"(no draft {o['plain_no_draft']:.3f}); forward ms plain "
                    f"{out['forward_ms_per_step']['plain']:.3f}; never-agree vs transformers "
                    f"{out['never_agree_vs_transformers']:.3f}; never-agreeing draft: acceptance "
                    f"{out['never_draft_acceptance']:.3f} at fixed k={SPEC_K}, drafts in adaptive "
                    f"{json.dumps(out['acceptance']['plain'])}"
                    f"; warm-up {sum(out['warmup_s'].values()):.1f} s; worker {out['worker_s']} s",
                    flush=True,
                )
    summaries = {v: _summary(rs) for v, rs in rounds.items()}
    result = {
        "overhead_ms_per_step": {
            v: {k: s["overhead_ms_per_step"][k] for k in ("plain", "speculative")} for v, s in summaries.items()
        },
        "never_agree_vs_transformers": {v: s["never_agree_vs_transformers"] for v, s in summaries.items()},
        "head_over_base": {
            k: round(summaries["head"]["overhead_ms_per_step"][k] / summaries["base"]["overhead_ms_per_step"][k], 3)
            for k in ("plain", "speculative")
        },
        "head_over_base_per_forward_ms": _per_forward(rounds),
        "commits": {"head": head_commit, "head_dirty_files": dirty, "head_content": head_hash, "base": base_commit},
        "settings": {**job, "rounds": args.rounds, "speculative_k": SPEC_K},
        "machine": _machine(),
        "summary": summaries,
        "rounds": {v: [{k: x for k, x in r.items() if k != "file"} for r in rs] for v, rs in rounds.items()},
        "wall_s": round(time.perf_counter() - started, 1),
    }
    stamp = datetime.now(UTC).strftime("%Y%m%dT%H%M%SZ")
    path = args.output or RESULTS / f"{stamp}-{head_commit[:7]}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp_path = path.with_name(path.name + ".tmp")
    tmp_path.write_text(json.dumps(result, indent=1) + "\n")
    os.replace(tmp_path, path)
    print(f"written {path}", flush=True)
    result["never_draft_acceptance"] = {v: s["never_draft_acceptance"] for v, s in summaries.items()}
    print(
        json.dumps(
            {
                k: result[k]
                for k in (
                    "overhead_ms_per_step",
                    "never_agree_vs_transformers",
                    "head_over_base",
                    "head_over_base_per_forward_ms",
                    "never_draft_acceptance",
                    "commits",
                    "wall_s",
                )
            }
        )
    )


def _per_forward(rounds: dict[str, list[dict]]) -> dict[str, float]:
    """Head over base of the overhead per ms of the forwards it sits between (each round's overhead over its own
    forward ms, medians over rounds): a ratio the machine's speed, which moves both alike within a worker, moves
    less than the ms themselves."""
    share = {
        v: {
            k: _median([r["overhead_ms_per_step"][k] / r["forward_ms_per_step"][k] for r in rs])
            for k in ("plain", "speculative")
        }
        for v, rs in rounds.items()
    }
    return {k: round(share["head"][k] / share["base"][k], 3) for k in ("plain", "speculative")}


if __name__ == "__main__":
    main()
