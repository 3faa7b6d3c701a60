"""One-off (issue 37): the same adaptive generate (Qwen pair, 192 tokens) on the main thread and on worker
threads, with set_num_threads / flush-denormal tried in the thread. Run: HF_ADASPEC_PROFILE=... python
benchmarks/generate_thread.py (optionally with MALLOC_ARENA_MAX=1)."""
import threading, time, json, torch
import hf_adaspec
from hf_adaspec.engine.run import SpeculationState
P = "Write a Python function is_palindrome(s) with a docstring and tests."
t = hf_adaspec.load("qwen2.5-coder-1.5b"); d = hf_adaspec.load("qwen2.5-coder-0.5b", quantize_lm_head=True)
hf_adaspec.enable(t.model)
inputs = t.tokenizer.apply_chat_template([{"role": "user", "content": P}], add_generation_prompt=True, return_tensors="pt", return_dict=True)
def direct():
    s = time.perf_counter()
    out = t.model.generate(**inputs, assistant_model=d.model, speculation="adaptive", max_new_tokens=192, do_sample=False,
                           return_dict_in_generate=True, speculation_state=SpeculationState())
    return round(time.perf_counter() - s, 2)
print("main", direct(), direct(), flush=True)
res = {}
def a(): res["a"] = direct()
def b(): torch.set_num_threads(torch.get_num_threads()); res["b"] = direct()
def c(): torch.set_flush_denormal(True); res["c"] = direct()
for name, f in (("thread", a), ("thread+set_num_threads", b), ("thread+flush_denormal", c), ("thread", a)):
    th = threading.Thread(target=f); th.start(); th.join(); print(name, res, flush=True)
print("main", direct(), flush=True)
