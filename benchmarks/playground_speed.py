"""Does the playground keep the speed it shows? The page's adaptive and plain runs against the CLI's.

Runs, one after the other, never two at once:

1. the CLI right before: ``hf-adaspec generate PROMPT --speculation adaptive`` and ``--speculation off``
   (plain) with the pair's models, each in its own process (tokens/s from its stats line);
2. the app as a user starts it (``python app/app.py --pair PAIR --port PORT``), driven in Debian's
   headless Chromium through Playwright: the prompt, method adaptive, max new tokens, "compare with plain"
   ticked, Generate; it waits for the speedup and reads the stats line (adaptive tokens/s, plain tokens/s,
   speedup, median realized/predicted step time, the page's own server-side ms per update) and, from the
   DevTools protocol, how long the browser's renderer main thread was busy during the run;
3. the comparison: page speedup / CLI speedup, page adaptive tokens/s / CLI's, the median ratio, against
   issue 37's bars (>= 0.9, >= 0.8, within 15%).

    python benchmarks/playground_speed.py --pair qwen --max-new-tokens 192

The smollm2 pair is for debugging the script: the CLI cannot load its mixed pair (fp32 target, NF4
draft), so its CLI runs use the fp32 model as both (``cli_pair_matches_page`` says so). The last stdout
line is one JSON object.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PROMPT = "Write a Python function is_palindrome(s) with a docstring and tests."
CHROMIUM = os.environ.get("HF_ADASPEC_CHROMIUM", "/usr/bin/chromium")
CHROMIUM_ARGS = ["--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run", "--disable-sync",
                 "--disable-background-networking", "--disable-component-update"]
BARS = {"speedup_ratio": 0.9, "adaptive_tps_ratio": 0.8, "time_ratio_tolerance": 0.15}  # issue 37's done-when
STATS = {  # what the page's stats line says, as inner text
    "adaptive_tps": r"adaptive: \d+ tokens, ([\d.]+) tokens/s",
    "mean_accepted_length": r"mean accepted length ([\d.]+)",
    "plain_steps_pct": r"plain steps (\d+)%",
    "median_realized_over_predicted": r"realized/predicted ([\d.]+|n/a)",
    "plain_tps": r"plain decoding ([\d.]+) tokens/s",
    "speedup": r"speedup ([\d.]+)x",
    "ui_updates": r"page: (\d+) updates",
    "ui_ms_per_update": r"updates, ([\d.]+) ms server-side each",
}


def _number(pattern: str, text: str) -> float | None:
    """The first group of ``pattern`` in ``text`` as a float (None when absent or "n/a")."""
    match = re.search(pattern, text)
    return float(match.group(1)) if match and match.group(1) != "n/a" else None


def cli_args(pair: str) -> list[str]:
    """``hf-adaspec generate`` options loading the playground's pair ``pair`` (as close as the CLI can)."""
    from hf_adaspec.playground.playground import PAIRS

    spec = PAIRS[pair]
    return ["--target", spec.target, "--draft", spec.draft or "none", "--quantization", spec.quantization,
            "--dtype", spec.dtype]


def cli_matches_page(pair: str) -> bool:
    """Whether the CLI loads exactly the page's models (one quantization for both, LM head quantized)."""
    from hf_adaspec.playground.playground import PAIRS

    spec = PAIRS[pair]
    return spec.draft is None or (spec.draft_quantization == spec.quantization and spec.quantize_draft_head)


def run_cli(pair: str, prompt: str, max_new_tokens: int, speculation: str) -> dict:
    """One ``hf-adaspec generate`` in its own process; its tokens/s (and decisions, for adaptive)."""
    exe = Path(sys.executable).with_name("hf-adaspec")
    cmd = [str(exe), "generate", prompt, "--speculation", speculation, "--max-new-tokens", str(max_new_tokens),
           *cli_args(pair)]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, check=False)
    line = next((ln for ln in reversed(proc.stdout.splitlines()) if ln.startswith("[hf-adaspec]")), "")
    tps = _number(r"= ([\d.]+) tokens/s", line)
    if proc.returncode or tps is None:
        raise SystemExit(f"`{' '.join(cmd)}` failed (exit {proc.returncode}):\n{proc.stdout[-2000:]}{proc.stderr[-3000:]}")
    return {"tokens_per_s": tps, "tokens": _number(r"\] \S+: (\d+) tokens", line),
            "mean_accepted_length": _number(r"mean accepted length ([\d.]+)", line),
            "plain_steps_pct": _number(r"plain steps (\d+)%", line), "line": line}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_app(pair: str, port: int, log_path: Path, timeout_s: float) -> subprocess.Popen:
    """``python app/app.py --pair PAIR --port PORT`` on 127.0.0.1; returns once it serves."""
    cmd = [sys.executable, str(ROOT / "app" / "app.py"), "--pair", pair, "--port", str(port)]
    with log_path.open("w") as log:
        proc = subprocess.Popen(cmd, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT,
                                env=os.environ | {"GRADIO_ANALYTICS_ENABLED": "False"})
    deadline = time.monotonic() + timeout_s
    while f"127.0.0.1:{port}" not in log_path.read_text():
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            raise SystemExit(f"the playground did not start:\n{log_path.read_text()[-3000:]}")
        time.sleep(0.5)
    return proc


def _renderer_busy_s(cdp) -> float:
    """Seconds the page's renderer main thread has spent on tasks so far (DevTools ``TaskDuration``)."""
    return {m["name"]: m["value"] for m in cdp.send("Performance.getMetrics")["metrics"]}["TaskDuration"]


def _wait_for_speedup(page, deadline: float) -> str:
    """The stats line once it shows the speedup. Polled once a second from here: a locator wait would
    poll inside the page, at every frame, work a user's browser does not do."""
    while not re.search(r"speedup \d+\.\d\dx", stats := page.locator("#stats").inner_text()):
        if time.perf_counter() > deadline:
            raise SystemExit(f"no speedup on the page before the timeout; it shows: {stats}")
        time.sleep(1.0)
    return stats


def drive_page(url: str, prompt: str, max_new_tokens: int, timeout_s: float, screenshot: Path | None) -> dict:
    """Run adaptive with "compare" ticked in headless Chromium; the stats line's numbers and browser load."""
    if not Path(CHROMIUM).exists() and not shutil.which(CHROMIUM):
        raise SystemExit(f"no Chromium at {CHROMIUM}: `apt-get install chromium`, or set HF_ADASPEC_CHROMIUM")
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, headless=True, args=CHROMIUM_ARGS)
        page = browser.new_page(viewport={"width": 1400, "height": 1100})
        page.set_default_timeout(timeout_s * 1000)
        page.goto(url)
        page.locator("#prompt textarea").fill(prompt)
        page.get_by_role("radio", name="adaptive", exact=True).check()
        box = page.locator("#max-new-tokens input[type=number]")
        box.fill(str(max_new_tokens))
        box.press("Enter")
        page.locator("#compare input[type=checkbox]").check()
        cdp = page.context.new_cdp_session(page)
        cdp.send("Performance.enable")
        busy, began = _renderer_busy_s(cdp), time.perf_counter()
        page.locator("#generate").click()
        stats = _wait_for_speedup(page, began + timeout_s)
        wall_s, busy = time.perf_counter() - began, _renderer_busy_s(cdp) - busy
        if screenshot is not None:
            page.screenshot(path=str(screenshot), full_page=True)
        browser.close()
    found = {name: _number(pattern, stats) for name, pattern in STATS.items()}
    return found | {"browser_busy_s": round(busy, 2), "browser_busy_share": round(busy / wall_s, 3),
                    "page_wall_s": round(wall_s, 1), "stats": stats}


def compare(cli: dict, page: dict) -> dict:
    """Page against CLI: the ratios issue 37 judges, and whether each meets its bar (None: not measurable)."""
    cli_speedup = cli["adaptive"]["tokens_per_s"] / cli["plain"]["tokens_per_s"]
    speedup_ratio = page["speedup"] / cli_speedup if page["speedup"] else None
    tps_ratio = page["adaptive_tps"] / cli["adaptive"]["tokens_per_s"] if page["adaptive_tps"] else None
    plain_ratio = page["plain_tps"] / cli["plain"]["tokens_per_s"] if page["plain_tps"] else None
    median = page["median_realized_over_predicted"]
    return {
        "cli_speedup": round(cli_speedup, 3), "page_speedup": page["speedup"],
        "page_over_cli_speedup": None if speedup_ratio is None else round(speedup_ratio, 3),
        "page_over_cli_adaptive_tps": None if tps_ratio is None else round(tps_ratio, 3),
        "page_over_cli_plain_tps": None if plain_ratio is None else round(plain_ratio, 3),
        "median_realized_over_predicted": median,
        "meets": {"speedup_ratio": None if speedup_ratio is None else speedup_ratio >= BARS["speedup_ratio"],
                  "adaptive_tps_ratio": None if tps_ratio is None else tps_ratio >= BARS["adaptive_tps_ratio"],
                  "median_time_ratio": None if median is None else abs(median - 1) <= BARS["time_ratio_tolerance"]},
    }


def main() -> None:
    from hf_adaspec.playground.playground import PAIRS

    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--pair", default="qwen", choices=sorted(PAIRS))
    parser.add_argument("--prompt", default=PROMPT)
    parser.add_argument("--max-new-tokens", type=int, default=192)
    parser.add_argument("--port", type=int, default=0, help="0: a free port")
    parser.add_argument("--timeout-s", type=float, default=1800.0, help="for the app's start and for the page's run")
    parser.add_argument("--screenshot", type=Path, default=None, help="a PNG of the page after the run")
    args = parser.parse_args()
    if args.max_new_tokens < 1:
        parser.error("--max-new-tokens must be >= 1")

    cli = {}
    for name, speculation in (("adaptive", "adaptive"), ("plain", "off")):
        cli[name] = run_cli(args.pair, args.prompt, args.max_new_tokens, speculation)
        print(f"CLI {cli[name]['line']}", flush=True)
    port = args.port or _free_port()
    with tempfile.TemporaryDirectory() as tmp:
        app = start_app(args.pair, port, Path(tmp) / "app.log", args.timeout_s)
        try:
            page = drive_page(f"http://127.0.0.1:{port}", args.prompt, args.max_new_tokens, args.timeout_s,
                              args.screenshot)
        finally:
            app.terminate()
            app.wait(timeout=60)
    print(f"page: {page.pop('stats')}", flush=True)
    result = compare(cli, page)
    print(f"speedup: CLI {result['cli_speedup']:.2f}x, page {page['speedup']}x; page/CLI speedup "
          f"{result['page_over_cli_speedup']}, adaptive tokens/s {result['page_over_cli_adaptive_tps']}; "
          f"median realized/predicted {result['median_realized_over_predicted']}", flush=True)
    for run in cli.values():
        run.pop("line")
    print(json.dumps({"pair": args.pair, "prompt": args.prompt, "max_new_tokens": args.max_new_tokens,
                      "cli_pair_matches_page": cli_matches_page(args.pair), "cli": cli, "page": page} | result))


if __name__ == "__main__":
    main()
