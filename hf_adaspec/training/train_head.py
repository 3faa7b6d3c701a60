"""``hf-adaspec train-head``: an EAGLE-3 draft head trained here by self-distillation, resumable, with its
validation agreement logged as a curve.

Design: recording (``head_data``) and training are separate passes over disk. The data set of a run is
the first ``tokens`` tokens of one fixed shard stream, so runs at several sizes are nested and their
curves compare data, not luck. The draft vocabulary is the ``draft_vocab`` ids the target predicts most
often on that data; the head starts from the target's readout (``eagle3_train.init_from_target``).
Training is AdamW on the training-time-test loss in bf16 autocast with float32 weights; every
``eval_every`` optimizer steps and at the end, the agreement α_s (the head's step-s argmax equals the
target's, given the earlier tokens were the target's) on each validation set goes to ``curve.jsonl`` with
the tokens seen and the hours spent. ``checkpoint.pt`` (weights, optimizer, step, curve) is written
atomically every ``checkpoint_minutes`` and at the end, so a killed run resumes where it was; the head
itself is written in the speculators format (``head/``), loadable by ``hf_adaspec.load_head`` and vLLM.
"""

from __future__ import annotations

import io
import json
import math
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from tqdm.auto import tqdm

from ..backend import hf_compat
from ..files import atomic_write
from ..models.eagle3 import Eagle3Head
from ..models.eagle3_format import random_head, save_head
from ..models.eagle3_train import (
    distill_loss,
    draft_index,
    init_from_target,
    soft_labels,
    ttt_forward,
)
from .head_data import Sequences


@dataclass(frozen=True)
class TrainConfig:
    """A training run: ``tokens`` of data, ``epochs`` over it (or ``train_steps`` optimizer steps when set,
    so runs on several data sizes spend the same compute), ``steps`` training-time-test steps, AdamW at
    ``lr`` (linear warm-up over ``warmup`` optimizer steps, cosine decay to 10%), ``batch`` sequences per
    step, a draft vocabulary of ``draft_vocab`` ids and an MLP ``intermediate`` wide, ``seed``.

    Raises:
        ValueError: a size, count or rate that is not positive.
    """

    tokens: int
    epochs: float = 2.0
    steps: int = 3
    lr: float = 5e-4
    warmup: int = 20
    batch: int = 4
    draft_vocab: int = 16000
    intermediate: int = 2048
    eval_every: int = 50
    checkpoint_minutes: float = 10.0
    seed: int = 0
    train_steps: int = 0

    def __post_init__(self) -> None:
        values = {
            "tokens": self.tokens,
            "epochs": self.epochs,
            "steps": self.steps,
            "lr": self.lr,
            "batch": self.batch,
            "draft_vocab": self.draft_vocab,
            "intermediate": self.intermediate,
            "eval_every": self.eval_every,
            "checkpoint_minutes": self.checkpoint_minutes,
        }
        bad = {k: v for k, v in values.items() if not v > 0}
        if bad or self.warmup < 0 or self.train_steps < 0:
            raise ValueError(
                f"train-head options must be positive: "
                f"{bad or {'warmup': self.warmup, 'train_steps': self.train_steps}}"
            )


def draft_vocabulary(data: Sequences, size: int, vocab: int) -> torch.Tensor:
    """The ``size`` target ids most often the target's top-1 on ``data`` (ties and the remainder by id):
    [size] long, sorted."""
    counts = torch.bincount(data.top_ids[..., 0][data.scored].flatten(), minlength=vocab).float()
    counts += torch.linspace(1e-3, 0, vocab)  # unseen ids: the lowest ids (special and common tokens) first
    return counts.topk(size).indices.sort().values


def build_head(target, data: Sequences, config: TrainConfig) -> Eagle3Head:
    """A head for ``target``: its draft vocabulary from ``data``, started from the target's readout, float32."""
    head = random_head(target, config.draft_vocab, seed=config.seed, intermediate_size=config.intermediate).float()
    head.set_vocabulary(draft_vocabulary(data, head.config.draft_vocab_size, head.config.target_vocab_size))
    init_from_target(head, *hf_compat.readout(target))
    return head


def batch_loss(
    head: Eagle3Head, data: Sequences, index: torch.Tensor, steps: int
) -> tuple[torch.Tensor, list[tuple[int, int]]]:
    """The training-time-test loss on ``data`` (a batch) and per step (agreements, scored entries)."""
    with torch.autocast("cpu", dtype=torch.bfloat16):
        outputs = ttt_forward(head, data.tokens, data.features, steps)  # steps × [B, T−1, H]
    ids, p = soft_labels(data.top_ids[:, 1:], data.top_logp[:, 1:], index)  # [B, T−1, K] each
    return distill_loss(head, outputs, ids, p, data.scored[:, 1:])


@torch.no_grad()
def agreement(head: Eagle3Head, data: Sequences, index: torch.Tensor, steps: int, batch: int = 4) -> list[float]:
    """α_s for s = 1..``steps`` on ``data``: the head's step-s argmax is the target's top-1, at scored entries."""
    totals = [[0, 0] for _ in range(steps)]
    for start in range(0, len(data), batch):
        _, counts = batch_loss(head, data.rows(torch.arange(start, min(start + batch, len(data)))), index, steps)
        for total, (agree, scored) in zip(totals, counts, strict=True):
            total[0], total[1] = total[0] + agree, total[1] + scored
    return [a / max(n, 1) for a, n in totals]


def learning_rate(config: TrainConfig, step: int, total: int) -> float:
    """Linear warm-up, then cosine decay to 10% of ``lr`` at step ``total``."""
    if step < config.warmup:
        return config.lr * (step + 1) / config.warmup
    done = min(1.0, (step - config.warmup) / max(1, total - config.warmup))
    return config.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * done)))


def train(target, data: Sequences, validation: dict[str, Sequences], config: TrainConfig, out: Path) -> Path:
    """Train (or resume) a head on ``data`` in ``out``; → the saved head's folder (``out/head``)."""
    torch.manual_seed(config.seed)
    head = build_head(target, data, config)
    index, per_epoch = draft_index(head), -(-len(data) // config.batch)
    total = config.train_steps or max(1, int(per_epoch * config.epochs))
    optimizer = torch.optim.AdamW(
        [p for p in head.parameters() if p.requires_grad], lr=config.lr, betas=(0.9, 0.95), weight_decay=0.0
    )
    state = _resume(out / "checkpoint.pt", head, optimizer, config)
    state.setdefault("seq_len", data.tokens.shape[1])
    order = _order(len(data), total, per_epoch, config.seed)
    bar = tqdm(total=total, initial=state["step"], unit="step", desc=f"training on {config.tokens} tokens")
    last_save, started = time.monotonic(), time.monotonic() - state["hours"] * 3600
    while state["step"] < total:
        step = state["step"]
        for group in optimizer.param_groups:
            group["lr"] = learning_rate(config, step, total)
        loss, _ = batch_loss(head, data.rows(order[step]), index, config.steps)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(head.parameters(), 1.0)
        optimizer.step()
        state["step"], state["hours"] = step + 1, (time.monotonic() - started) / 3600
        value = float(loss.detach())
        state["loss"] = 0.98 * state.get("loss", value) + 0.02 * value
        bar.update(1)
        bar.set_postfix(loss=f"{state['loss']:.3f}")
        if state["step"] % config.eval_every == 0 or state["step"] == total:
            _evaluate(head, validation, index, config, state, out)
        if state["step"] == total or time.monotonic() - last_save > 60 * config.checkpoint_minutes:
            _checkpoint(out / "checkpoint.pt", head, optimizer, config, state)
            last_save = time.monotonic()
    bar.close()
    return save_head(head.to(torch.bfloat16), out / "head")


def _order(n: int, total: int, per_epoch: int, seed: int) -> list[torch.Tensor]:
    """Each optimizer step's sequence indices: one fixed permutation per epoch, cut into batches."""
    gen, batches = torch.Generator().manual_seed(seed), []
    while len(batches) < total:
        batches += list(torch.randperm(n, generator=gen).chunk(per_epoch))
    return batches[:total]


def _evaluate(head, validation, index, config, state, out: Path) -> None:
    head.eval()
    point = {
        "step": state["step"],
        "tokens_seen": state["step"] * config.batch * state["seq_len"],
        "hours": round(state["hours"], 4),
        "train_loss": round(state.get("loss", float("nan")), 4),
        "alpha": {
            name: [round(a, 4) for a in agreement(head, data, index, config.steps)] for name, data in validation.items()
        },
    }
    head.train()
    state["curve"].append(point)
    tqdm.write(json.dumps(point))
    atomic_write(out / "curve.jsonl", lambda f: f.write("".join(json.dumps(p) + "\n" for p in state["curve"]).encode()))


def _checkpoint(path: Path, head, optimizer, config: TrainConfig, state: dict) -> None:
    buffer = io.BytesIO()
    torch.save(
        {"head": head.state_dict(), "optimizer": optimizer.state_dict(), "config": asdict(config), "state": state},
        buffer,
    )
    atomic_write(path, lambda f: f.write(buffer.getvalue()))


def _resume(path: Path, head, optimizer, config: TrainConfig) -> dict:
    """The run's state: from ``path`` when it holds this configuration's checkpoint, else fresh.
    Raises ValueError when ``path`` holds another configuration's (name the fix: another --out)."""
    fresh = {"step": 0, "hours": 0.0, "curve": []}
    if not path.exists():
        return fresh
    saved = torch.load(path, weights_only=False)
    if saved["config"] != asdict(config):
        raise ValueError(
            f"{path} was written with other options ({saved['config']}); use another --out or "
            "the same options to resume"
        )
    head.load_state_dict(saved["head"])
    optimizer.load_state_dict(saved["optimizer"])
    return saved["state"]
