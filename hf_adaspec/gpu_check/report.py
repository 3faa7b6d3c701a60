"""The GPU check's results: one JSON file and its markdown summary, both rewritten atomically after every
step, so a run cut off by its time limit still leaves what finished."""

from __future__ import annotations

import json
import math
from pathlib import Path

from ..files import atomic_write

RESULTS, SUMMARY = "gpu_check.json", "gpu_check.md"
REPLAY_METHODS = ("plain", "fixed-k", "adaptive", "adaptive-lookup")


def clean(value):
    """JSON-safe: non-finite floats as text, tuples as lists."""
    if isinstance(value, dict):
        return {str(k): clean(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [clean(v) for v in value]
    return str(value) if isinstance(value, float) and not math.isfinite(value) else value


def markdown(doc: dict) -> str:
    """The summary: one row per step, the profiles' step costs, the projections."""
    steps = doc["steps"]
    state = "finished" if doc.get("finished") else "in progress or cut off"
    head = f"Budget {doc['budget_s']:.0f} s, {state}; random weights."
    lines = [
        f"# hf-adaspec GPU check: {doc['device_label']}",
        "",
        head,
        "",
        "| step | status | s | result |",
        "|---|---|---|---|",
    ]
    for name, e in steps.items():
        where = f" (ran on {e['ran_on']})" if e.get("ran_on", doc["device_label"]) != doc["device_label"] else ""
        result = e.get("summary", e.get("error", ""))
        lines.append(f"| {name} | {e['status']} | {e.get('seconds', 0)} | {result}{where} |")
    measured = [e for e in steps.values() if "path" in e and "costs" in e]
    if measured:
        sizes = list(measured[0]["costs"])
        lines += [
            "",
            (
                f"Step costs, ms (profiles at context {measured[0]['context']}): the target's forward over 1 "
                "and 5 tokens / the draft's token"
            ),
            "",
            "| profile | " + " | ".join(sizes) + " |",
            "|---" * (1 + len(sizes)) + "|",
        ]
        lines += [
            f"| {Path(e['path']).parent.name} | "
            + " | ".join(f"{c['verify_ms_n1']} / {c['verify_ms_n5']} / {c['draft_ms']}" for c in e["costs"].values())
            + " |"
            for e in measured
        ]
    tables = steps.get("replay", {}).get("tables", {})
    if tables:
        lines += [
            "",
            (
                "Projections: speedup over plain by replay on the profiles above (predicted, not measured; "
                "acceptance of the CPU-traced Qwen2.5-Coder 1.5B/0.5B pair)"
            ),
            "",
            "| profile | batch | plain tokens/s | " + " | ".join(REPLAY_METHODS[1:]) + " |",
            "|---" * 6 + "|",
        ]
        lines += [
            f"| {name} | {b} | {r['plain_tokens_per_s']} | " + " | ".join(f"{r[m]}x" for m in REPLAY_METHODS[1:]) + " |"
            for name, rows in tables.items()
            for b, r in rows.items()
        ]
    return "\n".join(lines) + "\n"


def write_results(out: Path, doc: dict) -> None:
    """The results JSON, then its markdown summary (a summary that fails to render says so instead)."""
    data = clean(doc)
    atomic_write(out / RESULTS, lambda f: f.write(json.dumps(data, indent=1, allow_nan=False).encode()))
    try:
        text = markdown(data)
    except Exception as e:  # noqa: BLE001 - the JSON holds everything; the summary must not stop the run
        text = f"# hf-adaspec GPU check\n\nno summary ({type(e).__name__}: {e}); see {RESULTS}\n"
    atomic_write(out / SUMMARY, lambda f: f.write(text.encode()))
