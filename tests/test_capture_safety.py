"""What a GPU records can be recorded, proven on a CPU; a recording that fails anyway does not fail the request.

Every recorded step runs through the GPU's own path (arenas that pad to the bucket widths and record them as a
request opens them, ``Arena.record``, the head's ``draft_column``) with ``graphs.Rerun(check=True)`` as the capture:
the capture call runs under ``capture_check.refusing_host_reads``, which refuses what breaks a CUDA graph capture
(host reads, data-dependent shapes, host tensors). Covered: each verification width and the draft model's token
(batch 2, greedy and sampling), sliding-window and chunked masks, an EAGLE-3 head's column and the target's
feature widths. Negative controls: each kind of host read placed in a recorded step (by a forward pre-hook on the
model, as the GPU check's clock did on 2026-11-28) is refused, named once on stderr, and the request still gives
the eager path's tokens. A failure injected at the capture call: the same tokens, one line, that width eager for
the rest of the process, and a later request's recordings made as usual.
"""

from __future__ import annotations

import contextlib
import weakref

import pytest
import torch
import transformers
from conftest import left_padded, slow_except

import hf_adaspec
from hf_adaspec import CostTable, SpeculationState
from hf_adaspec.backend import arena_sizes, arenas, graphs, static_kv
from hf_adaspec.backend.arenas import arenas_of
from hf_adaspec.backend.capture_check import CaptureUnsafe, refusing_host_reads
from hf_adaspec.backend.head_kv import COLUMN

pytestmark = pytest.mark.usefixtures("one_thread", "private_cache")
COSTS = CostTable(verify_ms=(10.0,) * 9, draft_ms=1.0)  # given: no calibration (its probes would record too)
PROMPTS = [[5, 6, 7, 8, 9, 10, 3, 4] * 3, [11, 12, 13, 14, 15]]  # 24 and 5 tokens: past and inside a window of 8
BASE = dict(
    vocab_size=64,
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=8,
    max_position_embeddings=256,
    initializer_range=0.5,
    eos_token_id=None,
    bos_token_id=None,
    pad_token_id=0,
)
SLIDING = ["sliding_attention", "full_attention"]
ARCHITECTURES = {
    "llama": ("llama", {}),
    "gemma3-sliding": ("gemma3_text", {"sliding_window": 8, "layer_types": SLIDING, "tie_word_embeddings": False}),
    "llama4-chunked": (
        "llama4_text",
        {
            "attention_chunk_size": 8,
            "layer_types": ["chunked_attention", SLIDING[1]],
            "intermediate_size_mlp": 64,
            "num_local_experts": 2,
            "interleave_moe_layer_step": 2,
            "no_rope_layers": [1, 0],
        },
    ),
}


def _tiny(model_type: str, seed: int, **extra) -> torch.nn.Module:
    """A fresh 2-layer fp32 model of ``model_type`` (no arena, no recording yet), enabled."""
    config = transformers.AutoConfig.for_model(model_type, **{**BASE, **extra})
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config).float().eval()
    model.generation_config.eos_token_id, model.generation_config.pad_token_id = None, 0
    return hf_adaspec.enable(model)


@pytest.fixture
def as_on_a_gpu(monkeypatch):
    """Arenas pad to bucket widths and record them at opening, as on a GPU; each capture runs checked; the
    failures said so far are forgotten (each test sees its own line)."""
    monkeypatch.setattr(static_kv, "PAD_DEVICES", frozenset({"cpu"}))
    monkeypatch.setattr(arenas, "capture_for", lambda device: graphs.Rerun(check=True))
    _forget_failures(monkeypatch)


def _forget_failures(monkeypatch) -> None:
    """This test's failures start from none: none remembered, none said."""
    monkeypatch.setattr(graphs, "_FAILED", weakref.WeakKeyDictionary())
    monkeypatch.setattr(graphs, "_SAID", set())


def _generate(target, assistant, kv_cache: str, sample: bool, new: int = 16, prompts=PROMPTS):
    """k = 8 from ``assistant`` every step (whatever a policy would choose): verifications 9 wide, recordings of
    the widths 1, 2, 3, 5, 9 where arenas pad."""
    torch.manual_seed(3)
    return target.generate(
        **left_padded(prompts),
        assistant_model=assistant,
        speculation="fixed",
        num_speculative_tokens=8,
        speculation_costs=COSTS,
        speculation_state=SpeculationState(),
        max_new_tokens=new,
        do_sample=sample,
        kv_cache=kv_cache,
        return_dict_in_generate=True,
    )


def _unsafe(records) -> list[str]:
    return [f"width {r.width}: {r.error}" for r in records if r.error is not None]


@pytest.mark.parametrize("architecture", slow_except(sorted(ARCHITECTURES), fast={"llama"}))
def test_every_recorded_width_and_the_drafts_token_pass_the_capture_check(as_on_a_gpu, architecture, capsys):
    model_type, extra = ARCHITECTURES[architecture]
    target, draft = _tiny(model_type, 0, **extra), _tiny(model_type, 1, **extra)
    for sample in (False, True):
        out = _generate(target, draft, "static", sample)
        assert any(s.drafter == "draft_model" and s.k > 0 for s in out.speculation.steps)
    for model in (target, draft):
        records = arenas_of(model).records()
        graph_width = max(r.width for r in records)
        assert {r.width for r in records} == set(arena_sizes.width_buckets(graph_width)) and graph_width > 1
        assert {r.batch for r in records} == {2} and not _unsafe(records)
    assert "hf-adaspec" not in capsys.readouterr().err


@pytest.mark.slow  # the fast suite keeps test_every_recorded_width_..._pass_the_capture_check[llama] for the check
def test_the_heads_column_and_the_targets_feature_widths_pass_the_capture_check(as_on_a_gpu, models, tiny_head, capsys):
    target = models["target"]
    arenas_of(target).drop()
    arenas_of(tiny_head).drop()
    for sample in (False, True):
        out = _generate(target, tiny_head, "static", sample)
        assert any(s.drafter == "draft_head" and s.k > 1 for s in out.speculation.steps)
    head_records, target_records = arenas_of(tiny_head).records(), arenas_of(target).records()
    assert {(r.width, r.layers) for r in head_records} == {COLUMN} and not _unsafe(head_records)
    assert {r.layers for r in target_records} == {tiny_head.config.aux_layers} and not _unsafe(target_records)
    assert "hf-adaspec" not in capsys.readouterr().err


HOST_READS = {  # what a recorded step must not do, each on the block's ids [B, n] (a long tensor on the device)
    "item": (lambda ids: ids.sum().item(), "_local_scalar_dense"),
    "tolist": (lambda ids: ids.tolist(), "tolist"),
    "int": (lambda ids: int(ids[0, 0]), "_local_scalar_dense"),
    "if-tensor": (lambda ids: 1 if (ids > 3).any() else 0, "_local_scalar_dense"),
    "nonzero": (lambda ids: ids.nonzero(), "nonzero"),
    "boolean-mask": (lambda ids: ids[ids > 3], "boolean-mask indexing"),
    "host-tensor": (lambda ids: ids + torch.arange(ids.shape[1]), "on the host"),
    "cpu-copy": (lambda ids: ids.cpu(), "Tensor.cpu"),
}


@pytest.mark.parametrize("read", slow_except(sorted(HOST_READS), fast={"item"}))
def test_a_host_read_in_a_recorded_step_is_refused_and_the_request_runs_eagerly(
    as_on_a_gpu, tiny_factory, read, capsys
):
    """The negative control: the check refuses each host read (named in one stderr line); the width runs eagerly
    and the request gives the dynamic cache's tokens."""
    target, draft = hf_adaspec.enable(tiny_factory(0)), tiny_factory(1)
    reads, refused = HOST_READS[read]

    def hook(module, args, kwargs) -> None:
        reads(kwargs["input_ids"])

    target.register_forward_pre_hook(hook, with_kwargs=True)
    expected = _generate(target, draft, "dynamic", False).sequences
    assert torch.equal(_generate(target, draft, "static", False).sequences, expected)
    records = arenas_of(target).records()
    assert records and all(refused in r.error and not r.kept for r in records)
    assert all(r.error is None for r in arenas_of(draft).records())
    lines = [line for line in capsys.readouterr().err.splitlines() if "hf-adaspec" in line]
    assert len(lines) == 1 and refused in lines[0] and "LlamaForCausalLM" in lines[0]


def test_the_check_passes_what_a_capture_takes():
    """Device-side forms of the same work are not refused (the check is not simply strict)."""
    ids = torch.arange(12).reshape(2, 6)
    with refusing_host_reads():
        columns = torch.tensor([0, 2], device=ids.device)
        ids.masked_fill(ids > 3, 0) + torch.arange(6, device=ids.device) + ids[:, columns].sum(dim=1, keepdim=True)
        torch.where(ids > 3, ids, 0).index_copy_(1, columns[:1], ids[:, :1]).to(torch.float32)
    with pytest.raises(CaptureUnsafe, match="copies to the host"), refusing_host_reads():
        ids.to("cpu")


class FailingAt:
    """``Rerun``, except that capturing the ``fail``-th call raises (as a CUDA capture that is invalidated)."""

    def __init__(self, fail: int) -> None:
        self.calls, self.fail = 0, fail

    def __call__(self, fn):
        self.calls += 1
        if self.calls == self.fail:
            fn()  # the capture got under way
            raise RuntimeError("CUDA error: operation failed due to a previous error during capture")
        return graphs.Rerun(check=True)(fn)


@pytest.mark.slow  # the fast suite keeps test_a_failed_capture_of_the_heads_column_drafts_eagerly for the rule
def test_a_failed_capture_leaves_that_width_eager_and_the_next_request_records(monkeypatch, tiny_factory, capsys):
    """The second capture of a request fails: the request gives the eager tokens, one line names the error, that
    width stays eager; a later request (one row: new arenas) records its other widths and never that one."""
    monkeypatch.setattr(static_kv, "PAD_DEVICES", frozenset({"cpu"}))
    _forget_failures(monkeypatch)
    failing = FailingAt(2)
    monkeypatch.setattr(arenas, "capture_for", lambda device: failing)
    target, draft = hf_adaspec.enable(tiny_factory(0)), tiny_factory(1)
    expected = {rows: _generate(target, draft, "dynamic", False, prompts=PROMPTS[:rows]).sequences for rows in (2, 1)}
    assert torch.equal(_generate(target, draft, "static", False).sequences, expected[2])
    records = {model: arenas_of(model).records() for model in (target, draft)}
    failed = [(model, r.width) for model, rs in records.items() for r in rs if r.error is not None]
    assert len(failed) == 1 and all(r.kept for rs in records.values() for r in rs if r.error is None)
    lines = [line for line in capsys.readouterr().err.splitlines() if "hf-adaspec" in line]
    assert len(lines) == 1 and "operation failed due to a previous error during capture" in lines[0]
    assert torch.equal(_generate(target, draft, "static", False, prompts=PROMPTS[:1]).sequences, expected[1])
    ((model, width),) = failed
    later = [r for r in arenas_of(model).records() if r.batch == 1]
    assert later and all(r.kept and r.error is None for r in later) and width not in {r.width for r in later}
    assert "hf-adaspec" not in capsys.readouterr().err  # said once


def test_a_failed_capture_of_the_heads_column_drafts_eagerly(monkeypatch, models, tiny_head, capsys):
    """Every arena's first capture fails (the head's column among them): the head drafts eagerly, same tokens."""
    _forget_failures(monkeypatch)
    monkeypatch.setattr(arenas, "capture_for", lambda device: FailingAt(1))
    target = models["target"]
    for model in (target, tiny_head):
        arenas_of(model).drop()
    expected = _generate(target, tiny_head, "dynamic", False).sequences
    assert torch.equal(_generate(target, tiny_head, "static", False).sequences, expected)
    assert [r.error is not None for r in arenas_of(tiny_head).records()] == [True]
    assert sum("hf-adaspec" in line for line in capsys.readouterr().err.splitlines()) == 1


def test_the_installed_torch_is_in_the_supported_range_and_has_what_a_failed_capture_is_released_with():
    """pyproject's torch range holds this torch, which has the calls ``graphs.CudaGraphs`` releases a failed capture
    with (their names differ outside the range)."""
    import tomllib
    from pathlib import Path

    from packaging.specifiers import SpecifierSet
    from packaging.version import Version

    project = tomllib.loads((Path(__file__).resolve().parent.parent / "pyproject.toml").read_text())["project"]
    spec = next(d.removeprefix("torch") for d in project["dependencies"] if d.startswith("torch"))
    assert Version(Version(torch.__version__).base_version) in SpecifierSet(spec)
    assert callable(torch._C._cuda_endAllocateToPool) and callable(torch._C._cuda_releasePool)
    assert callable(torch.Generator.clone_state) and callable(torch.Generator.graphsafe_set_state)


@pytest.mark.parametrize("invalidated", [True, False], ids=["invalidated", "ended-cleanly"])
def test_a_failed_cuda_capture_releases_the_pool_and_the_generator_and_the_next_capture_gets_a_new_pool(
    monkeypatch, invalidated
):
    """``graphs.CudaGraphs`` on stand-ins for torch's CUDA calls (no GPU here): ``fn`` raises inside the capture.
    An invalidated capture (its ``capture_end`` raises, as torch's does before it ends the allocator's recording):
    the recording ended and the pool released, the generator given a state outside capture, the graph reset. A
    capture that still ended cleanly: only the graph reset (it releases itself). Either way the caller gets fn's
    error and the next capture goes to a new pool."""
    log, pools = [], iter(range(2, 9))

    class Graph:
        def capture_begin(self, pool):
            log.append(("begin", pool))

        def capture_end(self):
            log.append("end")
            if invalidated and fail[0]:
                raise RuntimeError("CUDA error: operation failed due to a previous error during capture")

        def reset(self):
            log.append("reset")

    class Generator:
        def clone_state(self):
            return "fresh state"

        def graphsafe_set_state(self, state):
            log.append(("generator", state))

    class Stream:
        def wait_stream(self, other):
            pass

    for name, value in {
        "Stream": Stream,
        "stream": lambda s: contextlib.nullcontext(),
        "current_stream": Stream,
        "synchronize": lambda: None,
        "CUDAGraph": Graph,
        "current_device": lambda: 0,
        "default_generators": (Generator(),),
        "graph_pool_handle": lambda: next(pools),
    }.items():
        monkeypatch.setattr(torch.cuda, name, value)
    monkeypatch.setattr(torch._C, "_cuda_endAllocateToPool", lambda device, pool: log.append(("end pool", pool)))
    monkeypatch.setattr(torch._C, "_cuda_releasePool", lambda device, pool: log.append(("release", pool)))
    capture, fail = graphs.CudaGraphs(pool=1, warmup=1), [True]

    def fn():
        if fail[0] and ("begin", 1) in log:
            raise RuntimeError("operation not permitted when stream is capturing")
        return (torch.zeros(1),)

    with pytest.raises(RuntimeError, match="operation not permitted when stream is capturing"):
        capture(fn)
    released = [("end pool", 1), ("release", 1), ("generator", "fresh state")] if invalidated else []
    assert log == [("begin", 1), "end", *released, "reset"] and capture.pool == 2
    log.clear()
    fail[0] = False
    graph, out = capture(fn)
    assert log == [("begin", 2), "end"] and isinstance(graph, Graph) and torch.equal(out[0], torch.zeros(1))
