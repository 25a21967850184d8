"""Multi-turn rollouts, token in and token out: each episode's environment steps between the actor's turns, on the
ranks that generate. Plain PyTorch.

Every turn is one :func:`~lightning_app_rlhf.generation.generate` call on the episodes still running (a finished
episode costs no more generation), each row keyed by its sample key and the turn number, so an episode's trajectory
does not depend on which rows share its batch, or on the placement. The sampled tokens are kept as sampled; the
observation's tokens are appended after them (:class:`~lightning_app_rlhf.agents.chat.ChatRenderer`). The loss mask
is 1 exactly on sampled tokens.
"""

from __future__ import annotations

import copy
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from lightning_app_rlhf.agents.chat import ChatRenderer
from lightning_app_rlhf.agents.environment import Environment, checked_messages, checked_step
from lightning_app_rlhf.core.config import AgentConfig, GenerationConfig
from lightning_app_rlhf.generation.backend import generate
from lightning_app_rlhf.generation.rollout import Rollout, mix_key
from lightning_app_rlhf.parallel.heartbeat import entering

EPISODE_STATS = ("turns", "tool_calls", "tool_errors", "environment_seconds", "truncated")
"""Per episode, in this order: the columns of :attr:`EpisodeRollout.stats`."""


@dataclass
class Episode:
    """One episode's tokens so far (after its prompt), with its loss mask, behaviour log-probs and rewards."""

    environment: Environment
    prompt: list[int]
    tokens: list[int] = field(default_factory=list)
    mask: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    rewards: list[float] = field(default_factory=list)
    """Per token: a turn's reward on that turn's last sampled token, else 0."""
    done: bool = False
    truncated: bool = False
    turns: int = 0
    tool_calls: int = 0
    tool_errors: int = 0
    seconds: float = 0.0

    def append(self, tokens: list[int], sampled: bool, logprobs: list[float] | None = None) -> None:
        self.tokens += tokens
        self.mask += [int(sampled)] * len(tokens)
        self.logprobs += logprobs if logprobs is not None else [0.0] * len(tokens)
        self.rewards += [0.0] * len(tokens)


@dataclass
class EpisodeRollout:
    """A batch of finished episodes: the rollout the rest of the iteration trains on, and what each episode did."""

    rollout: Rollout
    """Prompts (left-padded) and episodes: ``response_mask`` is the loss mask, 1 exactly on sampled tokens; the
    attention mask also covers the observation tokens; ``stopped`` is False for a truncated episode."""
    turn_rewards: torch.Tensor
    """[B, T] each turn's environment reward, on that turn's last sampled token."""
    stats: torch.Tensor
    """[B, len(EPISODE_STATS)] float32 per-episode counts (:data:`EPISODE_STATS`)."""


def turn_keys(keys: torch.Tensor, turn: int) -> torch.Tensor:
    """The keys of turn ``turn``: the samples' own keys on the first turn, then mixed with the turn number."""
    return keys if turn == 0 else torch.tensor([mix_key(int(k), turn) for k in keys.tolist()], dtype=torch.int64)


def start_episodes(environment: Environment, rows: Sequence[dict[str, Any]], renderer: ChatRenderer,
                   tokenizer: Any) -> list[Episode]:
    """One copy of ``environment`` per row, reset on it (:func:`start_episode`); its opening messages rendered as the
    prompt."""
    episodes = []
    for row in rows:
        env, prompt, seconds = start_episode(environment, row, renderer, tokenizer)
        episodes.append(Episode(env, prompt, seconds=seconds))
    return episodes


@torch.no_grad()
def run_episodes(
    model: torch.nn.Module,
    environment: Environment,
    rows: Sequence[dict[str, Any]],
    keys: torch.Tensor,
    tokenizer: Any,
    generation: GenerationConfig,
    agent: AgentConfig,
    eos_token_ids: Sequence[int],
    device: torch.device,
    lockstep_group: dist.ProcessGroup | None = None,
    inference_mode: bool = False,
    weights_version: int | None = None,
) -> EpisodeRollout:
    """Run one episode per row to its end: at most ``agent.max_turns`` assistant turns and
    ``agent.max_episode_tokens`` tokens after the prompt.

    An episode ends when its environment answers ``done``; it is *truncated* (``stopped`` False, so
    ``ppo.overlong_filter`` and the DAPO penalty see it) when a turn is cut at ``generation.max_new_tokens`` without an
    end of turn, when its tokens would pass the budget, or at ``max_turns`` without ``done``.

    Args:
        model: The actor (its generation module on this rank).
        environment: Copied per episode (``copy.deepcopy``), then reset on the episode's row.
        rows: Per episode, ``{"prompt": ..., **fields}``.
        keys: [B] the episodes' sample keys (:func:`~lightning_app_rlhf.generation.sample_keys`).
        tokenizer: The actor's tokenizer (its chat template renders the prompts and observations).
        generation: A turn's sampling settings (``max_new_tokens`` is per turn).
        agent: The turn and token limits.
        eos_token_ids: Ids that end an assistant turn.
        device: Where the prompts go.
        lockstep_group: Ranks of a sharded actor: every rank runs as many turns as the group's longest episode (with
            no rows when its own are done), so their forwards stay paired.
        inference_mode: See :func:`~lightning_app_rlhf.generation.generate`.
        weights_version: The policy version of ``model``'s weights (see
            :attr:`~lightning_app_rlhf.generation.DecodeRequest.weights_version`).
    """
    renderer = ChatRenderer(tokenizer, environment.tools, eos_token_ids)
    episodes = start_episodes(environment, rows, renderer, tokenizer)
    try:
        for turn in range(agent.max_turns):
            active = [i for i, e in enumerate(episodes) if not e.done]
            if not _any_running(bool(active), lockstep_group, device):
                break
            part = _generate_turn(model, [episodes[i] for i in active], keys[active], turn, tokenizer, generation,
                                  eos_token_ids, device, lockstep_group, inference_mode, weights_version)
            for row, i in enumerate(active):
                _finish_turn(episodes[i], part, row, turn, agent, renderer, tokenizer)
        for episode in episodes:
            if not episode.done:  # max_turns reached while the environment wanted more
                episode.done = episode.truncated = True
    finally:
        for episode in episodes:
            episode.environment.close()
    return _to_rollout(episodes, tokenizer.pad_token_id, device)


def _any_running(running: bool, lockstep_group: dist.ProcessGroup | None, device: torch.device) -> bool:
    if lockstep_group is None:
        return running
    flag = torch.tensor([int(running)], device=device)
    dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=lockstep_group)
    return bool(flag.item())


def _generate_turn(model: torch.nn.Module, episodes: list[Episode], keys: torch.Tensor, turn: int, tokenizer: Any,
                   generation: GenerationConfig, eos_token_ids: Sequence[int], device: torch.device,
                   lockstep_group: dist.ProcessGroup | None, inference_mode: bool,
                   weights_version: int | None) -> Rollout:
    """One assistant turn of ``episodes``: their whole contexts, left-padded, decoded together."""
    contexts = [e.prompt + e.tokens for e in episodes]
    width = max((len(c) for c in contexts), default=1)
    pad = tokenizer.pad_token_id
    input_ids = torch.tensor([[pad] * (width - len(c)) + c for c in contexts] or [[]], dtype=torch.long,
                             device=device).reshape(len(contexts), width)
    attention = torch.tensor([[0] * (width - len(c)) + [1] * len(c) for c in contexts] or [[]], dtype=torch.long,
                             device=device).reshape(len(contexts), width)
    return generate(model, input_ids, attention, generation, turn_keys(keys, turn), list(eos_token_ids), pad,
                    lockstep_group, tokenizer=tokenizer, inference_mode=inference_mode, weights_version=weights_version)


@dataclass
class TurnOutcome:
    """What an episode's environment answered to one complete assistant turn."""

    reward: float
    done: bool
    """The environment ended the episode."""
    observation: list[int] | None
    """The observation's tokens to append before the next turn; None where no turn follows (done, the last turn, or
    no room left for another turn within ``max_episode_tokens``: then the episode is truncated)."""
    tool_calls: int = 0
    tool_errors: int = 0
    seconds: float = 0.0


def start_episode(environment: Environment, row: dict[str, Any], renderer: ChatRenderer,
                  tokenizer: Any) -> tuple[Environment, list[int], float]:
    """A copy of ``environment`` reset on ``row``: the copy, its opening messages rendered as the prompt's tokens,
    and the seconds ``reset`` took."""
    env = copy.deepcopy(environment)
    env.tokenizer = tokenizer
    name = type(environment).__name__
    entering(f"{name}.reset")  # a stuck-rank verdict names the environment
    started = time.perf_counter()
    messages = checked_messages(env.reset(dict(row)), f"{name}.reset", allow_empty=False)
    return env, renderer.prompt_ids(messages), time.perf_counter() - started


def step_environment(environment: Environment, sampled: list[int], tokens_so_far: int, turn: int,
                     agent: AgentConfig, renderer: ChatRenderer, tokenizer: Any) -> TurnOutcome:
    """Step ``environment`` on a complete assistant turn (``sampled``, ending in an end of turn), the episode holding
    ``tokens_so_far`` tokens after its prompt with the turn: its reward, and the observation's tokens where another
    turn follows (turn ``turn`` is 0-based)."""
    name = type(environment).__name__
    entering(f"{name}.step (turn {turn + 1})")  # a stuck-rank verdict names the environment
    started = time.perf_counter()
    result = checked_step(environment.step(tokenizer.decode(sampled, skip_special_tokens=True)), f"{name}.step")
    outcome = TurnOutcome(result.reward, result.done, None, int(result.info.get("tool_calls", 0)),
                          int(result.info.get("tool_errors", 0)), time.perf_counter() - started)
    if result.done or turn + 1 == agent.max_turns:
        return outcome  # done; or no turn is left to answer the observation (run_episodes marks it truncated)
    observation = renderer.observation_ids(result.observation, sampled[-1] in renderer.end_of_turn_ids)
    if tokens_so_far + len(observation) < agent.max_episode_tokens:  # else no room is left for another turn
        outcome.observation = observation
    return outcome


def _finish_turn(episode: Episode, part: Rollout, row: int, turn: int, agent: AgentConfig, renderer: ChatRenderer,
                 tokenizer: Any) -> None:
    """Append row ``row`` of the turn's rollout to ``episode``, step its environment, append the observation."""
    sampled_mask = part.response_mask[row].bool()
    sampled = part.responses[row][sampled_mask].tolist()
    logprobs = part.logprobs[row][sampled_mask].tolist()
    room = agent.max_episode_tokens - len(episode.tokens)
    over_budget = len(sampled) > room
    sampled, logprobs = sampled[:room], logprobs[:room]
    episode.append(sampled, True, logprobs)
    episode.turns = turn + 1
    if over_budget or not bool(part.stopped[row]) or not sampled:  # cut: no complete turn to answer
        episode.done = episode.truncated = True
        return
    outcome = step_environment(episode.environment, sampled, len(episode.tokens), turn, agent, renderer, tokenizer)
    episode.seconds += outcome.seconds
    episode.rewards[-1] += outcome.reward
    episode.tool_calls += outcome.tool_calls
    episode.tool_errors += outcome.tool_errors
    if outcome.done:
        episode.done = True
    elif outcome.observation is not None:
        episode.append(outcome.observation, False)
    elif turn + 1 < agent.max_turns:  # no room left for another turn (at max_turns run_episodes marks it)
        episode.done = episode.truncated = True


def _to_rollout(episodes: list[Episode], pad: int, device: torch.device) -> EpisodeRollout:
    """The episodes as one rollout: prompts left-padded, episodes right-padded."""
    prompt_width = max((len(e.prompt) for e in episodes), default=0)
    width = max((len(e.tokens) for e in episodes), default=0)

    def rows(values: list[list[Any]], fill: Any, dtype: torch.dtype, left: bool = False) -> torch.Tensor:
        size = prompt_width if left else width
        padded = [[fill] * (size - len(v)) + v if left else v + [fill] * (size - len(v)) for v in values]
        return torch.tensor(padded, dtype=dtype, device=device).reshape(len(values), size)

    prompts = rows([e.prompt for e in episodes], pad, torch.long, left=True)
    prompt_mask = rows([[1] * len(e.prompt) for e in episodes], 0, torch.long, left=True)
    rollout = Rollout.from_responses(
        prompts, prompt_mask,
        rows([e.tokens for e in episodes], pad, torch.long),
        rows([e.mask for e in episodes], 0, torch.long),
        rows([e.logprobs for e in episodes], 0.0, torch.float32),
        torch.tensor([not e.truncated for e in episodes], dtype=torch.bool, device=device),
        response_attention=rows([[1] * len(e.tokens) for e in episodes], 0, torch.long),
    )
    stats = torch.tensor([[e.turns, e.tool_calls, e.tool_errors, e.seconds, e.truncated] for e in episodes],
                         dtype=torch.float32, device=device).reshape(len(episodes), len(EPISODE_STATS))
    return EpisodeRollout(rollout, rows([e.rewards for e in episodes], 0.0, torch.float32), stats)
