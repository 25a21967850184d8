"""Bad input fails early with an error that names the fix. Each case checks the error type and message."""

import copy
import math
import warnings

import lightning.pytorch as pl
import pytest
import torch

from lightning_app_rlhf import GenerationConfig, ModelSpec, PPOConfig, PromptDataModule, RLHFModule
from lightning_app_rlhf.roles import load_tokenizer

PROMPTS = ["list some fruit:", "red", "name a few animals:", "blue", "give me colors, like pink:", "sun"]
LONG_PROMPT = "give me fruit, like apple banana cherry grape lemon mango:"


def constant_reward(prompts, responses):
    return [1.0] * len(prompts)


def make_module(tokenizer, config, reward_fn=constant_reward, max_new_tokens=4, **ppo_kwargs):
    return RLHFModule(
        actor={"config": config},
        tokenizer=tokenizer,
        reward_fn=reward_fn,
        generation=GenerationConfig(max_new_tokens=max_new_tokens),
        ppo=PPOConfig(**ppo_kwargs),
    )


def make_trainer():
    return pl.Trainer(
        max_steps=1,
        accelerator="cpu",
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )


def fit(module, datamodule):
    trainer = make_trainer()
    with warnings.catch_warnings():
        # Lightning's own advice (num_workers, log_every_n_steps) is not what these tests are about.
        warnings.filterwarnings("ignore", message=".*(num_workers|log_every_n_steps).*")
        trainer.fit(module, datamodule=datamodule)
    return trainer


@pytest.fixture
def no_pad_tokenizer(tokenizer):
    """A copy of the demo tokenizer without a pad token (the session fixture stays intact)."""
    tok = copy.deepcopy(tokenizer)
    tok.pad_token = None
    assert tok.pad_token_id is None and tokenizer.pad_token_id == 0
    return tok


# ---- tokenizer ----


def test_tokenizer_without_pad_token(no_pad_tokenizer, tiny_gpt2_config):
    """No pad token: load_tokenizer, RLHFModule and PromptDataModule say how to set one."""
    fix = r"no pad token.*tokenizer\.pad_token = tokenizer\.eos_token"
    with pytest.raises(ValueError, match=fix):
        load_tokenizer(no_pad_tokenizer)
    with pytest.raises(ValueError, match=fix):
        make_module(no_pad_tokenizer, tiny_gpt2_config)
    with pytest.raises(ValueError, match=fix):
        PromptDataModule(prompts=PROMPTS, tokenizer=no_pad_tokenizer, batch_size=2).setup("fit")


def test_tokenizer_without_eos_token(tokenizer):
    """No EOS token: the error says to set tokenizer.eos_token."""
    tok = copy.deepcopy(tokenizer)
    tok.eos_token = None
    with pytest.raises(ValueError, match=r"no EOS token.*tokenizer\.eos_token"):
        load_tokenizer(tok)


# ---- context length ----


def test_prompt_too_long_for_context(tokenizer, tiny_gpt2_config):
    """A prompt that leaves no room for max_new_tokens in n_positions=16 stops fit, naming both fixes."""
    assert len(tokenizer(LONG_PROMPT, add_special_tokens=False)["input_ids"]) > 4
    tiny_gpt2_config["n_positions"] = 16
    module = make_module(tokenizer, tiny_gpt2_config, max_new_tokens=12)
    dm = PromptDataModule(prompts=[LONG_PROMPT, "red"], tokenizer=tokenizer, batch_size=2)
    with pytest.raises(ValueError, match=r"generation\.max_new_tokens=12.*data\.max_prompt_length \(<= 4\)"):
        fit(module, dm)


def test_prompt_capped_by_max_prompt_length_fits(tokenizer, tiny_gpt2_config):
    """Following the suggested fix (data.max_prompt_length=4) the same setup trains one iteration."""
    tiny_gpt2_config["n_positions"] = 16
    module = make_module(tokenizer, tiny_gpt2_config, max_new_tokens=12)
    dm = PromptDataModule(prompts=[LONG_PROMPT, "red"], tokenizer=tokenizer, batch_size=2, max_prompt_length=4)
    trainer = fit(module, dm)
    assert trainer.global_step == 1


# ---- batch shape ----


def test_batch_size_not_divisible_by_num_minibatches(tokenizer, tiny_gpt2_config):
    """batch_size 3 with num_minibatches 2 fails in setup, before any model is built."""
    module = make_module(tokenizer, tiny_gpt2_config, num_minibatches=2)
    dm = PromptDataModule(prompts=PROMPTS, tokenizer=tokenizer, batch_size=3)
    with pytest.raises(ValueError, match=r"batch size 3 is not divisible by ppo\.num_minibatches=2"):
        fit(module, dm)
    assert module.actor is None  # failed fast: configure_model never ran


def test_batch_size_not_divisible_without_datamodule(tokenizer, tiny_gpt2_config):
    """With a bare dataloader (no datamodule) the first training step still rejects the batch."""
    module = make_module(tokenizer, tiny_gpt2_config, num_minibatches=2)
    dm = PromptDataModule(prompts=PROMPTS, tokenizer=tokenizer, batch_size=3, shuffle=False)
    dm.setup("fit")
    with pytest.raises(ValueError, match=r"ppo\.num_minibatches=2"):
        make_trainer().fit(module, train_dataloaders=dm.train_dataloader())


def test_empty_dataset(tokenizer, tmp_path):
    """An empty prompt list or JSONL file fails in setup, saying the dataset is empty."""
    with pytest.raises(ValueError, match=r"prompt dataset is empty.*data\.batch_size=2"):
        PromptDataModule(prompts=[], tokenizer=tokenizer, batch_size=2).setup("fit")
    path = tmp_path / "empty.jsonl"
    path.write_text("\n")
    with pytest.raises(ValueError, match="empty"):
        PromptDataModule(prompts=str(path), tokenizer=tokenizer, batch_size=2).setup("fit")


def test_dataset_smaller_than_batch(tokenizer):
    """Fewer prompts than batch_size: not one full batch, so setup says to add prompts or lower the batch size."""
    with pytest.raises(ValueError, match=r"3 prompts, fewer than data\.batch_size=4.*lower data\.batch_size"):
        PromptDataModule(prompts=PROMPTS[:3], tokenizer=tokenizer, batch_size=4).setup("fit")


def test_batch_size_zero(tokenizer):
    """data.batch_size must be positive."""
    with pytest.raises(ValueError, match=r"data\.batch_size must be >= 1"):
        PromptDataModule(prompts=PROMPTS, tokenizer=tokenizer, batch_size=0)


def test_missing_prompt_file(tokenizer, tmp_path):
    """A JSONL path that does not exist is reported as a missing file, not as a failed import."""
    missing = str(tmp_path / "prompts.jsonl")
    with pytest.raises(FileNotFoundError, match="does not exist"):
        PromptDataModule(prompts=missing, tokenizer=tokenizer, batch_size=2).setup("fit")


# ---- vocabularies ----


def test_reference_with_other_vocabulary(tokenizer, tiny_gpt2_config):
    """A reference with 600 tokens against a 512-token actor is refused, naming the reference."""
    module = RLHFModule(
        actor={"config": tiny_gpt2_config},
        reference={"config": {**tiny_gpt2_config, "vocab_size": 600}},
        tokenizer=tokenizer,
        reward_fn=constant_reward,
    )
    with pytest.raises(ValueError, match=r"actor has a vocabulary of 512 tokens but the reference has 600"):
        module.configure_model()


def test_reference_vocabulary_checked_in_fit(tokenizer, tiny_gpt2_config):
    """The vocabulary check runs inside Trainer.fit too."""
    module = RLHFModule(
        actor={"config": tiny_gpt2_config},
        reference={"config": {**tiny_gpt2_config, "vocab_size": 600}},
        tokenizer=tokenizer,
        reward_fn=constant_reward,
        generation=GenerationConfig(max_new_tokens=4),
    )
    with pytest.raises(ValueError, match="reference"):
        fit(module, PromptDataModule(prompts=PROMPTS, tokenizer=tokenizer, batch_size=2))


def test_actor_smaller_than_tokenizer(tokenizer, tiny_gpt2_config):
    """An actor embedding smaller than the tokenizer asks to resize the model."""
    tiny_gpt2_config["vocab_size"] = 256
    module = make_module(tokenizer, tiny_gpt2_config)
    with pytest.raises(ValueError, match=r"tokenizer has 512 tokens.*resize_token_embeddings"):
        module.configure_model()


def test_critic_smaller_than_tokenizer(tokenizer, tiny_gpt2_config):
    """A critic that cannot read the actor's tokens is refused, naming the critic."""
    module = RLHFModule(
        actor={"config": tiny_gpt2_config},
        critic={"config": {**tiny_gpt2_config, "vocab_size": 256}},
        tokenizer=tokenizer,
        reward_fn=constant_reward,
    )
    with pytest.raises(ValueError, match=r"critic has a vocabulary of 256 tokens"):
        module.configure_model()


# ---- non-finite rewards ----


def nan_first(prompts, responses):
    return [math.nan] + [1.0] * (len(prompts) - 1)


def inf_last(prompts, responses):
    return [1.0] * (len(prompts) - 1) + [math.inf]


@pytest.mark.parametrize("reward_fn,shown", [(nan_first, "#0=nan"), (inf_last, "#3=inf")])
def test_nonfinite_rewards_raise(tokenizer, tiny_gpt2_config, reward_fn, shown):
    """With nonfinite_rewards='raise', a NaN/inf score stops fit and points to nonfinite_rewards='skip'."""
    module = make_module(tokenizer, tiny_gpt2_config, reward_fn=reward_fn, nonfinite_rewards="raise")
    dm = PromptDataModule(prompts=PROMPTS, tokenizer=tokenizer, batch_size=4)
    with pytest.raises(ValueError, match=r"1 of 4 scores are NaN or inf") as info:
        fit(module, dm)
    assert shown in str(info.value)
    assert "nonfinite_rewards='skip'" in str(info.value)


def nan_then_counting(prompts, responses):
    return [math.nan] + [float(i) for i in range(1, len(prompts))]


def test_nonfinite_rewards_skip(tokenizer, tiny_gpt2_config):
    """With 'skip', fit completes with a warning and reward/mean is the mean of the finite scores only."""
    module = make_module(tokenizer, tiny_gpt2_config, reward_fn=nan_then_counting, nonfinite_rewards="skip")
    dm = PromptDataModule(prompts=PROMPTS, tokenizer=tokenizer, batch_size=4)
    with pytest.warns(UserWarning, match=r"1 of 4 scores are NaN or inf.*nonfinite_rewards='skip'"):
        trainer = fit(module, dm)
    assert trainer.global_step == 1
    metrics = trainer.callback_metrics
    # Scores [nan, 1, 2, 3]: the finite ones have mean 2 and (unbiased) std 1; the NaN is not counted as 0.
    assert metrics["reward/mean"].item() == pytest.approx(2.0)
    assert metrics["reward/std"].item() == pytest.approx(1.0)
    assert all(torch.isfinite(v).all() for v in metrics.values())
    assert all(torch.isfinite(p).all() for p in module.actor.parameters())
    assert all(torch.isfinite(p).all() for p in module.critic.parameters())


def test_nonfinite_rewards_skip_whole_batch(tokenizer, tiny_gpt2_config):
    """With 'skip' and every score NaN, the iteration is skipped with a warning instead of crashing."""
    module = make_module(
        tokenizer, tiny_gpt2_config, reward_fn=lambda p, r: [math.nan] * len(p), nonfinite_rewards="skip"
    )
    dm = PromptDataModule(prompts=PROMPTS, tokenizer=tokenizer, batch_size=4)
    with pytest.warns(UserWarning, match="4 of 4 scores are NaN or inf"):
        trainer = fit(module, dm)
    assert trainer.global_step == 1
    assert all(torch.isfinite(p).all() for p in module.actor.parameters())
    assert all(torch.isfinite(p).all() for p in module.critic.parameters())


def test_minibatch_of_skipped_samples_takes_no_optimizer_step(tokenizer, tiny_gpt2_config):
    """Scores (nan, nan, 1, 2) and 4 minibatches of one sample: the two minibatches of a skipped sample take no
    step (AdamW's momentum and weight decay would still move the weights); the other two do."""
    module = make_module(tokenizer, tiny_gpt2_config, reward_fn=lambda p, r: [math.nan, math.nan, 1.0, 2.0],
                         nonfinite_rewards="skip", num_minibatches=4)
    dm = PromptDataModule(prompts=PROMPTS, tokenizer=tokenizer, batch_size=4)
    with pytest.warns(UserWarning, match="2 of 4 scores are NaN or inf"):
        fit(module, dm)
    for optimizer in module.optimizers():
        assert {int(state["step"]) for state in optimizer.optimizer.state.values()} == {2}


def test_reward_fn_wrong_number_of_scores(tokenizer, tiny_gpt2_config):
    """A reward function returning the wrong number of scores is refused with the counts."""
    module = make_module(tokenizer, tiny_gpt2_config, reward_fn=lambda p, r: [1.0])
    dm = PromptDataModule(prompts=PROMPTS, tokenizer=tokenizer, batch_size=2)
    with pytest.raises(ValueError, match=r"returned 1 scores for 2 responses.*one float per"):
        fit(module, dm)


# ---- bad configs ----


@pytest.mark.parametrize("kwargs,match", [
    ({"temperature": 0}, r"generation\.temperature must be > 0.*0\.01"),
    ({"temperature": -1.0}, r"generation\.temperature must be > 0"),
    ({"max_new_tokens": 0}, r"generation\.max_new_tokens must be >= 1"),
    ({"top_k": -1}, r"generation\.top_k must be >= 0"),
    ({"top_p": 0.0}, r"generation\.top_p must be in \(0, 1\]"),
    ({"top_p": 1.5}, r"generation\.top_p must be in \(0, 1\]"),
])
def test_bad_generation_config(kwargs, match):
    """Invalid sampling settings raise ValueError naming the field."""
    with pytest.raises(ValueError, match=match):
        GenerationConfig(**kwargs)


@pytest.mark.parametrize("kwargs,match", [
    ({"num_minibatches": 0}, r"ppo\.num_minibatches must be >= 1, got 0"),
    ({"ppo_epochs": 0}, r"ppo\.ppo_epochs must be >= 1"),
    ({"clip_range": 0.0}, r"ppo\.clip_range must be > 0"),
    ({"gamma": 1.5}, r"ppo\.gamma and ppo\.lam must be in \[0, 1\]"),
    ({"kl_coef": -0.1}, r"ppo\.kl_coef must be >= 0"),
    ({"kl_estimator": "k2"}, r"ppo\.kl_estimator must be 'k1' or 'k3'"),
    ({"kl_target": 0.0}, r"ppo\.kl_target must be > 0 or None"),
    ({"reward_clip": -1.0}, r"ppo\.reward_clip must be > 0 or None"),
    ({"nonfinite_rewards": "ignore"}, r"ppo\.nonfinite_rewards must be 'raise' or 'skip'"),
])
def test_bad_ppo_config(kwargs, match):
    """Invalid PPO hyper-parameters raise ValueError naming the field."""
    with pytest.raises(ValueError, match=match):
        PPOConfig(**kwargs)


def test_model_spec_needs_path_or_config():
    """ModelSpec() with neither path nor a config with model_type says what to give."""
    with pytest.raises(ValueError, match=r"either `path`.*`model_type`"):
        ModelSpec()
    with pytest.raises(ValueError, match=r"either `path`"):
        ModelSpec(config={"n_layer": 1})


def test_model_spec_nonexistent_path():
    """A path that is not a local directory raises FileNotFoundError with the offline download hint."""
    with pytest.raises(FileNotFoundError, match=r"'/nonexistent' is not a local directory.*--local-dir"):
        ModelSpec(path="/nonexistent")


def test_model_spec_bad_dtype(tiny_gpt2_config):
    """Only float32 and bfloat16 are accepted."""
    with pytest.raises(ValueError, match=r"dtype must be 'float32' or 'bfloat16'"):
        ModelSpec(config=tiny_gpt2_config, dtype="float16")


def test_module_needs_exactly_one_reward(tokenizer, tiny_gpt2_config):
    """Both reward_model and reward_fn, or neither, is refused."""
    with pytest.raises(ValueError, match=r"exactly one reward"):
        RLHFModule(actor={"config": tiny_gpt2_config}, tokenizer=tokenizer)
    with pytest.raises(ValueError, match=r"exactly one reward"):
        RLHFModule(
            actor={"config": tiny_gpt2_config},
            tokenizer=tokenizer,
            reward_model={"config": tiny_gpt2_config},
            reward_fn=constant_reward,
        )


def test_module_bad_reward_fn_import_path(tokenizer, tiny_gpt2_config):
    """A reward_fn import path that does not resolve says how to write one."""
    with pytest.raises(ValueError, match=r"Cannot import 'lightning_app_rlhf\.demo:no_such_reward'.*package\.module:name"):
        RLHFModule(actor={"config": tiny_gpt2_config}, tokenizer=tokenizer, reward_fn="lightning_app_rlhf.demo:no_such_reward")
