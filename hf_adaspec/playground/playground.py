"""The Gradio playground: every speculation decision, live (``hf-adaspec playground``, ``python app/app.py``).

Design: one Blocks page. Generate validates the request, starts the chosen method's run (``live.LiveRun``)
and returns at once with the id of its ``RunFeed``; the live view (``page``, one ``gr.HTML``)
polls that feed a few times a second and appends what is new — tokens coloured by how each was made,
the chosen k and the predicted vs realized time of each step, the latest decisions, a stats line — then,
optionally, the feed runs plain decoding of the same prompt the same way, for the speedup. The engine
never waits for the page; no Gradio event stays pending while a run lasts. Runs are serialised on the
pair's lock (and, served by ``launch``, on the main thread). Stop, or a new Generate in the same browser
session, stops the session's run at its next token (a closed page's run ends at its max new tokens). Bad
requests surface as ``gr.Error``; errors of a run come back in the feed; the server keeps serving. Model
pairs load lazily, once.
"""

from __future__ import annotations

import secrets
import threading
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

from . import page
from .live import (
    METHODS,
    LiveRun,
    LiveSnapshot,
    MainThreadRunner,
    RunSettings,
    in_new_thread,
)
from .views import (
    COLORS,
    CURSOR_FIELDS,
    DRAFTER_COLORS,
    SERIES_COLORS,
    RunFeed,
)

DECISION_ROWS = 12  # latest decisions the page shows
CHART_INTERVAL_MS = 1000  # the page redraws its charts and table at most this often (and at the end)
MAX_FEEDS = 32  # requests whose feeds are kept (the oldest is dropped)


@dataclass(frozen=True)
class PairSpec:
    """A model pair the playground offers: target and draft presets (draft None: prompt lookup only)."""

    label: str
    target: str
    draft: str | None
    quantization: str = "auto"
    dtype: str = "bfloat16"
    draft_quantization: str = "auto"
    quantize_draft_head: bool = True


PAIRS = {
    "qwen": PairSpec("Qwen2.5-Coder-1.5B ← 0.5B draft", "qwen2.5-coder-1.5b", "qwen2.5-coder-0.5b"),
    "smollm2": PairSpec(
        "SmolLM2-135M fp32 ← its NF4 copy (small, fast to load)",
        "smollm2-135m",
        "smollm2-135m",
        quantization="none",
        dtype="float32",
        draft_quantization="nf4",
        quantize_draft_head=False,
    ),
}


@dataclass
class LoadedPair:
    """Loaded target (enabled for speculation), tokenizer, draft model and the lock serialising runs."""

    model: object
    tokenizer: object
    draft: object | None
    lock: threading.Lock


class RunControl:
    """Per browser session: the stop event of its current run."""

    def __init__(self) -> None:
        self.stop = threading.Event()

    def __deepcopy__(self, memo) -> RunControl:
        return RunControl()  # Gradio deep-copies a State's value when a request beats the page's load event

    def start(self) -> threading.Event:
        self.stop = threading.Event()
        return self.stop


def load_pair(spec: PairSpec) -> LoadedPair:
    """Load ``spec``'s target (``hf_adaspec.enable``d) and draft; warm both with a short generate, then
    load or measure the cost tables now, while no request (and no browser) competes for the CPU."""
    import torch

    from .. import enable, load
    from ..config import SpeculationConfig
    from ..costs.cache import CostCache

    target = load(spec.target, quantization=spec.quantization, dtype=spec.dtype)
    enable(target.model)
    draft = None
    if spec.draft is not None:
        draft = load(
            spec.draft,
            quantization=spec.draft_quantization,
            dtype=spec.dtype,
            quantize_lm_head=spec.quantize_draft_head,
        ).model
    for model in (target.model, draft):
        if model is not None:
            model.generate(torch.tensor([[0, 1, 2, 3]]), max_new_tokens=2, do_sample=False)
    n_max = SpeculationConfig().max_speculative_tokens + 1  # the table generate(speculation=...) looks up
    for drafter in {None, draft}:
        CostCache().load_or_measure(target.model, drafter, n_max, print)
    return LoadedPair(target.model, target.tokenizer, draft, threading.Lock())


class Playground:
    """Holds the loaded pairs, the cached plain runs and the requests' feeds; ``build()`` returns the Gradio
    Blocks. poll_interval_s: how often the page polls a running request (s, > 0); ``launch_run`` starts each
    generate call (``live.LiveRun``'s ``launch``: a new thread by default; ``launch`` passes
    ``MainThreadRunner.submit``)."""

    def __init__(
        self,
        default_pair: str = "qwen",
        max_prompt_tokens: int = 2048,
        preload: bool = True,
        poll_interval_s: float = 0.25,
        launch_run: Callable[[Callable[[], None]], None] = in_new_thread,
    ) -> None:
        if default_pair not in PAIRS:
            raise ValueError(f"unknown pair {default_pair!r}; choose one of {sorted(PAIRS)}")
        if max_prompt_tokens < 1:
            raise ValueError(f"max_prompt_tokens must be >= 1, got {max_prompt_tokens}")
        if not poll_interval_s > 0:
            raise ValueError(f"poll_interval_s must be > 0 s, got {poll_interval_s}")
        self.default_pair, self.max_prompt_tokens = default_pair, max_prompt_tokens
        self.poll_interval_s, self.launch_run = poll_interval_s, launch_run
        self.pairs: dict[str, LoadedPair] = {}
        self.plain_runs: dict[tuple, LiveSnapshot] = {}
        self.feeds: OrderedDict[str, RunFeed] = OrderedDict()
        self.load_lock = threading.Lock()
        if preload:
            self.pair(default_pair)

    def pair(self, name: str) -> LoadedPair:
        """The loaded pair ``name`` (loaded on first use)."""
        with self.load_lock:
            if name not in self.pairs:
                self.pairs[name] = load_pair(PAIRS[name])
            return self.pairs[name]

    def encode(self, pair: LoadedPair, prompt: str) -> dict:
        """Chat-template ``prompt``; raises ValueError for an empty or over-long prompt."""
        if not prompt.strip():
            raise ValueError("The prompt is empty: type a prompt, then Generate.")
        inputs = pair.tokenizer.apply_chat_template(
            [{"role": "user", "content": prompt}], add_generation_prompt=True, return_tensors="pt", return_dict=True
        )
        n = inputs["input_ids"].shape[1]
        if n > self.max_prompt_tokens:
            raise ValueError(
                f"The prompt is {n} tokens; this playground accepts at most {self.max_prompt_tokens}. "
                "Shorten it, or start the playground with a larger --max-prompt-tokens."
            )
        return inputs

    def start(self, control: RunControl, *request) -> str:
        """Gradio handler: ``open_run(control, *request)``, a request that cannot run raised as gr.Error (its
        message names the fix; an exception other than ValueError, e.g. a pair that fails to load, is named
        too): the page shows it and the server keeps serving."""
        import gradio as gr

        try:
            return self.open_run(control, *request)
        except ValueError as exc:
            raise gr.Error(str(exc)) from exc
        except Exception as exc:
            raise gr.Error(f"{type(exc).__name__}: {exc}") from exc

    def open_run(
        self,
        control: RunControl,
        prompt,
        pair_name,
        method,
        k,
        max_new_tokens,
        do_sample,
        temperature,
        top_p,
        tpot_slo_ms,
        compare,
    ) -> str:
        """Stop the session's previous run, start this request's and return its feed id (the live view's value).
        Raises ValueError for a request that cannot run (naming the fix), and what loading the pair raises."""
        settings = RunSettings(
            method,
            int(k),
            int(max_new_tokens),
            bool(do_sample),
            float(temperature),
            float(top_p),
            float(tpot_slo_ms) if tpot_slo_ms else None,
        )
        pair = self.pair(pair_name)
        inputs = self.encode(pair, prompt)
        control.stop.set()
        stop = control.start()
        main = LiveRun(
            pair.model, pair.tokenizer, inputs, settings, pair.draft, stop, pair.lock, launch=self.launch_run
        )
        key = (
            pair_name,
            tuple(inputs["input_ids"][0].tolist()),
            settings.max_new_tokens,
            settings.do_sample,
            settings.temperature,
            settings.top_p,
        )
        plain = RunSettings(
            "plain",
            max_new_tokens=settings.max_new_tokens,
            do_sample=settings.do_sample,
            temperature=settings.temperature,
            top_p=settings.top_p,
        )

        def start_plain() -> LiveRun | LiveSnapshot:
            cached = self.plain_runs.get(key)
            return cached or LiveRun(
                pair.model, pair.tokenizer, inputs, plain, stop=stop, lock=pair.lock, launch=self.launch_run
            )

        def keep_plain(snapshot: LiveSnapshot) -> None:
            self.plain_runs[key] = snapshot

        comparing = bool(compare) and method != "plain"
        return self._keep(RunFeed(main, settings, start_plain if comparing else None, keep_plain))

    def _keep(self, feed: RunFeed) -> str:
        """Register ``feed`` under a new unguessable id (dropping the oldest beyond ``MAX_FEEDS``)."""
        feed_id = secrets.token_hex(8)
        self.feeds[feed_id] = feed
        while len(self.feeds) > MAX_FEEDS:
            self.feeds.popitem(last=False)
        return feed_id

    def poll(self, cursor: dict) -> dict:
        """The page's poll: ``cursor["run"]`` names the feed; the rest as ``RunFeed.poll``. An unknown feed
        answers done with an error."""
        feed = self.feeds.get(str(cursor.get("run")))
        if feed is None:
            return {name: [] for name in CURSOR_FIELDS} | {
                "done": True,
                "error": "unknown run",
                "stats": "This run is no longer kept: Generate again.",
            }
        return feed.poll(cursor)

    def build(self):
        """The Gradio Blocks page (not launched)."""
        import gradio as gr

        async def poll(cursor: dict) -> dict:  # a server function of the live view (a POST outside the queue)
            return self.poll(cursor)

        with gr.Blocks(title="hf-adaspec playground", analytics_enabled=False) as demo:
            control = gr.State(RunControl)
            gr.Markdown("## hf-adaspec playground — adaptive speculative decoding, decision by decision")
            with gr.Row():
                with gr.Column(scale=3):
                    prompt = gr.Textbox(
                        label="Prompt",
                        lines=4,
                        elem_id="prompt",
                        placeholder="Write a Python function that merges two sorted lists.",
                    )
                    with gr.Row():
                        generate = gr.Button("Generate", variant="primary", elem_id="generate")
                        stop = gr.Button("Stop", variant="stop", elem_id="stop")
                with gr.Column(scale=2):
                    pair = gr.Dropdown(
                        [(p.label, n) for n, p in PAIRS.items()],
                        value=self.default_pair,
                        label="Model pair (target ← draft)",
                        elem_id="pair",
                    )
                    method = gr.Radio(list(METHODS), value="adaptive", label="Method", elem_id="method")
                    k = gr.Slider(1, 8, value=4, step=1, label="k (fixed method)")
                    max_new = gr.Slider(1, 512, value=128, step=1, label="Max new tokens", elem_id="max-new-tokens")
                    compare = gr.Checkbox(
                        True, label="Compare with plain decoding of the same prompt", elem_id="compare"
                    )
                    with gr.Accordion("Sampling and TPOT SLO", open=False):
                        do_sample = gr.Checkbox(False, label="Sample (lossless speculative sampling)")
                        temperature = gr.Slider(0.05, 2.0, value=0.7, step=0.05, label="Temperature")
                        top_p = gr.Slider(0.05, 1.0, value=0.9, step=0.05, label="Top-p")
                        slo = gr.Number(
                            None,
                            label="TPOT SLO (ms per token, optional; adaptive avoids choices predicted to break it)",
                        )
            live = gr.HTML(
                "",
                html_template=page.TEMPLATE,
                css_template=page.CSS,
                js_on_load=page.SCRIPT,
                server_functions=[poll],
                elem_id="live",
                colors=COLORS,
                drafter_colors=DRAFTER_COLORS,
                series_colors=SERIES_COLORS,
                decision_rows=DECISION_ROWS,
                interval_ms=round(1000 * self.poll_interval_s),
                chart_interval_ms=CHART_INTERVAL_MS,
            )
            inputs = [control, prompt, pair, method, k, max_new, do_sample, temperature, top_p, slo, compare]
            generate.click(self.start, inputs, live, show_progress="hidden")
            stop.click(lambda c: c.stop.set(), [control], None, show_progress="hidden")
        return demo


def launch(
    pair: str = "qwen",
    host: str = "127.0.0.1",
    port: int = 7860,
    max_prompt_tokens: int = 2048,
    concurrency: int = 1,
    max_queue: int = 16,
    poll_interval_s: float = 0.25,
) -> None:
    """Load ``pair``, then serve the playground on ``host:port`` until interrupted (localhost by default);
    ``poll_interval_s`` as in ``Playground``. The page is served from Gradio's threads; every generate call runs
    on this (the main) thread (``live.MainThreadRunner``)."""
    runner = MainThreadRunner()
    playground = Playground(pair, max_prompt_tokens, poll_interval_s=poll_interval_s, launch_run=runner.submit)
    demo = playground.build()
    demo.queue(default_concurrency_limit=concurrency, max_size=max_queue)
    demo.launch(server_name=host, server_port=port, show_error=True, ssr_mode=False, prevent_thread_lock=True)
    try:
        runner.serve()
    except KeyboardInterrupt:
        demo.close()
