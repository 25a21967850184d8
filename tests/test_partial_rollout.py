"""Partial rollouts (``SeparationStrategy(partial_rollout=True)``, :mod:`lightning_app_rlhf.engine.partial_rollout`).

The pool's rules against hand-built schedules (a scripted decoder whose row lengths are known): the version of
every token, the budget on resume, what is carried and what is handed on. Then real runs from the CLI: one process
against 2 (the same trajectory), every algorithm, free-running on 4 processes within its bound, a resume from
mid-partial that logs what the uninterrupted run logged, and the loss options."""

from __future__ import annotations

import math

import pytest
import torch
from helpers import approx_or_none, fit_demo
from test_agent_placements import AGENT, GRPO_CONFIG
from test_agent_placements import COMPARED as AGENT_COMPARED
from test_placements import COMPARED, ONE_RANK_CALLS

from lightning_app_rlhf.algorithms.functional import rollout_correction, superseded_token_mask
from lightning_app_rlhf.agents.episodes import TurnOutcome
from lightning_app_rlhf.core.config import AgentConfig, PPOConfig
from lightning_app_rlhf.engine.partial_rollout import EpisodeEnvironments, PartialRollouts, fill_pool, resume_key
from lightning_app_rlhf.generation import repeat_samples
from lightning_app_rlhf.generation.rollout import mix_key
from lightning_app_rlhf.parallel.plan import PlacementPlan, flattening_plan, separation_plan

EOS, PAD = 2, 0


def batch_of(prompts: list[list[int]], first_index: int = 0) -> dict:
    """Left-padded prompts, with their dataset indices, as a datamodule collates them."""
    width = max(map(len, prompts))
    ids = torch.tensor([[PAD] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    return {"input_ids": ids, "attention_mask": mask, "index": torch.arange(first_index, first_index + len(prompts)),
            "fields": {"answer": [f"a{first_index + i}" for i in range(len(prompts))]}}


class ScriptedDecoder:
    """Row ``(index, sample)`` answers ``lengths[(index, sample)]`` tokens, the last one EOS; token ``t`` of a row is
    ``10 + t`` (so a resumed row continues where it stopped), its log-probability ``-t / 100``. Counts its rounds."""

    def __init__(self, lengths: dict[tuple[int, int], int]) -> None:
        self.lengths, self.rounds = lengths, 0

    def __call__(self, pool: PartialRollouts, version: int) -> None:
        rows = pool.unfinished()
        _, _, _, max_new = pool.round_inputs(rows, torch.device("cpu"))
        responses = torch.full((len(rows), max_new), PAD)
        mask = torch.zeros((len(rows), max_new), dtype=torch.long)
        logprobs = torch.zeros((len(rows), max_new))
        stopped = torch.zeros(len(rows), dtype=torch.uint8)
        for i, row in enumerate(rows):
            length, start = self.lengths[(row.index, row.sample)], len(row.tokens)
            n = min(max_new, length - start)
            responses[i, :n] = torch.tensor([10 + t for t in range(start, start + n)])
            responses[i, n - 1] = EOS if start + n == length else responses[i, n - 1]
            mask[i, :n] = 1
            logprobs[i, :n] = torch.tensor([-t / 100 for t in range(start, start + n)])
            stopped[i] = start + n == length
        pool.record(rows, {"responses": responses, "response_mask": mask, "logprobs": logprobs, "stopped": stopped},
                       version)
        self.rounds += 1


def one_call(pool: PartialRollouts, decoder: ScriptedDecoder, batch: dict, target: int, version: int,
             more: list[dict] | None = None):
    """What the engine does in one generation call (RLHFEngine._partial_rollout), with the scripted decoder."""
    refills = iter(more or [])
    fill_pool(pool, repeat_samples(batch, pool.group_size), target, lambda rows, r: rows["index"] * 100 + rows["sample"],
              lambda r: repeat_samples(next(refills), pool.group_size))
    while not pool.call_done(target, version):
        decoder(pool, version)
    return pool.take(target, torch.device("cpu"))


def test_versions_budgets_and_carried_samples_follow_a_hand_built_schedule():
    """Batches of 2 prompts x G=2, budget 8 tokens, segments of 3. Call 0 (version 0) holds 4 groups (the batch and
    one refill) and ends after the round where 2 groups are complete; the rest carry on. Call 1 (version 1) resumes
    them: their earlier tokens keep version 0, the new ones get 1, and they all finish in it (a carried sample never
    sees a third version); a row cut at the budget is done, not stopped."""
    lengths = {(0, 0): 2, (0, 1): 3,   # group 0: done in round 1
               (1, 0): 5, (1, 1): 1,   # group 1: done in round 2
               (2, 0): 7, (2, 1): 2,   # group 2 (the refill): 7 tokens, 3 + 3 in call 0, 1 in call 1
               (3, 0): 20, (3, 1): 4,  # group 3: row 0 runs into the budget (8)
               (4, 0): 1, (4, 1): 1, (5, 0): 9, (5, 1): 2}  # call 1's batch
    pool = PartialRollouts(group_size=2, max_new_tokens=8, segment_tokens=3, pad_token_id=PAD)
    decoder = ScriptedDecoder(lengths)
    batch, rollout, stats = one_call(pool, decoder, batch_of([[5, 6], [7]]), 2, version=0,
                                     more=[batch_of([[8, 9, 9], [4]], first_index=2)])
    assert decoder.rounds == 2  # group 1 completes in round 2
    assert batch["index"].tolist() == [0, 0, 1, 1] and batch["sample"].tolist() == [0, 1, 0, 1]
    assert batch["fields"] == {"answer": ["a0", "a0", "a1", "a1"]}
    assert rollout.response_mask.sum(1).tolist() == [2, 3, 5, 1]
    assert rollout.versions.tolist() == [[0, 0, 0, 0, 0], [0, 0, 0, 0, 0], [0, 0, 0, 0, 0], [0, 0, 0, 0, 0]]
    assert rollout.stopped.tolist() == [True] * 4
    # Carried: group 2 (6 of 7 tokens, and its 2-token row done), group 3 (6 of 20, 2 of... 4: done after 4).
    carried = {(s.index, s.sample): (len(s.tokens), s.done) for g in pool.groups for s in g}
    assert carried == {(2, 0): (6, False), (2, 1): (2, True), (3, 0): (6, False), (3, 1): (4, True)}
    assert stats["rollout/partial_carried_rows"] == 2 and stats["rollout/partial_carried_tokens"] == 18

    decoder.rounds = 0
    batch, rollout, stats = one_call(pool, decoder, batch_of([[3], [3, 3]], first_index=4), 2, version=1)
    assert batch["index"].tolist() == [2, 2, 3, 3]  # the carried groups first, in pool order
    assert rollout.response_mask.sum(1).tolist() == [7, 2, 8, 4]  # (3, 0) cut at the budget of 8
    assert rollout.stopped.tolist() == [True, True, False, True]
    assert rollout.versions[0].tolist() == [0] * 6 + [1, 0]  # 6 tokens at version 0, the 7th at 1 (0: padding)
    assert rollout.versions[2].tolist() == [0] * 6 + [1, 1]
    assert rollout.versions[1, :2].tolist() == [0, 0] and rollout.versions[3, :4].tolist() == [0] * 4
    assert rollout.responses[0, :7].tolist() == [10, 11, 12, 13, 14, 15, EOS]  # resumed where it stopped
    assert rollout.logprobs[2, :8].tolist() == pytest.approx([-t / 100 for t in range(8)])
    assert stats["rollout/partial_resumed_share"] == 0.5
    # One round did it; call 1's batch: group 4 done (handed on next), group 5's first row (9 tokens) carried with 3.
    assert decoder.rounds == 1
    assert {(s.index, s.sample): len(s.tokens) for g in pool.groups for s in g} == {(4, 0): 1, (4, 1): 1,
                                                                                    (5, 0): 3, (5, 1): 2}


def test_a_carried_sample_finishes_in_the_next_call_even_past_the_batch():
    """Call 1 has its 2 complete groups after its first round, but a sample carried from version 0 is not done: the
    call goes on until it is (6 more rounds), so that no token is ever more than one version older than its batch's
    newest."""
    lengths = {(0, 0): 1, (1, 0): 1, (2, 0): 16, (3, 0): 1, (4, 0): 1, (5, 0): 1}
    pool = PartialRollouts(group_size=1, max_new_tokens=16, segment_tokens=2, pad_token_id=PAD)
    decoder = ScriptedDecoder(lengths)
    batch, _, _ = one_call(pool, decoder, batch_of([[5], [6]]), 2, version=0,
                           more=[batch_of([[7], [8]], first_index=2)])
    assert batch["index"].tolist() == [0, 1] and decoder.rounds == 1
    decoder.rounds = 0
    batch, rollout, _ = one_call(pool, decoder, batch_of([[5], [6]], first_index=4), 2, version=1)
    assert decoder.rounds == 7
    assert batch["index"].tolist() == [2, 3]
    assert rollout.versions[0].tolist() == [0, 0] + [1] * 14
    assert [s.index for g in pool.groups for s in g] == [4, 5]


def test_the_pool_draws_further_prompts_only_to_reach_twice_the_batch_and_names_a_missing_source():
    pool = PartialRollouts(group_size=1, max_new_tokens=4, segment_tokens=4, pad_token_id=PAD)
    with pytest.raises(ValueError, match="no source of further prompts: use a PromptDataModule"):
        fill_pool(pool, repeat_samples(batch_of([[5]]), 1), 1, lambda rows, r: rows["index"], None)


def test_the_pool_survives_a_checkpoint_as_plain_data():
    pool = PartialRollouts(group_size=2, max_new_tokens=8, segment_tokens=3, pad_token_id=PAD)
    decoder = ScriptedDecoder({(0, 0): 2, (0, 1): 8, (1, 0): 8, (1, 1): 8, (2, 0): 1, (2, 1): 1, (3, 0): 1, (3, 1): 1})
    one_call(pool, decoder, batch_of([[5], [6]]), 2, version=0, more=[batch_of([[7], [8]], first_index=2)])
    state = pool.state_dict()
    restored = PartialRollouts(group_size=2, max_new_tokens=8, segment_tokens=3, pad_token_id=PAD)
    restored.load_state_dict(torch.load(_saved(state), weights_only=True))
    assert restored.state_dict() == state and restored.groups


def _saved(state):
    import io
    buffer = io.BytesIO()
    torch.save(state, buffer)
    buffer.seek(0)
    return buffer


def test_the_plan_keeps_one_version_of_the_bound_for_carried_tokens():
    plan = separation_plan(2, max_staleness=1, partial_rollout=True)
    assert (plan.schedule_staleness, plan.overlap, plan.run_ahead) == (0, False, 0)
    free = separation_plan(4, max_staleness=2, free_running=True, partial_rollout=True)
    assert (free.schedule_staleness, free.run_ahead) == (1, 2)
    assert PlacementPlan.from_dict(free.to_dict()) == free
    with pytest.raises(ValueError, match="set max_staleness >= 1"):
        PlacementPlan.from_dict({**flattening_plan(1).to_dict(), "partial_rollout": True})


def test_the_loss_options_mask_superseded_tokens_and_weigh_the_decoupled_objective():
    """``mask_superseded`` keeps each row's tokens of its newest version; ``decoupled`` weighs each token by
    p_proximal / p_behaviour and leaves out those above the cap (AReaL's decoupled PPO)."""
    mask = torch.tensor([[1, 1, 1, 0], [1, 1, 0, 0]])
    versions = torch.tensor([[3, 3, 4, 0], [2, 2, 0, 0]])
    assert superseded_token_mask(mask, versions).tolist() == [[0, 0, 1, 0], [1, 1, 0, 0]]
    proximal = torch.log(torch.tensor([[0.5, 0.5, 0.5, 1.0]]))
    behaviour = torch.log(torch.tensor([[0.5, 0.25, 0.1, 1.0]]))  # ratios 1, 2, 5
    weights, kept, stats = rollout_correction(proximal, behaviour, torch.tensor([[1, 1, 1, 0]]), "decoupled",
                                              "token", 3.0)
    assert weights[0].tolist() == pytest.approx([1.0, 2.0, 0.0, 0.0])
    assert kept.tolist() == [[1, 1, 0, 0]]
    assert stats["rollout/is_masked_frac"].item() == pytest.approx(1 / 3)
    with pytest.raises(ValueError, match="partial_rollout_loss='decoupled' recomputes"):
        PPOConfig(partial_rollout_loss="decoupled", recompute_old_logprobs=False)


# ---- multi-turn episodes ----


class ScriptedTurns:
    """Episode ``(index, sample)`` answers turns of ``turns[(index, sample)][k]`` tokens, each ending at EOS; token
    ``t`` of a turn is ``20 + t``. The pool's own rounds (:class:`ScriptedDecoder`'s rules, per turn)."""

    def __init__(self, turns: dict[tuple[int, int], list[int]]) -> None:
        self.turns = turns

    def __call__(self, pool: PartialRollouts, version: int) -> None:
        rows = pool.unfinished()
        _, _, _, max_new = pool.round_inputs(rows, torch.device("cpu"))
        responses = torch.full((len(rows), max_new), PAD)
        mask = torch.zeros((len(rows), max_new), dtype=torch.long)
        stopped = torch.zeros(len(rows), dtype=torch.uint8)
        for i, row in enumerate(rows):
            length, start = self.turns[(row.index, row.sample)][row.turns], row.turn_tokens
            n = min(max_new, length - start)
            responses[i, :n] = torch.tensor([20 + t for t in range(start, start + n)])
            responses[i, n - 1] = EOS if start + n == length else responses[i, n - 1]
            mask[i, :n] = 1
            stopped[i] = start + n == length
        pool.record(rows, {"responses": responses, "response_mask": mask, "logprobs": -mask.float(),
                           "stopped": stopped}, version)


def test_multi_turn_episodes_resume_mid_turn_with_their_observations_and_budgets():
    """One group of 2 episodes, turns of at most 4 tokens, 12 per episode, segments of 3. Episode 0's first turn (5
    tokens) is cut at the turn's budget: truncated. Episode 1's first turn (3 tokens) ends in round 1; its
    observation (2 tokens, not trained on) is appended; its second turn (4 tokens) spans rounds 2 and 3, a version
    change between them; its third (3 tokens) would pass the episode's 12 tokens: cut at the budget, truncated."""
    agent = AgentConfig(max_turns=3, max_episode_tokens=12)
    pool = PartialRollouts(group_size=2, max_new_tokens=4, segment_tokens=3, pad_token_id=PAD, agent=agent)
    pool.admit(repeat_samples(batch_of([[5]]) | {"prompts": ["p"]}, 2), torch.tensor([7, 8]))
    assert [s.started for s in pool.unstarted()] == [False, False]
    for s in pool.unstarted():  # what the environments' owners render and gather
        s.prompt_ids, s.started = [1, 5], True
    decoder = ScriptedTurns({(0, 0): [5], (0, 1): [3, 4, 3]})
    decoder(pool, version=0)  # round 1: episode 0 has 3 tokens; episode 1's turn ended, awaiting its environment
    (waiting,) = pool.awaiting_step()
    assert waiting.sample == 1 and waiting.turn_tokens == 3
    pool.answer(waiting, TurnOutcome(0.5, False, [30, 31], tool_calls=1), version=0)
    assert waiting.mask == [1, 1, 1, 0, 0] and waiting.turn_tokens == 0 and waiting.turns == 1
    assert [resume_key(s) for s in pool.unfinished()] == [mix_key(7, 3), mix_key(8, 1)]  # mid-turn / turn 1's key
    decoder(pool, version=0)  # round 2: episode 0 cut at 4 (its turn's budget); episode 1 has 3 of 4
    first = pool.groups[0][0]
    assert first.done and first.truncated and first.tokens == [20, 21, 22, 23] and first.turns == 1
    decoder(pool, version=1)  # round 3, under new weights: episode 1's second turn ends
    pool.answer(pool.awaiting_step()[0], TurnOutcome(0.25, False, [30, 31]), version=1)
    decoder(pool, version=1)  # its third turn: 3 tokens, but 12 - 11 = 1 left in the episode
    assert pool.call_done(1, version=1)
    batch, rollout, _ = pool.take(1, torch.device("cpu"))
    second = rollout.responses[1].tolist()
    assert second == [20, 21, EOS, 30, 31, 20, 21, 22, EOS, 30, 31, 20]
    assert rollout.response_mask[1].tolist() == [1, 1, 1, 0, 0, 1, 1, 1, 1, 0, 0, 1]
    assert rollout.versions[1].tolist() == [0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1]
    assert rollout.turn_rewards[1].tolist() == [0, 0, 0.5, 0, 0, 0, 0, 0, 0.25, 0, 0, 0]
    assert rollout.stopped.tolist() == [False, False]  # both truncated
    assert rollout.episode_stats.tolist() == [[1, 0, 0, 0, 1], [3, 1, 0, 0, 1]]
    assert batch["input_ids"].tolist() == [[1, 5], [1, 5]] and batch["prompts"] == ["p", "p"]


def test_a_resumed_pool_replays_each_episode_and_refuses_an_environment_that_answers_differently():
    """A checkpoint keeps the episodes' tokens, not their environments: a resumed rank rebuilds each by replaying
    the ended turns, and an environment that answers a turn with another observation is an error naming the fix."""
    from agent_task import LetterCount, tokenizer

    tok = tokenizer()
    agent = AgentConfig(max_turns=3, max_episode_tokens=96)
    pool = PartialRollouts(group_size=1, max_new_tokens=8, segment_tokens=8, pad_token_id=tok.pad_token_id,
                           agent=agent)
    pool.admit(batch_of([[5]]) | {"prompts": ["count"], "sample": torch.tensor([0])}, torch.tensor([3]))
    environments = EpisodeEnvironments(LetterCount(turns=3), tok, agent, owners=1, mine=0,
                                       end_of_turn_ids=lambda: [tok.eos_token_id])
    (sample,) = pool.unstarted()
    reset = environments.reset([sample])
    sample.prompt_ids, sample.started = reset["prompt"][0].tolist(), True
    turn = tok.encode("eee", add_special_tokens=False) + [tok.eos_token_id]
    pool.record([sample], {"responses": torch.tensor([turn]), "response_mask": torch.ones(1, len(turn)),
                           "logprobs": torch.zeros(1, len(turn)), "stopped": torch.tensor([1])}, version=0)
    answer = environments.step([sample])
    observation = answer["observation"][0]
    pool.answer(sample, TurnOutcome(*answer["outcome"][0, :2].tolist(), observation[observation >= 0].tolist()), 0)
    assert sample.turns == 1 and sample.mask.count(0) > 0

    restored = PartialRollouts(group_size=1, max_new_tokens=8, segment_tokens=8, pad_token_id=tok.pad_token_id,
                               agent=agent)
    restored.load_state_dict(torch.load(_saved(pool.state_dict()), weights_only=True))
    fresh = EpisodeEnvironments(LetterCount(turns=3), tok, agent, owners=1, mine=0,
                                end_of_turn_ids=lambda: [tok.eos_token_id])
    fresh.replay(restored)
    (rebuilt,) = fresh.environments.values()
    assert rebuilt.taken == 1  # stepped on the one ended turn
    restored.groups[0][0].tokens[len(turn)] += 1  # the observation as another environment would have answered it
    with pytest.raises(ValueError, match="LetterCount answered turn 1 of sample 0/0 with another observation than "
                                         "before the checkpoint: make reset and step depend only on the row"):
        EpisodeEnvironments(LetterCount(turns=3), tok, agent, owners=1, mine=0,
                            end_of_turn_ids=lambda: [tok.eos_token_id]).replay(restored)


# ---- real runs, from the CLI ----

PARTIAL = ("--trainer.strategy", "lightning_app_rlhf.strategies.SeparationStrategy",
           "--trainer.strategy.max_staleness", "1", "--trainer.strategy.partial_rollout", "true")
UNEVEN = ("--model.generation.stop_token_ids", str(list(range(100, 228))), "--model.generation.segment_tokens", "2")
"""A quarter of the demo's vocabulary ends a response: lengths about geometric, of mean 4, cut at 12 tokens, so that
whole groups of 4 complete at different rounds (rounds of 2 tokens)."""
ONE_PROCESS = ("--trainer.strategy", "lightning_app_rlhf.PlacementStrategy", "--trainer.strategy.plan.world_size", "1",
               "--trainer.strategy.plan.calls", ONE_RANK_CALLS, "--trainer.strategy.plan.max_staleness", "1",
               "--trainer.strategy.plan.partial_rollout", "true")
"""The same schedule on one process (every call on rank 0)."""


def logged(rows: list[dict]) -> list[dict]:
    return [r for r in rows if "reward/mean" in r]


def check_partial_rows(rows: list[dict], bound: int) -> None:
    """What every partial run logs: the carried samples, the per-token lag within the bound, and, from the second
    iteration on, rollouts with samples resumed under newer weights."""
    assert all(r["rollout/staleness_max"] <= bound for r in rows)
    assert any(r["rollout/partial_carried_rows"] > 0 for r in rows)
    assert any(r["rollout/partial_resumed_share"] > 0 for r in rows[1:])
    assert max(r["rollout/staleness_max"] for r in rows) == bound


def test_partial_rollouts_log_the_same_trajectory_on_one_two_and_four_processes(tmp_path):
    """PPO with partial rollouts on the on-policy schedule (``max_staleness=1``): every rank keeps the same pool, and
    rows are keyed per sample, so one process, Separation on 2 and on 4 (two generating ranks) log the same values;
    tokens carried over are one version old."""
    one = logged(fit_demo(tmp_path, "one", *ONE_PROCESS, *UNEVEN, steps=4))
    check_partial_rows(one, 1)
    for devices in (2, 4):
        placed = logged(fit_demo(tmp_path, f"separation{devices}", "--trainer.devices", str(devices), *PARTIAL,
                                 *UNEVEN, steps=4))
        for step, (got, want) in enumerate(zip(placed, one, strict=True)):
            for metric in (*COMPARED, "rollout/staleness_mean", "rollout/partial_carried_tokens"):
                assert got.get(metric) == approx_or_none(want.get(metric), rel=1e-4, abs=1e-6), (devices, step, metric)


@pytest.mark.parametrize("algorithm", ["grpo", "rloo", "reinforce_pp", pytest.param("dapo", marks=pytest.mark.slow),
                                       pytest.param("gspo", marks=pytest.mark.slow),
                                       pytest.param("cispo", marks=pytest.mark.slow),
                                       pytest.param("dr_grpo", marks=pytest.mark.slow),
                                       pytest.param("gspo_token", marks=pytest.mark.slow),
                                       pytest.param("reinforce_pp_baseline", marks=pytest.mark.slow)])
def test_every_algorithm_trains_with_partial_rollouts(tmp_path, algorithm):
    """The critic-free algorithms on Separation's 2 processes (PPO: above), whole groups handed on."""
    args = ["--trainer.devices", "2", *PARTIAL, *UNEVEN, "--model.algorithm", algorithm]
    if algorithm == "dapo":
        args += ["--model.ppo.dynamic_sampling", "false"]
    rows = logged(fit_demo(tmp_path, algorithm, *args, steps=3))
    check_partial_rows(rows, 1)
    assert all(math.isfinite(r["policy/loss"]) for r in rows)


def test_free_running_partial_rollouts_on_four_processes_stay_within_their_bound(tmp_path):
    """Free-running, ``max_staleness=2``: the generation side takes version ``i - 1`` or newer before each rollout
    and resumes carried samples under it; the training side checks every token's lag (at most 2) and logs it."""
    rows = logged(fit_demo(tmp_path, "free", "--trainer.devices", "4", *PARTIAL, "--trainer.strategy.free_running",
                           "true", "--trainer.strategy.max_staleness", "2", *UNEVEN, steps=6))
    assert [r["step"] for r in rows] == list(range(6))
    assert all(r["rollout/staleness_max"] <= 2 for r in rows)
    assert any(r["rollout/partial_carried_rows"] > 0 for r in rows)


def test_a_resume_from_mid_partial_logs_what_the_uninterrupted_run_logged(tmp_path):
    """The step-2 checkpoint holds samples in flight (tokens, log-probabilities, versions): the resumed run hands on
    the same rollouts and logs the same values at steps 2 and 3 as the uninterrupted one."""
    common = ["--trainer.devices", "2", *PARTIAL, *UNEVEN, "--trainer.enable_checkpointing", "true",
              "--trainer.callbacks+=lightning.pytorch.callbacks.ModelCheckpoint",
              f"--trainer.callbacks.dirpath={tmp_path / 'ckpt'}", "--trainer.callbacks.every_n_train_steps=2",
              "--trainer.callbacks.save_top_k=-1", "--trainer.callbacks.filename={step}"]
    full = logged(fit_demo(tmp_path, "full", *common, steps=4))
    assert full[1]["rollout/partial_carried_rows"] > 0  # the checkpoint after step 1 holds partial samples
    (checkpoint,) = (tmp_path / "ckpt").glob("step=2*.ckpt")
    resumed = logged(fit_demo(tmp_path, "resumed", *common, "--ckpt_path", str(checkpoint), steps=4))
    assert [r["step"] for r in resumed] == [2, 3]
    for got, want in zip(resumed, full[2:], strict=True):
        for metric in (*COMPARED, "rollout/staleness_mean", "rollout/partial_carried_tokens",
                       "rollout/partial_resumed_share"):
            assert got.get(metric) == approx_or_none(want.get(metric), rel=1e-5, abs=1e-7), (metric, got["step"])


@pytest.mark.parametrize("loss", ["decoupled", "mask_superseded"])
def test_the_loss_options_train(tmp_path, loss):
    rows = logged(fit_demo(tmp_path, loss, "--trainer.devices", "2", *PARTIAL, *UNEVEN, "--model.algorithm", "grpo",
                           "--model.ppo.partial_rollout_loss", loss, steps=3))
    check_partial_rows(rows, 1)
    key = "rollout/is_weight_mean" if loss == "decoupled" else "rollout/superseded_masked_frac"
    assert all(math.isfinite(r[key]) for r in rows if "policy/loss" in r)
    if loss == "mask_superseded":
        assert any(r[key] > 0 for r in rows)


MULTI_TURN_COMPARED = (*AGENT_COMPARED, "rollout/staleness_mean", "rollout/partial_carried_tokens",
                       "rollout/partial_resumed_share", "episode/tool_calls_mean")


@pytest.mark.parametrize("devices", [2, pytest.param(4, marks=pytest.mark.slow)])
def test_multi_turn_episodes_with_partial_rollouts_log_the_same_trajectory_as_one_process(tmp_path, devices):
    """GRPO on the multi-turn task (3 prompts x 4 episodes of up to 3 turns, segments of 3 tokens): episodes resume
    mid-turn and mid-episode under the next weights, their environments stepping on the generating ranks (each
    episode's on one of them); one process and Separation log the same values."""
    args = (*AGENT, "--model.generation.segment_tokens", "3")
    one = logged(fit_demo(tmp_path, "one", *args, *ONE_PROCESS, config=GRPO_CONFIG, steps=3))
    check_partial_rows(one, 1)
    assert any(1 < r["episode/turns_mean"] for r in one)
    placed = logged(fit_demo(tmp_path, f"separation{devices}", *args, "--trainer.devices", str(devices), *PARTIAL,
                             config=GRPO_CONFIG, steps=3))
    for step, (got, want) in enumerate(zip(placed, one, strict=True)):
        for metric in MULTI_TURN_COMPARED:
            assert got.get(metric) == approx_or_none(want.get(metric), rel=1e-4, abs=1e-6), (devices, step, metric)


@pytest.mark.slow  # the default run resumes single-turn partial rollouts (above) and replays an episode (unit test)
def test_a_multi_turn_resume_from_mid_partial_replays_the_episodes_and_logs_what_the_uninterrupted_run_logged(
        tmp_path):
    """The step-2 checkpoint holds episodes mid-turn: each generating rank rebuilds their environments by replaying
    the ended turns, and the resumed run logs what the uninterrupted one logged."""
    common = [*AGENT, "--model.generation.segment_tokens", "3", "--trainer.devices", "2", *PARTIAL,
              "--trainer.enable_checkpointing", "true",
              "--trainer.callbacks+=lightning.pytorch.callbacks.ModelCheckpoint",
              f"--trainer.callbacks.dirpath={tmp_path / 'ckpt'}", "--trainer.callbacks.every_n_train_steps=2",
              "--trainer.callbacks.save_top_k=-1", "--trainer.callbacks.filename={step}"]
    full = logged(fit_demo(tmp_path, "full", *common, config=GRPO_CONFIG, steps=4))
    assert full[1]["rollout/partial_carried_rows"] > 0
    (checkpoint,) = (tmp_path / "ckpt").glob("step=2*.ckpt")
    resumed = logged(fit_demo(tmp_path, "resumed", *common, "--ckpt_path", str(checkpoint), config=GRPO_CONFIG,
                              steps=4))
    assert [r["step"] for r in resumed] == [2, 3]
    for got, want in zip(resumed, full[2:], strict=True):
        for metric in MULTI_TURN_COMPARED:
            assert got.get(metric) == approx_or_none(want.get(metric), rel=1e-5, abs=1e-7), (metric, got["step"])


def test_partial_rollouts_refuse_what_they_cannot_carry():
    from lightning_app_rlhf.engine.partial_rollout import check_partial_rollout
    with pytest.raises(ValueError, match="set ppo.dynamic_sampling false, or partial_rollout false"):
        check_partial_rollout(dynamic_sampling=True)


def test_with_the_option_off_nothing_partial_is_kept(tmp_path):
    """The default: every call decodes its rows to the end, hands on all of them, keeps no pool and no versions."""
    rows = logged(fit_demo(tmp_path, "off", "--trainer.devices", "2", "--trainer.strategy", "rlhf_separation", *UNEVEN,
                           steps=2))
    assert not any(name.startswith("rollout/partial") for r in rows for name in r)
    assert not separation_plan(2, max_staleness=1).partial_rollout
