"""The ``q4`` and ``none`` formats read from a GGUF file (``models.gguf_weights``), end to end on a tiny Llama written
as llama.cpp's converter writes it (query/key rows interleaved per head, Q8_0, Q5_0, Q5_1 and F32 tensors), and the
fused projections (``kernels.fused``). Nothing here depends on the processor: the plain-C path gives the AVX2 one's
results within float rounding (``test_q4_kernel``)."""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch
import transformers

from hf_adaspec.kernels import fused, q4_layer
from hf_adaspec.models import gguf_weights
from hf_adaspec.models.format_load import load_weights
from hf_adaspec.models.formats import FORMATS, Source

TYPES = {
    "attn_q": "Q8_0",
    "attn_k": "Q5_0",
    "attn_v": "Q8_0",
    "attn_output": "Q5_1",
    "ffn_gate": "Q8_0",
    "ffn_up": "Q5_0",
    "ffn_down": "Q8_0",
    "output": "Q8_0",
    "token_embd": "Q8_0",
}


def _tiny() -> transformers.LlamaForCausalLM:
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=96,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
        initializer_range=0.3,
        tie_word_embeddings=False,
    )
    return transformers.LlamaForCausalLM(config).float().eval()


def _interleaved(w: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's converter's permutation of query/key rows (what the loader undoes)."""
    n = w.shape[0]
    return w.reshape(heads, 2, n // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


@pytest.fixture(scope="module")
def written(tmp_path_factory):
    """(tiny model, its GGUF file, config folder, the dense weights the file holds by HF name)."""
    model, folder = _tiny(), tmp_path_factory.mktemp("gguf")
    model.config.save_pretrained(folder)
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.LLAMA, model.config.num_hidden_layers)
    writer = gguf.GGUFWriter(str(folder / "tiny.gguf"), "llama")
    held = {}
    for hf, value in model.state_dict().items():
        base, _, suffix = hf.rpartition(".")
        name = f"{names.get_name(base)}.{suffix}"
        w = value.numpy()
        if ".attn_q." in name or ".attn_k." in name:
            heads = model.config.num_attention_heads if ".attn_q." in name else model.config.num_key_value_heads
            w = _interleaved(w, heads)
        kind = TYPES.get(name.split(".")[-2] if name.startswith("blk") else name.split(".")[0], "F32")
        if kind == "F32":
            writer.add_tensor(name, w)
            file_value = w
        else:
            qtype = gguf.GGMLQuantizationType[kind]
            blocks = gguf.quants.quantize(w, qtype)
            writer.add_tensor(name, blocks, raw_shape=blocks.shape, raw_dtype=qtype)
            file_value = gguf.quants.dequantize(blocks, qtype)
        if ".attn_q." in name or ".attn_k." in name:  # undo the interleaving: the model's own row order
            heads = model.config.num_attention_heads if ".attn_q." in name else model.config.num_key_value_heads
            file_value = file_value.reshape(heads, file_value.shape[0] // heads // 2, 2, -1).swapaxes(1, 2)
            file_value = file_value.reshape(w.shape)
        held[hf] = torch.from_numpy(np.ascontiguousarray(file_value, dtype=np.float32)).reshape(value.shape)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return model, folder / "tiny.gguf", str(folder), held


def _source(written) -> Source:
    _, path, folder, _ = written
    return Source(gguf=path, meta_path=lambda: folder, dense_path=lambda: pytest.fail("no dense copy is needed"))


def _logits(model, ids):
    with torch.inference_mode():
        return model(ids).logits


def test_none_reads_the_files_values_in_memory(written, private_cache):
    reference, _, _, held = written
    dense = load_weights(_source(written), "tiny", "none", "float32", "cpu", False)
    state = dense.state_dict()
    assert all(torch.equal(state[name], value) for name, value in held.items())  # rows un-interleaved, exact
    reference.load_state_dict(held)
    ids = torch.randint(0, 96, (2, 12), generator=torch.Generator().manual_seed(1))
    assert torch.equal(_logits(dense, ids), _logits(reference, ids))


def test_q4_keeps_every_exact_block_and_follows_the_dense_model(written, private_cache, capsys):
    _, _, _, held = written
    model = load_weights(_source(written), "tiny", "q4", "float32", "cpu", True)
    assert "Q5_1 tensors have no exact layout" in capsys.readouterr().err  # said once, naming the type
    attention = model.model.layers[0].self_attn
    assert isinstance(attention.q_proj, fused.Q4Slice) and isinstance(attention.o_proj, q4_layer.Q4Linear)
    qkv = attention.q_proj.fused.weight_float()  # [q + k + v rows, 64]: Q8_0, Q5_0 (as q8_0), Q8_0: exact
    names = [f"model.layers.0.self_attn.{p}_proj.weight" for p in "qkv"]
    assert torch.equal(qkv, torch.cat([held[n] for n in names]))
    assert torch.equal(model.lm_head.weight_float(), held["lm_head.weight"])
    o = attention.o_proj.weight_float()  # Q5_1: dequantized, then 8 bits per weight
    assert not torch.equal(o, held["model.layers.0.self_attn.o_proj.weight"])
    torch.testing.assert_close(o, held["model.layers.0.self_attn.o_proj.weight"], rtol=0, atol=0.01)
    dense = load_weights(_source(written), "tiny", "none", "float32", "cpu", False)
    ids = torch.randint(0, 96, (2, 12), generator=torch.Generator().manual_seed(2))
    ours, ref = _logits(model, ids), _logits(dense, ids)
    assert float((ours - ref).norm() / ref.norm()) < 0.06  # 8-bit activations, per 256 features
    assert float((ours.argmax(-1) == ref.argmax(-1)).float().mean()) > 0.9


def test_an_architecture_transformers_reshapes_is_refused(written, kernel_dir, monkeypatch):
    monkeypatch.setattr(gguf_weights, "_REFUSED", ("llama",))
    _, path, folder, _ = written
    assert gguf_weights.build(path, folder, torch.float32, False, kernel_dir) is None


def test_auto_on_a_gguf_file_q4_reads_times_q4_alone_and_loads_no_dense_weights(written, private_cache, monkeypatch):
    """Where q4 reads the file's own blocks here, it is the only format loaded: dense weights are not (nor the
    dense copy NF4 would requantize: ``_source`` fails any call for it), nothing is scored, the others are recorded
    as not tried, a progress line names each stage, and q4's quantized head (the file's blocks too) is kept by time
    alone."""
    from conftest import build_tiny_tokenizer

    from hf_adaspec.models import format_choice as fc

    loads, lines, real_load = [], [], fc.load_weights
    monkeypatch.setattr(
        fc, "load_weights", lambda source, name, fmt, *rest: loads.append(fmt) or real_load(source, name, fmt, *rest)
    )

    def timer(model, fmt, n):
        return {"none": 40.0, "q4": 10.0}[fmt] * n * (0.5 if isinstance(model.lm_head, q4_layer.Q4Linear) else 1.0)

    choice, model = fc.choose(
        _source(written),
        "tiny",
        build_tiny_tokenizer(),
        "float32",
        timer=timer,
        formats=("nf4", "q4", "none"),
        progress=lines.append,
    )
    measures = {(m.format, m.head): m for m in choice.measures}
    assert loads == ["q4"] and choice.chosen == "q4" and choice.head
    assert isinstance(model.model.layers[0].mlp.down_proj, q4_layer.Q4Linear) and isinstance(
        model.lm_head, q4_layer.Q4Linear
    )
    for fmt in ("none", "nf4"):
        assert measures[fmt, False].error == "not tried: q4 runs the GGUF file's own blocks"
    assert all(m.exact and m.top1 is None for m in (measures["q4", False], measures["q4", True]))
    assert "q4 10/60 ms the GGUF file's own blocks, not scored" in choice.line("tiny")
    assert [line.rpartition(": ")[2] for line in lines] == [
        "q4 on the GGUF file's own blocks (dense weights not loaded)",
        "q4 + quantized head",
    ]
    assert all(line.startswith("hf-adaspec: tiny: timing the weight formats") for line in lines)


def test_auto_on_a_gguf_file_probes_every_format_where_q4_does_not_run(written, private_cache):
    """A q4 that fails (here at its first timed forward) is recorded once with its error; dense weights are then
    loaded as the quality reference and the other formats probed as on any other source."""
    from conftest import build_tiny_tokenizer

    from hf_adaspec.models import format_choice as fc

    timed = []

    def timer(model, fmt, n):
        timed.append(fmt)
        if fmt == "q4":
            raise RuntimeError("no kernel here")
        return 40.0 * n

    choice, model = fc.choose(
        _source(written),
        "tiny",
        build_tiny_tokenizer(),
        "float32",
        timer=timer,
        quality_tokens=8,
        formats=("q4", "none"),
    )
    assert choice.chosen == "none" and not choice.head and timed.count("q4") == 1
    assert [(m.format, m.error) for m in choice.measures] == [("q4", "RuntimeError: no kernel here"), ("none", None)]
    assert "none 40/240 ms the quality reference" in choice.line("tiny")


def test_a_q4_head_put_on_a_loaded_model_is_the_head_a_load_with_it_gives(written, private_cache):
    """``auto`` measures q4's quantized-head variant by replacing the head of the q4 model it loaded."""

    ids = torch.randint(0, 96, (2, 12), generator=torch.Generator().manual_seed(4))
    swapped = load_weights(_source(written), "tiny", "q4", "float32", "cpu", False)
    dense_head = _logits(swapped, ids)
    swapped.set_output_embeddings(FORMATS["q4"].quantize_head(swapped, _source(written)))
    loaded = load_weights(_source(written), "tiny", "q4", "float32", "cpu", True)
    assert torch.equal(_logits(swapped, ids), _logits(loaded, ids))
    assert not torch.equal(_logits(swapped, ids), dense_head)


def test_a_file_whose_blocks_q4_cannot_read_keeps_the_other_formats(written, monkeypatch):
    _, path, folder, _ = written
    assert gguf_weights.reads_exactly(path, folder)
    monkeypatch.setattr(gguf_weights, "_REFUSED", ("llama",))
    assert not gguf_weights.reads_exactly(path, folder)


def test_fused_slices_give_each_layers_own_product_and_recompute_for_a_new_input(kernel_dir):
    torch.manual_seed(3)
    layers = [
        q4_layer.Q4Linear.dense(torch.nn.Linear(64, n, bias=bias), kernel_dir) for n, bias in ((32, True), (16, False))
    ]
    slices = fused.fuse(layers, kernel_dir)
    x, other = torch.randn(3, 64), torch.randn(3, 64)
    assert torch.equal(slices[0](x), layers[0](x)) and torch.equal(slices[1](x), layers[1](x))
    assert torch.equal(slices[1](other), layers[1](other))  # alone, another input: its own product
    assert torch.equal(slices[0](x), layers[0](x)) and torch.equal(slices[0](other), layers[0](other))
    assert [s.out_features for s in slices] == [32, 16] and "fused" in dict(slices[0].named_children())
    with pytest.raises(ValueError, match="in_features differ"):
        fused.fuse([layers[0], q4_layer.Q4Linear.dense(torch.nn.Linear(32, 8), kernel_dir)], kernel_dir)
