"""From a gathered rollout and its scores to the :class:`Experience` the train calls learn from. Plain PyTorch.

Runs on every rank on the whole batch (cheap, and it saves a broadcast), so group statistics see every sample of
a prompt even when its samples were generated and scored on different ranks.
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence
from typing import Any

import torch

from lightning_app_rlhf.agents.episodes import EPISODE_STATS
from lightning_app_rlhf.algorithms import Algorithm, ScoredRollout
from lightning_app_rlhf.algorithms.functional import kl_penalty, overlong_penalty
from lightning_app_rlhf.algorithms.shaping import AdaptiveKLController, FixedKLController, RunningMoments
from lightning_app_rlhf.core.config import GenerationConfig, PPOConfig
from lightning_app_rlhf.core.role_table import CRITIC, REFERENCE, REWARD
from lightning_app_rlhf.engine.dynamic_sampling import GroupCollector
from lightning_app_rlhf.engine.iteration_state import IterationState
from lightning_app_rlhf.generation import Rollout
from lightning_app_rlhf.models.calls import Experience, describe_nonfinite


class RewardShaping:
    """The stateful steps between raw scores and an algorithm's estimator: non-finite scores, the EOS penalty,
    running normalisation and clipping, and the KL coefficient in the reward (fixed or adaptive).

    Args:
        config: The update's settings.
        eos_token_id: The token id, or ids, that end a response properly; ``missing_eos_penalty`` punishes
            responses cut at ``generation.max_new_tokens`` without one (see :meth:`missing_eos`).
        max_episode_tokens: Multi-turn episodes' token budget (``agent.max_episode_tokens``): DAPO's overlong
            penalty measures an episode's tokens against it, not one turn's ``max_new_tokens``.
    """

    def __init__(self, config: PPOConfig, eos_token_id: int | Sequence[int],
                 max_episode_tokens: int | None = None) -> None:
        if config.kl_coef is None:
            raise ValueError("ppo.kl_coef is None, the algorithm's default: build the algorithm first "
                             "(build_algorithm(name, config, generation) writes its defaults into config).")
        self.config = config
        self.eos_token_ids = list(eos_token_id) if isinstance(eos_token_id, Sequence) else [eos_token_id]
        self.kl_controller = (
            AdaptiveKLController(config.kl_coef, config.kl_target, config.kl_horizon)
            if config.kl_target is not None
            else FixedKLController(config.kl_coef)
        )
        self.reward_moments = RunningMoments()
        self.max_episode_tokens = max_episode_tokens

    def missing_eos(self, rollout: Rollout, generation: GenerationConfig | None = None) -> torch.Tensor:
        """[B] True for responses that did not end properly: cut at ``max_new_tokens`` without a stop.

        Exact from ``rollout.stopped`` when the rollout carries it. Otherwise decided from the rollout itself: the
        sampler ends a row early only at a stop, so a response shorter than ``generation.max_new_tokens`` ended
        properly (whatever stopped it: EOS, the actor's other end ids, a stop id or a stop string); one of full
        length did when its last token is EOS or one of ``generation.stop_token_ids``. A full-length response
        ended by an id known only to the actor's generation config, or by a stop string, cannot be told from a cut
        one here and counts as cut. Without ``generation``, only the last token counts.
        """
        if rollout.stopped is not None:
            return ~rollout.stopped.to(rollout.response_mask.device)
        lengths = rollout.response_mask.sum(1)
        last = rollout.responses.gather(1, (lengths - 1).clamp(min=0).unsqueeze(1)).squeeze(1)
        ids = [*self.eos_token_ids, *((generation.stop_token_ids or []) if generation is not None else [])]
        ended = torch.isin(last, torch.tensor(ids, dtype=last.dtype, device=last.device))
        if generation is not None:
            ended = ended | (lengths < generation.max_new_tokens)
        return ~ended

    def overlong_penalty(self, rollout: Rollout, generation: GenerationConfig | None) -> torch.Tensor:
        """[B] DAPO's soft overlong penalty of each response (``ppo.overlong_buffer``), 0 or below; of a multi-turn
        episode, its sampled and observation tokens against ``max_episode_tokens``."""
        if rollout.turn_rewards is not None and self.max_episode_tokens is not None:  # a multi-turn episode
            lengths = rollout.attention_mask[:, rollout.prompt_length :].sum(1)
            return overlong_penalty(lengths, self.max_episode_tokens, self.config.overlong_buffer,
                                    self.config.overlong_penalty_factor)
        if generation is None:
            raise ValueError("ppo.overlong_buffer needs the generation settings (their max_new_tokens): pass them.")
        return overlong_penalty(rollout.response_mask.sum(1), generation.max_new_tokens, self.config.overlong_buffer,
                                self.config.overlong_penalty_factor)

    def finite(self, scores: torch.Tensor) -> torch.Tensor:
        """[B] which scores are finite; non-finite ones raise, or warn and are skipped (``nonfinite_rewards``)."""
        finite = torch.isfinite(scores)
        if bool(finite.all()):
            return finite
        message = describe_nonfinite(scores)
        if self.config.nonfinite_rewards == "raise":
            raise ValueError(f"{message}. Fix the reward, or set ppo.nonfinite_rewards='skip' to leave such samples "
                             "out of the update with a warning.")
        warnings.warn(f"{message}; these samples are left out of this update (ppo.nonfinite_rewards='skip').")
        return finite

    def shape(
        self, scores: torch.Tensor, finite: torch.Tensor, rollout: Rollout, generation: GenerationConfig | None = None
    ) -> torch.Tensor:
        """EOS penalty (see :meth:`missing_eos`), running normalisation and clipping; skipped samples score 0."""
        scores = torch.where(finite, scores, torch.zeros_like(scores))
        if self.config.missing_eos_penalty is not None:
            scores = scores - self.config.missing_eos_penalty * self.missing_eos(rollout, generation)
        if self.config.overlong_buffer:
            scores = scores + self.overlong_penalty(rollout, generation)
        if self.config.reward_norm:
            self.reward_moments.update(scores[finite])
            scores = (scores - self.reward_moments.mean) / (self.reward_moments.std + 1e-8)
        if self.config.reward_clip is not None:
            scores = scores.clamp(-self.config.reward_clip, self.config.reward_clip)
        return scores * finite

    def state_dict(self) -> dict[str, Any]:
        return {"kl_controller": self.kl_controller.state_dict(), "reward_moments": self.reward_moments.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.kl_controller.load_state_dict(state["kl_controller"])
        self.reward_moments.load_state_dict(state["reward_moments"])


def make_experience(
    rollout: Rollout,
    ref_logprobs: torch.Tensor | None,
    scores: torch.Tensor,
    values: torch.Tensor | None,
    algorithm: Algorithm,
    shaping: RewardShaping,
    iteration: int,
    kept: torch.Tensor | None = None,
) -> tuple[Experience, dict[str, torch.Tensor]]:
    """Shape the scores, estimate the KL, let ``algorithm`` compute advantages; return the experience and the
    rollout's statistics (reward, KL, length). Without a reference (``ref_logprobs`` None: the algorithm uses no KL)
    the KL is 0 in the advantages and not logged. ``kept`` [B]: False for rows that only fill the batch's shape
    (dynamic sampling short of groups), left out like skipped samples."""
    if kept is None:
        finite = shaping.finite(scores)
    else:
        finite = shaping.finite(torch.where(kept, scores, torch.zeros_like(scores))) & kept
    mask = rollout.response_mask * finite.unsqueeze(1).to(rollout.response_mask.dtype)
    shaped = shaping.shape(scores, finite, rollout, algorithm.generation)
    kl = (kl_penalty(rollout.logprobs, ref_logprobs, shaping.config.kl_estimator) * mask if ref_logprobs is not None
          else torch.zeros_like(rollout.logprobs))
    scored = ScoredRollout(
        scores=shaped, kl=kl, kl_coef=shaping.kl_controller.value, response_mask=mask, valid=finite,
        group_size=algorithm.generation.num_samples, values=values * mask if values is not None else None,
        turn_rewards=rollout.turn_rewards,
    )
    advantages, returns = algorithm.advantages(scored)
    config = shaping.config
    # DAPO's overlong filtering: a truncated response still counts in its group's statistics, not in the loss.
    truncated = shaping.missing_eos(rollout, algorithm.generation) & finite if config.overlong_filter else None
    loss_mask = mask * (~truncated).unsqueeze(1).to(mask.dtype) if truncated is not None else mask
    experience = Experience(
        sequences=rollout.sequences,
        attention_mask=rollout.attention_mask,
        response_mask=loss_mask,
        logprobs=rollout.logprobs,
        values=scored.values,
        advantages=advantages,
        returns=returns,
        prompt_length=rollout.prompt_length,
        iteration=iteration,
        ref_logprobs=ref_logprobs * loss_mask if algorithm.keeps_ref_logprobs else None,
    )
    stats = {**rollout_stats(scores, finite, rollout.response_mask.sum(1)),
             "kl/coef": torch.tensor(shaping.kl_controller.value)}
    if ref_logprobs is not None:
        stats["kl/mean"] = kl.sum(1).sum() / finite.float().sum().clamp(min=1.0)
    if config.overlong_buffer:
        stats["reward/overlong_penalty_mean"] = shaping.overlong_penalty(rollout, algorithm.generation)[finite].mean()
    if truncated is not None:
        stats["response/overlong_filtered"] = truncated.float().sum()
    if rollout.episode_stats is not None:
        stats.update(episode_stats(rollout.episode_stats))
    return experience, stats


def episode_stats(per_episode: torch.Tensor) -> dict[str, torch.Tensor]:
    """What the multi-turn episodes did, to log: turns per episode (mean), tool calls and tool errors (totals),
    the environments' seconds (total), and the share of truncated episodes."""
    columns = dict(zip(EPISODE_STATS, per_episode.unbind(1)))
    return {"episode/turns_mean": columns["turns"].mean(), "episode/tool_calls": columns["tool_calls"].sum(),
            "episode/tool_errors": columns["tool_errors"].sum(),
            "episode/environment_seconds": columns["environment_seconds"].sum(),
            "episode/truncated_frac": columns["truncated"].mean()}


def rollout_stats(scores: torch.Tensor, counted: torch.Tensor, lengths: torch.Tensor) -> dict[str, torch.Tensor]:
    """``reward/mean`` and ``reward/std`` of the ``counted`` [B] raw scores, and ``response/length_mean`` of every
    response's length [B]."""
    raw = scores[counted]
    return {
        "reward/mean": raw.mean() if raw.numel() else scores.new_tensor(float("nan")),
        "reward/std": raw.std() if raw.numel() > 1 else scores.new_tensor(0.0),
        "response/length_mean": lengths.float().mean(),
    }


def collect_experience(state: IterationState, algorithm: Algorithm, shaping: RewardShaping,
                       collector: GroupCollector | None, policy_version: int) -> bool:
    """The algorithm's advantages on ``state``'s gathered rollout, into ``state.experience`` (on every rank that
    holds the rollout: cheap, and it saves a broadcast). With dynamic sampling (``collector``), on the batch of
    informative groups the rounds collected, once it is complete; until then the round only adds its groups and this
    returns False (another round follows).

    Args:
        state: The iteration's state, its forward calls' results gathered.
        algorithm: The advantage estimator.
        shaping: Score shaping and the KL coefficient.
        collector: Dynamic sampling's collection of informative groups; None without it.
        policy_version: The version of the weights that generated the rollout.
    """
    assert state.rollout is not None
    rollout, outputs, kept = state.rollout, state.gathered, None
    state.scores = outputs[REWARD.name]
    if collector is not None:
        shaping.finite(state.scores)  # a non-finite score raises here, even in a group that is dropped
        collector.add(state.rollout, outputs, state.scores)
        if not collector.ready(state.prompts):
            return False
        batch = collector.take(state.prompts)
        # The reward and length of every response the rounds generated: the policy's, unfiltered.
        scores = batch.generated_scores
        state.stats.update(rollout_stats(scores, torch.isfinite(scores), batch.generated_lengths))
        if not bool(batch.kept.all()):
            groups = int(batch.kept.sum()) // collector.group_size
            warnings.warn(f"Dynamic sampling found {groups} of {state.prompts} informative groups in "
                          f"{batch.generation_rounds} generation rounds (ppo.max_generation_rounds); iteration "
                          f"{state.iteration} trains on those, the rest of the batch left out of the loss. Most "
                          "groups score alike: raise ppo.max_generation_rounds, or use prompts of mixed "
                          "difficulty.", stacklevel=2)
        rollout, outputs, kept = batch.rollout, batch.outputs, batch.kept
        state.stats.update({"train/filtered_groups": float(batch.filtered_groups),
                            "train/generation_rounds": float(batch.generation_rounds)})
    state.experience, stats = make_experience(rollout, outputs.get(REFERENCE.name), outputs[REWARD.name],
                                              outputs.get(CRITIC.name), algorithm, shaping,
                                              state.iteration, kept)
    state.experience.policy_version = policy_version  # the weights that generated it
    if rollout.versions is not None:  # partial rollouts: a version per token; the oldest is the rollout's
        state.experience.token_versions = rollout.versions
        mask = rollout.response_mask.bool()
        state.experience.policy_version = int(rollout.versions[mask].min()) if mask.any() else policy_version
    if collector is not None:  # the trained batch's own reward: biased by the filter, the policy's is above
        stats = {k: v for k, v in stats.items() if k not in ("reward/std", "response/length_mean")}
        stats["reward/trained_mean"] = stats.pop("reward/mean")
    state.stats.update(stats)
    return True
