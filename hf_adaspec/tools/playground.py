"""The Gradio playground: every speculation decision, live (``hf-adaspec playground``, ``python app/app.py``).

Design: one Blocks page; a Generate click runs a generator that drives ``live.run_live`` and turns
each ``LiveSnapshot`` into component values — HighlightedText (one span per token, labelled by how it
was made), a scatter plot of the chosen k per step, a line plot of each step's predicted vs realized
time (ms), a table of the latest decisions and a stats line; then, optionally, a plain run of the same
prompt through the same live path and the same updates, for the speedup. The engine never waits for
the page: the text and stats update at most every ``text_interval_s``, the charts and the table at most
every ``chart_interval_s`` (skipped in between: ``gr.skip()``), always once at the end; Gradio sends a
streamed output as a diff of the last one, so the growing token list costs its new tokens on the wire.
The page reports its own server-side time per update. The queue serialises runs (concurrency limit);
Stop sets the session's stop event (the run ends at its next token and frees the model) and cancels
the event. Errors surface as ``gr.Error`` in the page; the server keeps serving. Model pairs load
lazily, once.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass

from ..engine.stats import StepRecord
from .live import METHODS, LiveSnapshot, MainThreadRunner, RunSettings, in_new_thread, run_live
from .playground_views import (
    COLORS,
    DRAFTER_COLORS,
    SERIES_COLORS,
    UiCost,
    decisions_frame,
    k_frame,
    paced,
    stats_markdown,
    step_time_frame,
)

# Vega lays a chart's bottom legend and its y title out a few px outside the SVG it sizes, which clips them:
# let them show, in room the chart's block makes for them
PLOT_CSS = ("#k-plot svg, #time-plot svg { overflow: visible; } "
            "#k-plot, #time-plot { padding-bottom: 24px; padding-left: 28px; }")


@dataclass(frozen=True)
class PairSpec:
    """A model pair the playground offers: target and draft presets (draft None: prompt lookup only)."""

    label: str
    target: str
    draft: str | None
    quantization: str = "nf4"
    dtype: str = "bfloat16"
    draft_quantization: str = "nf4"
    quantize_draft_head: bool = True


PAIRS = {
    "qwen": PairSpec("Qwen2.5-Coder-1.5B ← 0.5B draft (NF4)", "qwen2.5-coder-1.5b", "qwen2.5-coder-0.5b"),
    "smollm2": PairSpec("SmolLM2-135M fp32 ← its NF4 copy (small, fast to load)", "smollm2-135m", "smollm2-135m",
                        quantization="none", dtype="float32", quantize_draft_head=False),
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
        draft = load(spec.draft, quantization=spec.draft_quantization, dtype=spec.dtype,
                     quantize_lm_head=spec.quantize_draft_head).model
    for model in (target.model, draft):
        if model is not None:
            model.generate(torch.tensor([[0, 1, 2, 3]]), max_new_tokens=2, do_sample=False)
    n_max = SpeculationConfig().max_speculative_tokens + 1  # the table generate(speculation=...) looks up
    for drafter in {None, draft}:
        CostCache().load_or_measure(target.model, drafter, n_max, print)
    return LoadedPair(target.model, target.tokenizer, draft, threading.Lock())


def _charts(steps: list[StepRecord], plain: LiveSnapshot | None, charts: bool) -> tuple:
    """(k plot, step-time plot, decisions) values, or three skips when the charts are not due."""
    import gradio as gr

    if not charts:
        return gr.skip(), gr.skip(), gr.skip()
    plain_ms = plain.step_intervals_ms() if plain is not None else []
    return k_frame(steps), step_time_frame(steps, plain_ms), decisions_frame(steps)


class Playground:
    """Holds the loaded pairs and the cached plain runs; ``build()`` returns the Gradio Blocks.
    text_interval_s, chart_interval_s: the least time between text and between chart updates (s, >= 0);
    ``launch_run`` starts each generate call (``live.run_live``'s ``launch``: a new thread by default;
    ``launch`` passes ``MainThreadRunner.submit``)."""

    def __init__(self, default_pair: str = "qwen", max_prompt_tokens: int = 2048, preload: bool = True,
                 text_interval_s: float = 0.25, chart_interval_s: float = 1.0,
                 launch_run: Callable[[Callable[[], None]], None] = in_new_thread) -> None:
        if default_pair not in PAIRS:
            raise ValueError(f"unknown pair {default_pair!r}; choose one of {sorted(PAIRS)}")
        if max_prompt_tokens < 1:
            raise ValueError(f"max_prompt_tokens must be >= 1, got {max_prompt_tokens}")
        if not (text_interval_s >= 0 and chart_interval_s >= 0):
            raise ValueError(f"update intervals must be >= 0 s, got {text_interval_s} and {chart_interval_s}")
        self.default_pair, self.max_prompt_tokens = default_pair, max_prompt_tokens
        self.text_interval_s, self.chart_interval_s, self.launch_run = text_interval_s, chart_interval_s, launch_run
        self.pairs: dict[str, LoadedPair] = {}
        self.plain_runs: dict[tuple, LiveSnapshot] = {}
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
        inputs = pair.tokenizer.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True,
                                                    return_tensors="pt", return_dict=True)
        n = inputs["input_ids"].shape[1]
        if n > self.max_prompt_tokens:
            raise ValueError(f"The prompt is {n} tokens; this playground accepts at most {self.max_prompt_tokens}. "
                             "Shorten it, or start the playground with a larger --max-prompt-tokens.")
        return inputs

    def run(self, control: RunControl, prompt, pair_name, method, k, max_new_tokens, do_sample, temperature, top_p,
            tpot_slo_ms, compare):
        """Gradio generator: yields (output, plain output, k plot, step-time plot, decisions, stats) per update;
        with ``compare``, then the plain run of the same prompt (cached per prompt and settings) the same way."""
        import gradio as gr

        try:
            settings = RunSettings(method, int(k), int(max_new_tokens), bool(do_sample), float(temperature),
                                   float(top_p), float(tpot_slo_ms) if tpot_slo_ms else None)
            pair = self.pair(pair_name)
            inputs = self.encode(pair, prompt)
            stop, ui = control.start(), UiCost()
            comparing = compare and method != "plain"
            done_note = "running plain decoding of the same prompt for the speedup…" if comparing else ""

            def main_view(snap: LiveSnapshot, charts: bool) -> tuple:
                note = "generating…" if not snap.done else done_note or ui.line()
                plain = snap if method == "plain" else None  # its step times go to the chart's plain series
                return (list(snap.pieces), [] if charts else gr.skip(), *_charts(snap.stats.steps, plain, charts),
                        stats_markdown(snap, settings, None, note))

            runs = run_live(pair.model, pair.tokenizer, inputs, settings, pair.draft, stop, pair.lock,
                            self.text_interval_s, launch=self.launch_run)
            main = yield from paced(runs, main_view, ui, self.chart_interval_s)
            if not comparing or stop.is_set():
                return
            plain = yield from self.plain_run(pair_name, pair, inputs, settings, main, stop, ui)
            yield (list(main.pieces), list(plain.pieces) if plain else gr.skip(),
                   *_charts(main.stats.steps, plain, True),
                   stats_markdown(main, settings, plain.stats.tokens_per_s if plain else None, ui.line()))
        except ValueError as exc:
            raise gr.Error(str(exc)) from exc
        except Exception as exc:  # shown in the page; the server keeps serving
            raise gr.Error(f"{type(exc).__name__}: {exc}") from exc

    def plain_run(self, pair_name: str, pair: LoadedPair, inputs: dict, settings: RunSettings, main: LiveSnapshot,
                  stop: threading.Event, ui: UiCost):
        """Generator: plain decoding of the same prompt through ``run_live``, its updates paced and built
        like the main run's (text and stats, then the charts and table); returns its final snapshot,
        cached per prompt and settings, or None when stopped."""
        import gradio as gr

        key = (pair_name, tuple(inputs["input_ids"][0].tolist()), settings.max_new_tokens, settings.do_sample,
               settings.temperature, settings.top_p)
        if key in self.plain_runs:
            return self.plain_runs[key]
        plain_settings = RunSettings("plain", max_new_tokens=settings.max_new_tokens, do_sample=settings.do_sample,
                                     temperature=settings.temperature, top_p=settings.top_p)

        def plain_view(snap: LiveSnapshot, charts: bool) -> tuple:
            note = (f"plain decoding of the same prompt, for the speedup: {snap.stats.new_tokens} tokens, "
                    f"{snap.stats.tokens_per_s:.1f} tokens/s…")
            return (gr.skip(), list(snap.pieces), *_charts(main.stats.steps, snap, charts),
                    stats_markdown(main, settings, None, note))

        runs = run_live(pair.model, pair.tokenizer, inputs, plain_settings, stop=stop, lock=pair.lock,
                        min_interval_s=self.text_interval_s, launch=self.launch_run)
        plain = yield from paced(runs, plain_view, ui, self.chart_interval_s)
        if stop.is_set():
            return None
        self.plain_runs[key] = plain
        return plain

    def build(self):
        """The Gradio Blocks page (not launched)."""
        import gradio as gr

        with gr.Blocks(title="hf-adaspec playground", analytics_enabled=False) as demo:
            control = gr.State(RunControl)
            gr.Markdown("## hf-adaspec playground — adaptive speculative decoding, decision by decision")
            with gr.Row():
                with gr.Column(scale=3):
                    prompt = gr.Textbox(label="Prompt", lines=4, elem_id="prompt",
                                        placeholder="Write a Python function that merges two sorted lists.")
                    with gr.Row():
                        generate = gr.Button("Generate", variant="primary", elem_id="generate")
                        stop = gr.Button("Stop", variant="stop", elem_id="stop")
                    output = gr.HighlightedText(label="Output: each token coloured by how it was made",
                                                color_map=COLORS, show_legend=True, combine_adjacent=True,
                                                elem_id="output")
                    stats = gr.Markdown(elem_id="stats")
                    plain_output = gr.HighlightedText(label="Plain decoding of the same prompt (the speedup's baseline)",
                                                      color_map=COLORS, combine_adjacent=True, show_inline_category=False,
                                                      elem_id="plain-output")
                with gr.Column(scale=2):
                    pair = gr.Dropdown([(p.label, n) for n, p in PAIRS.items()], value=self.default_pair,
                                       label="Model pair (target ← draft)", elem_id="pair")
                    method = gr.Radio(list(METHODS), value="adaptive", label="Method", elem_id="method")
                    k = gr.Slider(1, 8, value=4, step=1, label="k (fixed method)")
                    max_new = gr.Slider(1, 512, value=128, step=1, label="Max new tokens", elem_id="max-new-tokens")
                    compare = gr.Checkbox(True, label="Compare with plain decoding of the same prompt", elem_id="compare")
                    with gr.Accordion("Sampling and TPOT SLO", open=False):
                        do_sample = gr.Checkbox(False, label="Sample (lossless speculative sampling)")
                        temperature = gr.Slider(0.05, 2.0, value=0.7, step=0.05, label="Temperature")
                        top_p = gr.Slider(0.05, 1.0, value=0.9, step=0.05, label="Top-p")
                        slo = gr.Number(None, label="TPOT SLO (ms per token, optional; adaptive avoids choices predicted to break it)")
            with gr.Row():
                k_plot = gr.ScatterPlot(x="step", y="k", color="drafter", title="Chosen k per step (0 = plain step)",
                                        color_map=DRAFTER_COLORS, y_lim=[0, 8], elem_id="k-plot")
                time_plot = gr.LinePlot(x="step", y="ms", color="series", color_map=SERIES_COLORS,
                                        y_lim=[0, None], elem_id="time-plot",
                                        title="Step time (ms): predicted vs realized draft + verify; plain decoding's steps")
            decisions = gr.Dataframe(label="Latest decisions", elem_id="decisions")
            inputs = [control, prompt, pair, method, k, max_new, do_sample, temperature, top_p, slo, compare]
            # no progress trackers on the outputs: each runs a timer every animation frame while the run lasts,
            # which keeps the browser busy on the engine's cores (the Stop button has none)
            event = generate.click(self.run, inputs, [output, plain_output, k_plot, time_plot, decisions, stats],
                                   show_progress="hidden", show_progress_on=[stop])
            stop.click(lambda c: c.stop.set(), [control], None, cancels=[event])
        return demo


def launch(pair: str = "qwen", host: str = "127.0.0.1", port: int = 7860, max_prompt_tokens: int = 2048,
           concurrency: int = 1, max_queue: int = 16, text_interval_s: float = 0.25, chart_interval_s: float = 1.0) -> None:
    """Load ``pair``, then serve the playground on ``host:port`` until interrupted (localhost by default);
    the intervals as in ``Playground``. The page is served from Gradio's threads; every generate call runs
    on this (the main) thread (``live.MainThreadRunner``)."""
    runner = MainThreadRunner()
    playground = Playground(pair, max_prompt_tokens, text_interval_s=text_interval_s, chart_interval_s=chart_interval_s,
                            launch_run=runner.submit)
    demo = playground.build()
    demo.queue(default_concurrency_limit=concurrency, max_size=max_queue)
    demo.launch(server_name=host, server_port=port, show_error=True, ssr_mode=False, css=PLOT_CSS,
                prevent_thread_lock=True)
    try:
        runner.serve()
    except KeyboardInterrupt:
        demo.close()
