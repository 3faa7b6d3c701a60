"""Issue 71's bars on this machine in one resumable run: set-up and suite times from a fresh clone, then hf-adaspec
beside llama.cpp (built here by the anchor script, ``--isa native`` by default) on the demo prompt, held-out
Spec-Bench and held-out code, the verification curve, and the step's diagnostics; at the end each bar with its
figure and whether it is met.

Each step runs one command of the project (``STEPS``), its output in ``OUT/logs/STEP.log``, and records what it
measured in ``OUT/steps/STEP.json`` (written atomically); a step recorded as finished is not run again (a failed
one is), so an interrupted run goes on where it stopped (``--redo STEP`` runs one again). The set-up steps time
what a user runs: ``git clone`` of this checkout's HEAD into a temporary folder, ``make demo`` there with an empty
model cache and pip's cache off (install included), then ``make test``, then the fast suite. The rest runs from
this checkout with its ``.venv`` (``make install`` first). Run it alone on the machine (two model processes on 2
cores slow each other). Before each step it prints the step's planned time and the run's remaining time (the plan:
each step's time on the 2-core AVX2-only EPYC where the issue was measured; about 3.5 hours in all). The bars are
meant for a CPU with AVX2 and no AVX-512: elsewhere it stops unless ``--any-cpu`` (with ``--isa avx2`` and the AVX2
path reproduced, ``benchmarks/avx2``, it checks the run's plumbing on another CPU, not the bars).

    python benchmarks/cpu_bars.py --out benchmarks/results/<cpu>-<date> [--steps demo,test,fast,...] [--any-cpu]

Last line: one JSON object (the commit, the processor and its flags, each bar's figure, bound and verdict, each
step's seconds).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from step_profile import _cpu_flags  # benchmarks/, on sys.path when this script runs

from hf_adaspec.machine import processor_name

ROOT = Path(__file__).resolve().parents[1]
WORK = Path(tempfile.gettempdir()) / "hf-adaspec-cpu-bars"  # the set-up steps' clone (p/) and model cache (cache/)


@dataclass(frozen=True)
class Step:
    name: str
    planned_s: int  # on the 2-core AVX2-only EPYC (issue 71's measurements)
    command: str  # run by bash in ``where``; {out}, {bin}, {threads}, {py}, {isa} filled in
    where: str = "root"  # "root": this checkout; "clone": the fresh clone
    result: str = ""  # a file the command writes (under OUT), else its last stdout line is its JSON


PY = ".venv/bin/python"
BESIDE = "{py} benchmarks/llama_cpp_prompts.py --beside --max-new-tokens 256 --threads {threads} --bin {bin}"
STEPS = (
    Step("demo", 485, "make demo", "clone"),
    Step("test", 3240, "make test", "clone"),
    Step("fast", 140, '.venv/bin/python -m pytest -q -m "not slow and not browser" -n auto', "clone"),
    Step(
        "llama",
        480,
        "ISA={isa} ../shared/tools/llama_cpp_anchor.sh {out}/llama_cpp_anchor.json",
        "root",
        "llama_cpp_anchor.json",
    ),
    Step(
        "demo_beside",
        900,
        "{py} benchmarks/side_by_side.py --anchor {out}/llama_cpp_anchor.json --llama-cpp-bin {bin} --repeats 3",
    ),
    Step(
        "spec_bench",
        2400,
        BESIDE + " --split held-out --per-category 1 --output {out}/beside_spec_bench.json",
        "root",
        "beside_spec_bench.json",
    ),
    Step(
        "code",
        1500,
        BESIDE + " --prompts benchmarks/workloads/code.jsonl --split held-out --per-category 4 "
        "--output {out}/beside_code.json",
        "root",
        "beside_code.json",
    ),
    Step(
        "short",
        1200,
        BESIDE + " --split held-out --per-category 1 --categories qa,translation,extraction "
        "--repeats 11 --output {out}/beside_short.json",
        "root",
        "beside_short.json",
    ),
    Step(
        "verify",
        600,
        "{py} benchmarks/verify_curve.py --rounds 8 --llama-bench llama.cpp={bin}/llama-bench "
        "--out {out}/verify_curve.json",
        "root",
        "verify_curve.json",
    ),
    Step("kernel_ab", 600, "{py} benchmarks/kernel_ab.py --base 74df1df"),
    Step("step_profile", 300, "{py} benchmarks/step_profile.py --rounds 5"),
    Step("step_ab", 600, "{py} benchmarks/step_ab.py"),
    Step("decoder_ab", 600, "{py} benchmarks/decoder_ab.py"),
)


def commit() -> str:
    return subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True
    ).stdout.strip()


def pytest_counts(text: str) -> dict[str, int]:
    """pytest's closing line (``1 failed, 1209 passed, 3 skipped in 61.2s``) → {"failed": 1, "passed": 1209,
    "skipped": 3} ("errors" counted as "error")."""
    lines = [line for line in text.splitlines() if re.search(r"\b(passed|failed|error)s?\b.* in [0-9.]+s", line)]
    return (
        {word.removesuffix("s"): int(n) for n, word in re.findall(r"(\d+) (passed|failed|errors?|skipped)", lines[-1])}
        if lines
        else {}
    )


def run_step(step: Step, out: Path, isa: str) -> dict:
    """Runs ``step`` (its output in OUT/logs) → its record: seconds, exit status, what it measured. The demo step
    starts from a new clone and an empty model cache (``WORK``); the test and fast steps use what it left there."""
    clone = WORK / "p"
    if step.name == "demo" and WORK.exists():
        shutil.rmtree(WORK)
    if step.where == "clone" and not (clone / ".git").exists():
        subprocess.run(["git", "clone", "-q", str(ROOT), str(clone)], check=True)
    bin_ = Path.home() / f".cache/llama-cpp-anchor/build-{isa}/bin"  # where llama_cpp_anchor.sh builds
    command = step.command.format(out=out, bin=bin_, threads=os.cpu_count(), py=PY, isa=isa)
    env = dict(os.environ)
    if step.where == "clone":  # a new user's machine: no model cache, no pip cache
        env.update(HF_ADASPEC_CACHE=str(WORK / "cache"), PIP_NO_CACHE_DIR="1")
    log = out / "logs" / f"{step.name}.log"
    log.parent.mkdir(parents=True, exist_ok=True)
    start = time.monotonic()
    with open(log, "w") as f:
        rc = subprocess.run(
            ["bash", "-c", command],
            cwd=clone if step.where == "clone" else ROOT,
            env=env,
            stdout=f,
            stderr=subprocess.STDOUT,
        ).returncode
    seconds = round(time.monotonic() - start, 1)
    record = {"command": command, "commit": commit(), "where": step.where, "rc": rc, "seconds": seconds}
    text = log.read_text(errors="replace")
    if step.name in ("test", "fast"):
        record["pytest"] = pytest_counts(text)
    elif step.result:
        path = out / step.result
        record["result"] = json.loads(path.read_text()) if rc == 0 and path.exists() else None
    elif step.where == "root":
        last = text.strip().splitlines()[-1:] or [""]
        record["result"] = json.loads(last[0]) if rc == 0 and last[0].startswith("{") else None
    return record


def done(path: Path) -> bool:
    """Whether a step's record at ``path`` says it ran to the end (a failed step runs again)."""
    return path.exists() and json.loads(path.read_text())["rc"] == 0


def write_atomic(path: Path, doc: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(doc, indent=1))
    os.replace(tmp, path)


OVERALL = ("tokens_per_s", "overall")
BARS = (  # issue 71's done-when: (bar, the step and the keys of its figure, or the step whose seconds, bound)
    ("plain / llama.cpp plain, demo prompt", ("demo_beside", "interleaved", "plain_over_llama_cpp_plain"), ">= 1.0"),
    (
        "adaptive / llama.cpp plain, demo prompt",
        ("demo_beside", "interleaved", "adaptive_over_llama_cpp_plain"),
        ">= 1.0",
    ),
    ("plain / llama.cpp plain, held-out Spec-Bench", ("spec_bench", *OVERALL, "plain_over_llama_cpp_plain"), ">= 1.0"),
    (
        "adaptive / llama.cpp plain, held-out Spec-Bench",
        ("spec_bench", *OVERALL, "adaptive_over_llama_cpp_plain"),
        ">= 1.0",
    ),
    ("adaptive / llama.cpp plain, held-out code", ("code", *OVERALL, "adaptive_over_llama_cpp_plain"), ">= 1.5"),
    ("fresh make demo, s (install included)", ("demo",), "<= 240"),
    ("make test, s, no failure", ("test",), "<= 1800"),
    ("fast suite, s, no failure", ("fast",), "<= 60"),
)


def figure(records: dict[str, dict], step: str, *keys: str) -> float | None:
    """A bar's figure: the value at ``keys`` in ``step``'s result, or without keys the step's seconds where it
    exited 0 and pytest (if it ran) counted no failure or error; None where the step has not run or failed."""
    record = records.get(step)
    if not record or record["rc"] != 0:
        return None
    if not keys:
        counts = record.get("pytest", {})
        return None if counts.get("failed") or counts.get("error") else record["seconds"]
    doc = record.get("result")
    for key in keys:
        doc = doc.get(key) if isinstance(doc, dict) else None
    return doc


def bars(records: dict[str, dict]) -> list[dict]:
    """Each of ``BARS`` with its figure and verdict (met: None where the figure is missing)."""
    rows = []
    for name, (step, *keys), bound in BARS:
        value, (op, limit) = figure(records, step, *keys), bound.split()
        met = None if value is None else (value >= float(limit) if op == ">=" else value <= float(limit))
        rows.append({"bar": name, "figure": value, "bound": bound, "met": met})
    return rows


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path, required=True, help="folder for the logs, records and results")
    ap.add_argument("--steps", default=",".join(s.name for s in STEPS))
    ap.add_argument("--redo", default="", help="steps to run again though recorded")
    ap.add_argument("--any-cpu", action="store_true", help="run on a CPU with AVX-512 too (not the bars' CPU)")
    ap.add_argument("--isa", choices=("native", "avx2"), default="native", help="llama.cpp's build (anchor script)")
    args = ap.parse_args()
    flags = _cpu_flags()
    if not args.any_cpu and ("avx2" not in flags or any(f.startswith("avx512") for f in flags)):
        raise SystemExit(f"the bars are for a CPU with AVX2 and no AVX-512 (this one: {' '.join(flags)}); --any-cpu")
    wanted = args.steps.split(",")
    unknown = set(wanted) - {s.name for s in STEPS}
    if unknown:
        raise SystemExit(f"unknown steps {sorted(unknown)}; choose from {[s.name for s in STEPS]}")
    out = args.out.resolve()
    steps = [s for s in STEPS if s.name in wanted]
    records = {}
    for k, step in enumerate(steps):
        path = out / "steps" / f"{step.name}.json"
        if done(path) and step.name not in args.redo.split(","):
            records[step.name] = json.loads(path.read_text())
            continue
        left = sum(s.planned_s for s in steps[k:] if not done(out / "steps" / f"{s.name}.json"))
        print(
            f"[{k + 1}/{len(steps)}] {step.name}: planned {step.planned_s / 60:.0f} min, "
            f"the run's remaining {left / 60:.0f} min ({time.strftime('%H:%M')})",
            flush=True,
        )
        records[step.name] = run_step(step, out, args.isa)
        print(f"    {records[step.name]['seconds']:.0f} s, exit {records[step.name]['rc']}", flush=True)
        write_atomic(path, records[step.name])
    summary = {
        "commit": commit(),
        "steps_commits": {name: r.get("commit") for name, r in records.items()},
        "processor": processor_name(),
        "cpu_flags": flags,
        "bars": bars(records),
        "seconds": {name: r["seconds"] for name, r in records.items()},
        "failed_steps": [name for name, r in records.items() if r["rc"] != 0],
    }
    write_atomic(out / "bars.json", summary)
    for bar in summary["bars"]:
        print(f"{bar['bar']:50s} {bar['figure']!s:>10s} {bar['bound']:>8s}  {bar['met']}")
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
