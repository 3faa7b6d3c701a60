"""Training an EAGLE-3 head by self-distillation: the training-time test's forward, its loss, and a head
initialised from its target.

Design (Li et al., arXiv 2503.01840, §3.2 "training-time test"): the head is trained on the inputs it
meets when drafting. Along a sequence of T tokens with the target's features g [T, 3·H_t], entry p
(p = 1..T−1) is (x_p, fc(g_{p−1})) at step 1; at step s > 1 it is (x_p, h^{(s−1)}_{p−1}), the head's own
output one position before at the previous step, so step s predicts as the s-th drafted token does. The
attention of step s at entry p sees what a chain drafted after the true entries up to p − s + 1 would
see: step-1 keys at entries ≤ p − s + 1 and, for r = 2..s, the step-r key at entry p − s + r. Every step's
output at entry p is scored against the target's own next-token distribution after x_p (soft labels:
the target's top-k probabilities, renormalised over those in the draft vocabulary), so the head learns to
agree with the target it will be verified by (p = target, q = draft). One pass gives all steps' logits
for every position; where a drafted chain's earlier tokens are the true ones, ``replay.trace.head_along``
reproduces them with the head's cache (tested).
"""

from __future__ import annotations

import torch

from .eagle3 import Eagle3Head


def ttt_mask(n: int, step: int) -> torch.Tensor:
    """Which keys entry j (0-based, j = p − 1) of step ``step`` may attend: [n, step·n] bool over the keys of
    steps 1..step laid side by side. Every entry sees at least its own key; entries j < step − 1 have no
    chain (no true entry before it) and are never scored."""
    j = torch.arange(n)
    blocks = [j[None, :] <= (j[:, None] - step + 1)]  # step 1: true entries up to p − s + 1
    for r in range(2, step + 1):
        blocks.append(j[None, :] == (j[:, None] - step + r))  # step r: the chain's own entry p − s + r
    return torch.cat(blocks, dim=1)


def ttt_forward(head: Eagle3Head, tokens: torch.Tensor, features: torch.Tensor, steps: int) -> list[torch.Tensor]:
    """The head's pre-norm outputs at every entry for steps 1..``steps``: tokens [B, T] (target ids),
    features [B, T, 3·H_t] → ``steps`` tensors [B, T − 1, H]; entry j of step s (valid for j ≥ s − 1)
    predicts the token after tokens[:, j + 1]. Raises ValueError for steps < 1 or T < 2."""
    if steps < 1 or tokens.shape[1] < 2:
        raise ValueError(f"need steps >= 1 and sequences of 2 tokens or more, got {steps}, {tokens.shape[1]}")
    layer, n = head.layers[0], tokens.shape[1] - 1
    embeds = head.embed_tokens(tokens[:, 1:].to(head.embed_tokens.weight.device)).to(head.device, head.dtype)
    positions = torch.arange(1, n + 1, device=head.device).expand(tokens.shape[0], n)  # [B, n]
    hidden = head.fuse(features[:, :-1])  # [B, n, H]
    keys, values, outs = [], [], []
    for s in range(1, steps + 1):
        if s > 1:  # entry j reads the previous step's output at entry j − 1
            hidden = torch.cat([torch.zeros_like(outs[-1][:, :1]), outs[-1][:, :-1]], dim=1)
        residual, q, k, v = layer.project(embeds, hidden, positions)
        keys.append(k)
        values.append(v)
        allowed = ttt_mask(n, s).to(head.device).expand(tokens.shape[0], n, s * n)
        outs.append(layer.finish(residual, q, torch.cat(keys, dim=2), torch.cat(values, dim=2), allowed))
    return outs


def draft_index(head: Eagle3Head) -> torch.Tensor:
    """The draft id of each target id, −1 where it has none: [V] long (the inverse of ``target_ids``)."""
    index = torch.full((head.config.target_vocab_size,), -1, dtype=torch.long)
    index[head.target_ids()] = torch.arange(head.config.draft_vocab_size)
    return index


def soft_labels(
    top_ids: torch.Tensor, top_logp: torch.Tensor, t2d_index: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """The target's top-k next-token distribution on the draft vocabulary: top_ids [..., K] target ids,
    top_logp [..., K] their log-probabilities, ``t2d_index`` [V] (draft id of each target id, −1 when it
    has none) → (draft ids [..., K] with −1 → 0, probabilities [..., K] renormalised over those present,
    all zero where none is)."""
    draft = t2d_index[top_ids]  # [..., K]
    p = top_logp.float().exp() * (draft >= 0)
    total = p.sum(dim=-1, keepdim=True)
    return draft.clamp_min(0), torch.where(total > 0, p / total.clamp_min(1e-12), p)


def distill_loss(
    head: Eagle3Head,
    outputs: list[torch.Tensor],
    label_ids: torch.Tensor,
    label_p: torch.Tensor,
    valid: torch.Tensor,
    decay: float = 0.8,
) -> tuple[torch.Tensor, list[tuple[int, int]]]:
    """Cross-entropy of each step's draft distribution against the soft labels, steps weighted decay^(s−1)
    (EAGLE-3 weights later steps less): outputs as ``ttt_forward``'s, label_ids / label_p [B, n, K]
    (``soft_labels``), valid [B, n] bool (a scored entry) → (loss, per step (top-1 agreements, scored
    entries)). Agreement: the head's argmax is the target's top-1 (label column 0, the target's argmax)."""
    total, counts = torch.zeros((), device=head.device), []
    target_top = label_ids[..., 0]  # [B, n]
    has_top = label_p[..., 0] > 0  # the target's argmax is in the draft vocabulary
    for s, out in enumerate(outputs, start=1):
        scored = valid.clone()
        scored[:, : s - 1] = False
        logp = torch.log_softmax(head.lm_head(head.norm(out)).float(), dim=-1)  # [B, n, V_d]
        ce = -(logp.gather(-1, label_ids) * label_p).sum(dim=-1)  # [B, n]
        weight = scored & (label_p.sum(dim=-1) > 0)
        total = total + decay ** (s - 1) * (ce * weight).sum() / weight.sum().clamp_min(1)
        agree = (logp.argmax(dim=-1) == target_top) & has_top & scored
        counts.append((int(agree.sum()), int(scored.sum())))
    return total, counts


def init_from_target(head: Eagle3Head, output_weight: torch.Tensor, norm_weight: torch.Tensor) -> None:
    """Start the head where its target helps: output head rows and final norm copied from the target's
    (``output_weight`` [V, H], the target's dense output head; ``norm_weight`` [H], its final RMSNorm), fc
    reading the deepest feature layer as is, and the layer's attention and MLP outputs zeroed, so the head
    starts as the target's own readout of that layer. Raises ValueError when the widths differ."""
    c = head.config
    if output_weight.shape[1] != c.hidden_size or c.target_hidden_size != c.hidden_size:
        raise ValueError(f"the target's width {output_weight.shape[1]} is not the head's {c.hidden_size}")
    ids = head.target_ids()
    with torch.no_grad():
        head.lm_head.weight.copy_(output_weight.detach()[ids.to(output_weight.device)].to(head.lm_head.weight))
        head.norm.weight.copy_(norm_weight.detach().to(head.norm.weight))
        head.fc.weight.zero_()
        head.fc.weight[:, 2 * c.hidden_size :] = torch.eye(c.hidden_size)
        layer = head.layers[0]
        layer.self_attn.o_proj.weight.zero_()
        layer.mlp.down_proj.weight.zero_()
