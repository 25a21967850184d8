"""DAPO's dynamic sampling: which groups are dropped, how the rounds of one update fill its batch, and that a run logs
the one-process trajectory under every placement."""

from __future__ import annotations

import math
import warnings

import lightning.pytorch as pl
import pytest
import torch
from helpers import ROOT, fit_demo, make_module, run_ranks

from lightning_app_rlhf import PromptDataModule, demo
from lightning_app_rlhf.core.config import GenerationConfig, PPOConfig
from lightning_app_rlhf.engine.dynamic_sampling import GroupCollector, informative_groups, round_key
from lightning_app_rlhf.generation import Rollout, concat_rollouts
from lightning_app_rlhf.models.calls import Experience, policy_logprobs
from lightning_app_rlhf.models.roles import as_model_spec, build_causal_lm

GRPO_CONFIG = ROOT / "examples/configs/demo_grpo_cpu.yaml"
NAN = math.nan


def test_informative_groups_need_two_finite_scores_that_differ():
    scores = torch.tensor([1.0, 1.0, 1.0,   # all right: dropped
                           0.0, 1.0, 0.0,   # kept
                           NAN, 1.0, 1.0,   # the finite ones equal: dropped
                           NAN, NAN, 2.0,   # one finite score: dropped
                           NAN, 0.0, 0.5])  # kept
    assert informative_groups(scores, 3).tolist() == [False, True, False, False, True]
    assert informative_groups(torch.tensor([0.2, 0.2 + 1e-6]), 2).tolist() == [True]


def test_the_first_round_keys_samples_as_without_dynamic_sampling():
    assert round_key(7, 0) == 7
    assert len({round_key(7, r) for r in range(4)} | {round_key(8, r) for r in range(4)}) == 8


def _rollout(prompt_rows: list[list[int]], responses: list[list[int]], pad: int = 0) -> Rollout:
    """A left-padded rollout of explicit token rows (response tokens all real, log-prob -0.5 each)."""
    width = max(map(len, prompt_rows))
    prompts = torch.tensor([[pad] * (width - len(p)) + p for p in prompt_rows])
    prompt_mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompt_rows])
    length = max(map(len, responses))
    answers = torch.tensor([r + [pad] * (length - len(r)) for r in responses])
    answer_mask = torch.tensor([[1] * len(r) + [0] * (length - len(r)) for r in responses])
    return Rollout.from_responses(prompts, prompt_mask, answers, answer_mask, -0.5 * answer_mask.float(),
                                  torch.ones(len(responses), dtype=torch.bool))


def test_collected_groups_fill_the_batch_in_round_order_across_prompt_and_response_lengths():
    collector = GroupCollector(group_size=2, max_rounds=5, pad_token_id=0)
    # Round 1: prompt length 1, responses up to 2 tokens; group 0 ties, group 1 is informative.
    first = _rollout([[5], [5], [6], [6]], [[7], [7, 8], [9], [9, 9]])
    assert collector.add(first, {"reward": torch.tensor([1.0, 1.0, 0.0, 1.0])}, torch.tensor([1.0, 1.0, 0.0, 1.0])) == 1
    assert not collector.ready(target=2)
    # Round 2: prompt length 3, responses up to 3 tokens; both groups informative (one more than needed).
    second = _rollout([[3, 4, 5], [3, 4, 5], [4, 4], [4, 4]], [[1, 2, 3], [1], [2], [2, 3]])
    scores = torch.tensor([0.0, 1.0, 1.0, 0.0])
    assert collector.add(second, {"reward": scores}, scores) == 0
    assert collector.ready(target=2)
    batch = collector.take(target=2)
    assert batch.generation_rounds == 2 and batch.filtered_groups == 1 and batch.kept.tolist() == [True] * 4
    rollout = batch.rollout
    assert rollout.prompt_length == 3 and rollout.response_mask.shape == (4, 3)
    assert rollout.sequences.tolist() == [[0, 0, 6, 9, 0, 0], [0, 0, 6, 9, 9, 0],
                                          [3, 4, 5, 1, 2, 3], [3, 4, 5, 1, 0, 0]]
    assert rollout.attention_mask.tolist() == [[0, 0, 1, 1, 0, 0], [0, 0, 1, 1, 1, 0],
                                               [1, 1, 1, 1, 1, 1], [1, 1, 1, 1, 0, 0]]
    assert rollout.logprobs.tolist() == [[-0.5, 0, 0], [-0.5, -0.5, 0], [-0.5] * 3, [-0.5, 0, 0]]
    assert batch.outputs["reward"].tolist() == [0.0, 1.0, 0.0, 1.0]
    # Every generated response counts in the policy's reward, dropped or not.
    assert batch.generated_scores.tolist() == [1.0, 1.0, 0.0, 1.0, 0.0, 1.0, 1.0, 0.0]
    assert batch.generated_lengths.tolist() == [1, 2, 1, 2, 3, 1, 1, 2]
    assert collector.rounds == 0 and collector.groups == 0  # the next update starts afresh


def test_a_short_batch_after_the_last_round_is_filled_with_rows_left_out():
    collector = GroupCollector(group_size=2, max_rounds=2, pad_token_id=0)
    ties = torch.tensor([1.0, 1.0, 0.0, 0.0])
    collector.add(_rollout([[5]] * 4, [[7]] * 4), {"reward": ties}, ties)
    one = torch.tensor([1.0, 1.0, 0.0, 1.0])
    collector.add(_rollout([[6]] * 4, [[8]] * 4), {"reward": one}, one)
    assert collector.ready(target=2)  # one group of two, but no round left
    batch = collector.take(target=2)
    assert batch.kept.tolist() == [True, True, False, False] and batch.filtered_groups == 3
    assert batch.rollout.sequences[:, 0].tolist() == [6, 6, 6, 6]  # the informative group, then the last round's


def test_concatenated_rows_keep_their_log_probabilities(tiny_gpt2_config):
    """Re-padding a round's rows to a longer prompt and response changes none of the actor's outputs: positions
    follow the attention mask."""
    torch.manual_seed(0)
    actor = build_causal_lm(as_model_spec({"config": tiny_gpt2_config})).eval()
    short = _rollout([[5, 6], [7]], [[8, 9], [10]])
    long = _rollout([[5, 6, 7, 8, 9]], [[11, 12, 13, 14]])
    joined = concat_rollouts([short, long], pad_token_id=0)

    def logprobs(rollout: Rollout) -> torch.Tensor:
        experience = Experience(rollout.sequences, rollout.attention_mask, rollout.response_mask, rollout.logprobs,
                                None, torch.zeros_like(rollout.logprobs), None, rollout.prompt_length, 0)
        with torch.no_grad():
            return policy_logprobs(actor, experience, 1.0)[0] * rollout.response_mask

    alone, together = logprobs(short), logprobs(joined)
    torch.testing.assert_close(together[:2, :2], alone, atol=1e-5, rtol=1e-5)


def test_refill_batches_are_keyed_by_iteration_and_round(tokenizer):
    data = PromptDataModule(demo.prompts(64), tokenizer, batch_size=4, seed=3)
    data.setup("fit")
    first = data.refill_batch(5, 1)
    assert torch.equal(first["index"], data.refill_batch(5, 1)["index"])  # every rank, every resume
    assert len(set(first["index"].tolist())) == 4
    assert not torch.equal(first["index"], data.refill_batch(5, 2)["index"])
    assert not torch.equal(first["index"], data.refill_batch(6, 1)["index"])


def test_dynamic_sampling_needs_a_group_algorithm_a_plan_without_overlap_and_a_prompt_source(tokenizer):
    with pytest.raises(ValueError, match="ppo.dynamic_sampling false, or use a group algorithm"):
        make_module(algorithm="ppo", ppo=PPOConfig(dynamic_sampling=True))
    assert make_module(algorithm="dapo", generation=GenerationConfig(num_samples=2)).ppo.dynamic_sampling
    assert not make_module(algorithm="grpo", generation=GenerationConfig(num_samples=2)).ppo.dynamic_sampling
    module = make_module(algorithm="dapo", generation=GenerationConfig(num_samples=2, max_new_tokens=4))
    trainer = pl.Trainer(accelerator="cpu", devices=1, max_steps=1, logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False)
    data = PromptDataModule(demo.prompts(16), tokenizer, batch_size=2)
    data.setup("fit")
    with pytest.raises(ValueError, match="no source of them: use a PromptDataModule"):
        trainer.fit(module, train_dataloaders=data.train_dataloader())


def test_dynamic_sampling_refuses_a_plan_with_overlap():
    from lightning_app_rlhf.engine.dynamic_sampling import check_dynamic_sampling_plan
    from lightning_app_rlhf.parallel.plan import separation_plan

    check_dynamic_sampling_plan(separation_plan(2))
    with pytest.raises(ValueError, match=r"Use an on-policy plan \(max_staleness 0\), or set ppo.dynamic_sampling"):
        check_dynamic_sampling_plan(separation_plan(2, max_staleness=1))


def _fabric_rank(rank: int, port: int) -> None:
    """One Fabric process (its own: its process group and heartbeat end with it): DAPO refuses to run without a
    source of prompts, then runs with the datamodule's."""
    import os

    from lightning.fabric import Fabric

    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    fabric = Fabric(accelerator="cpu", devices=1, strategy="rlhf_flattening")
    fabric.launch()
    tokenizer = demo.build_tokenizer()
    module = fabric.strategy.setup_rlhf(fabric, make_module(
        tokenizer=tokenizer, algorithm="dapo", reward_fn=demo.topic_hit_reward, seed=0,
        generation=GenerationConfig(num_samples=4, max_new_tokens=8)))
    data = PromptDataModule(demo.prompts(32), tokenizer, batch_size=2)
    data.setup("fit")
    batch = next(iter(data.train_dataloader()))
    with pytest.raises(ValueError, match="module.refill_prompts = datamodule.refill_batch"):
        module.training_step(batch, 0)
    module.refill_prompts = data.refill_batch
    module.training_step(batch, 0)
    assert module.iteration == 1


def test_under_fabric_the_module_takes_its_refill_prompts_from_the_user():
    # Spawned, not forked: a child forked after the suite's earlier tests ran torch's OpenMP pool deadlocks in its
    # first kernel.
    run_ranks(_fabric_rank, 1, timeout=120, start_method="spawn")


def _update_batches(module) -> list[Experience]:
    """Record every experience the actor's train call receives (the engine's own method, called through)."""
    seen: list[Experience] = []
    updates = module.engine.updates
    update = type(updates).update

    def recording(loop, role, experience, wrapper):
        seen.append(experience)
        return update(loop, role, experience, wrapper)

    updates.update = recording.__get__(updates)
    return seen


class _RecordUpdates(pl.Callback):
    def __init__(self) -> None:
        self.batches: list[Experience] = []

    def on_train_start(self, trainer: pl.Trainer, pl_module) -> None:
        self.batches = _update_batches(pl_module)


@pytest.mark.parametrize("max_rounds", [8, 1])
def test_every_update_trains_on_a_full_batch_of_informative_groups(tokenizer, max_rounds):
    """A pass/fail reward that most groups of a random-init policy fail alike: each update trains on exactly
    ``batch_size`` groups, all informative (scores spread, so advantages too); with one round allowed, a short batch
    warns and leaves the rest out of the loss."""
    module = make_module(algorithm="dapo", reward_fn=demo.topic_hit_reward, seed=0,
                         generation=GenerationConfig(num_samples=4, max_new_tokens=10),
                         ppo=PPOConfig(max_generation_rounds=max_rounds, num_minibatches=2))
    recorder = _RecordUpdates()
    trainer = pl.Trainer(accelerator="cpu", devices=1, max_steps=3, logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False, callbacks=[recorder])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.fit(module, PromptDataModule(demo.prompts(64), tokenizer, batch_size=4))
    short = [str(w.message) for w in caught if "informative groups in" in str(w.message)]
    # (A batch with no informative group at all has nothing to learn: the train call does not run.)
    assert trainer.global_step == 3 and (len(recorder.batches) == 3 if max_rounds == 8 else recorder.batches)
    for experience in recorder.batches:
        assert len(experience.sequences) == 4 * 4
        kept = experience.response_mask.any(1).view(4, 4).all(1)
        spread = experience.advantages.abs().sum(1).view(4, 4).sum(1) > 0
        assert torch.equal(kept, spread)  # a kept group has advantages; a filling one has none
        if max_rounds == 8:
            assert bool(kept.all())
    if max_rounds == 1:
        assert short and "raise ppo.max_generation_rounds" in short[0]
        assert any(not bool(e.response_mask.any(1).all()) for e in recorder.batches)
    else:
        assert not short


DAPO_ARGS = ("--model.algorithm", "dapo", "--model.reward_fn", "lightning_app_rlhf.demo.topic_hit_reward",
             "--data.batch_size", "3", "--model.generation.num_samples", "4", "--model.ppo.kl_loss_coef", "0")
DAPO_COMPARED = ("reward/mean", "reward/std", "reward/trained_mean", "train/filtered_groups",
                 "train/generation_rounds", "policy/loss", "policy/clipfrac", "policy/approx_kl", "policy/entropy",
                 "response/length_mean")


@pytest.fixture(scope="module")
def dapo_one_process(tmp_path_factory):
    """DAPO with dynamic sampling on one process, pass/fail reward: the trajectory every placement must log."""
    return fit_demo(tmp_path_factory.mktemp("dapo"), "single", *DAPO_ARGS, config=GRPO_CONFIG)


@pytest.mark.parametrize("strategy", [pytest.param("rlhf_flattening", marks=pytest.mark.slow),
                                      pytest.param("rlhf_interleaving", marks=pytest.mark.slow), "rlhf_separation"])
def test_dynamic_sampling_logs_the_one_process_trajectory_under_every_placement(tmp_path, strategy,
                                                                               dapo_one_process):
    """3 prompts x 4 samples on 2 processes: the groups dropped, the refill rounds and the update are those of one
    process, step by step (refills are keyed by iteration and round; scores are gathered to every rank)."""
    reference = [r for r in dapo_one_process if "reward/mean" in r]
    assert [r["step"] for r in reference] == [0, 1, 2]
    assert sum(r["train/filtered_groups"] for r in reference) >= 3  # filtering and refill happened
    assert max(r["train/generation_rounds"] for r in reference) >= 2
    assert "kl/mean" not in reference[0]  # DAPO without KL: no reference role
    rows = fit_demo(tmp_path, strategy, *DAPO_ARGS, "--trainer.devices", "2", "--trainer.strategy", strategy,
                    config=GRPO_CONFIG)
    for step, (got, want) in enumerate(zip([r for r in rows if "reward/mean" in r], reference, strict=True)):
        for metric in DAPO_COMPARED:
            assert got[metric] == pytest.approx(want[metric], rel=1e-4, abs=1e-6), (strategy, step, metric)
