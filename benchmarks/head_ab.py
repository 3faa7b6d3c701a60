"""One-off (issue 56, auto's head choice): the q4 target with its dense output head against the file's Q6_K head,
plain greedy generate of 128 tokens on the demo prompt, one process, interleaved, 3 timed rounds after one.
Run from the project root: ``python benchmarks/head_ab.py``."""
import time, statistics, torch
from hf_adaspec import load
from hf_adaspec.cli.cli import DEFAULT_PROMPT
from hf_adaspec.models.formats import FORMATS
from hf_adaspec.models.loading import source
from hf_adaspec.models.presets import DEFAULT_TARGET
lm = load(DEFAULT_TARGET, quantization="q4")
m, tok = lm.model, lm.tokenizer
dense_head = m.get_output_embeddings()
q_head = FORMATS["q4"].quantize_head(m, source(DEFAULT_TARGET))
ids = tok.apply_chat_template([{"role": "user", "content": DEFAULT_PROMPT}], add_generation_prompt=True, return_tensors="pt", return_dict=True)
res = {"dense head": [], "q4 head": []}
for r in range(4):
    for name, head in (("dense head", dense_head), ("q4 head", q_head)):
        m.set_output_embeddings(head)
        s = time.perf_counter()
        out = m.generate(**ids, max_new_tokens=128, min_new_tokens=128, do_sample=False)
        el = time.perf_counter() - s
        if r: res[name].append(128 / el)
print({k: [round(x, 2) for x in v] for k, v in res.items()}, {k: round(statistics.median(v), 2) for k, v in res.items()})
