"""Padding-free log-probabilities (``ppo.padding_free``): a batch's real tokens packed into fewer rows.

A rollout row is a left-padded prompt followed by a response that is right-padded after its end, so a padded forward
computes every layer and the LM head at positions that hold no token. With short, uneven responses (a group of
completions where most end early but one runs to ``max_new_tokens``) most of that arithmetic is padding.

Here each row's real tokens (one contiguous span) are laid end to end in rows of the longest span's length
(first-fit decreasing), with position ids restarting at 0 for every sequence and no attention mask: Hugging Face
then builds the block-diagonal causal mask of packed sequences from the position ids (its padding-free path, for
every attention implementation), so no token attends to another sequence's. The LM head runs only on the packed
columns that predict a response token (``logits_to_keep`` as an index tensor). A batch where packing would not pay
keeps the padded forward (:func:`pack_rows`). Numbers equal the padded forward's within float rounding; positions
with no real token get log-probability and entropy 0 (the padded forward's values there are masked out by every
consumer).

Plain PyTorch, no Lightning.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from lightning_app_rlhf.algorithms import functional


@dataclass(frozen=True)
class PackedRows:
    """The packed layout of a ``[B, P + T]`` batch (prompt length ``P``, response length ``T``)."""

    input_ids: torch.Tensor
    """[R, C] the real tokens of every row, end to end; an unused slot holds a real token at position 0 (a sequence
    of its own, seen by nothing else)."""
    position_ids: torch.Tensor
    """[R, C] 0, 1, ... within each packed sequence."""
    logits_columns: torch.Tensor
    """[K] the packed columns whose logits are needed (``logits_to_keep``), ascending."""
    logits_index: torch.Tensor
    """[N] for each real response token, its predicting position's flat index into the ``[R, K]`` logits."""
    response_index: torch.Tensor
    """[N] for each real response token, its flat index into ``[B, T]``."""
    tokens: torch.Tensor
    """[N] the real response tokens, in ``response_index`` order."""
    shape: tuple[int, int]
    """``(B, T)``: the shape of the per-token outputs."""


PACKING_PAYS_BELOW = 0.8
"""Pack only where the packed rows hold at most this share of the padded batch's positions: with less padding than
that, the block-diagonal mask and the gathers cost more than the positions saved (``benchmarks/padding_free.py``:
responses all of full length, 91% of the positions real, made a step 4-6% slower packed)."""


def pack_rows(
    sequences: torch.Tensor, attention_mask: torch.Tensor, prompt_length: int, only_where_it_pays: bool = True
) -> PackedRows | None:
    """The packed layout of a rollout batch, or None where the padded forward runs instead: packing would keep more
    than :data:`PACKING_PAYS_BELOW` of the positions, or run the LM head at more positions than the padded forward
    (which runs it on the ``T + 1`` response positions of every row; packed, it runs on every column where some
    packed row predicts a response token, so long prompts before short responses can cost more there), a row's real
    tokens are not one contiguous span, or a response token has no prompt token before it.

    Args:
        sequences: [B, P + T] left-padded prompts followed by their responses.
        attention_mask: [B, P + T] 1 for real tokens.
        prompt_length: ``P``.
        only_where_it_pays: False: pack whenever the rows allow it (tests, measurements).
    """
    batch, width = sequences.shape
    response_length = width - prompt_length
    mask = attention_mask.bool()
    lengths = mask.sum(1)
    starts = mask.int().argmax(1)  # first real token (0 for an empty row)
    ends = width - mask.flip(1).int().argmax(1)
    real = lengths > 0
    if bool(((ends - starts != lengths) & real).any()) or bool((real & (starts >= prompt_length)).any()):
        return None

    # First-fit decreasing into rows of the longest span: deterministic, and no longer than the padded row. One
    # host copy of the lengths (not a device sync per row).
    sizes = lengths.tolist()
    capacity = max(max(sizes, default=0), 1)
    room: list[int] = []
    bin_of, offset_of = [0] * batch, [0] * batch
    for row in sorted(range(batch), key=lambda r: -sizes[r]):
        need = sizes[row]
        if need == 0:
            continue
        slot = next((b for b, free in enumerate(room) if free >= need), len(room))
        if slot == len(room):
            room.append(capacity)
        bin_of[row], offset_of[row] = slot, capacity - room[slot]
        room[slot] -= need
    num_rows = max(len(room), 1)
    if only_where_it_pays and num_rows * capacity > PACKING_PAYS_BELOW * batch * width:
        return None
    device = sequences.device
    bins = torch.tensor(bin_of, device=device)
    offsets = torch.tensor(offset_of, device=device)

    rows, cols = mask.nonzero(as_tuple=True)
    within = cols - starts[rows]
    slots = bins[rows] * capacity + offsets[rows] + within
    # Unused slots repeat a real token: a pad id there would have Hugging Face warn that padding needs a mask.
    input_ids = sequences.new_full((num_rows * capacity,), int(sequences[rows[0], cols[0]]) if len(rows) else 0)
    position_ids = torch.zeros(num_rows * capacity, dtype=torch.long, device=device)
    input_ids[slots] = sequences[rows, cols]
    position_ids[slots] = within

    # A response token at padded column c is predicted by the position of column c - 1.
    response_rows, response_cols = mask[:, prompt_length:].nonzero(as_tuple=True)
    columns = offsets[response_rows] + (response_cols + prompt_length - 1 - starts[response_rows])
    logits_columns = torch.unique(columns)  # sorted
    if only_where_it_pays and num_rows * len(logits_columns) > batch * (response_length + 1):
        return None  # the LM head would run at more positions than the padded forward's (long prompts, short answers)
    index = bins[response_rows] * len(logits_columns) + torch.searchsorted(logits_columns, columns)
    return PackedRows(
        input_ids=input_ids.view(num_rows, capacity),
        position_ids=position_ids.view(num_rows, capacity),
        logits_columns=logits_columns,
        logits_index=index,
        response_index=response_rows * response_length + response_cols,
        tokens=sequences[response_rows, response_cols + prompt_length],
        shape=(batch, response_length),
    )


def packed_response_logits(model: nn.Module, packed: PackedRows) -> torch.Tensor:
    """Logits [1, N, V] at the positions that predict the N real response tokens: one forward of the packed rows,
    the LM head on the needed columns only."""
    logits = model(
        input_ids=packed.input_ids,
        position_ids=packed.position_ids,
        use_cache=False,
        logits_to_keep=packed.logits_columns,
    ).logits
    return logits.reshape(-1, logits.shape[-1])[packed.logits_index].unsqueeze(0)


def unpack_per_token(values: torch.Tensor, packed: PackedRows) -> torch.Tensor:
    """[1, N] per-token values back into ``[B, T]``, 0 where no real response token is (keeps the graph)."""
    batch, response_length = packed.shape
    out = values.new_zeros(batch * response_length)
    return out.index_put((packed.response_index,), values[0]).view(batch, response_length)


def padding_free_logprobs_and_entropy(
    model: nn.Module, packed: PackedRows, temperature: float, entropy_grad: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`~lightning_app_rlhf.models.calls.policy_logprobs` on packed rows: log-probabilities (with gradients)
    and entropies, each [B, T]."""
    logits = packed_response_logits(model, packed)
    logprobs, entropy = functional.token_logprobs_and_entropy(logits, packed.tokens.unsqueeze(0), temperature,
                                                              entropy_grad)
    return unpack_per_token(logprobs, packed), unpack_per_token(entropy, packed)


@torch.no_grad()
def padding_free_logprobs(model: nn.Module, packed: PackedRows, temperature: float) -> torch.Tensor:
    """Log-probabilities [B, T] of the real response tokens (the reference's scoring forward), no graph."""
    logits = packed_response_logits(model, packed)
    return unpack_per_token(functional.logprobs_from_logits(logits, packed.tokens.unsqueeze(0), temperature), packed)
