"""Tests for ``lightning_app_rlhf.models.roles``: seeded random init, frozen references, offline loading, dropout off."""

import pytest
import torch
from torch import nn
from transformers import GPT2ForSequenceClassification, GPT2LMHeadModel, GPT2Model, PreTrainedTokenizerBase

from lightning_app_rlhf.generation import position_ids_from_mask
from lightning_app_rlhf.models.roles import (
    ModelSpec,
    ValueModel,
    as_model_spec,
    build_causal_lm,
    build_critic,
    build_reference,
    build_reward_model,
    default_optimizer,
    load_tokenizer,
    resolve_import,
    vocab_size,
)


def state_equal(a: nn.Module, b: nn.Module) -> bool:
    sa, sb = a.state_dict(), b.state_dict()
    return sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)


@pytest.fixture
def saved_lm(tiny_gpt2_config, tmp_path):
    """A tiny causal LM saved with save_pretrained; returns (model, directory)."""
    model = build_causal_lm(ModelSpec(config=tiny_gpt2_config, init_seed=7))
    path = tmp_path / "lm"
    model.save_pretrained(path)
    return model, str(path)


def test_random_init_is_deterministic_under_init_seed(tiny_gpt2_config):
    """Two builds with the same init_seed are equal; another seed gives other weights."""
    a = build_causal_lm(ModelSpec(config=tiny_gpt2_config, init_seed=3))
    torch.manual_seed(12345)  # the global RNG state must not matter
    b = build_causal_lm(ModelSpec(config=tiny_gpt2_config, init_seed=3))
    c = build_causal_lm(ModelSpec(config=tiny_gpt2_config, init_seed=4))
    assert isinstance(a, GPT2LMHeadModel)
    assert state_equal(a, b)
    assert not torch.equal(a.transformer.h[0].attn.c_attn.weight, c.transformer.h[0].attn.c_attn.weight)
    assert a.config.n_layer == 1 and a.config.n_embd == 32 and vocab_size(a) == 512


def test_random_init_leaves_global_rng_alone(tiny_gpt2_config):
    """Building a model does not consume the global RNG (it is forked)."""
    torch.manual_seed(0)
    expected = torch.rand(4)
    torch.manual_seed(0)
    build_causal_lm(ModelSpec(config=tiny_gpt2_config))
    assert torch.equal(torch.rand(4), expected)


def test_critic_random_init_deterministic_and_zero_head(tiny_gpt2_config):
    """Critics from the same spec are equal; the value head starts at zero, so every value is 0."""
    a = build_critic(ModelSpec(config=tiny_gpt2_config, init_seed=1))
    b = build_critic(ModelSpec(config=tiny_gpt2_config, init_seed=1))
    assert isinstance(a, ValueModel) and isinstance(a.backbone, GPT2Model)
    assert state_equal(a, b)
    assert a.config is a.backbone.config
    ids = torch.tensor([[0, 5, 6, 7], [8, 9, 10, 11]])
    mask = torch.tensor([[0, 1, 1, 1], [1, 1, 1, 1]])
    values = a(ids, mask, position_ids_from_mask(mask))
    assert values.shape == (2, 4) and values.dtype == torch.float32
    assert torch.equal(values, torch.zeros(2, 4))


def test_build_reference_is_exact_frozen_copy(tiny_gpt2_config):
    """The default reference equals the actor, has no gradients, and shares no storage with it."""
    actor = build_causal_lm(ModelSpec(config=tiny_gpt2_config))
    reference = build_reference(actor, None)
    assert reference is not actor
    assert state_equal(actor, reference)
    assert all(not p.requires_grad for p in reference.parameters())
    assert all(p.requires_grad for p in actor.parameters())
    actor_ptrs = {p.data_ptr() for p in actor.parameters()}
    assert not actor_ptrs & {p.data_ptr() for p in reference.parameters()}
    assert all(not p.requires_grad for p in reference.parameters())  # frozen; configure_model sets its eval mode
    with torch.no_grad():
        actor.transformer.wte.weight.add_(1.0)
    assert not torch.equal(actor.transformer.wte.weight, reference.transformer.wte.weight)


def test_build_reference_from_spec(tiny_gpt2_config):
    """A reference spec builds its own frozen model from that spec."""
    actor = build_causal_lm(ModelSpec(config=tiny_gpt2_config, init_seed=0))
    reference = build_reference(actor, ModelSpec(config=tiny_gpt2_config, init_seed=5))
    assert all(not p.requires_grad for p in reference.parameters())
    assert state_equal(reference, build_causal_lm(ModelSpec(config=tiny_gpt2_config, init_seed=5)))
    assert not state_equal(reference, actor)


def test_actor_loads_from_saved_directory(saved_lm):
    """A save_pretrained directory loads back through ModelSpec(path=...) with equal weights."""
    model, path = saved_lm
    loaded = build_causal_lm(ModelSpec(path=path))
    assert isinstance(loaded, GPT2LMHeadModel)
    assert state_equal(model, loaded)
    assert all(p.requires_grad for p in loaded.parameters())
    ids = torch.tensor([[3, 4, 5, 6]])
    with torch.no_grad():
        torch.testing.assert_close(loaded(input_ids=ids).logits, model(input_ids=ids).logits, rtol=0, atol=0)


def test_path_with_config_override(saved_lm):
    """With a path, config entries override the saved config."""
    _, path = saved_lm
    spec = ModelSpec(path=path, config={"n_positions": 32})
    assert spec.load_config().n_positions == 32
    assert ModelSpec(path=path).load_config().n_positions == 64


def test_critic_loads_backbone_of_causal_lm(saved_lm):
    """A critic from a causal-LM directory has the LM's transformer weights and a zero value head."""
    model, path = saved_lm
    critic = build_critic(ModelSpec(path=path))
    assert isinstance(critic.backbone, GPT2Model)
    assert state_equal(critic.backbone, model.transformer)
    assert torch.equal(critic.value_head.weight, torch.zeros(1, 32))
    assert torch.equal(critic.value_head.bias, torch.zeros(1))
    ids = torch.tensor([[0, 0, 5, 6, 7]])
    mask = torch.tensor([[0, 0, 1, 1, 1]])
    assert torch.equal(critic(ids, mask, position_ids_from_mask(mask)), torch.zeros(1, 5))


def test_reward_model_loads_one_label_classifier(saved_lm, tokenizer):
    """A reward model from the directory is a frozen one-label classifier over the LM's transformer weights."""
    model, path = saved_lm
    reward = build_reward_model(ModelSpec(path=path), tokenizer.pad_token_id)
    assert isinstance(reward, GPT2ForSequenceClassification)
    assert reward.config.num_labels == 1
    assert reward.config.pad_token_id == tokenizer.pad_token_id
    assert state_equal(reward.transformer, model.transformer)
    assert all(not p.requires_grad for p in reward.parameters())
    ids = torch.tensor([[5, 6, 7, 2]])
    assert reward(input_ids=ids).logits.shape == (1, 1)


def test_reward_model_scores_last_real_token(tiny_gpt2_config, tokenizer):
    """Left padding before the prompt and pad after EOS do not change the score."""
    reward = build_reward_model(ModelSpec(config=tiny_gpt2_config, init_seed=2), tokenizer.pad_token_id)
    alone = torch.tensor([[5, 6, 7, 2]])
    padded = torch.tensor([[0, 0, 5, 6, 7, 2, 0, 0]])
    mask = torch.tensor([[0, 0, 1, 1, 1, 1, 0, 0]])
    with torch.no_grad():
        expected = reward(input_ids=alone).logits
        got = reward(input_ids=padded, attention_mask=mask, position_ids=position_ids_from_mask(mask)).logits
    torch.testing.assert_close(got, expected, rtol=0, atol=1e-5)


def test_reward_model_from_path_is_deterministic(saved_lm, tokenizer):
    """Weights missing from a checkpoint (the score head) are initialised from init_seed, not the global RNG."""
    _, path = saved_lm
    torch.manual_seed(1)
    a = build_reward_model(ModelSpec(path=path, init_seed=0), tokenizer.pad_token_id)
    torch.manual_seed(2)
    b = build_reward_model(ModelSpec(path=path, init_seed=0), tokenizer.pad_token_id)
    assert torch.equal(a.score.weight, b.score.weight)


def test_default_optimizer_is_fused_adamw_with_the_updates_of_foreach(tiny_gpt2_config):
    """The default optimizer is AdamW at lr 1e-5 on torch's fused kernel; three steps move the weights as the
    ``foreach`` implementation does, within float rounding (and by far more than that)."""
    fused_model = build_causal_lm(ModelSpec(config=tiny_gpt2_config, init_seed=3))
    foreach_model = build_causal_lm(ModelSpec(config=tiny_gpt2_config, init_seed=3))
    start = {k: v.clone() for k, v in fused_model.state_dict().items()}
    fused = default_optimizer(fused_model.parameters())
    foreach = torch.optim.AdamW(foreach_model.parameters(), lr=1e-5, foreach=True)
    assert type(fused) is torch.optim.AdamW and fused.defaults["fused"] and fused.defaults["lr"] == 1e-5
    generator = torch.Generator().manual_seed(0)
    for _ in range(3):
        for a, b in zip(fused_model.parameters(), foreach_model.parameters()):
            a.grad = torch.randn(a.shape, generator=generator)
            b.grad = a.grad.clone()
        fused.step()
        foreach.step()
    for (name, a), b in zip(fused_model.named_parameters(), foreach_model.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-9, msg=name)
        assert (a - start[name]).abs().max() > 2e-5  # three steps of about lr each: the comparison is not vacuous


def test_bfloat16_dtype(tiny_gpt2_config):
    """dtype='bfloat16' gives bf16 parameters, value head included; values come back as float32."""
    critic = build_critic(ModelSpec(config=tiny_gpt2_config, dtype="bfloat16"))
    assert {p.dtype for p in critic.parameters()} == {torch.bfloat16}
    ids = torch.tensor([[5, 6, 7]])
    mask = torch.ones_like(ids)
    assert critic(ids, mask, position_ids_from_mask(mask)).dtype == torch.float32


def test_dropout_is_disabled(tiny_gpt2_config):
    """A config with 0.5 dropout everywhere gives p == 0 on every nn.Dropout, and train-mode forwards agree."""
    tiny_gpt2_config.update(resid_pdrop=0.5, embd_pdrop=0.5, attn_pdrop=0.5, summary_first_dropout=0.5)
    spec = ModelSpec(config=tiny_gpt2_config)
    for model in (build_causal_lm(spec), build_critic(spec), build_reward_model(spec, 0)):
        dropouts = [m for m in model.modules() if isinstance(m, nn.Dropout)]
        assert len(dropouts) >= 3
        assert all(m.p == 0.0 for m in dropouts)
    actor = build_causal_lm(spec)
    actor.train()
    ids = torch.tensor([[5, 6, 7, 8, 9]])
    with torch.no_grad():
        assert torch.equal(actor(input_ids=ids).logits, actor(input_ids=ids).logits)


def test_attention_dropout_is_disabled():
    """A Llama-style model with ``attention_dropout`` 0.5 (dropout inside the attention kernel, no nn.Dropout): off,
    and train-mode forwards agree."""
    from transformers import LlamaConfig

    config = LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                         num_key_value_heads=2, vocab_size=64, attention_dropout=0.5).to_dict()
    actor = build_causal_lm(ModelSpec(config=config))
    assert [m.attention_dropout for m in actor.modules() if hasattr(m, "attention_dropout")] == [0.0]
    actor.train()
    ids = torch.tensor([[5, 6, 7, 8, 9]])
    with torch.no_grad():
        assert torch.equal(actor(input_ids=ids).logits, actor(input_ids=ids).logits)


def test_load_tokenizer_from_saved_directory(tokenizer, tmp_path):
    """A tokenizer saved with save_pretrained loads back with the same special tokens, padding side and ids."""
    tokenizer.save_pretrained(tmp_path / "tok")
    loaded = load_tokenizer(str(tmp_path / "tok"))
    assert isinstance(loaded, PreTrainedTokenizerBase)
    assert (loaded.pad_token_id, loaded.bos_token_id, loaded.eos_token_id) == (0, 1, 2)
    assert loaded.padding_side == "left"
    assert len(loaded) == 512
    text = "list some fruit: apple banana"
    assert loaded(text, add_special_tokens=False)["input_ids"] == tokenizer(text, add_special_tokens=False)["input_ids"]


def test_load_tokenizer_from_import_path(tokenizer):
    """An import path to a builder function is called; a tokenizer instance passes through unchanged."""
    built = load_tokenizer("lightning_app_rlhf.demo:build_tokenizer")
    assert (built.pad_token_id, built.eos_token_id, len(built)) == (0, 2, 512)
    assert built("red blue")["input_ids"] == tokenizer("red blue")["input_ids"]
    assert load_tokenizer(tokenizer) is tokenizer


def test_load_tokenizer_bad_targets():
    """A non-importable target or a non-tokenizer target raises naming the expected form."""
    with pytest.raises(ValueError, match="package.module:name"):
        load_tokenizer("no_such_package_xyz:build")
    with pytest.raises(TypeError, match="not a Hugging Face tokenizer"):
        load_tokenizer("lightning_app_rlhf.demo:prompts")


def test_as_model_spec_and_resolve_import(saved_lm):
    """Specs come from a ModelSpec, a dict or a path; import paths work with ':' or '.'."""
    _, path = saved_lm
    spec = ModelSpec(path=path)
    assert as_model_spec(spec) is spec
    assert as_model_spec(path).path == path
    assert as_model_spec({"config": {"model_type": "gpt2"}, "init_seed": 3}).init_seed == 3
    from lightning_app_rlhf import demo

    assert resolve_import("lightning_app_rlhf.demo:topic_reward") is demo.topic_reward
    assert resolve_import("lightning_app_rlhf.demo.topic_reward") is demo.topic_reward
    with pytest.raises(ValueError, match="is not an import path"):
        resolve_import("nodots")
