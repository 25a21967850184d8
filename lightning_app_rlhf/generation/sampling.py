"""The per-token arithmetic every decode loop shares: positions that skip left padding, keyed noise, top-k/top-p
filtering and the exponential-race draw. Pure functions of tensors; plain PyTorch.

Every backend draws its tokens through :func:`next_token`, so the same keys give the same tokens under every backend,
device and placement. The draw is the exponential race (the Gumbel-max trick): row ``b`` takes
``argmax_v p_v / E_v`` with ``E_v = -log u_v`` and ``u_v`` a uniform read off an integer hash of (the row's seed, its
response column, ``v``). That picks ``v`` with probability ``p_v / sum(p)``, needs no cumulative sum over the
vocabulary (the float64 scan Inductor could not compile on CUDA), and its noise is a pure function of integers
computed on the device: no per-row generator on the host, no copy per call, and the compiled decode step holds the
draw in its one graph.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from lightning_app_rlhf.core.config import GenerationConfig

_MASK32 = 0xFFFFFFFF


def position_ids_from_mask(attention_mask: torch.Tensor) -> torch.Tensor:
    """Positions that skip left padding, so a padded prompt sees the same positions as an unpadded one."""
    return (attention_mask.long().cumsum(-1) - 1).clamp(min=0)


def _times(x: torch.Tensor, constant: int) -> torch.Tensor:
    """``x * constant mod 2**32`` for ``x`` in [0, 2**32), in int64 without overflow: the constant's two 16-bit
    halves multiply separately (each product < 2**48), and the high half's product only matters mod 2**16."""
    low, high = constant & 0xFFFF, constant >> 16
    return (x * low + (((x * high) & 0xFFFF) << 16)) & _MASK32


def hash32(x: torch.Tensor) -> torch.Tensor:
    """murmur3's 32-bit finalizer (``fmix32``), elementwise on int64 values in [0, 2**32): a bijection of 32-bit
    integers in which every input bit flips every output bit with probability about 1/2. The arithmetic stays in
    int64 (every intermediate below 2**49), the same on every device and under Inductor, where uint32 tensors have
    too few operators."""
    x = x ^ (x >> 16)
    x = _times(x, 0x85EBCA6B)
    x = x ^ (x >> 13)
    x = _times(x, 0xC2B2AE35)
    return x ^ (x >> 16)


def keyed_seeds(keys: torch.Tensor) -> torch.Tensor:
    """[B] 32-bit seeds (int64, in [0, 2**32)) from [B] 64-bit sample keys: both halves of a key count."""
    keys = keys.to(torch.int64)
    return hash32(hash32(keys & _MASK32) ^ ((keys >> 32) & _MASK32))


def keyed_uniforms(seeds: torch.Tensor, columns: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """[B, V] float32 uniforms in (0, 1): entry ``(b, v)`` is a function of ``seeds[b]``, ``columns[b]`` and ``v``
    only (a row's noise does not depend on its batch, its position in it, or the device).

    Args:
        seeds: [B] the rows' :func:`keyed_seeds`.
        columns: [B] (or [1], broadcast) the response column each row samples.
        vocab_size: V.
    """
    # The golden-ratio step keeps consecutive columns' streams apart before the hash mixes them.
    stream = hash32(seeds ^ hash32((columns.to(torch.int64) * 0x9E3779B9) & _MASK32))
    tokens = torch.arange(vocab_size, dtype=torch.int64, device=seeds.device)
    bits = hash32(stream.unsqueeze(-1) ^ tokens)
    # The top 23 bits plus one half: 24 significant bits, exact in float32, never 0 or 1.
    return ((bits >> 9).to(torch.float32) + 0.5) * 2.0**-23


def filter_log_probs(log_probs: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    """``-inf`` for tokens outside the top-k and outside the top-p nucleus; the most likely token always stays.

    Both filters cut at a threshold (a token stays when its log-probability is at least the last kept one's), so
    tokens tied with the last kept one stay too, and no scatter back from sorted order is needed.
    """
    if 0 < top_k < log_probs.shape[-1]:
        kth = torch.topk(log_probs, top_k, dim=-1).values[..., -1:]
        log_probs = log_probs.masked_fill(log_probs < kth, float("-inf"))
    if top_p < 1.0:
        ordered = torch.sort(log_probs, dim=-1, descending=True).values
        probs = ordered.exp()
        mass_before = probs.cumsum(-1) - probs
        kept = (mass_before < top_p * probs.sum(-1, keepdim=True)).sum(-1, keepdim=True)
        threshold = ordered.gather(-1, kept - 1)
        log_probs = log_probs.masked_fill(log_probs < threshold, float("-inf"))
    return log_probs


def exponential_race(log_probs: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """[B] the token of each row of ``log_probs`` [B, V] (unnormalised; ``-inf`` where filtered) that wins the race
    ``argmax p / E`` with ``E = -log u``: token ``v`` wins with probability ``p_v / sum(p)``."""
    return (log_probs - torch.log(-torch.log(uniforms))).argmax(-1)


def next_token(
    logits: torch.Tensor,
    config: GenerationConfig,
    seeds: torch.Tensor | None,
    columns: torch.Tensor | None,
    done: torch.Tensor,
    pad_token_id: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row's next token [B] and its behaviour log-probability [B] at the sampling temperature.

    The token is the most likely one (``config.do_sample=False``) or the keyed race over the top-k/top-p filtered
    distribution; the log-probability is that of the unfiltered distribution. A row already done gets
    ``pad_token_id`` and log-probability 0. Only tensor arithmetic, no host sync: a compiled decode step holds it in
    one graph.

    Args:
        logits: [B, V] the next token's logits, in any float dtype (the arithmetic runs in float32).
        config: ``temperature``, ``do_sample``, ``top_k`` and ``top_p``.
        seeds: [B] the rows' :func:`keyed_seeds` on the logits' device; None when greedy.
        columns: [B] or [1] the response column each row samples (its own step); None when greedy.
        done: [B] True for rows that already ended.
        pad_token_id: The token of rows already done.
    """
    # At temperature 1 no division: a pass over [B, V] that changes no number (as the training side's
    # ``functional.tempered_float``, a layer above this one).
    scaled = logits.float() if config.temperature == 1.0 else logits.float() / config.temperature
    log_probs = F.log_softmax(scaled, dim=-1)
    if config.do_sample:
        uniforms = keyed_uniforms(seeds, columns, log_probs.shape[-1])
        token = exponential_race(filter_log_probs(log_probs, config.top_k, config.top_p), uniforms)
    else:
        token = log_probs.argmax(-1)
    token = token.masked_fill(done, pad_token_id)
    return token, log_probs.gather(-1, token.unsqueeze(-1)).squeeze(-1).masked_fill(done, 0.0)
