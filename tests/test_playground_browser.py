"""The playground in a real browser: ``python app/app.py --pair smollm2`` on localhost, driven through
Playwright in Debian's headless Chromium (``make test`` installs it; see README).

Saves screenshots under $HF_ADASPEC_SCREENSHOTS (default: pytest's tmp dir).
"""

from __future__ import annotations

import os
import re
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytestmark = [pytest.mark.slow, pytest.mark.browser]
ROOT = Path(__file__).resolve().parents[1]
CHROMIUM = os.environ.get("HF_ADASPEC_CHROMIUM", "/usr/bin/chromium")
# as root on a closed network: no sandbox, no background connections (they fail and slow the start)
CHROMIUM_ARGS = [
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-sync",
    "--disable-background-networking",
    "--disable-component-update",
]
DRAFT_GREEN = "rgba(34, 197, 94"  # COLORS["draft token, accepted"] as the page renders it
MAX_PROMPT_TOKENS = 120


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def app_url(tmp_path_factory):
    """Start the app as a user would (a subprocess on 127.0.0.1), wait until it serves; stop it after."""
    port, log_path = _free_port(), tmp_path_factory.mktemp("app") / "app.log"
    cmd = [
        sys.executable,
        str(ROOT / "app" / "app.py"),
        "--pair",
        "smollm2",
        "--port",
        str(port),
        "--max-prompt-tokens",
        str(MAX_PROMPT_TOKENS),
    ]
    with log_path.open("w") as log:
        proc = subprocess.Popen(
            cmd, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, env=os.environ | {"GRADIO_ANALYTICS_ENABLED": "False"}
        )
    deadline = time.monotonic() + 600  # first use assembles and converts SmolLM2
    while f"127.0.0.1:{port}" not in log_path.read_text():
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            pytest.fail(f"the playground did not start:\n{log_path.read_text()[-3000:]}")
        time.sleep(0.5)
    yield f"http://127.0.0.1:{port}"
    proc.terminate()
    proc.wait(timeout=30)


@pytest.fixture(scope="module")
def browser():
    if not Path(CHROMIUM).exists() and not shutil.which(CHROMIUM):
        pytest.fail(
            f"no Chromium at {CHROMIUM}: `apt-get install chromium` (make test does it as root), "
            "or point HF_ADASPEC_CHROMIUM at one"
        )
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, headless=True, args=CHROMIUM_ARGS)
        yield browser
        browser.close()


@pytest.fixture
def page(browser, app_url):
    page = browser.new_page(viewport={"width": 1400, "height": 1100})
    page.set_default_timeout(120_000)
    page.goto(app_url)
    yield page
    page.close()


@pytest.fixture(scope="module")
def shots(tmp_path_factory) -> Path:
    path = Path(os.environ.get("HF_ADASPEC_SCREENSHOTS") or tmp_path_factory.mktemp("screenshots"))
    path.mkdir(parents=True, exist_ok=True)
    return path


def _set_up(page, prompt: str, method: str, max_new_tokens: int) -> None:
    page.locator("#prompt textarea").fill(prompt)
    page.get_by_role("radio", name=method, exact=True).check()
    box = page.locator("#max-new-tokens input[type=number]")
    box.fill(str(max_new_tokens))
    box.press("Enter")


def _shown(page, selector: str) -> bool:
    """Whether every element matching ``selector`` lies inside each ancestor that clips (overflow not visible)."""
    return page.locator(selector).evaluate_all("""els => els.every(e => {
        const r = e.getBoundingClientRect();
        for (let a = e.parentElement; a; a = a.parentElement) {
            if (getComputedStyle(a).overflow === 'visible') continue;
            const b = a.getBoundingClientRect();
            if (r.top < b.top - 1 || r.bottom > b.bottom + 1) return false;
            if (r.left < b.left - 1 || r.right > b.right + 1) return false;
        }
        return r.height > 0;
    })""")


def _token_colours(page) -> list[str]:
    return page.locator("#output .token").evaluate_all("els => els.map(e => e.style.backgroundColor)")


def test_generate_shows_coloured_tokens_chart_and_speedup(page, shots):
    _set_up(page, "Write a Python function that reverses a list.", "fixed", 24)
    page.locator("#generate").click()
    page.wait_for_function(  # accepted draft tokens, coloured
        f"() => [...document.querySelectorAll('#output .token')]"
        f".some(e => e.style.backgroundColor.startsWith('{DRAFT_GREEN}'))"
    )
    page.get_by_text(re.compile(r"speedup \d+\.\d\dx")).wait_for()  # then the plain run of the same prompt
    stats = page.locator("#stats").inner_text()
    assert re.search(r"fixed: 24 tokens, [\d.]+ tokens/s", stats), stats
    assert re.search(r"realized/predicted ([\d.]+|n/a) \(median\)", stats) and re.search(r"page: \d+ updates", stats)
    assert set(_token_colours(page)) - {""}, "tokens carry no colour"
    text = page.locator("#output").inner_text()
    assert text and page.locator("#plain-output").inner_text() == text  # greedy: plain decoding's text, once
    assert page.locator("#plain-output .token").count() > 0
    assert page.locator("#decisions").get_by_text("draft_model").count() > 0
    steps = page.locator("#decisions tbody tr").count()
    assert int(page.locator("#k-plot").get_attribute("data-points")) >= steps > 0  # one point per step
    assert int(page.locator("#time-plot").get_attribute("data-points")) > steps  # predicted, realized, plain
    keyed = (("#k-keys", ["plain", "draft_model"]), ("#time-keys", ["predicted", "realized", "plain decoding"]))
    for keys, series in keyed:
        assert set(series) <= set(page.locator(f"{keys} .key").all_text_contents())
        assert _shown(page, f"{keys} .key"), f"{keys}' entries are cut off"
    page.screenshot(path=str(shots / "playground.png"), full_page=True)


def test_too_long_prompt_shows_error_and_server_keeps_serving(page, shots):
    _set_up(page, "word " * (2 * MAX_PROMPT_TOKENS), "adaptive", 8)
    page.locator("#generate").click()
    page.get_by_text(f"accepts at most {MAX_PROMPT_TOKENS}").first.wait_for()
    page.screenshot(path=str(shots / "playground_error.png"))
    _set_up(page, "Say hello.", "plain", 8)
    page.locator("#generate").click()
    page.get_by_text(re.compile(r"plain: 8 tokens")).wait_for()
    assert _token_colours(page)


def test_stop_cancels_and_frees_the_model(page):
    _set_up(page, "Count from 1 to 500, one number per line.", "plain", 512)
    page.locator("#generate").click()
    page.locator("#output .token").first.wait_for()
    page.locator("#stop").click()
    time.sleep(2)
    stopped = page.locator("#stats").inner_text()
    time.sleep(2)
    assert page.locator("#stats").inner_text() == stopped, "generation went on after Stop"
    assert int(re.search(r"(\d+) tokens", stopped).group(1)) < 512
    _set_up(page, "Say hello.", "adaptive", 6)  # the model is free again: a new run completes
    page.locator("#generate").click()
    page.get_by_text(re.compile(r"adaptive: 6 tokens")).wait_for()
