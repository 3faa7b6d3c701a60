"""An EAGLE-3 draft head (Li et al., "EAGLE-3: Scaling up Inference Acceleration of Large Language Models
via Training-Time Test", arXiv 2503.01840), in plain torch, with a KV cache for a ragged batch.

Notation: the target's residual stream at the inputs of three of its layers (``aux_layers``), concatenated,
is its feature g_t ∈ R^{3·H_t} at position t. The head keeps one entry per position p ≥ 1: the input
(embed(x_p), fc(g_{p-1})) — the token at p and the target's feature one position before — and its output
at p predicts x_{p+1}. Drafting on from the last entry, the next input is (embed(d_j), h_{j-1}): the token
just drafted and the head's own pre-norm output (the training-time test of EAGLE-3). The decoder layer
(speculators' ``Eagle3DecoderLayer``, vLLM's ``Eagle3LlamaForCausalLM``): attention over
[input_layernorm(embed), hidden_norm(hidden)] (2H wide), the hidden (normed first when
``norm_before_residual``) as the residual, then a SiLU MLP; logits over a draft vocabulary of V_d tokens,
draft id j being target id j + d2t[j] (``t2d`` marks the target ids that have one).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch
from torch import nn


@dataclass(frozen=True)
class HeadConfig:
    """The head's shape: hidden size H (and the target's, H_t), attention heads (query and key/value),
    head_dim, MLP width, RMSNorm ε, RoPE θ, q/k/v/o biases, the draft and target vocabulary sizes, the
    target's three feature layers, whether the hidden input is normed before the residual, and the
    verifier (the target's name or path, as recorded in the checkpoint).

    Raises:
        ValueError: a size < 1, heads that do not divide, three feature layers not given, or a draft
            vocabulary larger than the target's.
    """

    hidden_size: int
    num_heads: int
    num_kv_heads: int
    intermediate_size: int
    target_hidden_size: int
    draft_vocab_size: int
    target_vocab_size: int
    aux_layers: tuple[int, int, int]
    head_dim: int = 0  # 0: hidden_size // num_heads (set on construction)
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    attention_bias: bool = False
    norm_before_residual: bool = False
    max_position_embeddings: int = 32768
    verifier: str = ""

    def __post_init__(self) -> None:
        sizes = (
            self.hidden_size,
            self.num_heads,
            self.num_kv_heads,
            self.intermediate_size,
            self.target_hidden_size,
            self.draft_vocab_size,
            self.target_vocab_size,
        )
        if min(sizes) < 1:
            raise ValueError(f"head sizes must be >= 1, got {sizes}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_heads ({self.num_heads}) must be a multiple of num_kv_heads ({self.num_kv_heads})")
        if len(self.aux_layers) != 3 or min(self.aux_layers) < 0:
            raise ValueError(f"aux_layers must be three layer indices >= 0, got {self.aux_layers}")
        if self.draft_vocab_size > self.target_vocab_size:
            raise ValueError(
                f"draft_vocab_size ({self.draft_vocab_size}) exceeds the target's ({self.target_vocab_size})"
            )
        if not self.head_dim:
            object.__setattr__(self, "head_dim", self.hidden_size // self.num_heads)

    @property
    def dim(self) -> int:
        """Per-head width of queries, keys and values."""
        return self.head_dim


class RMSNorm(nn.Module):
    """x / rms(x) · w (Zhang & Sennrich 2019), computed in float32."""

    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight, self.eps = nn.Parameter(torch.ones(size)), eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        f = x.float()
        return (f * torch.rsqrt(f.pow(2).mean(-1, keepdim=True) + self.eps)).to(x.dtype) * self.weight


def rotate(x: torch.Tensor, positions: torch.Tensor, theta: float) -> torch.Tensor:
    """RoPE (Su et al. 2021, rotate-half layout as Llama's) of x [B, h, M, d] at positions [B, M]."""
    d = x.shape[-1]
    inv = 1.0 / theta ** (torch.arange(0, d, 2, dtype=torch.float32, device=x.device) / d)  # [d/2]
    angles = positions.float()[:, None, :, None] * inv  # [B, 1, M, d/2]
    cos, sin = torch.cat([angles.cos()] * 2, -1), torch.cat([angles.sin()] * 2, -1)  # [B, 1, M, d]
    half = torch.cat([-x[..., d // 2 :], x[..., : d // 2]], dim=-1)
    return (x.float() * cos + half.float() * sin).to(x.dtype)


class HeadKV(Protocol):
    """Where a head keeps its entries' keys and values for a ragged batch: ``HeadCache`` (grown by
    concatenation) or ``backend.head_kv.StaticHeadCache`` (on an arena, its drafted column a recorded step).
    ``lengths`` [B] long: entries per row; ``k``, ``v`` [B, kv_heads, L, d]: what attention reads."""

    lengths: torch.Tensor

    @property
    def k(self) -> torch.Tensor: ...

    @property
    def v(self) -> torch.Tensor: ...

    def add(self, k: torch.Tensor, v: torch.Tensor, valid: torch.Tensor) -> torch.Tensor: ...

    def rollback(self, lengths: torch.Tensor) -> None: ...

    def select(self, rows: torch.Tensor) -> None: ...

    def draft_column(
        self, head: Eagle3Head, tokens: torch.Tensor, hidden: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]: ...


class HeadCache:
    """The head's keys and values for a batch whose rows hold different numbers of entries: k, v
    [B, kv_heads, L, d] and mask [B, L] (True = an entry of that row); lengths [B] long, entries per row
    (a row's entries sit at positions 1..lengths)."""

    def __init__(self, batch: int) -> None:
        self.k: torch.Tensor | None = None
        self.v: torch.Tensor | None = None
        self.mask = torch.zeros(batch, 0, dtype=torch.bool)
        self.lengths = torch.zeros(batch, dtype=torch.long)

    def add(self, k: torch.Tensor, v: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
        """Append a block's keys and values [B, kv_heads, M, d] with ``valid`` [B, M] (CPU bool) → which keys
        each block column attends to, [B, M, L] bool (CPU): the row's entries up to its own column; a padded
        column, which has none, attends to every column (its output is discarded)."""
        self.k = k if self.k is None else torch.cat([self.k, k], dim=2)
        self.v = v if self.v is None else torch.cat([self.v, v], dim=2)
        self.mask = torch.cat([self.mask, valid], dim=1)
        self.lengths = self.lengths + valid.long().sum(dim=1)
        m, width = valid.shape[1], self.mask.shape[1]
        allowed = torch.ones(m, width, dtype=torch.bool).tril(width - m)[None] & self.mask[:, None, :]  # [B, M, L]
        return allowed | ~allowed.any(dim=-1, keepdim=True)

    def draft_column(
        self, head: Eagle3Head, tokens: torch.Tensor, hidden: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """One drafted column for every row: tokens [B, 1] (target ids) with hidden [B, 1, H] → the head's
        pre-norm outputs [B, 1, H] and float32 logits [B, V] on the CPU (``Eagle3Head.logits``)."""
        out = head.step(tokens, hidden, torch.ones(tokens.shape, dtype=torch.bool), self)
        return out, head.logits(out[:, -1])

    def rollback(self, lengths: torch.Tensor) -> None:
        """Keep each row's first ``lengths`` [B] entries; crop columns no row uses."""
        kept = (self.mask.long().cumsum(dim=1) <= lengths[:, None]) & self.mask
        self.mask, self.lengths = kept, torch.minimum(self.lengths, lengths)
        used = kept.any(dim=0).nonzero()
        width = int(used[-1]) + 1 if used.numel() else 0
        if self.k is not None and width < self.k.shape[2]:
            self.k, self.v, self.mask = self.k[:, :, :width], self.v[:, :, :width], self.mask[:, :width]

    def select(self, rows: torch.Tensor) -> None:
        """Keep batch rows ``rows`` ([b] long indices)."""
        if self.k is not None:
            self.k, self.v = self.k[rows.to(self.k.device)], self.v[rows.to(self.v.device)]
        self.mask, self.lengths = self.mask[rows], self.lengths[rows]


class Eagle3Head(nn.Module):
    """The head's weights, named as the speculators checkpoint names them (``fc``, ``layers.0.*``,
    ``norm``, ``lm_head``, ``d2t``, ``t2d``). ``embed_tokens`` is the target's input embedding, shared and
    not a submodule (so moving or casting the head leaves the target alone, and it is never saved)."""

    def __init__(self, config: HeadConfig, embed_tokens: nn.Embedding) -> None:
        """Raises ValueError when the embedding's shape is not [target_vocab_size, hidden_size]."""
        super().__init__()
        if tuple(embed_tokens.weight.shape) != (config.target_vocab_size, config.hidden_size):
            raise ValueError(
                f"the embedding is {tuple(embed_tokens.weight.shape)}, the head needs "
                f"[{config.target_vocab_size}, {config.hidden_size}]: a head of another target?"
            )
        self.config, h = config, config.hidden_size
        self.__dict__["embed_tokens"] = embed_tokens
        self.fc = nn.Linear(3 * config.target_hidden_size, h, bias=False)
        self.layers = nn.ModuleList([_Layer(config)])
        self.norm = RMSNorm(h, config.rms_norm_eps)
        self.lm_head = nn.Linear(h, config.draft_vocab_size, bias=False)
        self.register_buffer("d2t", torch.zeros(config.draft_vocab_size, dtype=torch.long))
        self.register_buffer("t2d", torch.zeros(config.target_vocab_size, dtype=torch.bool))
        self.set_vocabulary(torch.arange(config.draft_vocab_size))

    def set_vocabulary(self, target_ids: torch.Tensor) -> None:
        """Draft id j proposes target id ``target_ids[j]`` ([V_d] long, distinct): sets ``d2t`` (offsets)
        and ``t2d``. Raises ValueError for a wrong length, an id out of range or a repeated id."""
        ids = target_ids.long().cpu()
        if ids.shape != (self.config.draft_vocab_size,) or ids.unique().numel() != ids.numel():
            raise ValueError(f"need {self.config.draft_vocab_size} distinct target ids, got shape {tuple(ids.shape)}")
        if int(ids.min()) < 0 or int(ids.max()) >= self.config.target_vocab_size:
            raise ValueError(f"target ids must be in [0, {self.config.target_vocab_size})")
        self.d2t.copy_(ids - torch.arange(ids.numel()))
        self.t2d.zero_()
        self.t2d[ids] = True

    def target_ids(self) -> torch.Tensor:
        """The target id of each draft id: [V_d] long, on the CPU."""
        return torch.arange(self.config.draft_vocab_size) + self.d2t.cpu()

    @property
    def device(self) -> torch.device:
        return self.fc.weight.device

    @property
    def dtype(self) -> torch.dtype:
        return self.fc.weight.dtype

    def fuse(self, features: torch.Tensor) -> torch.Tensor:
        """The hidden input of true entries: fc(g), features [B, M, 3·H_t] → [B, M, H]."""
        return self.fc(features.to(device=self.device, dtype=self.dtype))

    def step(self, tokens: torch.Tensor, hidden: torch.Tensor, valid: torch.Tensor, cache: HeadKV) -> torch.Tensor:
        """Append entries (tokens [B, M] target ids, hidden [B, M, H], ``valid`` [B, M] bool marking real
        columns, left-padded) to ``cache`` at each row's next positions; → pre-norm outputs [B, M, H]."""
        offsets = valid.long().cumsum(dim=1) - 1
        positions = (cache.lengths[:, None] + 1 + offsets.clamp_min(0)).to(self.device)  # [B, M]
        table = self.embed_tokens.weight
        embeds = self.embed_tokens(tokens.to(table.device)).to(device=self.device, dtype=self.dtype)
        return self.layers[0](embeds, hidden.to(self.dtype), positions, valid, cache)

    def draft_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Logits over the draft vocabulary, in the head's dtype on its device: [B, H] → [B, V_d]."""
        return self.lm_head(self.norm(hidden))

    def widen(self, draft: torch.Tensor) -> torch.Tensor:
        """Float32 logits over the target vocabulary, −inf off the draft vocabulary: [B, V_d] → [B, V] (CPU)."""
        out = torch.full((draft.shape[0], self.config.target_vocab_size), float("-inf"))
        out[:, self.target_ids()] = draft.float().cpu()
        return out

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """``widen(draft_logits(hidden))``: [B, H] → [B, V] float32 on the CPU."""
        return self.widen(self.draft_logits(hidden))


class _Layer(nn.Module):
    """One EAGLE-3 decoder layer: attention reads [norm(embed), norm(hidden)], the hidden is the residual."""

    def __init__(self, c: HeadConfig) -> None:
        super().__init__()
        h, d, b = c.hidden_size, c.dim, c.attention_bias
        self.c = c
        self.input_layernorm, self.hidden_norm = RMSNorm(h, c.rms_norm_eps), RMSNorm(h, c.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(h, c.rms_norm_eps)
        self.self_attn = nn.Module()
        self.self_attn.q_proj = nn.Linear(2 * h, c.num_heads * d, bias=b)
        self.self_attn.k_proj = nn.Linear(2 * h, c.num_kv_heads * d, bias=b)
        self.self_attn.v_proj = nn.Linear(2 * h, c.num_kv_heads * d, bias=b)
        self.self_attn.o_proj = nn.Linear(c.num_heads * d, h, bias=b)
        self.mlp = nn.Module()
        self.mlp.gate_proj = nn.Linear(h, c.intermediate_size, bias=False)
        self.mlp.up_proj = nn.Linear(h, c.intermediate_size, bias=False)
        self.mlp.down_proj = nn.Linear(c.intermediate_size, h, bias=False)

    def project(
        self, embeds: torch.Tensor, hidden: torch.Tensor, positions: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """Entries (embeds, hidden [B, M, H] at ``positions`` [B, M]) → residual [B, M, H], rotated queries
        [B, heads, M, d], rotated keys and values [B, kv_heads, M, d]."""
        c, a = self.c, self.self_attn
        normed = self.hidden_norm(hidden)
        residual = normed if c.norm_before_residual else hidden
        x = torch.cat([self.input_layernorm(embeds), normed], dim=-1)  # [B, M, 2H]
        bsz, m, _ = x.shape
        q = rotate(a.q_proj(x).view(bsz, m, c.num_heads, c.dim).transpose(1, 2), positions, c.rope_theta)
        k = rotate(a.k_proj(x).view(bsz, m, c.num_kv_heads, c.dim).transpose(1, 2), positions, c.rope_theta)
        v = a.v_proj(x).view(bsz, m, c.num_kv_heads, c.dim).transpose(1, 2)
        return residual, q, k, v

    def finish(
        self, residual: torch.Tensor, q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, allowed: torch.Tensor
    ) -> torch.Tensor:
        """Attention of q over keys/values [B, kv_heads, L, d] where ``allowed`` [B, M, L] (every query row
        allows at least one key), then the residual and the MLP → pre-norm outputs [B, M, H]."""
        c, a = self.c, self.self_attn
        bsz, m = residual.shape[:2]
        group = c.num_heads // c.num_kv_heads
        b, kv, length, d = keys.shape  # each key/value head serves ``group`` query heads (expand: graph-safe)
        keys, values = (
            t[:, :, None].expand(b, kv, group, length, d).reshape(b, kv * group, length, d) for t in (keys, values)
        )
        out = nn.functional.scaled_dot_product_attention(q, keys, values, attn_mask=allowed[:, None])
        x = residual + a.o_proj(out.transpose(1, 2).reshape(bsz, m, c.num_heads * c.dim))
        y = self.post_attention_layernorm(x)
        return x + self.mlp.down_proj(nn.functional.silu(self.mlp.gate_proj(y)) * self.mlp.up_proj(y))

    def forward(
        self, embeds: torch.Tensor, hidden: torch.Tensor, positions: torch.Tensor, valid: torch.Tensor, cache: HeadKV
    ) -> torch.Tensor:
        residual, q, k, v = self.project(embeds, hidden, positions)
        allowed = cache.add(k, v, valid).to(q.device)  # [B, M, L]
        return self.finish(residual, q, cache.k, cache.v, allowed)
