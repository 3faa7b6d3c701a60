"""Adaptive speculative decoding on the default Qwen2.5-Coder pair; prints the text and the stats.

Run: python examples/quickstart.py   (after `make install`; first run assembles and converts models)
"""

import hf_adaspec


def main() -> None:
    target = hf_adaspec.load(hf_adaspec.DEFAULT_TARGET)
    draft = hf_adaspec.load(hf_adaspec.DEFAULT_DRAFT, quantize_lm_head=True)
    hf_adaspec.enable(target.model)
    inputs = target.tokenizer.apply_chat_template(
        [{"role": "user", "content": "Write a quicksort in Python."}],
        add_generation_prompt=True, return_tensors="pt", return_dict=True,
    )
    out = target.model.generate(
        **inputs, assistant_model=draft.model, speculation="adaptive",
        max_new_tokens=128, return_dict_in_generate=True,
    )
    print(target.tokenizer.decode(out.sequences[0, inputs["input_ids"].shape[1]:], skip_special_tokens=True))
    print(out.speculation.summary())
    for step in out.speculation.steps[:10]:
        print(step)


if __name__ == "__main__":
    main()
