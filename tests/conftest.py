"""Shared fixtures for the fast CPU tests: tiny random Llama models built from a config (no downloads)."""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import gc
import hashlib
from pathlib import Path

import pytest
import torch
import transformers

import hf_adaspec
from hf_adaspec.files import atomic_write
from hf_adaspec.policy.decision import Decision


def pytest_collection_finish(session):
    """Move everything alive after collection (torch, transformers, gradio, the test modules) out of the
    garbage collector's reach (``gc.freeze``): a full collection then scans only what the tests create, and
    the library's own ``gc.collect`` (the format probe calls it after each format) stays cheap."""
    gc.freeze()


def build_tiny_llama(seed: int, vocab_size: int = 64) -> transformers.LlamaForCausalLM:
    """A 2-layer, 32-wide Llama in float32, eval mode; weights from ``torch.manual_seed(seed)``.

    initializer_range=0.5 makes the random logits peaked enough for varied, non-degenerate greedy text.
    EOS is unset so only an explicit ``eos_token_id`` stops generation.
    """
    torch.manual_seed(seed)
    config = transformers.LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        initializer_range=0.5,
        eos_token_id=None,
        bos_token_id=None,
        pad_token_id=0,
    )
    model = transformers.LlamaForCausalLM(config).float().eval()
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    return model


def build_tiny_tokenizer() -> transformers.PreTrainedTokenizerFast:
    """A word-level tokenizer over the tiny models' 64 ids (``w0`` … ``w63``, split on whitespace), built in
    memory: no files, no downloads."""
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from tokenizers.pre_tokenizers import Whitespace

    tok = Tokenizer(WordLevel({f"w{i}": i for i in range(64)}, unk_token="w0"))
    tok.pre_tokenizer = Whitespace()
    return transformers.PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="w0", pad_token="w0")


def save_tiny_llama(path, hidden_size: int) -> str:
    """A tiny random Llama (seed 0; ``hidden_size`` wide, MLPs twice that, 64 ids, no EOS, pad 0) and
    ``build_tiny_tokenizer``'s tokenizer saved in ``path``; → ``path`` as a string."""
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=64,
        hidden_size=hidden_size,
        intermediate_size=2 * hidden_size,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        initializer_range=0.5,
        eos_token_id=None,
        bos_token_id=None,
        pad_token_id=0,
    )
    transformers.LlamaForCausalLM(config).save_pretrained(path)
    build_tiny_tokenizer().save_pretrained(path)
    return str(path)


def slow_except(values, fast) -> list:
    """``values`` as ``pytest.param``s for a one-argument ``parametrize``, those not in ``fast`` marked slow: the fast
    suite keeps a representative of the matrix, ``pytest -q`` (make test, CI) runs all of it."""
    return [pytest.param(v, marks=() if v in fast else pytest.mark.slow) for v in values]


def left_padded(prompts, pad: int = 0) -> dict[str, torch.Tensor]:
    """input_ids and attention_mask [B, T] for token lists of different lengths, rows right-aligned."""
    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), pad, dtype=torch.long)
    mask = torch.zeros(len(prompts), width, dtype=torch.long)
    for i, p in enumerate(prompts):
        ids[i, width - len(p) :], mask[i, width - len(p) :] = torch.tensor(p), 1
    return {"input_ids": ids, "attention_mask": mask}


def decide(controller, view):
    """``controller``'s decision from the ``StepView`` ``view`` (the engine hands ``decide`` a callable that
    builds it)."""
    return controller.decide(view.batch, lambda: view)


class PlainController:
    """Always a plain step, resting where ``rest_on(n)`` says for the n-th step (from 1), without asking for
    the view either way; keeps every decided step's outcome it observes."""

    def __init__(self, rest_on=lambda n: False) -> None:
        self.rest_on, self.asked, self.outcomes = rest_on, 0, []

    def decide(self, batch, view):
        self.asked += 1
        return Decision.plain(batch, rested=self.rest_on(self.asked))

    def observe(self, decision, outcome) -> None:
        self.outcomes.append(outcome)

    def account(self, elapsed_ms, emitted, plain, predicted_ms):
        pass

    def may_explore(self):
        return True

    def select(self, rows):
        pass


@contextlib.contextmanager
def single_thread():
    """One intra-op thread inside the block, torch's count restored after. For module and session fixtures:
    they are set up before the function-scoped ``one_thread``, and on a loaded 2-core machine two threads
    make each tiny forward ~10x slower (thread spin-up and barriers dominate)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)


@pytest.fixture
def one_thread():
    """Run tiny-tensor tests on one intra-op thread (thread spin-up dominates otherwise); restore after."""
    with single_thread():
        yield


@pytest.fixture(scope="module")
def tiny_factory():
    """``tiny_factory(seed, vocab_size=64)`` → a fresh tiny Llama."""
    return build_tiny_llama


@pytest.fixture(scope="session")
def kernel_dir(request, tmp_path_factory):
    """Where the C kernels are built (``kernels.cbuild.build``), for every private cache: pytest's cache folder,
    so a build is reused by later runs (a library is named after its source, compiler and flags, and written
    atomically); a fresh folder per session where pytest's cache is off (``-p no:cacheprovider``)."""
    return kept_folder(request, "hf-adaspec-kernels") or tmp_path_factory.mktemp("kernels")


def kept_folder(request, name: str) -> Path | None:
    """The folder ``name`` in pytest's cache folder (kept across runs), or None where pytest's cache is off."""
    return request.config.cache.mkdir(name) if request.config.pluginmanager.has_plugin("cacheprovider") else None


@pytest.fixture
def private_cache(tmp_path, monkeypatch, kernel_dir):
    """Any calibration writes under tmp_path, never the user's cache; the q4 kernel's build is shared."""
    monkeypatch.setenv("HF_ADASPEC_CACHE", str(tmp_path))
    (tmp_path / "kernels").symlink_to(kernel_dir, target_is_directory=True)


@pytest.fixture(scope="module")
def models(tiny_factory):
    """target (enabled) and drafts: another seed (α≈0), a perturbed copy (0<α<1), the target itself (α=1).

    Enabled under ``single_thread``: the model's own ``SpeculationState`` takes its thread chooser from torch's
    count at ``enable``, and module fixtures are set up before ``one_thread``; else the tests' generate calls
    would switch to two threads per step (~10x slower tiny forwards on a loaded 2-core machine)."""
    with single_thread():
        target = hf_adaspec.enable(tiny_factory(0))
    noisy = copy.deepcopy(target)
    gen = torch.Generator().manual_seed(2)
    with torch.no_grad():
        for p in noisy.parameters():
            p.add_(0.05 * p.std() * torch.randn(p.shape, generator=gen))
    return {"target": target, "other_seed": tiny_factory(1), "noisy_copy": noisy, "same_model": tiny_factory(0)}


HEAD_LAYERS = (0, 1, 1)  # the tiny target's residual stream at the inputs of layers 0, 1 (twice): 3 × 32 wide
HEAD_PROMPTS = (
    [5, 6, 7, 8, 9, 10] * 4,
    [11, 12, 13],
    [3, 4, 5, 6, 7, 3, 4, 5, 6, 7, 8],
    [40, 41, 40, 41, 40],
    list(range(1, 41)),
)


def train_tiny_head(target, steps: int = 80, draft_vocab: int = 48, lr: float = 1e-2):
    """An EAGLE-3 head for the tiny target, trained for seconds: the target's greedy continuations of 32
    random prompts and of ``HEAD_PROMPTS`` (40 tokens each), teacher-forced, cross-entropy against the
    target's argmax; the draft vocabulary is the ``draft_vocab`` most frequent argmax tokens."""
    from hf_adaspec.models.eagle3 import Eagle3Head, HeadCache, HeadConfig

    torch.manual_seed(0)
    gen = torch.Generator().manual_seed(1)
    randoms = torch.randint(1, 64, (32, 8), generator=gen)  # [32, 8]: one batch, no padding
    with torch.no_grad():
        seqs = [*target.generate(randoms, max_new_tokens=40, do_sample=False)]
        seqs += [target.generate(torch.tensor([p]), max_new_tokens=40, do_sample=False)[0] for p in HEAD_PROMPTS]
    width = max(len(s) for s in seqs)
    seqs = torch.stack([torch.cat([s, s[-1:].expand(width - len(s))]) for s in seqs])  # [N, T]
    with torch.no_grad():
        out = target(seqs, output_hidden_states=True)
    features = torch.cat([out.hidden_states[i] for i in HEAD_LAYERS], dim=-1)  # [N, T, 96]
    labels = out.logits.argmax(-1)  # the target's next token after each position
    ids = torch.bincount(labels.flatten(), minlength=64).argsort(descending=True)[:draft_vocab].sort().values
    config = HeadConfig(32, 4, 2, 64, 32, draft_vocab, 64, HEAD_LAYERS, verifier="tiny-llama")
    head = Eagle3Head(config, target.get_input_embeddings())
    head.set_vocabulary(ids)
    to_draft = torch.full((64,), -1)
    to_draft[ids] = torch.arange(draft_vocab)
    tokens, hidden, wanted = seqs[:, 1:], features[:, :-1], to_draft[labels[:, 1:]]  # entry p: (x_p, g_{p-1})
    valid = torch.ones(tokens.shape, dtype=torch.bool)
    opt = torch.optim.Adam(head.parameters(), lr=lr)
    for _ in range(steps):
        logits = head.lm_head(head.norm(head.step(tokens, head.fuse(hidden), valid, HeadCache(len(seqs)))))
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, draft_vocab), wanted.reshape(-1), ignore_index=-1)
        opt.zero_grad()
        loss.backward()
        opt.step()
    return head.eval()


@pytest.fixture(scope="session")
def tiny_head_weights(request):
    """(state dict, config) of ``train_tiny_head`` on the seed-0 tiny target, trained once and kept in pytest's
    cache folder (as the kernels are) under a hash of what makes it: this file, the head's module, torch's and
    transformers' versions; written atomically. Trained per session where pytest's cache is off."""
    from hf_adaspec.models import eagle3

    folder = kept_folder(request, "hf-adaspec-tiny-head")
    made_of = [Path(__file__).read_bytes(), Path(eagle3.__file__).read_bytes(), torch.__version__.encode()]
    tag = hashlib.sha256(b"".join([*made_of, transformers.__version__.encode()])).hexdigest()[:16]
    path = folder / f"head-{tag}.pt" if folder else None
    if path is not None and path.exists():
        kept = torch.load(path, weights_only=True)
        return kept["state"], eagle3.HeadConfig(**{**kept["config"], "aux_layers": tuple(kept["config"]["aux_layers"])})
    with single_thread():  # session fixtures run before one_thread; two threads make tiny steps several times slower
        head = train_tiny_head(build_tiny_llama(0))
    state = {k: v.detach().clone() for k, v in head.state_dict().items()}
    if path is not None:
        atomic_write(path, lambda f: torch.save({"state": state, "config": dataclasses.asdict(head.config)}, f))
    return state, head.config


@pytest.fixture(scope="module")
def tiny_head(models, tiny_head_weights):
    """The trained tiny head on this module's target (``models["target"]``, whose embedding it shares)."""
    from hf_adaspec.models.eagle3 import Eagle3Head

    state, config = tiny_head_weights
    head = Eagle3Head(config, models["target"].get_input_embeddings())
    head.load_state_dict(state)
    return head.eval()
