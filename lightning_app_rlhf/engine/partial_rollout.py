"""Partial rollouts (:attr:`~lightning_app_rlhf.parallel.plan.PlacementPlan.partial_rollout`): a generation call ends
once a batch of groups is complete, not when its longest response does, and the unfinished samples resume under the
next weights. Plain PyTorch.

With very uneven response lengths a rollout waits for its longest response, its generating ranks decoding a few rows
for most of the call. slime (``--partial-rollout``) and AReaL (interruptible generation) end the call early instead
and carry the unfinished samples over. Here:

- **The pool.** Every rank that holds the rollout keeps the same pool of groups in flight (each rank updates it from
  the same gathered tokens): the samples carried from the previous call first, then the iteration's prompts, topped
  up to twice the batch with further prompts (``more_prompts``, as dynamic sampling draws them) so that a call has
  more rows in flight than it hands on.
- **Segments.** The generating ranks decode the unfinished rows in rounds of at most ``generation.segment_tokens``
  tokens, each round a fresh prefill of the prompt and the tokens so far (a backend's own cache is not kept across
  rounds; vLLM's prefix cache serves the repeated prefix within a weight version). A round's tokens are gathered;
  the call ends after the round where at least the batch's groups are complete and every sample carried from an
  older version has finished: a sample spans at most two consecutive versions, so its tokens stay within
  ``max_staleness`` (the schedule keeps one version for them: ``PlacementPlan.schedule_staleness``).
- **The rollout** is the first complete groups in pool order; the rest stay, and the next call resumes them under
  its weights. Each token carries the version that sampled it (:attr:`Rollout.versions`).
- **Budgets.** A sample never has more than ``max_new_tokens`` response tokens: a round decodes at most what is left
  of it, and a row that reaches it is done (cut, not stopped).
- **Keys.** A row's draws are keyed by its sample key, mixed with the number of tokens it already has when it
  resumes: deterministic on every placement, and its first segment draws what an uninterrupted call draws.

Not supported: multi-turn episodes (an environment's state would have to be carried too), dynamic sampling (its
rounds are per update), and stop strings that span two segments (each round matches within its own tokens).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from lightning_app_rlhf.generation.rollout import Rollout, mix_key

POOL_GROUPS_PER_BATCH = 2
"""The pool is topped up to this many times the batch's groups before each call: the rows a call keeps in flight
beyond those it hands on (slime's over-sampling), so that it can end before its longest responses do."""


@dataclass
class PartialSample:
    """One sample (a row) of the pool: its prompt, its sample key, and the response so far."""

    prompt_ids: list[int]
    index: int
    """The prompt's dataset index."""
    sample: int
    """Which of its group's responses this is."""
    key: int
    """The row's sample key (:func:`~lightning_app_rlhf.generation.rollout.sample_keys`)."""
    fields: dict[str, Any] = field(default_factory=dict)
    """The prompt's row fields (what a reward function reads)."""
    prompt: Any = None
    """The prompt as the dataset holds it (text or messages), where the batch carries it."""
    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    """The policy version that sampled each token."""
    stopped: bool = False
    """Ended at a stop token (else, once done, cut at ``max_new_tokens``)."""
    done: bool = False


class PartialRollouts:
    """The pool of samples in flight across generation calls (module docstring).

    Args:
        group_size: Responses per prompt (``generation.num_samples``): a group is handed on whole.
        max_new_tokens: The response budget of every sample, across its segments.
        segment_tokens: Tokens a round decodes at most (``generation.segment_tokens``).
        pad_token_id: Pads prompts (left) and responses (right).
    """

    def __init__(self, group_size: int, max_new_tokens: int, segment_tokens: int, pad_token_id: int) -> None:
        self.group_size, self.max_new_tokens, self.pad_token_id = group_size, max_new_tokens, pad_token_id
        self.segment_tokens = segment_tokens
        self.groups: list[list[PartialSample]] = []
        """Groups in flight, oldest first."""

    # ---- filling the pool ----

    def admit(self, batch: dict[str, Any], keys: torch.Tensor) -> None:
        """Add the rows of ``batch`` (each prompt repeated ``group_size`` times, consecutively:
        :func:`~lightning_app_rlhf.generation.repeat_samples`) as fresh samples, with their sample ``keys``."""
        fields = batch.get("fields") or {}
        prompts = batch.get("prompts")
        samples = []
        for row in range(len(batch["input_ids"])):
            ids = batch["input_ids"][row][batch["attention_mask"][row].bool()].tolist()
            samples.append(PartialSample(ids, int(batch["index"][row]), int(batch["sample"][row]), int(keys[row]),
                                         {name: values[row] for name, values in fields.items()},
                                         prompts[row] if prompts is not None else None))
        self.groups += [samples[i : i + self.group_size] for i in range(0, len(samples), self.group_size)]

    def short_of(self, target: int) -> bool:
        """Whether the pool holds fewer groups than a call on a batch of ``target`` groups keeps in flight."""
        return len(self.groups) < POOL_GROUPS_PER_BATCH * target

    # ---- one round ----

    def unfinished(self) -> list[PartialSample]:
        """The samples still decoding, in pool order: a round's rows."""
        return [s for group in self.groups for s in group if not s.done]

    def round_inputs(self, rows: list[PartialSample],
                     device: torch.device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, int]:
        """A round's left-padded inputs (each row's prompt and tokens so far), attention mask and keys, and how many
        tokens it decodes at most (the segment, or less where every row has less of its budget left)."""
        input_ids, attention_mask = self._left_padded([s.prompt_ids + s.tokens for s in rows], device)
        keys = torch.tensor([mix_key(s.key, len(s.tokens)) if s.tokens else s.key for s in rows], dtype=torch.int64)
        left = max(self.max_new_tokens - len(s.tokens) for s in rows)
        return input_ids, attention_mask, keys, min(self.segment_tokens, left)

    def record(self, rows: list[PartialSample], out: dict[str, torch.Tensor], version: int) -> int:
        """Append a round's gathered tokens (``responses``, ``response_mask``, ``logprobs``, ``stopped``, one row per
        sample of ``rows``), sampled by policy ``version``; a row is done at a stop or at its budget. Returns the
        tokens kept."""
        kept = 0
        for i, sample in enumerate(rows):
            n = int(out["response_mask"][i].sum())
            take = min(n, self.max_new_tokens - len(sample.tokens))
            sample.tokens += out["responses"][i, :take].tolist()
            sample.logprobs += out["logprobs"][i, :take].tolist()
            sample.versions += [version] * take
            sample.stopped = bool(out["stopped"][i]) and take == n
            sample.done = sample.stopped or len(sample.tokens) >= self.max_new_tokens
            kept += take
        return kept

    def call_done(self, target: int, version: int) -> bool:
        """Whether the call ends: at least ``target`` groups complete, and no unfinished sample holds tokens of a
        version older than ``version`` (one carried from an earlier call finishes in this one)."""
        complete = sum(all(s.done for s in group) for group in self.groups)
        stale = any(not s.done and s.versions and s.versions[0] < version for group in self.groups for s in group)
        return complete >= target and not stale

    # ---- handing on ----

    def take(self, target: int, device: torch.device) -> tuple[dict[str, Any], Rollout, dict[str, float]]:
        """The first ``target`` complete groups, in pool order, out of the pool: their prompts as a batch (as
        :func:`~lightning_app_rlhf.generation.repeat_samples` gives it), their rollout with a version per token, and
        what the pool carries on (``rollout/partial_*``)."""
        chosen: list[list[PartialSample]] = []
        rest: list[list[PartialSample]] = []
        for group in self.groups:
            (chosen if len(chosen) < target and all(s.done for s in group) else rest).append(group)
        self.groups = rest
        rows = [s for group in chosen for s in group]
        batch = self._batch(rows, device)
        width = max(len(s.tokens) for s in rows)
        responses = torch.full((len(rows), width), self.pad_token_id, dtype=torch.long, device=device)
        response_mask = torch.zeros((len(rows), width), dtype=batch["attention_mask"].dtype, device=device)
        logprobs = torch.zeros((len(rows), width), dtype=torch.float32, device=device)
        versions = torch.zeros((len(rows), width), dtype=torch.long, device=device)
        for i, s in enumerate(rows):
            n = len(s.tokens)
            responses[i, :n] = torch.tensor(s.tokens, dtype=torch.long)
            response_mask[i, :n] = 1
            logprobs[i, :n] = torch.tensor(s.logprobs, dtype=torch.float32)
            versions[i, :n] = torch.tensor(s.versions, dtype=torch.long)
        stopped = torch.tensor([s.stopped for s in rows], device=device)
        rollout = Rollout.from_responses(batch["input_ids"], batch["attention_mask"], responses, response_mask,
                                         logprobs, stopped)
        rollout.versions = versions
        carried = [s for group in self.groups for s in group]
        stats = {
            "rollout/partial_resumed_share": sum(len(set(s.versions)) > 1 for s in rows) / len(rows),
            "rollout/partial_carried_rows": float(sum(not s.done for s in carried)),
            "rollout/partial_carried_tokens": float(sum(len(s.tokens) for s in carried)),
            "rollout/partial_pool_groups": float(len(self.groups)),
        }
        return batch, rollout, stats

    def _left_padded(self, sequences: list[list[int]], device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """Token lists left-padded into one batch, and its attention mask."""
        length = max(map(len, sequences))
        input_ids = torch.full((len(sequences), length), self.pad_token_id, dtype=torch.long, device=device)
        attention_mask = torch.zeros((len(sequences), length), dtype=torch.long, device=device)
        for i, ids in enumerate(sequences):
            input_ids[i, length - len(ids) :] = torch.tensor(ids, dtype=torch.long)
            attention_mask[i, length - len(ids) :] = 1
        return input_ids, attention_mask

    def _batch(self, rows: list[PartialSample], device: torch.device) -> dict[str, Any]:
        input_ids, attention_mask = self._left_padded([s.prompt_ids for s in rows], device)
        batch: dict[str, Any] = {
            "input_ids": input_ids, "attention_mask": attention_mask,
            "index": torch.tensor([s.index for s in rows], device=device),
            "sample": torch.tensor([s.sample for s in rows], device=device),
            "fields": {name: [s.fields[name] for s in rows] for name in rows[0].fields},
        }
        if all(s.prompt is not None for s in rows):
            batch["prompts"] = [s.prompt for s in rows]
        return batch

    # ---- checkpoints ----

    def state_dict(self) -> dict[str, Any]:
        """The pool as plain lists, numbers and strings (a weights-only load reads it)."""
        return {"groups": [[vars(s) for s in group] for group in self.groups]}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.groups = [[PartialSample(**s) for s in group] for group in state.get("groups", [])]


def fill_pool(pool: PartialRollouts, batch: dict[str, Any], target: int,
              keys: Callable[[dict[str, Any], int], torch.Tensor],
              more_prompts: Callable[[int], dict[str, Any]] | None) -> int:
    """Admit the iteration's ``batch`` (repeated per sample), then further prompts until the pool holds
    :data:`POOL_GROUPS_PER_BATCH` times ``target`` groups. Returns the further rounds of prompts drawn.

    Args:
        pool: The pool.
        batch: The iteration's prompts, repeated per sample.
        target: Groups per rollout.
        keys: ``(batch, round) -> [rows]`` the sample keys of a round's rows (round 0: the iteration's batch).
        more_prompts: ``round -> batch`` (repeated per sample) of further prompts, round 1, 2, ...
    """
    pool.admit(batch, keys(batch, 0))
    drawn = 0
    while pool.short_of(target):
        if more_prompts is None:
            raise ValueError("partial_rollout keeps more prompts in flight than a batch holds, and this run has no "
                             "source of further prompts: use a PromptDataModule (trainer.fit(module, "
                             "datamodule=...)), or set module.refill_prompts ((iteration, round) -> batch).")
        drawn += 1
        extra = more_prompts(drawn)
        pool.admit(extra, keys(extra, drawn))
    return drawn


def check_partial_rollout(dynamic_sampling: bool, multi_turn: bool) -> None:
    """Raise naming the fix where partial rollouts cannot run (module docstring: what is not supported)."""
    if dynamic_sampling:
        raise ValueError("partial_rollout carries unfinished samples across updates, and ppo.dynamic_sampling collects "
                         "groups over generation rounds within one update: set ppo.dynamic_sampling false, or "
                         "partial_rollout false.")
    if multi_turn:
        raise ValueError("partial_rollout does not carry a multi-turn episode's environment across updates yet: run "
                         "episodes (environment=...) with partial_rollout false.")
