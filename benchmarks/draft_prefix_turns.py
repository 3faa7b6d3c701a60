"""Draft prefix reuse in a two-turn chat: how many prompt tokens the draft reuses on each turn.

The second turn's prompt resends the first turn and its answer, so the draft (``engine.draft_prefix``,
always on at batch size 1) should start from its cache of the first request up to where the two prompts
part. Greedy, "adaptive", the default Qwen pair (NF4), 48 new tokens per turn.

Run: python benchmarks/draft_prefix_turns.py
Last stdout line: one JSON object (per turn: prompt tokens and draft-reused tokens).
"""

import json

from common import load_pair

TURNS = ("Write a Python function that checks whether a number is prime.", "Now add type hints and a docstring.")


def main() -> None:
    model, tokenizer, draft = load_pair()
    messages, rows = [], []
    for text in TURNS:
        messages.append({"role": "user", "content": text})
        inputs = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt",
                                               return_dict=True)
        out = model.generate(**inputs, assistant_model=draft, speculation="adaptive", max_new_tokens=48,
                             do_sample=False, return_dict_in_generate=True)
        prompt = inputs["input_ids"].shape[1]
        rows.append({"prompt_tokens": prompt, "draft_reused_tokens": out.speculation.draft_prefix_tokens})
        print(f"turn {len(rows)}: prompt {prompt} tokens, the draft reused {rows[-1]['draft_reused_tokens']}")
        answer = tokenizer.decode(out.sequences[0, prompt:], skip_special_tokens=True)
        messages.append({"role": "assistant", "content": answer})
    print(json.dumps({"turns": rows}))


if __name__ == "__main__":
    main()
