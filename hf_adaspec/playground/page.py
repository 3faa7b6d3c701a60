"""The playground's live view, as one ``gr.HTML`` component: its template, CSS and the script it loads.

Design: the engine never waits for the page, and the page never re-renders what it has. The component's
value is the current request's feed id; a new id re-renders the empty view, and the script polls the
feed (``server.poll``: a Gradio server function, a plain POST outside the queue) every ``interval_ms``
with the counts it already has, appends the new token spans and plain-run pieces, and at most every
``chart_interval_ms`` (and at the end) redraws the two small canvas charts and the decisions table from
the steps it holds; it stops once the feed says done. No event stays
pending while a run lasts, so no progress tracker animates in the browser on the engine's cores.
The element ids (output, stats, plain-output, k-plot, time-plot, decisions) are what the browser test reads.
"""

from __future__ import annotations

TEMPLATE = """
<div class="live" data-run="${value}">
  <div class="legend" id="legend"></div>
  <div class="tokens" id="output"></div>
  <div class="stats" id="stats"></div>
  <div class="caption">Plain decoding of the same prompt (the speedup's baseline)</div>
  <div class="tokens plain" id="plain-output"></div>
  <div class="charts">
    <figure><figcaption>Chosen k per step (0 = plain step)</figcaption>
      <canvas id="k-plot" width="560" height="220"></canvas><div class="keys" id="k-keys"></div></figure>
    <figure><figcaption>Step time (ms): predicted vs realized draft + verify; plain decoding's steps</figcaption>
      <canvas id="time-plot" width="560" height="220"></canvas><div class="keys" id="time-keys"></div></figure>
  </div>
  <div class="caption">Latest decisions</div>
  <table id="decisions"><thead><tr><th>step</th><th>drafter</th><th>k</th><th>accepted</th><th>α</th>
    <th>predicted tok/s</th><th>predicted ms</th><th>realized ms</th></tr></thead><tbody></tbody></table>
</div>
"""

CSS = """
.live { font-size: 14px; }
.tokens, .stats, .charts, table { contain: content; }
.tokens { white-space: pre-wrap; font-family: var(--font-mono); min-height: 3em; padding: 8px;
          border: 1px solid var(--border-color-primary); border-radius: 6px; }
.token { border-radius: 3px; }
.stats { white-space: pre-line; margin: 8px 0; }
.caption, figcaption { font-weight: 600; margin: 10px 0 4px; }
.charts { display: flex; gap: 16px; flex-wrap: wrap; }
figure { margin: 0; }
.keys, .legend { display: flex; gap: 12px; flex-wrap: wrap; margin: 4px 0; }
.key::before { content: ""; display: inline-block; width: 10px; height: 10px; margin-right: 4px;
               background: var(--c); border-radius: 2px; }
table { border-collapse: collapse; font-variant-numeric: tabular-nums; }
td, th { padding: 2px 8px; border-bottom: 1px solid var(--border-color-primary); text-align: right; }
"""

SCRIPT = """
const $ = (sel) => element.querySelector(sel);
const text = (tag, cls, content) => { const e = document.createElement(tag); if (cls) e.className = cls;
  e.textContent = content; return e; };
const key = (label, colour) => { const e = text('span', 'key', label); e.style.setProperty('--c', colour); return e; };

function draw(canvas, series, yMax) {  // series: [{colour, points: [[x, y]], line}]
  const ctx = canvas.getContext('2d'), w = canvas.width, h = canvas.height, pad = 34;
  const xs = series.flatMap(s => s.points.map(p => p[0]));
  const ys = series.flatMap(s => s.points.filter(p => p[1] !== null).map(p => p[1]));
  const xMax = Math.max(10, ...xs), top = yMax ?? Math.max(1, ...ys) * 1.1;
  const X = (x) => pad + (w - pad - 8) * (x - 1) / Math.max(1, xMax - 1), Y = (y) => h - pad + 10 - (h - pad) * y / top;
  ctx.clearRect(0, 0, w, h);
  ctx.strokeStyle = '#9ca3af'; ctx.fillStyle = '#6b7280'; ctx.font = '11px sans-serif';
  ctx.beginPath(); ctx.moveTo(pad, 4); ctx.lineTo(pad, Y(0)); ctx.lineTo(w - 4, Y(0)); ctx.stroke();
  for (const y of [0, top / 2, top]) ctx.fillText(String(Math.round(y)), 2, Y(y) + 4);
  ctx.fillText('step', w - 30, h - 4); ctx.fillText(String(xMax), X(xMax) - 12, Y(0) + 14);
  let drawn = 0;
  for (const s of series) {
    ctx.strokeStyle = ctx.fillStyle = s.colour; ctx.beginPath();
    let open = false;
    for (const [x, y] of s.points) {
      if (y === null) { open = false; continue; }
      drawn += 1;
      if (s.line) { if (open) ctx.lineTo(X(x), Y(y)); else ctx.moveTo(X(x), Y(y)); open = true; }
      else ctx.fillRect(X(x) - 2.5, Y(y) - 2.5, 5, 5);
    }
    if (s.line) ctx.stroke();
  }
  canvas.dataset.points = String(drawn);
}

let cur = null;
function reset() {
  cur = {pieces: 0, steps: 0, plain_pieces: 0, plain_ms: 0, rows: [], plainMs: [], fresh: false, drawn: -1e9};
  $('#legend').replaceChildren(...Object.entries(props.colors).map(([label, c]) => key(label, c)));
  $('#k-keys').replaceChildren(...Object.entries(props.drafter_colors).map(([d, c]) => key(d, c)));
  $('#time-keys').replaceChildren(...Object.entries(props.series_colors).map(([s, c]) => key(s, c)));
}

function render(r) {  // text and stats at every poll; charts and table at most once a second, and at the end
  const spans = (pieces) => pieces.map(([t, label]) => { const e = text('span', 'token', t);
    e.style.backgroundColor = props.colors[label] + '55'; e.title = label; return e; });
  $('#output').append(...spans(r.pieces)); $('#plain-output').append(...spans(r.plain_pieces));
  cur.pieces += r.pieces.length; cur.plain_pieces += r.plain_pieces.length;
  cur.rows.push(...r.steps); cur.steps += r.steps.length;
  cur.plainMs.push(...r.plain_ms); cur.plain_ms += r.plain_ms.length;
  $('#stats').textContent = r.stats;
  cur.fresh = cur.fresh || r.steps.length > 0 || r.plain_ms.length > 0;
  if (!cur.fresh || (!r.done && performance.now() - cur.drawn < props.chart_interval_ms)) return;
  cur.fresh = false; cur.drawn = performance.now();
  const byDrafter = Object.keys(props.drafter_colors).map(d => ({colour: props.drafter_colors[d],
    points: cur.rows.map((row, i) => [i + 1, row[0] === d ? row[1] : null])}));
  draw($('#k-plot'), byDrafter, 8);
  const sc = props.series_colors;
  draw($('#time-plot'), [
    {colour: sc['predicted'], line: true, points: cur.rows.map((row, i) => [i + 1, row[5]])},
    {colour: sc['realized'], line: true, points: cur.rows.map((row, i) => [i + 1, row[6]])},
    {colour: sc['plain decoding'], line: true, points: cur.plainMs.map((ms, i) => [i + 1, ms])}]);
  const first = Math.max(0, cur.rows.length - props.decision_rows);
  $('#decisions tbody').replaceChildren(...cur.rows.slice(first).map((row, i) => {
    const tr = document.createElement('tr');
    for (const v of [first + i + 1, ...row]) tr.append(text('td', '', v === null ? 'n/a' : String(v)));
    return tr; }));
}

async function follow(run) {
  reset();
  while (run === props.value) {
    const began = performance.now();
    let r;
    try {
      r = await server.poll({run, pieces: cur.pieces, steps: cur.steps, plain_pieces: cur.plain_pieces,
                             plain_ms: cur.plain_ms});
    } catch (e) { $('#stats').textContent = 'lost the server: ' + e; return; }
    if (run !== props.value) return;  // a newer request took the view
    render(r);
    if (r.done) return;
    await new Promise(ok => setTimeout(ok, Math.max(0, props.interval_ms - (performance.now() - began))));
  }
}

reset();
watch('value', () => { if (props.value) follow(props.value); });
if (props.value) follow(props.value);
"""
