"""The dense route (issue 56): a q4 layer's product over many rows through its dequantized weight, where it starts
(measured once per machine and cached), and that decoding, and so greedy output, does not depend on it."""

from __future__ import annotations

import types

import pytest
import torch
from conftest import save_tiny_llama
from test_q4_kernel import gguf_rows

import hf_adaspec
from hf_adaspec.bench.bench import divergence_gap
from hf_adaspec.kernels import q4, q4_layer, route
from hf_adaspec.models import route_choice
from hf_adaspec.models.format_load import load_weights
from hf_adaspec.models.format_quality import agreement, greedy_reference
from hf_adaspec.models.formats import FORMATS

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture
def kdir(kernel_dir):
    return kernel_dir


@pytest.fixture
def tiny_dir(tmp_path, private_cache):
    """A tiny Llama (64 wide: every linear fits q4's groups of 32) and its tokenizer, saved."""
    return save_tiny_llama(tmp_path / "tiny", 64)


def _fused(kdir, bias: bool) -> q4_layer.Q4Linear:
    """A 512-wide layer of three kinds (fused projections), 40 output rows."""
    parts = [
        gguf_rows("Q4_K", 16, 512, 1, kdir),
        gguf_rows("Q6_K", 8, 512, 2, kdir),
        gguf_rows("Q8_0", 16, 512, 3, kdir),
    ]
    return q4_layer.Q4Linear(
        512, parts, torch.randn(40, generator=torch.Generator().manual_seed(4)) if bias else None, kdir
    )


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("bias", [False, True])
def test_the_dense_route_is_the_dense_weights_product(kdir, dtype, bias):
    """Each tile (here one per kind: 16, 8 and 16 rows) is exactly F.linear on the dequantized weight's rows (in the
    activations' dtype, bias rounded to it), the arithmetic of the dense model the file dequantizes to. Like is
    compared with like: a product of another shape (the whole [40, 512] weight) may be blocked otherwise by the
    CPU's BLAS, so it is held to float rounding only: 64 float32 units in the last place of its largest value, plus
    one unit of the dtype."""
    layer = _fused(kdir, bias)
    x = torch.randn(70, 512, generator=torch.Generator().manual_seed(5)).to(dtype)  # [M, K]
    assert q4_layer.DENSE_TILE_BYTES // (512 * x.element_size()) >= max(layer.rows.tolist())  # a kind fits one tile
    weight = layer.weight_float().to(dtype)  # [40, 512]
    b = None if layer.bias is None else layer.bias.to(dtype)  # [40]
    got = layer.dense_product(x)  # [70, 40]
    bounds = [0, *torch.cumsum(layer.rows, 0).tolist()]  # [0, 16, 24, 40]
    for lo, hi in zip(bounds, bounds[1:]):
        tile = torch.nn.functional.linear(x, weight[lo:hi], None if b is None else b[lo:hi])  # [70, hi - lo]
        assert torch.equal(got[:, lo:hi], tile), (lo, hi)
    whole = torch.nn.functional.linear(x, weight, b)  # [70, 40]
    atol = 64 * torch.finfo(torch.float32).eps * float(whole.abs().max())
    torch.testing.assert_close(got, whole, rtol=torch.finfo(dtype).eps, atol=atol)


def test_tiles_give_the_whole_matrix_product(kdir, monkeypatch):
    layer = _fused(kdir, True)
    x = torch.randn(9, 512, generator=torch.Generator().manual_seed(6))  # [M, K]
    whole = layer.dense_product(x)
    monkeypatch.setattr(q4_layer, "DENSE_TILE_BYTES", 7 * 512 * 4)  # 7 rows a tile: tiles inside and across the kinds
    tiled = layer.dense_product(x)
    assert tiled.shape == (9, 40) and torch.allclose(tiled, whole, rtol=1e-5, atol=1e-5)


def test_a_layer_takes_the_dense_route_from_its_dense_rows(kdir):
    layer = _fused(kdir, True)
    x = torch.randn(2, 3, 512, generator=torch.Generator().manual_seed(7))  # [B, T, K]: 6 rows
    flat = x.reshape(6, 512)
    kernel = q4.linear(flat, layer.blocks, layer.kind_ids, layer.rows, 512, kdir, layer.bias)
    assert torch.equal(layer(x).reshape(6, 40), kernel)  # no route set
    layer.dense_rows = 7
    assert torch.equal(layer(x).reshape(6, 40), kernel)
    layer.dense_rows = 6
    assert torch.equal(layer(x).reshape(6, 40), layer.dense_product(flat))
    assert not torch.equal(layer.dense_product(flat), kernel)  # the two differ: the route was taken


def test_the_route_starts_where_the_dense_product_stays_faster():
    rows = (64, 128, 256, 512)
    assert route.crossover(rows, [10, 20, 40, 80], [15, 18, 20, 30]) == 128
    assert route.crossover(rows, [10, 20, 40, 80], [5, 25, 20, 30]) == 256  # faster at 64, slower at 128
    assert route.crossover(rows, [10, 20, 40, 80], [5, 10, 20, 90]) is None  # slower at the largest
    assert route.crossover(rows, [10, 20, 40, 80], [10, 20, 40, 80]) is None  # a tie is not faster


@pytest.mark.parametrize(
    "timings,measured,start",
    [
        ([(80, 90)], [512], None),  # the dense product slower at the largest count: nothing smaller is timed
        ([(80, 30), (40, 20), (20, 25)], [128, 256, 512], 256),
        ([(80, 30), (40, 20), (20, 15), (10, 5)], [64, 128, 256, 512], 64),
    ],
)
def test_the_route_is_timed_from_the_largest_count_down_until_the_dense_product_is_not_faster(
    monkeypatch, timings, measured, start
):
    script = iter(timings)  # (kernel ms, dense ms) at 512, 256, 128, 64 rows
    monkeypatch.setattr(route, "_medians_ms", lambda ways: next(script))
    layer = types.SimpleNamespace(dense_rows=7, in_features=32)
    rows, kernel_ms, dense_ms = route.measure(layer, torch.float32)
    assert rows == measured and list(zip(kernel_ms, dense_ms)) == timings[::-1] and layer.dense_rows == 7
    assert route.crossover(tuple(rows), kernel_ms, dense_ms) == start


def test_the_route_is_measured_once_per_machine_and_cached(tiny_dir, monkeypatch, tmp_path):
    calls = []

    def fake(layer, dtype):
        calls.append(dtype)
        return [128, 256, 512], [20.0, 40.0, 80.0], [15.0, 20.0, 30.0]

    monkeypatch.setattr(route, "measure", fake)
    model = load_weights(tiny_dir, "tiny", "q4", "float32", "cpu", False)
    assert calls == [torch.float32] and {m.dense_rows for m in route.layers(model)} == {128}
    assert route_choice.apply(load_weights(tiny_dir, "tiny", "q4", "float32", "cpu", False)) == 128
    assert len(calls) == 1  # read back
    for path in (tmp_path / "routes").iterdir():
        path.write_text(path.read_text().replace("128", "64"))  # the digest no longer matches
    route_choice.apply(model)
    assert len(calls) == 2  # measured again
    load_weights(tiny_dir, "tiny", "q4", "bfloat16", "cpu", False)
    assert calls[-1] == torch.bfloat16  # another dtype, another decision


def test_a_quantized_head_takes_the_body_s_route(tiny_dir):
    model = load_weights(tiny_dir, "tiny", "q4", "float32", "cpu", False)
    route.set_rows(model, 9)
    head = FORMATS["q4"].quantize_head(model, tiny_dir)
    assert head.dense_rows == 9


def test_speculative_greedy_equals_plain_with_the_prefill_on_the_dense_route(tiny_dir):
    """The prompt (20 tokens) is prefilled through dense weights, every step and verification (k + 1 = 5 rows)
    through the kernel: both methods decode the same way, so in float32 their outputs are the same."""
    target = hf_adaspec.enable(load_weights(tiny_dir, "tiny", "q4", "float32", "cpu", False))
    route.set_rows(target, 16)
    draft = load_weights(tiny_dir, "tiny", "none", "float32", "cpu", False)
    prompt = torch.randint(1, 64, (1, 20), generator=torch.Generator().manual_seed(8))
    plain = target.generate(prompt, max_new_tokens=30, do_sample=False)
    spec = target.generate(
        prompt,
        max_new_tokens=30,
        do_sample=False,
        assistant_model=draft,
        speculation="fixed",
        num_speculative_tokens=4,
        speculation_costs=hf_adaspec.CostTable(verify_ms=tuple(10.0 + n for n in range(9)), draft_ms=1.0),
    )
    assert divergence_gap(target, plain, spec) is None


def test_the_quality_check_reads_through_the_kernel_whatever_the_route(tiny_dir, monkeypatch):
    """Agreement is scored on the decoding path: with the route from 4 rows, the teacher-forced forward (25 rows)
    still multiplies on the kernel, and the route is back after."""
    model = load_weights(tiny_dir, "tiny", "q4", "float32", "cpu", False)
    refs = greedy_reference(model, [torch.arange(3, 15)], 13)
    route.set_rows(model, None)
    on_kernel = agreement(model, refs)
    dense_calls = []
    product = q4_layer.Q4Linear.dense_product
    monkeypatch.setattr(
        q4_layer.Q4Linear, "dense_product", lambda self, x: dense_calls.append(x.shape) or product(self, x)
    )
    route.set_rows(model, 4)
    assert agreement(model, refs) == on_kernel and on_kernel[0] == 1.0 and not dense_calls
    assert {m.dense_rows for m in route.layers(model)} == {4}
    with torch.inference_mode():
        model(torch.arange(3, 15)[None])
    assert dense_calls  # outside the check the route is taken


def test_the_route_is_in_the_cost_identity(tiny_dir):
    """A cost table timed with one route is not reused with another (batched verifications can reach it)."""
    from hf_adaspec.costs.table import pair_identity

    model = load_weights(tiny_dir, "tiny", "q4", "float32", "cpu", False)
    route.set_rows(model, None)
    never = pair_identity(model, None)
    route.set_rows(model, 128)
    assert never["q4_dense_rows"] == [0] and pair_identity(model, None) == {**never, "q4_dense_rows": [128]}
