"""Bad input fails early with an error that names the fix. Each case checks the error type and message."""

import copy
import math
import warnings

import lightning.pytorch as pl
import pytest
import torch
from helpers import make_module

from lightning_app_rlhf import GenerationConfig, ModelSpec, PPOConfig, PromptDataModule, RLHFModule
from lightning_app_rlhf.models.roles import load_tokenizer

PROMPTS = ["list some fruit:", "red", "name a few animals:", "blue", "give me colors, like pink:", "sun"]
LONG_PROMPT = "give me fruit, like apple banana cherry grape lemon mango:"


def constant_reward(prompts, responses):
    return [1.0] * len(prompts)


def tiny_module(tokenizer, config, reward_fn=constant_reward, max_new_tokens=4, **ppo_kwargs):
    return make_module(actor={"config": config}, tokenizer=tokenizer, reward_fn=reward_fn,
                       generation=GenerationConfig(max_new_tokens=max_new_tokens), ppo=PPOConfig(**ppo_kwargs))


def make_trainer(max_steps=1):
    return pl.Trainer(
        max_steps=max_steps,
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
        tiny_module(no_pad_tokenizer, tiny_gpt2_config)
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
    module = tiny_module(tokenizer, tiny_gpt2_config, max_new_tokens=12)
    dm = PromptDataModule(prompts=[LONG_PROMPT, "red"], tokenizer=tokenizer, batch_size=2)
    with pytest.raises(ValueError, match=r"generation\.max_new_tokens=12.*data\.max_prompt_length \(<= 4\)"):
        fit(module, dm)


def test_prompt_capped_by_max_prompt_length_fits(tokenizer, tiny_gpt2_config):
    """Following the suggested fix (data.max_prompt_length=4) the same setup trains one iteration."""
    tiny_gpt2_config["n_positions"] = 16
    module = tiny_module(tokenizer, tiny_gpt2_config, max_new_tokens=12)
    dm = PromptDataModule(prompts=[LONG_PROMPT, "red"], tokenizer=tokenizer, batch_size=2, max_prompt_length=4)
    trainer = fit(module, dm)
    assert trainer.global_step == 1


# ---- algorithm options ----


def test_scale_rewards_outside_its_values():
    with pytest.raises(ValueError, match=r"ppo\.scale_rewards must be 'group', 'batch' or 'none' \(or None for the "
                                         r"algorithm's own\), got 'std'"):
        PPOConfig(scale_rewards="std")


def test_scale_rewards_on_an_algorithm_other_than_grpo():
    """Dr. GRPO never scales, RLOO and the others have no group std: a scale_rewards there would do nothing (it
    applies to the algorithms with GRPO's advantages: grpo, dapo, gspo, gspo_token, cispo). The message says how a
    config meant for several algorithms gives it."""
    with pytest.raises(ValueError, match=r"ppo\.scale_rewards='batch' is a setting of \['cispo', 'dapo', 'grpo', "
                                         r"'gspo', 'gspo_token'\], not of algorithm 'rloo'\. Remove it .*"
                                         r"ppo\.per_algorithm: \{cispo: \{scale_rewards: batch\}"):
        make_module(reward_fn=lambda p, r: [0.0] * len(r), algorithm="rloo",
                    generation=GenerationConfig(num_samples=2), ppo=PPOConfig(scale_rewards="batch"))


def test_whiten_advantages_on_an_algorithm_other_than_ppo():
    with pytest.raises(ValueError, match=r"ppo\.whiten_advantages=False is a setting of \['ppo'\], not of "
                                         r"algorithm 'reinforce_pp'"):
        make_module(reward_fn=lambda p, r: [0.0] * len(r), algorithm="reinforce_pp",
                    ppo=PPOConfig(whiten_advantages=False))


def test_per_algorithm_names_and_settings():
    """A typo in ``ppo.per_algorithm`` would leave its settings unused without a word: both kinds are refused."""
    with pytest.raises(ValueError, match=r"ppo\.per_algorithm\.grpo sets \['scale_reward'\], which are not ppo "
                                         r"settings"):
        PPOConfig(per_algorithm={"grpo": {"scale_reward": "batch"}})
    with pytest.raises(ValueError, match=r"ppo\.scale_rewards must be 'group', 'batch' or 'none'"):
        PPOConfig(per_algorithm={"grpo": {"scale_rewards": "std"}})
    with pytest.raises(ValueError, match=r"ppo\.per_algorithm names \['gpro'\], which are no registered algorithms"):
        make_module(reward_fn=lambda p, r: [0.0] * len(r), algorithm="grpo",
                    ppo=PPOConfig(per_algorithm={"gpro": {"scale_rewards": "batch"}}))


# ---- batch shape ----


def test_batch_size_not_divisible_by_num_minibatches(tokenizer, tiny_gpt2_config):
    """batch_size 3 with num_minibatches 2 fails in setup, before any model is built."""
    module = tiny_module(tokenizer, tiny_gpt2_config, num_minibatches=2)
    dm = PromptDataModule(prompts=PROMPTS, tokenizer=tokenizer, batch_size=3)
    with pytest.raises(ValueError, match=r"batch size 3 is not divisible by ppo\.num_minibatches=2"):
        fit(module, dm)
    assert module.actor is None  # failed fast: configure_model never ran


def test_batch_size_not_divisible_without_datamodule(tokenizer, tiny_gpt2_config):
    """With a bare dataloader (no datamodule) the first training step still rejects the batch."""
    module = tiny_module(tokenizer, tiny_gpt2_config, num_minibatches=2)
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


def test_reference_with_other_vocabulary(tiny_gpt2_config):
    """A reference with 600 tokens against a 512-token actor is refused, naming the reference."""
    module = make_module(reference={"config": {**tiny_gpt2_config, "vocab_size": 600}}, reward_fn=constant_reward)
    with pytest.raises(ValueError, match=r"actor has a vocabulary of 512 tokens but the reference has 600"):
        module.configure_model()


def test_reference_vocabulary_checked_in_fit(tokenizer, tiny_gpt2_config):
    """The vocabulary check runs inside Trainer.fit too."""
    module = make_module(reference={"config": {**tiny_gpt2_config, "vocab_size": 600}}, reward_fn=constant_reward,
                         generation=GenerationConfig(max_new_tokens=4))
    with pytest.raises(ValueError, match="reference"):
        fit(module, PromptDataModule(prompts=PROMPTS, tokenizer=tokenizer, batch_size=2))


def test_actor_smaller_than_tokenizer(tokenizer, tiny_gpt2_config):
    """An actor embedding smaller than the tokenizer asks to resize the model."""
    tiny_gpt2_config["vocab_size"] = 256
    module = tiny_module(tokenizer, tiny_gpt2_config)
    with pytest.raises(ValueError, match=r"tokenizer has 512 tokens.*resize_token_embeddings"):
        module.configure_model()


def test_critic_smaller_than_tokenizer(tiny_gpt2_config):
    """A critic that cannot read the actor's tokens is refused, naming the critic."""
    module = make_module(critic={"config": {**tiny_gpt2_config, "vocab_size": 256}}, reward_fn=constant_reward)
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
    module = tiny_module(tokenizer, tiny_gpt2_config, reward_fn=reward_fn, nonfinite_rewards="raise")
    dm = PromptDataModule(prompts=PROMPTS, tokenizer=tokenizer, batch_size=4)
    with pytest.raises(ValueError, match=r"1 of 4 scores are NaN or inf") as info:
        fit(module, dm)
    assert shown in str(info.value)
    assert "nonfinite_rewards='skip'" in str(info.value)


def nan_then_counting(prompts, responses):
    return [math.nan] + [float(i) for i in range(1, len(prompts))]


def test_nonfinite_rewards_skip(tokenizer, tiny_gpt2_config):
    """With 'skip', fit completes with a warning and reward/mean is the mean of the finite scores only."""
    module = tiny_module(tokenizer, tiny_gpt2_config, reward_fn=nan_then_counting, nonfinite_rewards="skip")
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
    module = tiny_module(
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
    module = tiny_module(tokenizer, tiny_gpt2_config, reward_fn=lambda p, r: [math.nan, math.nan, 1.0, 2.0],
                         nonfinite_rewards="skip", num_minibatches=4)
    dm = PromptDataModule(prompts=PROMPTS, tokenizer=tokenizer, batch_size=4)
    with pytest.warns(UserWarning, match="2 of 4 scores are NaN or inf"):
        fit(module, dm)
    for optimizer in module.optimizers():
        assert {int(state["step"]) for state in optimizer.optimizer.state.values()} == {2}


def test_reward_fn_wrong_number_of_scores(tokenizer, tiny_gpt2_config):
    """A reward function returning the wrong number of scores is refused with the counts."""
    module = tiny_module(tokenizer, tiny_gpt2_config, reward_fn=lambda p, r: [1.0])
    dm = PromptDataModule(prompts=PROMPTS, tokenizer=tokenizer, batch_size=2)
    with pytest.raises(ValueError, match=r"at iteration 0, .*returned a list of 1 score\. .*one float per .*2 of them"):
        fit(module, dm)


# ---- bad configs ----


@pytest.mark.parametrize("kwargs,match", [
    ({"temperature": 0}, r"generation\.temperature must be > 0.*generation\.do_sample: false for greedy decoding"),
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



# ---- reward functions that fail ----


def rollout_of(tokenizer, prompts, response_length=2):
    """A rollout of ``prompts`` (left-padded) with ``response_length`` arbitrary response tokens each."""
    from lightning_app_rlhf.data import collate_left_padded
    from lightning_app_rlhf.generation import Rollout

    batch = collate_left_padded([{"input_ids": tokenizer(p, add_special_tokens=False)["input_ids"], "index": i}
                                 for i, p in enumerate(prompts)], tokenizer.pad_token_id)
    responses = torch.full((len(prompts), response_length), 70)
    mask = torch.ones_like(responses)
    return Rollout(torch.cat([batch["input_ids"], responses], 1), torch.cat([batch["attention_mask"], mask], 1),
                   mask, torch.zeros(responses.shape), batch["input_ids"].shape[1])


def test_reward_fn_that_raises_names_iteration_and_first_prompt(tokenizer, tiny_gpt2_config):
    """A reward function raising at the second iteration stops fit with a RewardFunctionError naming iteration 1
    and that batch's first prompt; the function's own exception is the cause, with its traceback."""
    from lightning_app_rlhf.models.calls import RewardFunctionError

    calls = []

    def second_call_fails(prompts, responses):
        calls.append(len(prompts))
        if len(calls) == 2:
            raise KeyError("answer")
        return [0.0] * len(prompts)

    module = tiny_module(tokenizer, tiny_gpt2_config, reward_fn=second_call_fails)
    dm = PromptDataModule(prompts=PROMPTS, tokenizer=tokenizer, batch_size=2, shuffle=False)
    trainer = make_trainer(max_steps=2)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*(num_workers|log_every_n_steps).*")
        with pytest.raises(RewardFunctionError) as info:
            trainer.fit(module, datamodule=dm)
    message = str(info.value)
    assert "second_call_fails' raised KeyError: 'answer'" in message
    assert f"at iteration 1, on a batch of 2 responses whose first prompt is {PROMPTS[2]!r}" in message
    assert isinstance(info.value.__cause__, KeyError) and info.value.__cause__.__traceback__ is not None


@pytest.mark.parametrize("returned,shown", [
    (None, r"returned None \(is a `return` missing\?\)"),
    ({"score": 1.0}, r"returned a dict \(\{'score': 1\.0\}\)"),
    (["1.0", "2.0", "3.0"], r"returned a list whose item #0 is '1\.0' \(a str, not a number\)"),
    ([1.0, None, 3.0], r"returned a list whose item #1 is None\."),
    ([[1.0], [2.0], [3.0]], r"returned a list whose item #0 is \[1\.0\] \(a list, not a number\)"),
    ([1.0, 2.0], r"returned a list of 2 scores\."),
    (torch.ones(3, 2), r"returned a Tensor of shape \(3, 2\)"),
    (0.5, r"returned a float \(0\.5\)"),
])
def test_reward_fn_bad_return_value_says_what_came_back(tokenizer, returned, shown):
    """Anything but one number per response is refused, naming what was expected and what came back."""
    from lightning_app_rlhf.models.calls import reward_forward

    rollout = rollout_of(tokenizer, ["red", "blue", "sun"])
    with pytest.raises(ValueError, match=shown) as info:
        reward_forward(lambda prompts, responses: returned, rollout, tokenizer, iteration=4)
    message = str(info.value)
    assert "at iteration 4, on a batch of 3 responses whose first prompt is 'red'" in message
    assert "must return one float per (prompt, response) pair: 3 of them" in message


def test_reward_fn_numpy_object_array_names_the_first_non_number(tokenizer):
    """A numpy array of strings or objects is refused with its dtype and first offending item."""
    np = pytest.importorskip("numpy")
    from lightning_app_rlhf.models.calls import reward_forward

    rollout = rollout_of(tokenizer, ["red", "blue", "sun"])
    with pytest.raises(ValueError, match=r"returned a ndarray of dtype object, whose item #1 is None\."):
        reward_forward(lambda p, r: np.array([1.0, None, 2.0]), rollout, tokenizer)


def test_reward_fn_accepted_return_types(tokenizer):
    """Lists or tuples of floats, ints and bools (numpy scalars and 0-d tensors too), 1-D tensors, numpy arrays
    and [B, 1] columns all give float32 scores."""
    np = pytest.importorskip("numpy")
    from lightning_app_rlhf.models.calls import reward_forward

    rollout = rollout_of(tokenizer, ["red", "blue", "sun"])
    for returned in ([1.0, 0, True], (1, 0, 1), [np.float32(1), np.int64(0), np.bool_(True)],
                     [torch.tensor(1.0), torch.tensor(0), torch.tensor(True)], torch.tensor([1, 0, 1]),
                     np.array([1.0, 0.0, 1.0]), np.array([True, False, True]), torch.tensor([[1.0], [0.0], [1.0]])):
        scores = reward_forward(lambda p, r, value=returned: value, rollout, tokenizer)
        assert scores.dtype == torch.float32 and scores.tolist() == [1.0, 0.0, 1.0], returned


# ---- prompt files ----


def test_malformed_jsonl_line_names_file_and_line(tokenizer, tmp_path):
    """A line that is not JSON fails naming the file, its 1-based line (blank lines counted) and the JSON error."""
    path = tmp_path / "prompts.jsonl"
    path.write_text('{"prompt": "red"}\n\n{"prompt": "blue",}\n')
    with pytest.raises(ValueError, match=r"prompts\.jsonl', line 3, column \d+: not valid JSON \(.+\)"):
        PromptDataModule(prompts=str(path), tokenizer=tokenizer, batch_size=1).setup("fit")


def test_non_utf8_prompt_file_names_byte_offset(tokenizer, tmp_path):
    """Latin-1 bytes in a prompt file fail naming the file, the byte offset and the line."""
    path = tmp_path / "latin1.jsonl"
    path.write_bytes('{"prompt": "red"}\n{"prompt": "caf\u00e9"}\n'.encode("latin-1"))
    offset = len('{"prompt": "red"}\n{"prompt": "caf')
    with pytest.raises(ValueError, match=rf"latin1\.jsonl' is not valid UTF-8: byte offset {offset} \(line 2\)"):
        PromptDataModule(prompts=str(path), tokenizer=tokenizer, batch_size=1).setup("fit")


def test_utf8_bom_prompt_file_is_read(tokenizer, tmp_path):
    """A UTF-8 file with a byte-order mark (as some editors write) reads like one without."""
    path = tmp_path / "bom.jsonl"
    path.write_bytes(b"\xef\xbb\xbf" + '{"prompt": "caf\u00e9"}\n"red"\n'.encode())
    dm = PromptDataModule(prompts=str(path), tokenizer=tokenizer, batch_size=2)
    dm.setup("fit")
    assert dm.dataset.prompts == ["caf\u00e9", "red"]


def test_blank_prompts_dropped_with_one_warning(tokenizer):
    """Empty and whitespace-only prompts are left out, with one warning naming how many and which rows."""
    prompts = ["red", "", "blue", "  \n\t", "sun"]
    dm = PromptDataModule(prompts=prompts, tokenizer=tokenizer, batch_size=2)
    with pytest.warns(UserWarning, match=r"Dropped 2 of the 5 prompts of data\.prompts: .*whitespace only "
                                         r"\(rows #1, #3, counting from 0\)") as record:
        dm.setup("fit")
    assert len([w for w in record if "Dropped" in str(w.message)]) == 1
    assert dm.dataset.prompts == ["red", "blue", "sun"]


def test_blank_prompts_leaving_fewer_than_a_batch_raise(tokenizer):
    """When dropping the blank prompts leaves less than one batch, setup raises the batch-size error."""
    dm = PromptDataModule(prompts=["red", " ", "", "blue"], tokenizer=tokenizer, batch_size=3)
    with pytest.warns(UserWarning, match="Dropped 2 of the 4"), pytest.raises(
        ValueError, match=r"2 prompts after dropping 2 blank ones, fewer than data\.batch_size=3"
    ):
        dm.setup("fit")


def test_max_prompt_length_zero_names_the_setting(tokenizer):
    """max_prompt_length=0 truncates every prompt away: the error names the setting, not a prompt."""
    with pytest.raises(ValueError, match=r"data\.max_prompt_length must be >= 1"):
        PromptDataModule(prompts=PROMPTS, tokenizer=tokenizer, batch_size=2, max_prompt_length=0).setup("fit")


# ---- placement ----


def test_plan_world_size_differs_from_devices(tokenizer, tiny_gpt2_config):
    """A plan for 2 ranks in a 1-process job fails naming both numbers and --trainer.devices."""
    import datetime

    from lightning_app_rlhf.parallel.plan import flattening_plan
    from lightning_app_rlhf.strategies.placement_setup import place

    module = tiny_module(tokenizer, tiny_gpt2_config)
    with pytest.raises(ValueError, match=r"plan covers 2 ranks but the job runs 1 processes .*--trainer\.devices.* "
                                         r"multiply to 2"):
        place(flattening_plan(2), module, 1, 0, torch.device("cpu"), datetime.timedelta(seconds=30))


# ---- code in model directories ----


def custom_code_directory(directory, marker, config_name, auto_map):
    """A directory whose config declares ``auto_map`` code that would write ``marker`` if imported."""
    import json

    directory.mkdir()
    (directory / "custom.py").write_text(f"import pathlib\npathlib.Path({str(marker)!r}).write_text('ran')\n")
    (directory / config_name).write_text(json.dumps({"model_type": "custom_marker", "auto_map": auto_map}))
    return str(directory)


def test_model_directory_custom_code_is_not_run(tmp_path):
    """A local model directory whose config.json declares auto_map code: nothing runs, and the error names
    trust_remote_code and the setting that would allow it."""
    from lightning_app_rlhf.models.roles import build_causal_lm

    marker = tmp_path / "executed"
    path = custom_code_directory(tmp_path / "model", marker, "config.json",
                                 {"AutoConfig": "custom.Config", "AutoModelForCausalLM": "custom.Model"})
    with pytest.raises(ValueError, match=r"declares custom code .*trust_remote_code is off.*'trust_remote_code'"):
        build_causal_lm(ModelSpec(path=path))
    assert not marker.exists()


def test_tokenizer_directory_custom_code_is_not_run(tmp_path):
    """The same for a tokenizer directory whose tokenizer_config.json declares auto_map code."""
    marker = tmp_path / "executed"
    path = custom_code_directory(tmp_path / "tokenizer", marker, "tokenizer_config.json",
                                 {"AutoTokenizer": ["custom.Tokenizer", None]})
    with pytest.raises(ValueError, match=r"declares custom code .*trust_remote_code is off.*package\.module:function"):
        load_tokenizer(path)
    assert not marker.exists()
