"""Pipeline parallelism per call (lightning_app_rlhf/parallel/pipeline*.py): a role cut at its decoder layers into
stages, torch's schedules over gloo on 2 forked ranks. Pipelined scoring equals the unpipelined calls of the engine;
a pipelined train step (GPipe, 1F1B) leaves the weights the one-process update leaves; a role's weights gather and
load bit for bit by the unpipelined model's names; a family that cannot be split is refused with the fix; a dead
stage is an error within the timeout."""

from __future__ import annotations

import copy
import datetime
import math
import time

import pytest
import torch
import torch.distributed as dist
from helpers import TINY_GPT2, run_ranks
from torch import nn

from lightning_app_rlhf.algorithms import build_algorithm
from lightning_app_rlhf.algorithms.functional import logprobs_from_logits
from lightning_app_rlhf.core.config import GenerationConfig, PPOConfig
from lightning_app_rlhf.generation import Rollout
from lightning_app_rlhf.models.calls import (
    Experience,
    critic_forward,
    critic_values,
    policy_logprobs,
    reference_forward,
    response_logits,
)
from lightning_app_rlhf.models.roles import ModelSpec, build_causal_lm, build_critic, build_reward_model
from lightning_app_rlhf.parallel.failures import PlacementError
from lightning_app_rlhf.parallel.pipeline import (
    PipelinedRole,
    PipelineGroup,
    PipelineInputs,
    create_pipeline_groups,
)
from lightning_app_rlhf.parallel.pipeline_losses import minibatch_scale, policy_loss_fn, value_loss_fn
from lightning_app_rlhf.parallel.pipeline_split import PipelineStageModule
from lightning_app_rlhf.parallel.pipeline_weights import gather_full_state_dict, load_full_state_dict

TINY_LLAMA = {"model_type": "llama", "vocab_size": 512, "hidden_size": 32, "intermediate_size": 64,
              "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 64,
              "bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 0}
TINY_QWEN2 = {**TINY_LLAMA, "model_type": "qwen2"}
TWO_LAYER_GPT2 = {**TINY_GPT2, "n_layer": 2}
CONFIGS = {"llama": TINY_LLAMA, "qwen2": TINY_QWEN2, "gpt2": TWO_LAYER_GPT2}

ROWS, PROMPT, RESPONSE = 8, 5, 7
TEMPERATURE = 0.7
REL = 1e-5


def _rollout(seed: int = 0) -> Rollout:
    """Left-padded prompts and responses of uneven length (pads after the end), as generation returns them."""
    g = torch.Generator().manual_seed(seed)
    sequences = torch.randint(3, 512, (ROWS, PROMPT + RESPONSE), generator=g)
    attention_mask = torch.ones_like(sequences)
    response_mask = torch.ones(ROWS, RESPONSE, dtype=torch.long)
    for row in range(ROWS):
        pad = row % 3
        sequences[row, :pad] = 0
        attention_mask[row, :pad] = 0
        length = RESPONSE - row % 4
        response_mask[row, length:] = 0
        sequences[row, PROMPT + length :] = 0
        attention_mask[row, PROMPT + length :] = 0
    return Rollout(sequences, attention_mask, response_mask, torch.zeros(ROWS, RESPONSE), PROMPT)


def _role(kind: str, family: str) -> nn.Module:
    """A role's module as the engine builds it (seeded: every rank builds the same)."""
    spec = ModelSpec(config=dict(CONFIGS[family]), init_seed=3)
    if kind == "actor":
        return build_causal_lm(spec).train()
    if kind == "critic":
        critic = build_critic(spec).train()
        with torch.no_grad():  # a zero head would give zero values and gradients to compare
            critic.value_head.weight.copy_(torch.randn(critic.value_head.weight.shape,
                                                       generator=torch.Generator().manual_seed(5)))
        return critic
    return build_reward_model(spec, pad_token_id=0).eval()


def _close(actual: torch.Tensor, expected: torch.Tensor) -> None:
    torch.testing.assert_close(actual, expected, rtol=REL, atol=REL * max(1.0, expected.abs().max().item()))


def _init(rank: int, port: int) -> PipelineGroup:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2,
                            timeout=datetime.timedelta(seconds=60))
    pipeline = create_pipeline_groups([[0, 1]], rank, timeout=datetime.timedelta(seconds=60))
    assert pipeline is not None
    return pipeline


# ---- scoring ----


def _scoring_ranks(rank: int, port: int, family: str) -> None:
    pipeline = _init(rank, port)
    rollout = _rollout()
    cpu = torch.device("cpu")
    for n_microbatches in (1, 3):  # 3 does not divide 8 rows: padded, and the padding dropped
        reference = _role("actor", family).eval()
        expected = reference_forward(reference, rollout, TEMPERATURE)
        piped = PipelinedRole(copy.deepcopy(reference), pipeline, rank, cpu, "reference.forward")
        got = piped.logprobs(rollout.sequences, rollout.attention_mask, rollout.response_mask, PROMPT, TEMPERATURE,
                             n_microbatches)
        _close(got, expected)

        critic = _role("critic", family).eval()
        expected = critic_forward(critic, rollout)
        piped = PipelinedRole(copy.deepcopy(critic), pipeline, rank, cpu, "critic.forward")
        _close(piped.values(rollout.sequences, rollout.attention_mask, rollout.response_mask, PROMPT,
                            n_microbatches), expected)

        reward = _role("reward", family)
        expected = reward(input_ids=rollout.sequences, attention_mask=rollout.attention_mask,
                          position_ids=(rollout.attention_mask.cumsum(-1) - 1).clamp(min=0)).logits[:, 0].float()
        piped = PipelinedRole(copy.deepcopy(reward), pipeline, rank, cpu, "reward.forward")
        _close(piped.scores(rollout.sequences, rollout.attention_mask, n_microbatches), expected)
    dist.destroy_process_group()


@pytest.mark.parametrize("family", ["llama", "gpt2", "qwen2"])
def test_pipelined_scoring_equals_unpipelined(family):
    """pp=2 reference log-probabilities, critic values and reward scores equal the engine's unpipelined calls (rel
    1e-5, float32), with 1 and 3 micro-batches, on both ranks."""
    run_ranks(_scoring_ranks, 2, family, timeout=120)


# ---- training ----


def _experience(model: nn.Module, algorithm_name: str) -> Experience:
    """A scored rollout of ``model`` (its own log-probabilities, shifted so that some ratios clip), with advantages,
    values and returns, seeded."""
    rollout = _rollout(1)
    g = torch.Generator().manual_seed(7)
    with torch.no_grad():
        logits = response_logits(model, rollout.sequences, rollout.attention_mask, PROMPT)
        behaviour = logprobs_from_logits(logits[:, :-1], rollout.responses, TEMPERATURE)
    mask = rollout.response_mask
    behaviour = (behaviour + 0.3 * torch.randn(behaviour.shape, generator=g)) * mask
    advantages = torch.randn(mask.shape, generator=g) * mask
    values = torch.randn(mask.shape, generator=g) * mask
    returns = torch.randn(mask.shape, generator=g) * mask
    ref_logprobs = (behaviour + 0.1 * torch.randn(mask.shape, generator=g)) * mask
    return Experience(rollout.sequences, rollout.attention_mask, mask, behaviour, values, advantages, returns, PROMPT,
                      iteration=0, ref_logprobs=ref_logprobs if algorithm_name == "grpo" else None)


def _algorithm(name: str):
    return build_algorithm(name, PPOConfig(), GenerationConfig(max_new_tokens=RESPONSE, num_samples=4))


MINIBATCHES = (torch.tensor([0, 3, 4, 6]), torch.tensor([1, 2, 5, 7]))
"""Two optimizer steps, one per minibatch of 4 rows."""


def _unpipelined_update(model: nn.Module, role: str, algorithm_name: str, experience: Experience,
                        n_microbatches: int) -> tuple[dict[str, torch.Tensor], list[float]]:
    """The engine's update on one process: per minibatch, micro-batch losses scaled by the whole minibatch (as
    UpdateLoop.accumulate_gradients), backward, one AdamW step. Returns the weights and each minibatch's loss."""
    algorithm = _algorithm(algorithm_name)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses = []
    for indices in MINIBATCHES:
        batch = experience.minibatch(indices)
        scale = minibatch_scale(batch, RESPONSE)
        optimizer.zero_grad()
        total = 0.0
        for rows in torch.arange(len(indices)).tensor_split(n_microbatches):
            micro = batch.minibatch(rows)
            if role == "critic":
                loss, _ = algorithm.value_loss(critic_values(model, micro), micro, scale)
            else:
                logprobs, entropy = policy_logprobs(model, micro, TEMPERATURE, entropy_grad=False)
                loss, _ = algorithm.policy_loss(logprobs, entropy, micro, scale)
            loss.backward()
            total += loss.item()
        optimizer.step()
        losses.append(total)
    return {name: t.detach().clone() for name, t in model.state_dict().items()}, losses


def _pipelined_update(piped: PipelinedRole, role: str, algorithm_name: str, experience: Experience,
                      n_microbatches: int) -> list[float]:
    """The same update through the pipeline; returns each minibatch's summed loss (on every stage)."""
    algorithm = _algorithm(algorithm_name)
    optimizer = torch.optim.AdamW(piped.parameters(), lr=1e-2)
    losses = []
    for indices in MINIBATCHES:
        batch = experience.minibatch(indices)
        scale = minibatch_scale(batch, RESPONSE)
        if role == "critic":
            loss_fn, keep = value_loss_fn(algorithm, batch, scale), 0
        else:
            loss_fn, keep = policy_loss_fn(algorithm, batch, scale, TEMPERATURE, entropy_grad=False), RESPONSE + 1
        optimizer.zero_grad()
        inputs = PipelineInputs.from_mask(batch.sequences, batch.attention_mask)
        losses.append(piped.backward(inputs, loss_fn, n_microbatches, logits_to_keep=keep).item())
        piped.clip_and_step(optimizer)
    return losses


def _training_ranks(rank: int, port: int, family: str, role: str, algorithm_name: str, schedule: str) -> None:
    pipeline = _init(rank, port)
    model = _role(role, family)
    experience = _experience(_role("actor", family), algorithm_name)
    n_microbatches = 2
    expected, expected_losses = _unpipelined_update(copy.deepcopy(model), role, algorithm_name, experience,
                                                    n_microbatches)
    piped = PipelinedRole(copy.deepcopy(model), pipeline, rank, torch.device("cpu"), f"{role}.train", schedule)
    losses = _pipelined_update(piped, role, algorithm_name, experience, n_microbatches)
    assert all(math.isfinite(loss) and loss != 0 for loss in losses), losses
    assert losses == pytest.approx(expected_losses, rel=REL)
    got = gather_full_state_dict(piped)
    assert set(got) == set(expected), set(got) ^ set(expected)
    before = model.state_dict()
    moved = 0
    for name, value in expected.items():
        _close(got[name], value)
        moved += not torch.equal(value, before[name])
    assert moved > len(expected) // 2  # the update moved the weights: the comparison is not of initial values
    dist.destroy_process_group()


@pytest.mark.parametrize(("family", "role", "algorithm_name", "schedule"), [
    ("llama", "actor", "grpo", "1f1b"),
    ("gpt2", "actor", "grpo", "gpipe"),
    ("llama", "actor", "ppo", "gpipe"),
    ("gpt2", "actor", "ppo", "1f1b"),
    ("llama", "critic", "ppo", "1f1b"),
    ("gpt2", "critic", "ppo", "gpipe"),
])
def test_pipelined_training_equals_unpipelined(family, role, algorithm_name, schedule):
    """Two AdamW steps of a pp=2 train call (2 micro-batches, the engine's loss on the last stage) leave every
    weight, gathered by name, where the one-process update leaves it (rel 1e-5): GRPO's and PPO's actor loss, PPO's
    value loss, GPipe and 1F1B, Llama and GPT-2 (whose embedding and LM head are tied across the two stages)."""
    run_ranks(_training_ranks, 2, family, role, algorithm_name, schedule, timeout=120)


# ---- weights ----


def _weights_ranks(rank: int, port: int, family: str) -> None:
    pipeline = _init(rank, port)
    model = _role("actor", family)
    full = {name: t.clone() for name, t in model.state_dict().items()}
    piped = PipelinedRole(copy.deepcopy(model), pipeline, rank, torch.device("cpu"), "actor.train")
    gathered = gather_full_state_dict(piped)
    assert list(gathered) == [name for name in full if name in gathered] and set(gathered) == set(full)
    assert all(torch.equal(gathered[name], full[name]) for name in full)
    # Into stages of a differently initialised model: bit for bit, and gathered back whole.
    other = build_causal_lm(ModelSpec(config=dict(CONFIGS[family]), init_seed=11))
    fresh = PipelinedRole(other, pipeline, rank, torch.device("cpu"), "actor.train")
    written = load_full_state_dict(fresh, full)
    assert written > 0
    assert all(torch.equal(t, full[name]) for name, t in fresh.module.role.state_dict().items())
    assert all(torch.equal(t, full[name]) for name, t in gather_full_state_dict(fresh).items())
    dist.destroy_process_group()


@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_state_dict_gather_and_load_round_trip(family):
    """A pp=2 role's gathered state dict is the unpipelined model's, name for name, bit for bit; loading it into the
    stages of another model makes them bit-identical."""
    run_ranks(_weights_ranks, 2, family, timeout=120)


def test_stage_names_are_the_unpipelined_names():
    """Each stage keeps the whole model's parameter names; together the stages hold every one; GPT-2's tied LM head
    stays on the last stage."""
    model = _role("actor", "gpt2")
    names = set(model.state_dict())
    first = PipelineStageModule(copy.deepcopy(model), 0, 2, "actor")
    last = PipelineStageModule(copy.deepcopy(model), 1, 2, "actor")
    first_names, last_names = set(first.role.state_dict()), set(last.role.state_dict())
    assert first_names | last_names == names
    assert "transformer.wte.weight" in first_names and "lm_head.weight" in last_names
    assert "transformer.h.0.attn.c_attn.weight" in first_names and "transformer.h.1.attn.c_attn.weight" in last_names
    assert "transformer.ln_f.weight" in last_names and "transformer.ln_f.weight" not in first_names


# ---- refusals ----


def test_unsupported_family_is_refused_with_the_fix():
    """A family the split does not know (here OPT) is refused naming pp=1 and the supported families."""
    model = build_causal_lm(ModelSpec(config={"model_type": "opt", "vocab_size": 512, "hidden_size": 32,
                                              "ffn_dim": 64, "num_hidden_layers": 2, "num_attention_heads": 2,
                                              "word_embed_proj_dim": 32, "pad_token_id": 0}))
    with pytest.raises(ValueError, match=r"model_type is 'opt'.*Use pp=1.*supported family") as error:
        PipelineStageModule(model, 0, 2, "actor.train")
    assert "llama" in str(error.value) and "gpt2" in str(error.value)


def test_more_stages_than_layers_is_refused():
    with pytest.raises(ValueError, match="Lower pp to at most 2"):
        PipelineStageModule(_role("actor", "gpt2"), 0, 3, "actor.train")


def test_training_micro_batches_must_divide_the_rows():
    """A training call's micro-batches are one size (padding rows would add gradients): the error names a count."""
    piped = PipelinedRole(_role("actor", "gpt2"), PipelineGroup((0,), None, None, datetime.timedelta(seconds=5)),
                          0, torch.device("cpu"), "actor.train")
    rollout = _rollout()
    inputs = PipelineInputs.from_mask(rollout.sequences, rollout.attention_mask)
    with pytest.raises(ValueError, match=r"8 rows into 3 micro-batches.*e.g. 2\)"):
        piped.backward(inputs, lambda out, rows: out.sum(), 3)


def test_unknown_schedule_is_refused():
    with pytest.raises(ValueError, match=r"Unknown pipeline schedule 'zb'.*\['1f1b', 'gpipe'\]"):
        PipelinedRole(_role("actor", "gpt2"), PipelineGroup((0,), None, None, datetime.timedelta(seconds=5)), 0,
                      torch.device("cpu"), "actor.train", schedule="zb")


# ---- nothing hangs ----


def _dead_stage_ranks(rank: int, port: int) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    pipeline = create_pipeline_groups([[0, 1]], rank, timeout=datetime.timedelta(seconds=2))
    assert pipeline is not None
    piped = PipelinedRole(_role("actor", "gpt2").eval(), pipeline, rank, torch.device("cpu"), "reference.forward")
    if rank == 0:  # the last stage never comes: its forward must fail within the timeout, naming the pipeline
        rollout = _rollout()
        start = time.monotonic()
        with pytest.raises(PlacementError, match=r"Rank 0: stage 0 of 2 of the pipeline of reference.forward.*timeout"):
            piped.logprobs(rollout.sequences, rollout.attention_mask, rollout.response_mask, PROMPT, 1.0, 2)
        assert time.monotonic() - start < 6  # the 2 s timeout, not rank 1's 8 s
    else:
        time.sleep(8)  # rank 1 is stuck: alive, but it never runs its stage


def test_a_missing_stage_is_an_error_not_a_hang():
    """Stage 0 waits for a stage that is stuck (alive, never running its part): a PlacementError naming the stage and
    the call within the pipeline group's timeout (2 s), not a hang."""
    run_ranks(_dead_stage_ranks, 2, timeout=60)


# ---- the plan's pipeline-parallel degrees ----


def _plan_fields(**changes) -> dict:
    from lightning_app_rlhf.parallel.plan import flattening_plan

    return {**flattening_plan(4).to_dict(), **changes}


def test_plan_pp_degrees_validate_round_trip_and_show():
    """A plan's pp degrees and schedule: kept (1s dropped), saved and read back, filtered with the roles, shown
    beside the ranks (a train call with its schedule)."""
    from lightning_app_rlhf.parallel.plan import PlacementPlan
    from lightning_app_rlhf.planner.cost_model import call_ranks

    plan = PlacementPlan(**_plan_fields(pp={"actor.train": 2, "reference.forward": 4, "critic.train": 1},
                                        tp={"actor.train": 2}, wrappers={"actor": "fsdp2", "critic": "ddp"},
                                        pipeline_schedule="gpipe"))
    assert plan.pp == {"actor.train": 2, "reference.forward": 4}
    assert plan.pp_degree("actor.train") == 2 and plan.pp_degree("critic.train") == 1
    assert PlacementPlan.from_dict(plan.to_dict()) == plan
    assert plan.for_roles(("actor", "reward")).pp == {"actor.train": 2}
    shown = call_ranks(plan)
    assert "actor.train 0-3 tp2 pp2 gpipe" in shown and "reference.forward 0-3 pp4" in shown
    assert "critic.train 0-3" in shown


@pytest.mark.parametrize(("changes", "message"), [
    ({"pp": {"actor.generate": 2}}, r"'actor.generate' has pipeline-parallel degree 2.*give it a `tp` degree"),
    ({"pp": {"actor.train": 3}}, r"degree 3 on 4 ranks: tp x pp must divide.*Use pp among \[1, 2, 4\]"),
    ({"pp": {"actor.train": 4}, "tp": {"actor.train": 2}, "wrappers": {"actor": "fsdp2", "critic": "ddp"}},
     r"degree 4 and tensor-parallel degree 2 on 4 ranks.*Use pp among \[1, 2\] with this tp"),
    ({"pp": {"critic.forward": 2}, "calls": {**_plan_fields()["calls"], "critic.forward": [0]}},
     r"degree 2 on 1 ranks.*Use pp among \[1\]"),
    ({"pp": {"reward.train": 2}}, r"pp names call 'reward.train', which the plan does not run"),
    ({"pipeline_schedule": "zb"}, r"pipeline_schedule='zb': use one of \['1f1b', 'gpipe'\]"),
])
def test_plan_pp_refusals_name_the_fix(changes, message):
    from lightning_app_rlhf.parallel.plan import PlacementPlan

    with pytest.raises(ValueError, match=message):
        PlacementPlan(**_plan_fields(**changes))


def test_the_engine_runs_pipelined_train_and_scoring_calls_and_refuses_the_rest_naming_the_fix():
    """The strategies' check: pp on the train calls and the scoring calls runs (DDP over pipelines); a trained
    role's scoring call pipelined off its train pipelines, tp and pp on one call, a sharding wrapper on a pipelined
    train call, a wrapper on a pipelined frozen role and stale rollouts are refused, each naming the fix. The plan's
    schedule names are the pipeline's."""
    from lightning_app_rlhf.parallel.pipeline import SCHEDULES
    from lightning_app_rlhf.parallel.pipeline_checks import check_pipeline_parallel
    from lightning_app_rlhf.parallel.plan import PIPELINE_SCHEDULES, PlacementPlan

    assert tuple(SCHEDULES) == PIPELINE_SCHEDULES
    check_pipeline_parallel(PlacementPlan(**_plan_fields()))
    runs = PlacementPlan(**_plan_fields(pp={"actor.train": 2, "critic.train": 4, "critic.forward": 4,
                                            "reference.forward": 2, "reward.forward": 4}))
    check_pipeline_parallel(runs)
    assert runs.runs_on_whole_copy("actor.generate") and not runs.runs_on_whole_copy("critic.forward")
    refused = [
        ({"pp": {"critic.train": 2, "critic.forward": 4}}, r"'critic.forward' is pipelined \(pp=4\).*not on "
         r"'critic.train''s pipelines.*Give 'critic.forward' the ranks and pp of 'critic.train'"),
        ({"pp": {"actor.train": 2}, "tp": {"actor.train": 2}, "wrappers": {"actor": "fsdp2", "critic": "ddp"}},
         r"tensor-parallel degree 2 and pipeline-parallel degree 2.*Remove 'actor.train' from `tp` or from `pp`"),
        ({"pp": {"actor.train": 2}, "wrappers": {"actor": "zero1", "critic": "ddp"}},
         r"'actor.train' is pipelined \(pp=2\) with wrapper 'zero1'.*Set wrappers: \{actor: ddp\}"),
        ({"pp": {"reference.forward": 2}, "wrappers": {"actor": "ddp", "critic": "ddp", "reference": "fsdp2"}},
         r"also shards it with 'fsdp2'. Remove 'reference' from `wrappers`"),
        ({"pp": {"actor.train": 2}, "max_staleness": 1}, r"on-policy only for now. Set max_staleness: 0"),
    ]
    for changes, message in refused:
        with pytest.raises(ValueError, match=message):
            check_pipeline_parallel(PlacementPlan(**_plan_fields(**changes)))
