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

- **Multi-turn episodes** resume mid-turn and mid-episode. A round decodes the turn in progress of every unfinished
  episode (at most what is left of the turn's ``max_new_tokens`` and of ``agent.max_episode_tokens``); an episode
  whose turn ended waits for its environment's answer (:class:`EpisodeEnvironments`), whose observation is appended
  before the next round. Each episode's environment lives on one replica of ``actor.generate`` (its *owner*), which
  resets and steps it; the answers are gathered to every rank of the pool. A checkpoint keeps the episodes' tokens,
  not the environments: a resumed run rebuilds each environment by replaying its episode (``reset``, then ``step``
  on each complete turn's text), and refuses an environment that answers differently.

Not supported: dynamic sampling (its rounds are per update), and stop strings that span two segments (each round
matches within its own tokens).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from lightning_app_rlhf.agents import ChatRenderer, Environment
from lightning_app_rlhf.agents.episodes import EPISODE_STATS, TurnOutcome, start_episode, step_environment
from lightning_app_rlhf.core.config import AgentConfig
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
    """Ended at a stop token (else, once done, cut at ``max_new_tokens``); a multi-turn episode: not truncated."""
    done: bool = False
    uid: int = 0
    """The sample's number in the pool's admission order: which replica holds its environment (multi-turn)."""
    mask: list[int] = field(default_factory=list)
    """Per token: 1 where sampled, 0 on an observation (multi-turn)."""
    rewards: list[float] = field(default_factory=list)
    """Per token: a turn's environment reward on that turn's last sampled token, else 0 (multi-turn)."""
    turn_tokens: int = 0
    """Tokens sampled in the turn in progress (single-turn: all of them)."""
    turns: int = 0
    """Turns ended (multi-turn; :data:`~lightning_app_rlhf.agents.EPISODE_STATS` from here on)."""
    tool_calls: int = 0
    tool_errors: int = 0
    seconds: float = 0.0
    """The environment's seconds (reset and steps)."""
    truncated: bool = False
    started: bool = True
    """Multi-turn: the environment was reset and ``prompt_ids`` are its rendered opening messages."""
    awaiting_step: bool = False
    """Multi-turn: the turn ended at an end of turn, and the environment has not answered it yet."""


class PartialRollouts:
    """The pool of samples in flight across generation calls (module docstring).

    Args:
        group_size: Responses per prompt (``generation.num_samples``): a group is handed on whole.
        max_new_tokens: The response budget of every sample (of every turn, multi-turn), across its segments.
        segment_tokens: Tokens a round decodes at most (``generation.segment_tokens``).
        pad_token_id: Pads prompts (left) and responses (right).
        agent: Multi-turn episodes' limits (None: single-turn).
    """

    def __init__(self, group_size: int, max_new_tokens: int, segment_tokens: int, pad_token_id: int,
                 agent: AgentConfig | None = None) -> None:
        self.group_size, self.max_new_tokens, self.pad_token_id = group_size, max_new_tokens, pad_token_id
        self.segment_tokens, self.agent = segment_tokens, agent
        self.groups: list[list[PartialSample]] = []
        """Groups in flight, oldest first."""
        self.admitted = 0
        """Samples admitted so far: the next one's :attr:`PartialSample.uid`."""

    # ---- filling the pool ----

    def admit(self, batch: dict[str, Any], keys: torch.Tensor) -> None:
        """Add the rows of ``batch`` (each prompt repeated ``group_size`` times, consecutively:
        :func:`~lightning_app_rlhf.generation.repeat_samples`) as fresh samples, with their sample ``keys``."""
        fields = batch.get("fields") or {}
        prompts = batch.get("prompts")
        if self.agent is not None and prompts is None:
            raise ValueError("Multi-turn rollouts reset each environment on its dataset row, and this batch carries no "
                             "prompt rows: build the batches with PromptDataModule (or collate_left_padded), or add "
                             "batch['prompts'], one per row.")
        samples = []
        for row in range(len(batch["input_ids"])):
            # Multi-turn: the prompt is the environment's opening messages, rendered once it is reset.
            ids = [] if self.agent is not None else batch["input_ids"][row][batch["attention_mask"][row].bool()].tolist()
            samples.append(PartialSample(ids, int(batch["index"][row]), int(batch["sample"][row]), int(keys[row]),
                                         {name: values[row] for name, values in fields.items()},
                                         prompts[row] if prompts is not None else None, uid=self.admitted,
                                         started=self.agent is None))
            self.admitted += 1
        self.groups += [samples[i : i + self.group_size] for i in range(0, len(samples), self.group_size)]

    def short_of(self, target: int) -> bool:
        """Whether the pool holds fewer groups than a call on a batch of ``target`` groups keeps in flight."""
        return len(self.groups) < POOL_GROUPS_PER_BATCH * target

    # ---- one round ----

    def unfinished(self) -> list[PartialSample]:
        """The samples still decoding, in pool order: a round's rows."""
        return [s for group in self.groups for s in group if not s.done and not s.awaiting_step]

    def unstarted(self) -> list[PartialSample]:
        """Multi-turn: the admitted episodes whose environment is not reset yet, in pool order."""
        return [s for group in self.groups for s in group if not s.started]

    def awaiting_step(self) -> list[PartialSample]:
        """Multi-turn: the episodes whose turn ended and waits for its environment's answer, in pool order."""
        return [s for group in self.groups for s in group if s.awaiting_step]

    def left(self, sample: PartialSample) -> int:
        """Tokens ``sample`` may still sample in its turn: what is left of ``max_new_tokens`` and, multi-turn, of
        ``agent.max_episode_tokens``."""
        left = self.max_new_tokens - sample.turn_tokens
        return left if self.agent is None else min(left, self.agent.max_episode_tokens - len(sample.tokens))

    def round_inputs(self, rows: list[PartialSample],
                     device: torch.device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, int]:
        """A round's left-padded inputs (each row's prompt and tokens so far), attention mask and keys, and how many
        tokens it decodes at most (the segment, or less where every row has less of its budget left)."""
        input_ids, attention_mask = self._left_padded([s.prompt_ids + s.tokens for s in rows], device)
        keys = torch.tensor([resume_key(s) for s in rows], dtype=torch.int64)
        return input_ids, attention_mask, keys, min(self.segment_tokens, max(map(self.left, rows)))

    def record(self, rows: list[PartialSample], out: dict[str, torch.Tensor], version: int) -> int:
        """Append a round's gathered tokens (``responses``, ``response_mask``, ``logprobs``, ``stopped``, one row per
        sample of ``rows``), sampled by policy ``version``. Single-turn, a row is done at a stop or at its budget;
        multi-turn, a turn ended at a stop awaits its environment (:meth:`answer`), and an episode cut at its turn's
        or its own budget is done, truncated (no complete turn to answer, as in
        :func:`~lightning_app_rlhf.agents.run_episodes`). Returns the tokens kept."""
        kept = 0
        for i, sample in enumerate(rows):
            n = int(out["response_mask"][i].sum())
            take = min(n, self.left(sample))
            sample.tokens += out["responses"][i, :take].tolist()
            sample.logprobs += out["logprobs"][i, :take].tolist()
            sample.versions += [version] * take
            sample.mask += [1] * take
            sample.rewards += [0.0] * take
            sample.turn_tokens += take
            stopped = bool(out["stopped"][i]) and take == n
            if self.agent is None:
                sample.stopped = stopped
                sample.done = stopped or len(sample.tokens) >= self.max_new_tokens
            elif stopped and sample.turn_tokens:
                sample.awaiting_step = True
            elif not self.left(sample):
                self._end_turn(sample)
                sample.done = sample.truncated = True
            kept += take
        return kept

    def answer(self, sample: PartialSample, outcome: TurnOutcome, version: int) -> None:
        """Multi-turn: the environment's ``outcome`` for ``sample``'s ended turn (:meth:`record`): its reward on the
        turn's last token, then the observation appended (tagged ``version``, not trained on), or the episode done,
        truncated where the environment did not end it (its last turn, or no room for another)."""
        sample.awaiting_step = False
        sample.rewards[-1] += outcome.reward
        sample.tool_calls += outcome.tool_calls
        sample.tool_errors += outcome.tool_errors
        sample.seconds += outcome.seconds
        self._end_turn(sample)
        if outcome.done:
            sample.done = sample.stopped = True
        elif outcome.observation is not None:
            n = len(outcome.observation)
            sample.tokens += outcome.observation
            sample.logprobs += [0.0] * n
            sample.versions += [version] * n
            sample.mask += [0] * n
            sample.rewards += [0.0] * n
        else:
            sample.done = sample.truncated = True

    @staticmethod
    def _end_turn(sample: PartialSample) -> None:
        sample.turns += 1
        sample.turn_tokens = 0

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
        attention = torch.zeros_like(response_mask)
        logprobs = torch.zeros((len(rows), width), dtype=torch.float32, device=device)
        rewards = torch.zeros((len(rows), width), dtype=torch.float32, device=device)
        versions = torch.zeros((len(rows), width), dtype=torch.long, device=device)
        for i, s in enumerate(rows):
            n = len(s.tokens)
            responses[i, :n] = torch.tensor(s.tokens, dtype=torch.long)
            response_mask[i, :n] = torch.tensor(s.mask, dtype=response_mask.dtype)
            attention[i, :n] = 1
            logprobs[i, :n] = torch.tensor(s.logprobs, dtype=torch.float32)
            rewards[i, :n] = torch.tensor(s.rewards, dtype=torch.float32)
            versions[i, :n] = torch.tensor(s.versions, dtype=torch.long)
        stopped = torch.tensor([s.stopped for s in rows], device=device)
        multi_turn = self.agent is not None
        rollout = Rollout.from_responses(batch["input_ids"], batch["attention_mask"], responses, response_mask,
                                         logprobs, stopped, attention if multi_turn else None)
        rollout.versions = versions
        if multi_turn:
            rollout.turn_rewards = rewards
            rollout.episode_stats = torch.tensor(
                [[s.turns, s.tool_calls, s.tool_errors, s.seconds, s.truncated] for s in rows], dtype=torch.float32,
                device=device).reshape(len(rows), len(EPISODE_STATS))
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
        return {"groups": [[vars(s) for s in group] for group in self.groups], "admitted": self.admitted}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.groups = [[PartialSample(**s) for s in group] for group in state.get("groups", [])]
        self.admitted = state.get("admitted", sum(map(len, self.groups)))


class EpisodeEnvironments:
    """Multi-turn partial rollouts: the environments of the pool's episodes that this rank holds, each episode's on
    one replica of ``actor.generate`` (its owner: ``uid % owners``), which resets and steps it. :meth:`reset` and
    :meth:`step` return this rank's answers for its own episodes; gathered in replica order (:meth:`in_gather_order`),
    every rank of the pool applies them alike.

    Args:
        prototype: The task's environment, copied per episode.
        tokenizer: The actor's tokenizer (its chat template renders prompts and observations).
        agent: The episodes' limits.
        owners: Replicas of ``actor.generate``.
        mine: This rank's replica of ``actor.generate``; None off its group (it holds no environment).
        end_of_turn_ids: ``() -> ids`` that end an assistant turn (read once, where an environment first runs: the
            actor's own end ids come from its generation module).
    """

    def __init__(self, prototype: Environment, tokenizer: Any, agent: AgentConfig, owners: int, mine: int | None,
                 end_of_turn_ids: Callable[[], list[int]]) -> None:
        self.prototype, self.tokenizer, self.agent, self.owners, self.mine = prototype, tokenizer, agent, owners, mine
        self._end_of_turn_ids = end_of_turn_ids
        self._renderer: ChatRenderer | None = None
        self.environments: dict[int, Environment] = {}
        """This rank's episodes' environments, by :attr:`PartialSample.uid`."""

    @property
    def renderer(self) -> ChatRenderer:
        if self._renderer is None:
            self._renderer = ChatRenderer(self.tokenizer, self.prototype.tools, self._end_of_turn_ids())
        return self._renderer

    def owned(self, samples: list[PartialSample]) -> list[PartialSample]:
        """Those of ``samples`` whose environment this rank holds."""
        return [s for s in samples if self.mine is not None and s.uid % self.owners == self.mine]

    def in_gather_order(self, samples: list[PartialSample]) -> list[PartialSample]:
        """``samples`` in the order their answers are gathered: by owner, then in pool order."""
        return [s for owner in range(self.owners) for s in samples if s.uid % self.owners == owner]

    def reset(self, samples: list[PartialSample]) -> dict[str, torch.Tensor] | None:
        """Reset a copy of the environment for each of ``samples`` this rank owns: their rendered prompts
        (``prompt``, padded with -1) and the seconds ``reset`` took; None off ``actor.generate``'s group."""
        if self.mine is None:
            return None
        prompts, seconds = [], []
        for s in self.owned(samples):
            self.environments[s.uid], prompt, took = start_episode(self.prototype, self._row(s), self.renderer,
                                                                   self.tokenizer)
            prompts.append(prompt)
            seconds.append(took)
        return {"prompt": _padded(prompts), "seconds": torch.tensor(seconds, dtype=torch.float64)}

    def step(self, samples: list[PartialSample]) -> dict[str, torch.Tensor] | None:
        """Step the environment of each of ``samples`` this rank owns on its ended turn: per sample, its
        ``observation`` (padded with -1) and ``outcome`` (reward, done, has an observation, tool calls, tool errors,
        seconds); None off ``actor.generate``'s group."""
        if self.mine is None:
            return None
        observations, outcomes = [], []
        for s in self.owned(samples):
            sampled = s.tokens[len(s.tokens) - s.turn_tokens:]
            outcome = step_environment(self.environments[s.uid], sampled, len(s.tokens), s.turns, self.agent,
                                       self.renderer, self.tokenizer)
            observations.append(outcome.observation or [])
            outcomes.append([outcome.reward, outcome.done, outcome.observation is not None, outcome.tool_calls,
                             outcome.tool_errors, outcome.seconds])
        return {"observation": _padded(observations),
                "outcome": torch.tensor(outcomes, dtype=torch.float64).reshape(len(outcomes), 6)}

    def close_finished(self, pool: PartialRollouts) -> None:
        """Close the environments of this rank's episodes that are done (or no longer in the pool)."""
        running = {s.uid for group in pool.groups for s in group if not s.done}
        for uid in [uid for uid in self.environments if uid not in running]:
            self.environments.pop(uid).close()

    def replay(self, pool: PartialRollouts) -> None:
        """Rebuild the environments of this rank's running episodes that it does not hold (a resumed run: a
        checkpoint keeps the tokens, not the environments): reset a copy on the episode's row, then step it on each
        ended turn's tokens, checking that it renders the same prompt and answers with the same observations.

        Raises:
            ValueError: The environment renders another prompt or answers a turn with another observation than it
                did before the checkpoint.
        """
        name = type(self.prototype).__name__
        for s in self.owned([s for group in pool.groups for s in group]):
            if not s.started or s.done or s.uid in self.environments:
                continue
            env, prompt, _ = start_episode(self.prototype, self._row(s), self.renderer, self.tokenizer)
            runs = _runs(s.mask)
            try:
                if prompt != s.prompt_ids:
                    raise ValueError(f"rendered another prompt for sample {s.index}/{s.sample}")
                for turn in range(s.turns):
                    (start, end), observation = runs[2 * turn], runs[2 * turn + 1]
                    outcome = step_environment(env, s.tokens[start:end], end, turn, self.agent, self.renderer,
                                               self.tokenizer)
                    if outcome.observation != s.tokens[observation[0]:observation[1]]:
                        raise ValueError(f"answered turn {turn + 1} of sample {s.index}/{s.sample} with another "
                                         "observation")
            except ValueError as error:
                env.close()
                raise ValueError(f"A resumed run rebuilds each partial episode's environment by replaying its turns, "
                                 f"and {name} {error} than before the checkpoint: make reset and step depend only on "
                                 "the row and the turns' text, or resume with partial_rollout false from a "
                                 "checkpoint saved without it.") from None
            self.environments[s.uid] = env

    @staticmethod
    def _row(sample: PartialSample) -> dict[str, Any]:
        return {"prompt": sample.prompt, **sample.fields}


def _padded(rows: list[list[int]]) -> torch.Tensor:
    """Token lists as one [N, width] tensor, padded with -1."""
    width = max(map(len, rows), default=0)
    return torch.tensor([r + [-1] * (width - len(r)) for r in rows], dtype=torch.long).reshape(len(rows), width)


def _runs(mask: list[int]) -> list[tuple[int, int]]:
    """``[start, end)`` of each run of equal values of ``mask`` (an episode's turns and observations, alternating)."""
    runs, start = [], 0
    for i in range(1, len(mask) + 1):
        if i == len(mask) or mask[i] != mask[start]:
            runs.append((start, i))
            start = i
    return runs


def resume_key(sample: PartialSample) -> int:
    """The key of ``sample``'s next round: its turn's key (:func:`~lightning_app_rlhf.agents.episodes.turn_keys`: its
    own key on the first turn, then mixed with the turn number), mixed with the tokens it has of the turn where it
    resumes one. A turn's first segment draws what an uninterrupted turn draws."""
    key = mix_key(sample.key, sample.turns) if sample.turns else sample.key
    return mix_key(key, sample.turn_tokens) if sample.turn_tokens else key


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


def check_partial_rollout(dynamic_sampling: bool) -> None:
    """Raise naming the fix where partial rollouts cannot run (module docstring: what is not supported)."""
    if dynamic_sampling:
        raise ValueError("partial_rollout carries unfinished samples across updates, and ppo.dynamic_sampling collects "
                         "groups over generation rounds within one update: set ppo.dynamic_sampling false, or "
                         "partial_rollout false.")
