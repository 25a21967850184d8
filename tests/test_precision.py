"""Precision per role (``ModelSpec.precision``): frozen roles in bf16, trained roles in bf16-mixed or fp32, float32
log-probs and values, and how a role's setting meets the Trainer's ``precision``."""

from __future__ import annotations

import dataclasses

import lightning.pytorch as pl
import pytest
import torch
from helpers import fit_demo, run_ranks
from torch import nn

from lightning_app_rlhf import GenerationConfig, PPOConfig, PromptDataModule, RLHFModule, demo
from lightning_app_rlhf.generation import generate, sample_keys
from lightning_app_rlhf.models.calls import critic_values, policy_logprobs, reference_forward
from lightning_app_rlhf.models.roles import (
    ModelSpec,
    build_causal_lm,
    build_critic,
    build_reference,
    hold_in,
    precision_context,
    role_precisions,
)

TINY = {
    "model_type": "gpt2", "n_layer": 2, "n_embd": 64, "n_head": 4, "vocab_size": 512, "n_positions": 64,
    "bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 0,
}
TRAINED = ("actor", "critic")


# ---- settings and their refusals ----


def test_spec_precision_sets_the_parameter_dtype():
    """bf16-true builds bfloat16 weights; 32-true and bf16-mixed keep float32 weights."""
    assert {p.dtype for p in build_causal_lm(ModelSpec(config=TINY, precision="bf16-true")).parameters()} == {
        torch.bfloat16}
    for precision in ("32-true", "bf16-mixed", None):
        model = build_causal_lm(ModelSpec(config=TINY, precision=precision))
        assert {p.dtype for p in model.parameters()} == {torch.float32}


@pytest.mark.parametrize("fields,message", [
    ({"precision": "16-mixed"}, "precision must be one of"),
    ({"shadow_precision": "bf16-mixed"}, "shadow_precision must be"),
    ({"dtype": "bfloat16", "precision": "bf16-mixed"}, "drop `dtype`"),
])
def test_bad_spec_precisions_are_refused(fields, message):
    with pytest.raises(ValueError, match=message):
        ModelSpec(config=TINY, **fields)


def test_role_precisions_default_to_the_run_and_refuse_contradictions():
    """The run's precision is each role's default; a role's own setting wins; a trained role in bf16-true and a role
    set otherwise under a bf16-true run are refused with the fix."""
    roles = {"actor": None, "critic": "32-true", "reference": "bf16-true", "reward": None}
    assert role_precisions(roles, TRAINED, "bf16-mixed") == {
        "actor": "bf16-mixed", "critic": "32-true", "reference": "bf16-true", "reward": "bf16-mixed"}
    assert role_precisions(roles, TRAINED, "32") == {
        "actor": "32-true", "critic": "32-true", "reference": "bf16-true", "reward": "32-true"}
    with pytest.raises(ValueError, match="use precision='bf16-mixed'"):
        role_precisions({"actor": "bf16-true"}, TRAINED, "32-true")
    with pytest.raises(ValueError, match="casts every role to bfloat16"):
        role_precisions(roles, TRAINED, "bf16-true")
    assert role_precisions({"actor": None, "reference": "bf16-true"}, TRAINED, "bf16-true") == {
        "actor": "bf16-true", "reference": "bf16-true"}
    with pytest.raises(ValueError, match="not supported"):
        role_precisions(roles, TRAINED, "16-mixed")


def test_module_refuses_a_bf16_true_trained_role(tokenizer):
    module = RLHFModule(actor={"config": TINY, "precision": "bf16-true"}, tokenizer=tokenizer,
                        reward_fn=demo.topic_reward)
    with pytest.raises(ValueError, match="without float32 master weights"):
        module.role_precisions()


def test_reference_copy_takes_only_a_precision(tokenizer):
    """A reference spec with only a precision is the actor's copy at that precision (as a dict, a ModelSpec, or the
    spec's saved fields); other roles need weights of their own."""
    for reference in ({"precision": "bf16-true"}, ModelSpec(precision="bf16-true"),
                      dataclasses.asdict(ModelSpec(precision="bf16-true"))):
        module = RLHFModule(actor={"config": TINY}, tokenizer=tokenizer, reward_fn=demo.topic_reward,
                            reference=reference)
        assert module.specs.reference is None and module.specs.reference_precision == "bf16-true"
    with pytest.raises(ValueError, match="takes only `precision`"):
        RLHFModule(actor={"config": TINY}, tokenizer=tokenizer, reward_fn=demo.topic_reward,
                   reference={"precision": "bf16-true", "init_seed": 3})
    with pytest.raises(ValueError, match="only the reference can be a copy of the actor"):
        RLHFModule(actor={"config": TINY}, critic={"precision": "bf16-mixed"}, tokenizer=tokenizer,
                   reward_fn=demo.topic_reward)


def test_a_32_true_role_turns_the_trainers_autocast_off():
    """Under a bf16 autocast (Trainer(precision='bf16-mixed')), a 32-true role computes in float32, a bf16-mixed
    one in bf16."""
    layer, x = nn.Linear(4, 4), torch.randn(2, 4)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        with precision_context("32-true", torch.device("cpu")):
            assert layer(x).dtype == torch.float32
        with precision_context("bf16-mixed", torch.device("cpu")):
            assert layer(x).dtype == torch.bfloat16
    with precision_context("bf16-mixed", torch.device("cpu")):
        assert layer(x).dtype == torch.bfloat16


# ---- numbers ----


def _rollout(actor: nn.Module, tokenizer):
    batch = tokenizer(["tell me about cats", "a story on the sea", "dogs", "name a fruit"], return_tensors="pt",
                      padding=True)
    keys = sample_keys(0, 0, torch.arange(4), torch.zeros(4, dtype=torch.long))
    with torch.no_grad():
        return generate(actor, batch["input_ids"], batch["attention_mask"], GenerationConfig(max_new_tokens=16), keys,
                        eos_token_id=[tokenizer.eos_token_id], pad_token_id=tokenizer.pad_token_id)


def test_bf16_reference_log_probs_are_float32_within_bf16_tolerance(tokenizer):
    """The actor's reference held in bf16 gives float32 log-probs within bf16 rounding of the float32 reference's:
    measured max |diff| ~0.03 nats on log-probs of about -6; the bound is 0.1 (mean 0.02)."""
    actor = build_causal_lm(ModelSpec(config=TINY))
    rollout = _rollout(actor, tokenizer)
    fp32 = reference_forward(build_reference(actor, None), rollout, temperature=1.0)
    bf16_model = hold_in(build_reference(actor, None), "bf16-true")
    assert {p.dtype for p in bf16_model.parameters()} == {torch.bfloat16}
    bf16 = reference_forward(bf16_model, rollout, temperature=1.0)
    assert fp32.dtype == bf16.dtype == torch.float32
    mask = rollout.response_mask.bool()
    diff = (fp32 - bf16).abs()[mask]
    assert 0 < diff.max() < 0.1 and diff.mean() < 0.02, (diff.max(), diff.mean())
    assert (fp32[mask] < 0).all()


def test_bf16_mixed_log_probs_and_values_are_float32(tokenizer):
    """Under bf16 autocast the actor's training log-probs and the critic's values come out float32, with gradients
    on the float32 weights, close to the float32 results."""
    actor = build_causal_lm(ModelSpec(config=TINY))
    critic = build_critic(ModelSpec(config=TINY))
    nn.init.normal_(critic.value_head.weight, std=0.1)
    rollout = _rollout(actor, tokenizer)
    fp32_logp, _ = policy_logprobs(actor, rollout, 1.0)
    fp32_values = critic_values(critic, rollout)
    with precision_context("bf16-mixed", torch.device("cpu")):
        logp, entropy = policy_logprobs(actor, rollout, 1.0)
        values = critic_values(critic, rollout)
    assert logp.dtype == entropy.dtype == values.dtype == torch.float32
    values.sum().backward()
    assert critic.value_head.weight.grad.dtype == torch.float32
    assert (logp - fp32_logp).abs().max() < 0.1
    assert (values - fp32_values).abs().max() < 0.05


class KeepLogged(pl.Callback):
    def __init__(self) -> None:
        self.logged: list[dict[str, float]] = []
        self.dtypes: dict[str, set[torch.dtype]] = {}

    def on_train_start(self, trainer: pl.Trainer, pl_module: RLHFModule) -> None:
        for role in ("actor", "critic", "reference", "reward"):
            self.dtypes[role] = {p.dtype for p in pl_module.role_module(role).parameters()}

    def on_train_batch_end(self, trainer: pl.Trainer, *_: object) -> None:
        self.logged.append({k: float(v) for k, v in trainer.callback_metrics.items()})


def _run(tokenizer, steps: int = 4, frozen: str | None = None, trained: str | None = None,
         trainer_precision: str = "32-true", reward_precision: str | None = None) -> KeepLogged:
    pl.seed_everything(0)
    reward = {"config": {**TINY, "n_layer": 1}, "init_seed": 7, "precision": reward_precision or frozen}
    module = RLHFModule(
        actor={"config": TINY, "precision": trained}, tokenizer=tokenizer, reward_model=reward,
        reference={"precision": frozen}, generation=GenerationConfig(max_new_tokens=12),
        ppo=PPOConfig(kl_coef=0.05), actor_optimizer=lambda p: torch.optim.AdamW(p, lr=1e-3),
        critic_optimizer=lambda p: torch.optim.AdamW(p, lr=1e-3),
    )
    keep = KeepLogged()
    trainer = pl.Trainer(accelerator="cpu", devices=1, max_steps=steps, logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False, callbacks=[keep],
                         precision=trainer_precision)
    trainer.fit(module, PromptDataModule(demo.prompts(), tokenizer, batch_size=8))
    return keep


def test_bf16_frozen_roles_train_close_to_float32(tokenizer):
    """Reference and reward model held in bf16 (actor and critic in fp32): each role has the configured dtype, every
    logged value is finite and close to the float32 run's. The first iteration scores the same tokens (sampling uses
    the fp32 actor only): reward, KL and losses within 0.005 (measured: KL -0.0005 vs 0, reward 0.0323 vs 0.0320);
    then the updates differ by bf16 rounding and the samples drift: within 0.05 for two more iterations. How far
    they drift depends on the CPU's bf16 kernels: at most 0.008 on one machine, KL -0.066 vs -0.039 at iteration 2
    on a fresh one of the same kind. Later iterations sample different tokens and are not compared."""
    bf16, fp32 = _run(tokenizer, steps=3, frozen="bf16-true"), _run(tokenizer, steps=3)
    assert bf16.dtypes == {"actor": {torch.float32}, "critic": {torch.float32}, "reference": {torch.bfloat16},
                           "reward": {torch.bfloat16}}
    assert fp32.dtypes["reference"] == fp32.dtypes["reward"] == {torch.float32}
    assert len(bf16.logged) == len(fp32.logged) == 3
    for step, (got, want) in enumerate(zip(bf16.logged, fp32.logged, strict=True)):
        for name in ("reward/mean", "kl/mean", "policy/loss", "value/loss", "response/length_mean"):
            assert torch.isfinite(torch.tensor(got[name])), name
            assert got[name] == pytest.approx(want[name], abs=0.005 if step == 0 else 0.05), (step, name)


def test_bf16_mixed_trained_roles_under_an_fp32_trainer(tokenizer):
    """actor (and so the critic, which shares its spec) in bf16-mixed under Trainer(precision='32-true'): float32
    master weights, finite values, close to the float32 run."""
    mixed, fp32 = _run(tokenizer, steps=2, trained="bf16-mixed"), _run(tokenizer, steps=2)
    assert mixed.dtypes["actor"] == mixed.dtypes["critic"] == {torch.float32}
    assert mixed.logged[0]["kl/mean"] != fp32.logged[0]["kl/mean"]  # the actor did compute in bf16
    for got, want in zip(mixed.logged, fp32.logged, strict=True):
        for name in ("reward/mean", "kl/mean", "value/loss"):
            assert torch.isfinite(torch.tensor(got[name])), name
            assert got[name] == pytest.approx(want[name], abs=0.1), name


def test_a_32_true_reward_model_under_a_bf16_mixed_trainer(tokenizer):
    """Trainer(precision='bf16-mixed') with the reward model set to 32-true: the reward model scores in float32, so
    the first iteration's mean score equals the float32 run's exactly (bf16 sampling picks the same tokens here),
    while with the Trainer's bf16 default for every role it does not."""
    fp32 = _run(tokenizer, steps=1)
    pinned = _run(tokenizer, steps=1, trainer_precision="bf16-mixed", reward_precision="32-true")
    default = _run(tokenizer, steps=1, trainer_precision="bf16-mixed")
    assert pinned.logged[0]["response/length_mean"] == fp32.logged[0]["response/length_mean"]
    assert pinned.logged[0]["reward/mean"] == fp32.logged[0]["reward/mean"]
    assert default.logged[0]["reward/mean"] != fp32.logged[0]["reward/mean"]


# ---- bf16 copies that never train: Separation's shadows and tensor-parallel copies ----


@pytest.mark.slow  # 2 processes; the bf16 TP-copy test covers the rounding of reallocated weights
def test_bf16_shadows_halve_the_reallocated_bytes(tmp_path):
    """Separation on 2 processes with ``actor.shadow_precision: bf16-true`` (the critic shares the actor's spec):
    the shadows are refreshed with bf16 weights, exactly half the bytes of the float32 run, every logged value is
    finite, and the first iteration's KL (actor == reference, so only rounding) stays below 0.01 nats."""
    separation = ("--trainer.devices", "2", "--trainer.strategy", "rlhf_separation")
    bf16 = [r for r in fit_demo(tmp_path, "bf16", *separation, "--model.actor.shadow_precision", "bf16-true",
                                steps=2) if "reward/mean" in r]
    fp32 = [r for r in fit_demo(tmp_path, "fp32", *separation, steps=2) if "reward/mean" in r]
    assert len(bf16) == len(fp32) == 2
    for got, want in zip(bf16, fp32, strict=True):
        assert got["reallocate/bytes"] == want["reallocate/bytes"] / 2 > 0
        assert all(torch.isfinite(torch.tensor(got[name])) for name in ("reward/mean", "kl/mean", "value/loss"))
    assert abs(bf16[0]["kl/mean"]) < 0.01


def _tp_copy_in_bf16(rank: int, port: int, out: str) -> None:
    import json
    from pathlib import Path

    import torch.distributed as dist

    from lightning_app_rlhf.parallel.placement import create_placement
    from lightning_app_rlhf.parallel.plan import PlacementPlan, flattening_plan
    from lightning_app_rlhf.parallel.tensor_parallel import TensorParallelCopy

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    flat = flattening_plan(2)
    plan = PlacementPlan(2, flat.calls, flat.wrappers, name="tp", tp={"actor.generate": 2})
    placement = create_placement(plan, rank, torch.device("cpu"))
    llama = {"model_type": "llama", "num_hidden_layers": 2, "hidden_size": 32, "intermediate_size": 64,
             "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 512, "max_position_embeddings": 64,
             "bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 0}
    actor = build_causal_lm(ModelSpec(config=llama))
    copy = TensorParallelCopy.build("actor.generate", actor, placement.tp_group("actor.generate"), 2,
                                    torch.device("cpu"))
    hold_in(copy.module, "bf16-true")
    with torch.no_grad():  # "one update": the copy must take the new weights
        generator = torch.Generator().manual_seed(1)
        for p in actor.parameters():
            p.add_(0.02 * torch.randn(p.shape, generator=generator))
    copy.load(list(actor.parameters()))
    own = {id(p) for p in copy.module.parameters()}
    ids = torch.randint(3, 512, (4, 8), generator=torch.Generator().manual_seed(2))
    rollout = generate(actor, ids, torch.ones_like(ids), GenerationConfig(max_new_tokens=8),
                       sample_keys(7, 0, torch.arange(4)), eos_token_id=2, pad_token_id=0)
    whole = reference_forward(actor, rollout, 1.0)
    tp = reference_forward(copy.module, rollout, 1.0, lockstep_group=placement.tp_group("actor.generate"))
    result = {
        "same_parameters": all(id(p) in own for p in copy.trainable),
        "dtypes": sorted({str(p.dtype) for p in copy.module.parameters()}),
        "rounded_exactly": all(torch.equal(a, b.to(torch.bfloat16))
                               for a, b in zip(copy.full_parameters(), actor.parameters())),
        "logprob_diff": (tp - whole).abs().max().item(),
        "logprob_dtype": str(tp.dtype),
    }
    dist.destroy_process_group()
    Path(out, f"rank{rank}.json").write_text(json.dumps(result))


def test_tensor_parallel_copy_held_in_bf16_takes_float32_weights(tmp_path):
    """A 2-way tensor-parallel generation copy cast to bf16 (``shadow_precision: bf16-true``) keeps its parameter
    objects, takes the trained float32 weights rounded to bf16 exactly, and scores float32 log-probs within bf16
    tolerance (0.1 nats) of the whole float32 actor."""
    import json

    run_ranks(_tp_copy_in_bf16, 2, str(tmp_path))
    for rank in range(2):
        result = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert result["same_parameters"] and result["rounded_exactly"], result
        assert result["dtypes"] == ["torch.bfloat16"] and result["logprob_dtype"] == "torch.float32", result
        assert 0 < result["logprob_diff"] < 0.1, result
