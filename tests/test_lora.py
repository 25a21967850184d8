"""PEFT LoRA roles: adapters on actor and critic, the reference on the actor's base, every placement,
Separation moving adapter bytes only, checkpoint/resume, and export to plain transformers / peft."""

from __future__ import annotations

import sys
from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch
import yaml
from helpers import ROOT, approx_or_none, fit_demo, make_module

from lightning_app_rlhf import GenerationConfig, PPOConfig, PromptDataModule, RLHFModule, demo
from lightning_app_rlhf.algorithms import functional
from lightning_app_rlhf.callbacks import ExportActor
from lightning_app_rlhf.generation import generate, sample_keys
from lightning_app_rlhf.models.calls import response_logits
from lightning_app_rlhf.models.roles import AdapterDisabledReference, ModelSpec, build_causal_lm, build_critic
from lightning_app_rlhf.parallel.placed_roles import PlacedRoles
from lightning_app_rlhf.parallel.placement import Placement
from lightning_app_rlhf.parallel.plan import (
    PlacementPlan,
    flattening_plan,
    interleaving_plan,
    separation_plan,
)

LORA = {"r": 4, "lora_alpha": 8, "target_modules": ["c_attn"]}
DEMO_CONFIG = ROOT / "examples/configs/demo_lora_cpu.yaml"
STRATEGIES = ("rlhf_flattening", "rlhf_interleaving", "rlhf_separation")
COMPARED = (
    "reward/mean",
    "reward/std",
    "kl/mean",
    "policy/loss",
    "policy/clipfrac",
    "policy/approx_kl",
    "policy/entropy",
    "value/loss",
    "value/clipfrac",
    "response/length_mean",
)


def nbytes(params) -> int:
    return sum(p.numel() * p.element_size() for p in params)


def perturb_adapters(model: torch.nn.Module, seed: int = 0) -> None:
    """Give the LoRA B matrices (zero at init) random values, so the adapters change the model."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.copy_(0.5 * torch.randn(p.shape, generator=generator))


# ---- roles and validation (in process) ----


def test_lora_roles_train_only_adapters_and_the_value_head(tiny_gpt2_config):
    """The actor trains its adapters only, the critic its adapters plus the value head; the base weights equal the
    plain model's bit for bit, and the shared reference computes the base model, not the adapted actor."""
    actor = build_causal_lm(ModelSpec(config=tiny_gpt2_config, lora=LORA))
    critic = build_critic(ModelSpec(config=tiny_gpt2_config, lora=LORA))
    plain = build_causal_lm(ModelSpec(config=tiny_gpt2_config))
    assert [n.split("h.0.")[1] for n, p in actor.named_parameters() if p.requires_grad] == [
        "attn.c_attn.lora_A.default.weight",
        "attn.c_attn.lora_B.default.weight",
    ]
    trainable = [n for n, p in critic.named_parameters() if p.requires_grad]
    assert trainable[-2:] == ["value_head.weight", "value_head.bias"] and len(trainable) == 4
    # r=4 on c_attn (32 -> 96): A is 4x32, B is 96x4; fp32
    assert nbytes(p for p in actor.parameters() if p.requires_grad) == (4 * 32 + 96 * 4) * 4
    base = {
        k.replace(".base_layer", ""): v
        for k, v in actor.get_base_model().state_dict().items()
        if "lora_" not in k
    }
    assert base.keys() == plain.state_dict().keys()
    assert all(torch.equal(base[k], v) for k, v in plain.state_dict().items())

    reference = AdapterDisabledReference(actor)
    perturb_adapters(actor)
    ids = torch.randint(3, 512, (2, 9))
    with torch.no_grad():
        assert torch.equal(reference(input_ids=ids).logits, plain(input_ids=ids).logits)
        assert not torch.allclose(actor(input_ids=ids).logits, plain(input_ids=ids).logits)
        assert torch.allclose(actor(input_ids=ids).logits, actor(input_ids=ids).logits)  # adapters back on


def test_lora_settings_are_checked_up_front(tokenizer, tiny_gpt2_config, monkeypatch):
    """Bad LoRA fields, LoRA on frozen roles, a bias-training shared base and a missing peft fail with the fix."""
    reward = {"reward_fn": lambda p, r: [0.0] * len(p)}
    with pytest.raises(ValueError, match=r"Invalid LoRA settings .*rank.*peft.LoraConfig fields"):
        ModelSpec(config=tiny_gpt2_config, lora={"rank": 8})
    for role in ("reference", "reward_model"):
        kwargs = {**reward, role: {"config": tiny_gpt2_config, "lora": LORA}}
        if role == "reward_model":
            kwargs.pop("reward_fn")
        with pytest.raises(
            ValueError, match=rf"`{role}` is frozen, so LoRA adapters on it would never train"
        ):
            RLHFModule(actor={"config": tiny_gpt2_config}, tokenizer=tokenizer, **kwargs)
    with pytest.raises(ValueError, match=r"bias='all' trains the base model's biases.*bias='none'"):
        RLHFModule(
            actor={"config": tiny_gpt2_config, "lora": {**LORA, "bias": "all"}}, tokenizer=tokenizer, **reward
        )
    # With a reference of its own, a bias-training actor is fine.
    RLHFModule(
        actor={"config": tiny_gpt2_config, "lora": {**LORA, "bias": "all"}},
        tokenizer=tokenizer,
        reference={"config": tiny_gpt2_config},
        **reward,
    )
    monkeypatch.setitem(sys.modules, "peft", None)  # as if peft were not installed
    with pytest.raises(ImportError, match=r"pip install 'lightning-app-rlhf\[peft\]'"):
        ModelSpec(config=tiny_gpt2_config, lora=LORA)


def test_shared_reference_must_run_where_the_actor_lives(tokenizer, tiny_gpt2_config):
    """Every preset puts the reference on ranks holding the actor; a custom plan that does not, or that splits an
    FSDP2 actor's group, fails before any model is built, naming the fix."""
    for plan in (
        flattening_plan(2),
        interleaving_plan(2),
        separation_plan(2),
        interleaving_plan(4, 0.25, 0.75),
        separation_plan(4, generation_ranks=[0, 1, 2], training_ranks=[3]),
        flattening_plan(4, "fsdp2"),
    ):
        plan.validate_shared_reference()
    calls = {
        "actor.generate": (0,),
        "reference.forward": (1,),
        "reward.forward": (0,),
        "critic.forward": (0,),
        "actor.train": (0,),
        "critic.train": (1,),
    }
    lonely = PlacementPlan(2, calls)
    with pytest.raises(
        ValueError,
        match=r"ranks \[1\] run 'reference.forward' without holding the actor.*"
        r"separate `reference`",
    ):
        lonely.validate_shared_reference()
    split = PlacementPlan(
        4, {**flattening_plan(4).calls, "reference.forward": (0, 1)}, {"actor": "fsdp2", "critic": "ddp"}
    )
    with pytest.raises(
        ValueError, match=r"part of the fsdp2 group \[0, 1, 2, 3\].*all of the actor's train ranks"
    ):
        split.validate_shared_reference()

    module = RLHFModule(
        actor={"config": tiny_gpt2_config, "lora": LORA},
        tokenizer=tokenizer,
        reward_fn=lambda p, r: [0.0] * len(p),
    )
    module.placed_roles = PlacedRoles(Placement(lonely, rank=1))
    with pytest.raises(ValueError, match="without holding the actor"):
        module.configure_model()
    assert module.critic is None  # nothing was built
    # A separate reference model may live anywhere.
    module = RLHFModule(
        actor={"config": tiny_gpt2_config, "lora": LORA},
        tokenizer=tokenizer,
        reference={"config": tiny_gpt2_config},
        reward_fn=lambda p, r: [0.0] * len(p),
    )
    module.placed_roles = PlacedRoles(Placement(lonely, rank=1))
    module.configure_model()
    assert module.actor is None and isinstance(module.reference, torch.nn.Module)


def test_kv_cache_generation_with_a_peft_actor_matches_a_full_forward(tokenizer, tiny_gpt2_config):
    """generate() on a PeftModel with non-zero adapters: the behaviour log-probs equal a no-cache forward's."""
    actor = build_causal_lm(ModelSpec(config=tiny_gpt2_config, lora=LORA))
    perturb_adapters(actor)
    batch = tokenizer(
        ["list some fruit:", "red", "name a few animals: cat dog"],
        return_tensors="pt",
        padding=True,
        add_special_tokens=False,
    )
    rollout = generate(
        actor,
        batch["input_ids"],
        batch["attention_mask"],
        GenerationConfig(max_new_tokens=10),
        sample_keys(0, 0, torch.arange(3)),
        eos_token_id=2,
        pad_token_id=0,
    )
    with torch.no_grad():
        logits = response_logits(actor, rollout.sequences, rollout.attention_mask, rollout.prompt_length)[:, :-1]
    full = functional.logprobs_from_logits(logits, rollout.responses)
    valid = rollout.response_mask.bool()
    torch.testing.assert_close(rollout.logprobs[valid], full[valid], rtol=0, atol=1e-4)


# ---- export (in process) ----


def _greedy_ours(module: RLHFModule, batch: dict[str, torch.Tensor], new_tokens: int) -> list[list[int]]:
    rollout = generate(
        module.actor,
        batch["input_ids"],
        batch["attention_mask"],
        GenerationConfig(max_new_tokens=new_tokens, top_k=1),
        sample_keys(0, 0, torch.arange(3)),
        eos_token_id=2,
        pad_token_id=0,
    )
    return [r[m.bool()].tolist() for r, m in zip(rollout.responses, rollout.response_mask)]


def _greedy_hf(model: torch.nn.Module, batch: dict[str, torch.Tensor], new_tokens: int) -> list[list[int]]:
    out = model.generate(**batch, max_new_tokens=new_tokens, do_sample=False, eos_token_id=2, pad_token_id=0)
    rows = []
    for row in out[:, batch["input_ids"].shape[1] :].tolist():
        rows.append(row[: row.index(2) + 1] if 2 in row else row)
    return rows


def test_exported_actor_reloads_with_plain_transformers_and_peft(tmp_path, tokenizer, tiny_gpt2_config):
    """A LoRA actor trained for a few PPO iterations, exported merged (ExportActor callback) and as an adapter
    (export_actor), reloads with plain transformers / peft and gives the same greedy tokens as our generate."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    base_dir = tmp_path / "base"
    torch.manual_seed(0)
    build_causal_lm(ModelSpec(config=tiny_gpt2_config)).save_pretrained(base_dir)
    pl.seed_everything(0)
    module = RLHFModule(
        actor={"path": str(base_dir), "lora": LORA},
        tokenizer=tokenizer,
        reward_fn=demo.topic_reward,
        generation=GenerationConfig(max_new_tokens=8),
        ppo=PPOConfig(ppo_epochs=2),
        actor_optimizer=lambda p: torch.optim.AdamW(p, lr=3e-2),
    )
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=1,
        max_steps=3,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[ExportActor(str(tmp_path / "merged"))],
    )
    trainer.fit(module, PromptDataModule(demo.prompts(64), tokenizer, batch_size=8))
    assert module.export_actor(tmp_path / "adapter", merge=False) == tmp_path / "adapter"
    assert sorted(p.name for p in (tmp_path / "adapter").glob("adapter_*")) == [
        "adapter_config.json",
        "adapter_model.safetensors",
    ]

    batch = tokenizer(
        ["name a fruit:", "list some animals: cat", "red"],
        return_tensors="pt",
        padding=True,
        add_special_tokens=False,
    )
    ours = _greedy_ours(module, dict(batch), 12)
    merged = AutoModelForCausalLM.from_pretrained(tmp_path / "merged")
    adapter = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base_dir), tmp_path / "adapter")
    base = AutoModelForCausalLM.from_pretrained(base_dir)
    assert AutoTokenizer.from_pretrained(tmp_path / "merged").pad_token_id == 0
    with torch.no_grad():
        assert _greedy_hf(merged, dict(batch), 12) == ours
        assert _greedy_hf(adapter, dict(batch), 12) == ours
        assert _greedy_hf(base, dict(batch), 12) != ours  # training changed what the actor says
    with pytest.raises(ValueError, match="no LoRA adapter to export"):
        make_module().export_actor(tmp_path / "x", merge=False)


# ---- every placement, 2 processes (CLI, YAML config) ----


def run_lora_demo(
    tmp_path: Path, name: str, *args: str, steps: int = 3
) -> tuple[list[dict[str, float]], str]:
    """The LoRA demo config for a few iterations: its metrics.csv rows and its stdout."""
    rows = fit_demo(tmp_path, name, *args, config=DEMO_CONFIG, steps=steps, max_new_tokens=8)
    return rows, (tmp_path / f"{name}.out").read_text()


def demo_role_bytes() -> tuple[int, int, int]:
    """(actor bytes, critic bytes, trainable bytes of both) of the LoRA demo config's roles, fp32."""
    config = yaml.safe_load(DEMO_CONFIG.read_text())
    spec = ModelSpec(**config["model"]["actor"])
    actor, critic = build_causal_lm(spec), build_critic(spec)
    trainable = nbytes(p for m in (actor, critic) for p in m.parameters() if p.requires_grad)
    return nbytes(actor.parameters()), nbytes(critic.parameters()), trainable


@pytest.mark.slow  # LoRA training and export stay in the default run on one process
def test_lora_actor_and_critic_train_under_every_placement(tmp_path):
    """Flattening, Interleaving and Separation on 2 processes: the same trajectory; the reference costs no
    parameter bytes anywhere; Separation moves exactly the adapters and the value head after every update."""
    logged = {
        s: run_lora_demo(tmp_path, s, "--trainer.devices", "2", "--trainer.strategy", s) for s in STRATEGIES
    }
    runs = {s: [r for r in rows if "reward/mean" in r] for s, (rows, _) in logged.items()}
    reference = runs["rlhf_flattening"]
    assert [r["step"] for r in reference] == [0, 1, 2]
    for strategy, rows in runs.items():
        for got, want in zip(rows, reference, strict=True):
            for metric in COMPARED:
                assert got[metric] == pytest.approx(want[metric], rel=1e-4, abs=1e-6), (
                    strategy,
                    got["step"],
                    metric,
                )
    # The first rollout comes from the initial actor, which the reference (adapters off) equals exactly; after
    # the first update the adapters moved the policy away from it.
    assert reference[0]["kl/mean"] == pytest.approx(0.0, abs=1e-6)
    assert abs(reference[2]["kl/mean"]) > 1e-4 and reference[2]["policy/approx_kl"] != 0  # k1: either sign

    actor, critic, trainable = demo_role_bytes()
    # Adapters + value head: r=8 on every projection is 11% of this 64-dim toy model (about 1% of SmolLM2-135M).
    assert trainable < (actor + critic) / 8
    for strategy, (rows, stdout) in logged.items():
        memory = next(r for r in rows if "memory/param_bytes_rank0" in r)
        # Every rank holds actor + critic (trained or shadow); rank 0 also runs the reference, for free.
        assert [memory[f"memory/param_bytes_rank{r}"] for r in (0, 1)] == [actor + critic] * 2, strategy
        trains_on = {"rlhf_separation": [1]}.get(strategy, [0, 1])
        # gradients + two AdamW moments, of the trainable bytes only
        assert [memory[f"memory/state_bytes_rank{r}"] for r in (0, 1)] == [
            3 * trainable if r in trains_on else 0 for r in (0, 1)
        ], strategy
        assert "reference (shared)" in stdout and "holds no parameters of its own" in stdout
        row = next(line for line in stdout.splitlines() if "reference (shared)" in line)
        assert row.split("│")[4:7] == ["   0.00 ", "  0.00 ", "      0.00 "], row
        moved = [r["reallocate/bytes"] for r in runs[strategy]]
        assert moved == ([trainable] * 3 if strategy == "rlhf_separation" else [0] * 3), strategy


@pytest.mark.slow  # resume is covered per placement in test_placements; LoRA training in the default run
def test_lora_resumed_run_logs_what_the_uninterrupted_run_logged(tmp_path):
    """Kill-and-resume under Separation with LoRA roles: resumed from the step-2 checkpoint, steps 2 and 3 log the
    values of the uninterrupted run (adapters, value head, optimizers and shadows restored)."""
    common = [
        "--trainer.devices",
        "2",
        "--trainer.strategy",
        "rlhf_separation",
        "--trainer.enable_checkpointing",
        "true",
        "--model.ppo.kl_target",
        "1.0",
        "--model.ppo.kl_horizon",
        "100",
        "--trainer.callbacks+=lightning.pytorch.callbacks.ModelCheckpoint",
        f"--trainer.callbacks.dirpath={tmp_path / 'ckpt'}",
        "--trainer.callbacks.every_n_train_steps=2",
        "--trainer.callbacks.save_top_k=-1",
        "--trainer.callbacks.filename={step}",
    ]
    full = [r for r in run_lora_demo(tmp_path, "full", *common, steps=4)[0] if "reward/mean" in r]
    (checkpoint,) = (tmp_path / "ckpt").glob("step=2*.ckpt")
    resumed = [
        r
        for r in run_lora_demo(tmp_path, "resumed", *common, "--ckpt_path", str(checkpoint), steps=4)[0]
        if "reward/mean" in r
    ]
    assert [r["step"] for r in resumed] == [2, 3]
    for got, want in zip(resumed, full[2:], strict=True):
        for metric in (*COMPARED, "kl/coef", "reallocate/bytes"):
            assert got.get(metric) == approx_or_none(want.get(metric), rel=1e-5, abs=1e-7), (
                metric,
                got["step"],
            )
