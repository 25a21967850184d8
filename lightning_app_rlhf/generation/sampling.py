"""The per-token arithmetic every decode loop shares: positions that skip left padding, keyed noise, top-k/top-p
filtering and the keyed draw. Pure functions of tensors; plain PyTorch.

Every backend draws its tokens through :func:`next_token`, so the same keys give the same tokens under every backend,
device and placement. The draw descends a sum tree (:func:`sum_tree_draw`): the row's probabilities are summed in
pairs, level by level, in a fixed order of elementwise additions, and from the root each level goes to the right
child with probability ``right / (left + right)``, by one uniform per level read off an integer hash of (the row's
seed, its response column, the level). A leaf is reached with its probability ``p_v / sum(p)``. The arithmetic of a
row touches that row only and its order is written out as elementwise additions (no reduction or scan kernel,
whose order on a GPU can follow the batch's shape): the same probabilities give the same token in any batch. No
cumulative sum over the vocabulary either (the float64 scan Inductor could not compile on CUDA), no host generator,
no copy per call: the compiled decode step holds the draw in its one graph.

Until 2026-12-02 the draw was the exponential race (:func:`exponential_race`: ``argmax p_v / E_v`` over one keyed
uniform per token): a 32-bit hash of every vocabulary entry (several int64 passes over ``[B, V]``) and two
logarithms, about 20x the tree's cost on one CPU thread at 49152 tokens. The tree needs one exponential pass over
``[B, V]``, about as many additions, and ``ceil(log2 V)`` uniforms per row (``benchmarks/keyed_draw.py``).
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


def keyed_uniforms(seeds: torch.Tensor, columns: torch.Tensor, count: int) -> torch.Tensor:
    """[B, count] float32 uniforms in (0, 1): entry ``(b, j)`` is a function of ``seeds[b]``, ``columns[b]`` and ``j``
    only (a row's noise does not depend on its batch, its position in it, or the device). :func:`next_token` reads
    one per level of its sum tree (``j`` the level); the exponential race reads one per token (``j`` the token).

    Args:
        seeds: [B] the rows' :func:`keyed_seeds`.
        columns: [B] (or [1], broadcast) the response column each row samples.
        count: How many uniforms per row.
    """
    # The golden-ratio step keeps consecutive columns' streams apart before the hash mixes them.
    stream = hash32(seeds ^ hash32((columns.to(torch.int64) * 0x9E3779B9) & _MASK32))
    indices = torch.arange(count, dtype=torch.int64, device=seeds.device)
    bits = hash32(stream.unsqueeze(-1) ^ indices)
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


def tree_depth(vocab_size: int) -> int:
    """The levels below the root of :func:`sum_tree_draw`'s tree over ``vocab_size`` leaves, ``ceil(log2 V)``: the
    uniforms one draw reads (16 for SmolLM2's 49152 tokens)."""
    return max(vocab_size - 1, 0).bit_length()


def sum_tree_draw(log_probs: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """[B] a token of each row of ``log_probs`` [B, V] (unnormalised; ``-inf`` where filtered), token ``v`` with
    probability ``p_v / sum(p)`` for ``p = exp(log_probs)``, by descending a sum tree with ``uniforms``
    [B, :func:`tree_depth` (V)] in (0, 1), one per level from the root down.

    Level 0 is ``p``; each next level holds the sums of the level's first and second halves (a level of odd length
    gets a zero leaf at its end first), so node ``i`` of a level of length ``n`` has the children ``i`` and
    ``i + n/2`` on the level below, and the last level is the row's total. Every sum is one elementwise addition: a
    row's numbers do not depend on the batch or on a reduction kernel's order. At each level a row goes right when
    ``u * (left + right) >= left`` and the right child is not empty: right with probability ``right / (left + right)``
    (to float32 and the uniforms' 2**-23 steps), never into a subtree of filtered tokens (nor into an empty left one:
    ``u * right >= 0``), so the leaf reached has ``p_v > 0``.
    """
    rows = log_probs.shape[0]
    levels = []
    level = log_probs.exp()
    while level.shape[-1] > 1:
        if level.shape[-1] % 2:
            level = F.pad(level, (0, 1))
        half = level.shape[-1] // 2
        level = level.reshape(rows, 2, half)
        levels.append(level)
        level = level[:, 0] + level[:, 1]
    # The index as [B, 1, 1] and the uniforms split once: few ops per level, which eager runs one by one.
    index = torch.zeros(rows, 1, 1, dtype=torch.int64, device=log_probs.device)
    for level, uniform in zip(reversed(levels), uniforms.reshape(rows, 1, 1, len(levels)).unbind(-1)):
        left, right = level.gather(2, index.expand(rows, 2, 1)).split(1, dim=1)
        go_right = (uniform * (left + right) >= left) & (right > 0)
        index = index + go_right * level.shape[-1]
    return index.reshape(rows)


def exponential_race(log_probs: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """[B] the token of each row of ``log_probs`` [B, V] (unnormalised; ``-inf`` where filtered) that wins the race
    ``argmax p / E`` with ``E = -log u``: token ``v`` wins with probability ``p_v / sum(p)``. ``uniforms`` [B, V]: one
    per token. The draw before :func:`sum_tree_draw` (see the module's docstring); :func:`next_token` no longer uses
    it."""
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

    The token is the most likely one (``config.do_sample=False``) or the keyed draw from the top-k/top-p filtered
    distribution (:func:`sum_tree_draw`); the log-probability is that of the unfiltered distribution. A row already
    done gets ``pad_token_id`` and log-probability 0. Only tensor arithmetic, no host sync: a compiled decode step
    holds it in one graph.

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
        uniforms = keyed_uniforms(seeds, columns, tree_depth(log_probs.shape[-1]))
        token = sum_tree_draw(filter_log_probs(log_probs, config.top_k, config.top_p), uniforms)
    else:
        token = log_probs.argmax(-1)
    token = token.masked_fill(done, pad_token_id)
    return token, log_probs.gather(-1, token.unsqueeze(-1)).squeeze(-1).masked_fill(done, 0.0)
