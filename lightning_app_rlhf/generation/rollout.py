"""The batch-level side of ``actor.generate``: the :class:`Rollout` it returns, the per-sample keys that fix its
random draws, the repeated prompt rows of a group, and the row chunks a call runs in. Plain PyTorch.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F

_MASK64 = (1 << 63) - 1


@dataclass
class Rollout:
    """What ``actor.generate`` produces for one batch of left-padded prompts."""

    sequences: torch.Tensor
    """[B, P + T] prompt tokens (left-padded) followed by response tokens (pad after EOS)."""
    attention_mask: torch.Tensor
    """[B, P + T] 1 for real prompt tokens and for response tokens up to and including EOS."""
    response_mask: torch.Tensor
    """[B, T] 1 for response tokens up to and including EOS: the loss mask. In a multi-turn episode, 1 exactly on the
    sampled tokens (the observations between turns are 0 here, 1 in ``attention_mask``)."""
    logprobs: torch.Tensor
    """[B, T] behaviour log-probabilities of the sampled tokens at the sampling temperature (no top-k/top-p)."""
    prompt_length: int
    """P, the padded prompt length."""
    stopped: torch.Tensor | None = None
    """[B] True where the response ended at a stop token or stop string (its last masked token), False where it
    was cut at ``max_new_tokens``. None when unknown, e.g. a rollout rebuilt from gathered tensors."""
    turn_rewards: torch.Tensor | None = None
    """[B, T] a multi-turn episode's environment rewards, each on its turn's last sampled token; None: single-turn."""
    episode_stats: torch.Tensor | None = None
    """[B, len(agents.EPISODE_STATS)] what each multi-turn episode did (turns, tool calls...); None: single-turn."""
    versions: torch.Tensor | None = None
    """[B, T] the policy version that sampled each response token (0 off the response mask), with partial rollouts,
    where a sample's tokens can come from several versions (:mod:`~lightning_app_rlhf.engine.partial_rollout`); None:
    the whole rollout comes from one version (the experience's ``policy_version``)."""

    @classmethod
    def from_responses(
        cls,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor,
        responses: torch.Tensor,
        response_mask: torch.Tensor,
        logprobs: torch.Tensor,
        stopped: torch.Tensor,
        response_attention: torch.Tensor | None = None,
    ) -> Rollout:
        """The rollout of left-padded prompts followed by their responses.

        Args:
            input_ids: [B, P] left-padded prompt tokens.
            attention_mask: [B, P] 1 for real prompt tokens.
            responses: [B, T] response tokens, pad after a row's end.
            response_mask: [B, T] 1 for response tokens up to and including a row's end, in ``attention_mask``'s
                dtype.
            logprobs: [B, T] behaviour log-probabilities of the response tokens, 0 after a row's end.
            stopped: [B] whether each row ended at a stop (else it was cut at ``max_new_tokens``).
            response_attention: [B, T] 1 on every real response token, where that is more than the sampled ones
                (a multi-turn episode's observation tokens are attended to, not trained on); None: ``response_mask``.
        """
        return cls(
            sequences=torch.cat([input_ids, responses], dim=1),
            attention_mask=torch.cat([attention_mask, response_mask if response_attention is None
                                      else response_attention.to(response_mask.dtype)], dim=1),
            response_mask=response_mask,
            logprobs=logprobs,
            prompt_length=input_ids.shape[1],
            stopped=stopped,
        )

    @property
    def responses(self) -> torch.Tensor:
        return self.sequences[:, self.prompt_length :]

    def texts(self, tokenizer: Any) -> tuple[list[str], list[str]]:
        """Prompt texts (padding dropped) and completion texts (up to and including the stop token; a multi-turn
        episode's every turn and observation), decoded by ``tokenizer``."""
        prompt_mask = self.attention_mask[:, : self.prompt_length].bool()
        prompts = [tokenizer.decode(ids[mask]) for ids, mask in zip(self.sequences[:, : self.prompt_length],
                                                                    prompt_mask)]
        response_attention = self.attention_mask[:, self.prompt_length :].bool()
        completions = [tokenizer.decode(ids[mask]) for ids, mask in zip(self.responses, response_attention)]
        return prompts, completions

    def completion_rows(self, tokenizer: Any, scores: torch.Tensor) -> list[dict[str, Any]]:
        """Per row: the prompt's text, the completion's text and token ids (up to and including the stop token), and
        the reward's raw score."""
        ids = [response[mask.bool()].tolist()
               for response, mask in zip(self.responses, self.attention_mask[:, self.prompt_length :])]
        return [{"prompt": prompt, "completion": completion, "completion_ids": row_ids, "reward": float(score)}
                for prompt, completion, row_ids, score in zip(*self.texts(tokenizer), ids, scores.tolist())]

    def select(self, rows: slice | torch.Tensor) -> Rollout:
        """The rollout of a subset of rows (a slice, or a boolean or index tensor)."""
        part = lambda t: t[rows] if t is not None else None
        return Rollout(self.sequences[rows], self.attention_mask[rows], self.response_mask[rows],
                       self.logprobs[rows], self.prompt_length, part(self.stopped), part(self.turn_rewards),
                       part(self.episode_stats), part(self.versions))

    def final_turns(self) -> torch.Tensor:
        """[B, T] 1 on the sampled tokens of each row's last turn (the whole response of a single-turn rollout): the
        last run of 1s of ``response_mask``."""
        mask = self.response_mask.bool()
        if not mask.shape[1]:
            return self.response_mask
        positions = torch.arange(mask.shape[1], device=mask.device).expand_as(mask)
        last = torch.where(mask, positions, -1).amax(1, keepdim=True)
        last_gap = torch.where(~mask & (positions <= last), positions, -1).amax(1, keepdim=True)
        return (mask & (positions > last_gap)).to(self.response_mask.dtype)


def concat_rollouts(rollouts: list[Rollout], pad_token_id: int) -> Rollout:
    """The rows of ``rollouts`` in order, as one rollout: prompts left-padded to the longest prompt part, responses
    right-padded to the longest response part (pad tokens, masks and log-probabilities 0). Positions follow the
    attention mask, so the extra padding changes no model output."""
    prompt = max(r.prompt_length for r in rollouts)
    response = max(r.response_mask.shape[1] for r in rollouts)

    def pad(t: torch.Tensor, left: int, right: int, value: float = 0) -> torch.Tensor:
        return F.pad(t, (left, right), value=value) if left or right else t

    parts = []
    for r in rollouts:
        left, right = prompt - r.prompt_length, response - r.response_mask.shape[1]
        parts.append((pad(r.sequences, left, right, pad_token_id), pad(r.attention_mask, left, right),
                      pad(r.response_mask, 0, right), pad(r.logprobs, 0, right)))
    def joined(column: list[torch.Tensor | None], pad_right: bool) -> torch.Tensor | None:
        if any(t is None for t in column):
            return None
        return torch.cat([pad(t, 0, response - t.shape[1]) if pad_right else t for t in column])

    return Rollout(*(torch.cat(column) for column in zip(*parts)), prompt_length=prompt,
                   stopped=joined([r.stopped for r in rollouts], False),
                   turn_rewards=joined([r.turn_rewards for r in rollouts], True),
                   episode_stats=joined([r.episode_stats for r in rollouts], False),
                   versions=joined([r.versions for r in rollouts], True))


def sample_keys(
    seed: int, iteration: int, sample_indices: torch.Tensor, repeat_indices: torch.Tensor | None = None
) -> torch.Tensor:
    """One 63-bit key per sample from (seed, iteration, prompt index, sample index), by a splitmix64-style mix.

    ``sample_indices`` are the prompts' global indices; ``repeat_indices`` which of the ``generation.num_samples``
    responses of its prompt a row is (None: all 0, the first response, whose key does not depend on the group size).
    """
    repeats = repeat_indices.tolist() if repeat_indices is not None else [0] * len(sample_indices)
    keys = []
    for index, repeat in zip(sample_indices.tolist(), repeats):
        z = (seed * 0x9E3779B97F4A7C15 + iteration * 0xBF58476D1CE4E5B9 + index * 0x94D049BB133111EB
             + repeat * 0xD1B54A32D192ED03) & _MASK64
        keys.append(_finalize(z))
    return torch.tensor(keys, dtype=torch.int64)


def mix_key(key: int, salt: int) -> int:
    """A new 63-bit key from ``key`` and ``salt`` (e.g. a multi-turn episode's turn number), by the same mix."""
    return _finalize(((key & _MASK64) + salt * 0xD6E8FEAC8F3A5A1D + 0x9E3779B97F4A7C15) & _MASK64)


def _finalize(z: int) -> int:
    z = ((z ^ (z >> 31)) * 0xD6E8FEAC8F3A5A1D) & _MASK64
    return z ^ (z >> 29)


def repeat_samples(batch: dict[str, Any], num_samples: int) -> dict[str, Any]:
    """Each prompt row repeated ``num_samples`` times, consecutively (a prompt's group is contiguous), with
    ``sample``: which repeat a row is. Row fields (lists) and the prompts as given (``prompts``) are repeated alike."""
    repeat = lambda t: t.repeat_interleave(num_samples, dim=0)
    out = {key: repeat(batch[key]) for key in ("input_ids", "attention_mask", "index")}
    out["sample"] = torch.arange(num_samples, device=batch["index"].device).repeat(len(batch["index"]))
    fields = batch.get("fields") or {}
    out["fields"] = {name: [v for v in values for _ in range(num_samples)] for name, values in fields.items()}
    if batch.get("prompts") is not None:
        out["prompts"] = [prompt for prompt in batch["prompts"] for _ in range(num_samples)]
    return out


def row_chunks(
    num_rows: int,
    batch_size: int | None,
    lockstep_group: dist.ProcessGroup | None = None,
    device: torch.device | str | None = None,
) -> list[slice]:
    """Consecutive row chunks of a rank's ``num_rows`` rows, each of at most ``batch_size`` rows.

    ``ceil(num_rows / batch_size)`` chunks of near-equal size (sizes differ by at most one), covering the rows in
    order; ``batch_size=None``: one chunk of every row. With ``lockstep_group`` (ranks whose model is sharded and
    must run the same number of forwards), the count is ``ceil(max rows over the group / batch_size)`` on every
    rank, from one all-reduce on ``device``: a rank's chunks are then non-empty when it has at least as many rows as
    chunks, and a rank with fewer rows gets empty chunks, which its caller runs on a stand-in row so that the
    group's collectives stay paired. Without a group, zero rows give no chunks.
    """
    if batch_size is None:
        num_chunks = 1 if num_rows > 0 or lockstep_group is not None else 0
    else:
        most = num_rows
        if lockstep_group is not None:
            count = torch.tensor([num_rows], dtype=torch.int64, device=device)
            dist.all_reduce(count, op=dist.ReduceOp.MAX, group=lockstep_group)
            most = int(count.item())
        num_chunks = -(-most // batch_size)
    bounds = [i * num_rows // num_chunks for i in range(num_chunks + 1)] if num_chunks else []
    return [slice(start, stop) for start, stop in itertools.pairwise(bounds)]
