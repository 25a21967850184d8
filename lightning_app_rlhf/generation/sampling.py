"""The per-token arithmetic every decode loop shares: positions that skip left padding, keyed uniforms, top-k/top-p
filtering and inverse-CDF sampling. Pure functions of tensors; plain PyTorch.

Every backend draws its tokens through :func:`next_token` from :func:`keyed_uniforms`, so the same keys give the same
tokens under every backend, device and placement.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from lightning_app_rlhf.core.config import GenerationConfig


def position_ids_from_mask(attention_mask: torch.Tensor) -> torch.Tensor:
    """Positions that skip left padding, so a padded prompt sees the same positions as an unpadded one."""
    return (attention_mask.long().cumsum(-1) - 1).clamp(min=0)


def keyed_uniforms(keys: torch.Tensor, num: int) -> torch.Tensor:
    """[B, num] uniforms in [0, 1); row b depends only on ``keys[b]``."""
    rows = []
    for key in keys.tolist():
        generator = torch.Generator().manual_seed(key)
        rows.append(torch.rand(num, generator=generator, dtype=torch.float64))
    return torch.stack(rows)


def filter_probs(probs: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    """Zero out tokens outside the top-k and outside the top-p nucleus (the most likely token always stays)."""
    if top_k > 0 and top_k < probs.shape[-1]:
        kth = torch.topk(probs, top_k, dim=-1).values[..., -1:]
        probs = probs.masked_fill(probs < kth, 0.0)
    if top_p < 1.0:
        sorted_probs, order = torch.sort(probs, dim=-1, descending=True)
        mass_before = sorted_probs.cumsum(-1) - sorted_probs
        sorted_probs = sorted_probs.masked_fill(mass_before >= top_p * sorted_probs.sum(-1, keepdim=True), 0.0)
        probs = torch.zeros_like(probs).scatter(-1, order, sorted_probs)
    return probs


def inverse_cdf_sample(probs: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """Sample one token per row of (unnormalised) ``probs`` [B, V] with the given uniforms [B]."""
    cdf = probs.double().cumsum(-1)
    targets = (uniforms.to(cdf.device) * cdf[:, -1]).unsqueeze(-1)
    tokens = torch.searchsorted(cdf, targets, right=True).squeeze(-1)
    return tokens.clamp(max=probs.shape[-1] - 1)


def _draw(probs: torch.Tensor, uniforms: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    return inverse_cdf_sample(filter_probs(probs, top_k, top_p), uniforms)


# Inductor's Triton code fails to compile the draw over a real vocabulary (tens of thousands of columns): the float64
# cumsum it splits, and the top-p scatter (InductorError "list indices must be integers or slices, not NoneType",
# torch 2.11 on an H200). So on CUDA the draw runs eagerly: one graph break in the compiled decode step, the same
# arithmetic, the same tokens as eager. On the CPU Inductor compiles it.
_draw_eager = torch.compiler.disable(_draw)


def next_token(
    logits: torch.Tensor,
    config: GenerationConfig,
    uniforms: torch.Tensor | None,
    step: int,
    done: torch.Tensor,
    pad_token_id: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row's next token [B] and its behaviour log-probability [B] at the sampling temperature.

    The token is the most likely one (``config.do_sample=False``) or a keyed draw from the top-k/top-p filtered
    distribution; the log-probability is that of the unfiltered distribution. A row already done gets
    ``pad_token_id`` and log-probability 0.

    Args:
        logits: [B, V] the next token's logits, in any float dtype (the arithmetic runs in float32).
        config: ``temperature``, ``do_sample``, ``top_k`` and ``top_p``.
        uniforms: [B, max_new_tokens] the rows' :func:`keyed_uniforms` (on any device); None when greedy.
        step: The response column being sampled: the column of ``uniforms`` that is used.
        done: [B] True for rows that already ended.
        pad_token_id: The token of rows already done.
    """
    # At temperature 1 no division: a pass over [B, V] that changes no number (as the training side's
    # ``functional.tempered_float``, a layer above this one).
    scaled = logits.float() if config.temperature == 1.0 else logits.float() / config.temperature
    log_probs = F.log_softmax(scaled, dim=-1)
    if config.do_sample:
        draw = _draw_eager if logits.is_cuda else _draw
        token = draw(log_probs.exp(), uniforms[:, step], config.top_k, config.top_p)
    else:
        token = log_probs.argmax(-1)
    token = token.masked_fill(done, pad_token_id)
    return token, log_probs.gather(-1, token.unsqueeze(-1)).squeeze(-1).masked_fill(done, 0.0)

