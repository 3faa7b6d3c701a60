"""The Gradio playground: every speculation decision, live (``hf-adaspec playground``, ``python app/app.py``).

Design: one Blocks page; a Generate click runs a generator that drives ``live.run_live`` and turns
each ``LiveSnapshot`` into component values — HighlightedText (one span per token, labelled by how it
was made), a scatter plot of the chosen k per step, a line plot of predicted vs realized goodput, a table
of the latest decisions (drafter, k, α, predicted goodput) and a stats line; then, optionally, a plain
run of the same prompt for the speedup. The queue serialises runs (concurrency limit); Stop sets the
session's stop event (the run ends at its next token and frees the model) and cancels the event.
Errors surface as ``gr.Error`` in the page; the server keeps serving. Model pairs load lazily, once.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

import pandas as pd

from ..engine.stats import StepRecord
from .live import (
    METHODS,
    SOURCE_LABELS,
    LiveSnapshot,
    RunSettings,
    run_live,
    slo_attainment,
)

COLORS = dict(zip(SOURCE_LABELS.values(), ("#22c55e", "#06b6d4", "#f59e0b", "#ef4444", "#a855f7", "#9ca3af"),
                  strict=True))
DRAFTER_COLORS = {"plain": COLORS["target, plain step"], "draft_model": COLORS["draft token, accepted"],
                  "prompt_lookup": COLORS["n-gram token, accepted"], "suffix": COLORS["suffix token, accepted"]}
SERIES_COLORS = {"predicted": "#3b82f6", "realized": "#f97316"}
DECISION_ROWS = 12  # latest decisions shown in the table


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


def _with_domain(frame: pd.DataFrame, column: str, values) -> pd.DataFrame:
    """Append one row per value of ``column`` with NaN elsewhere (not drawn). The page fixes a plot's
    colour domain from its first value, so every series must be in it from the start."""
    return pd.concat([frame, pd.DataFrame({column: pd.Series(list(values), dtype="str")})], ignore_index=True)


def k_frame(steps: list[StepRecord]) -> pd.DataFrame:
    """One row per step: step index, chosen k, drafter ("plain" for k = 0); plus the domain rows."""
    frame = pd.DataFrame({"step": pd.Series(range(1, len(steps) + 1), dtype="float64"),
                          "k": pd.Series([s.k for s in steps], dtype="float64"),
                          "drafter": pd.Series([s.drafter for s in steps], dtype="str")})
    return _with_domain(frame, "drafter", DRAFTER_COLORS)


def goodput_frame(steps: list[StepRecord]) -> pd.DataFrame:
    """Long format: per step, predicted and realized goodput (tokens/s; NaN is not drawn); plus domain rows."""
    n = len(steps)
    frame = pd.DataFrame({
        "step": pd.Series([*range(1, n + 1)] * 2, dtype="float64"),
        "series": pd.Series(["predicted"] * n + ["realized"] * n, dtype="str"),
        "tokens/s": pd.Series([s.predicted_goodput for s in steps] + [s.realized_goodput for s in steps], dtype="float64"),
    })
    return _with_domain(frame, "series", SERIES_COLORS)


def decisions_frame(steps: list[StepRecord]) -> pd.DataFrame:
    """The latest decisions: drafter, k, accepted, α estimate, predicted and realized goodput, ms."""
    first = max(len(steps) - DECISION_ROWS, 0)
    return pd.DataFrame(
        [(i, s.drafter, s.k, s.accepted, round(s.alpha, 3), round(s.predicted_goodput, 1),
          round(s.realized_goodput, 1), round(s.draft_ms + s.verify_ms, 1))
         for i, s in enumerate(steps[first:], first + 1)],
        columns=["step", "drafter", "k", "accepted", "α", "predicted tok/s", "realized tok/s", "step ms"],
    )


def stats_markdown(snapshot: LiveSnapshot, settings: RunSettings, plain_tps: float | None, note: str = "") -> str:
    """One status line: tokens, tokens/s, TTFT, acceptance, mean accepted length, plain share, SLO, speedup."""
    s = snapshot.stats
    parts = [f"**{settings.method}**: {s.new_tokens} tokens, {s.tokens_per_s:.1f} tokens/s, TTFT {s.prefill_ms:.0f} ms"]
    if settings.method != "plain":
        acceptance = "n/a" if s.acceptance_rate != s.acceptance_rate else f"{s.acceptance_rate:.2f}"
        parts.append(f"acceptance {acceptance}, mean accepted length {s.mean_accepted_length:.2f}, "
                     f"plain steps {100 * s.plain_share:.0f}%")
        if settings.tpot_slo_ms is not None:
            met = slo_attainment(s.steps, settings.tpot_slo_ms)
            parts.append(f"TPOT SLO {settings.tpot_slo_ms:g} ms met by {100 * met:.0f}% of tokens")
    if plain_tps:
        parts.append(f"plain decoding {plain_tps:.1f} tokens/s → **speedup {s.tokens_per_s / plain_tps:.2f}x**")
    return " | ".join(parts) + (f"  \n{note}" if note else "")


class Playground:
    """Holds the loaded pairs and cached plain rates; ``build()`` returns the Gradio Blocks."""

    def __init__(self, default_pair: str = "qwen", max_prompt_tokens: int = 2048, preload: bool = True) -> None:
        if default_pair not in PAIRS:
            raise ValueError(f"unknown pair {default_pair!r}; choose one of {sorted(PAIRS)}")
        if max_prompt_tokens < 1:
            raise ValueError(f"max_prompt_tokens must be >= 1, got {max_prompt_tokens}")
        self.default_pair, self.max_prompt_tokens = default_pair, max_prompt_tokens
        self.pairs: dict[str, LoadedPair] = {}
        self.plain_rates: dict[tuple, float] = {}
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

    def plain_rate(self, key: tuple, pair: LoadedPair, inputs: dict, settings: RunSettings, stop) -> float | None:
        """Tokens/s of plain decoding on the same prompt and settings (cached per key; None if stopped)."""
        if key not in self.plain_rates:
            plain = RunSettings("plain", max_new_tokens=settings.max_new_tokens, do_sample=settings.do_sample,
                                temperature=settings.temperature, top_p=settings.top_p)
            *_, last = run_live(pair.model, pair.tokenizer, inputs, plain, stop=stop, lock=pair.lock)
            if stop.is_set():
                return None
            self.plain_rates[key] = last.stats.tokens_per_s
        return self.plain_rates[key]

    def run(self, control: RunControl, prompt, pair_name, method, k, max_new_tokens, do_sample, temperature, top_p,
            tpot_slo_ms, compare):
        """Gradio generator: yields (highlighted, k plot, goodput plot, decisions, stats) per update."""
        import gradio as gr

        try:
            settings = RunSettings(method, int(k), int(max_new_tokens), bool(do_sample), float(temperature),
                                   float(top_p), float(tpot_slo_ms) if tpot_slo_ms else None)
            pair = self.pair(pair_name)
            inputs = self.encode(pair, prompt)
            stop = control.start()
            snapshot = LiveSnapshot()
            for snapshot in run_live(pair.model, pair.tokenizer, inputs, settings, pair.draft, stop, pair.lock):
                yield self.view(snapshot, settings, None, "" if snapshot.done else "generating…")
            if not compare or method == "plain" or stop.is_set():
                return
            yield self.view(snapshot, settings, None, "running plain decoding of the same prompt for the speedup…")
            key = (pair_name, tuple(inputs["input_ids"][0].tolist()), settings.max_new_tokens, settings.do_sample,
                   settings.temperature, settings.top_p)
            yield self.view(snapshot, settings, self.plain_rate(key, pair, inputs, settings, stop), "")
        except ValueError as exc:
            raise gr.Error(str(exc)) from exc
        except Exception as exc:  # noqa: BLE001 — shown in the page; the server keeps serving
            raise gr.Error(f"{type(exc).__name__}: {exc}") from exc

    @staticmethod
    def view(snapshot: LiveSnapshot, settings: RunSettings, plain_tps: float | None, note: str) -> tuple:
        steps = snapshot.stats.steps
        return (snapshot.pieces, k_frame(steps), goodput_frame(steps), decisions_frame(steps),
                stats_markdown(snapshot, settings, plain_tps, note))

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
                with gr.Column(scale=2):
                    pair = gr.Dropdown([(p.label, n) for n, p in PAIRS.items()], value=self.default_pair,
                                       label="Model pair (target ← draft)", elem_id="pair")
                    method = gr.Radio(list(METHODS), value="adaptive", label="Method", elem_id="method")
                    k = gr.Slider(1, 8, value=4, step=1, label="k (fixed method)")
                    max_new = gr.Slider(1, 512, value=128, step=1, label="Max new tokens", elem_id="max-new-tokens")
                    compare = gr.Checkbox(True, label="Compare with plain decoding of the same prompt")
                    with gr.Accordion("Sampling and TPOT SLO", open=False):
                        do_sample = gr.Checkbox(False, label="Sample (lossless speculative sampling)")
                        temperature = gr.Slider(0.05, 2.0, value=0.7, step=0.05, label="Temperature")
                        top_p = gr.Slider(0.05, 1.0, value=0.9, step=0.05, label="Top-p")
                        slo = gr.Number(None, label="TPOT SLO (ms per token, optional; adaptive avoids choices predicted to break it)")
            with gr.Row():
                k_plot = gr.ScatterPlot(x="step", y="k", color="drafter", title="Chosen k per step (0 = plain step)",
                                        color_map=DRAFTER_COLORS, y_lim=[0, 8], elem_id="k-plot")
                goodput_plot = gr.LinePlot(x="step", y="tokens/s", color="series", elem_id="goodput-plot", color_map=SERIES_COLORS,
                                           title="Goodput per step (tokens/s): predicted (blue) vs realized (orange)")
            decisions = gr.Dataframe(label="Latest decisions", elem_id="decisions")
            inputs = [control, prompt, pair, method, k, max_new, do_sample, temperature, top_p, slo, compare]
            event = generate.click(self.run, inputs, [output, k_plot, goodput_plot, decisions, stats])
            stop.click(lambda c: c.stop.set(), [control], None, cancels=[event])
        return demo


def launch(pair: str = "qwen", host: str = "127.0.0.1", port: int = 7860, max_prompt_tokens: int = 2048,
           concurrency: int = 1, max_queue: int = 16) -> None:
    """Load ``pair``, then serve the playground on ``host:port`` until interrupted (localhost by default)."""
    playground = Playground(pair, max_prompt_tokens)
    demo = playground.build()
    demo.queue(default_concurrency_limit=concurrency, max_size=max_queue)
    demo.launch(server_name=host, server_port=port, show_error=True, ssr_mode=False)
