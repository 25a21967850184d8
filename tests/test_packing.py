"""``ppo.padding_free``: the packed layout, checked by hand; packed log-probabilities, entropies and gradients against
the padded forward's on GPT-2 and Llama; and a run with it logging the padded run's values."""

import warnings
from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch
from helpers import make_module, metrics_rows
from lightning.pytorch.loggers import CSVLogger
from torch.testing import assert_close

from lightning_app_rlhf import GenerationConfig, PPOConfig, PromptDataModule, demo
from lightning_app_rlhf.algorithms import functional
from lightning_app_rlhf.generation import Rollout
from lightning_app_rlhf.models import calls
from lightning_app_rlhf.models.calls import Experience, policy_logprobs, reference_forward, response_logits
from lightning_app_rlhf.models.packing import PACKING_PAYS_BELOW, pack_rows
from lightning_app_rlhf.models.roles import ModelSpec, build_causal_lm

FAMILIES = {
    "gpt2": {"model_type": "gpt2", "n_layer": 2, "n_embd": 32, "n_head": 2, "vocab_size": 512, "n_positions": 64,
             "bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 0},
    "llama": {"model_type": "llama", "num_hidden_layers": 2, "hidden_size": 32, "num_attention_heads": 4,
              "num_key_value_heads": 2, "intermediate_size": 64, "vocab_size": 512, "max_position_embeddings": 64,
              "bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 0},
}


def batch_of(prompt_lengths: list[int], response_lengths: list[int], prompt_width: int, response_width: int,
             seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Random tokens (3..511) in left-padded prompts followed by right-padded responses; pads are token 0."""
    generator = torch.Generator().manual_seed(seed)
    sequences = torch.randint(3, 512, (len(prompt_lengths), prompt_width + response_width), generator=generator)
    mask = torch.zeros_like(sequences)
    for row, (prompt, response) in enumerate(zip(prompt_lengths, response_lengths)):
        mask[row, prompt_width - prompt : prompt_width + response] = 1
    return sequences * mask, mask


def test_pack_rows_lays_each_rows_real_tokens_end_to_end():
    """Rows of 5, 2 and 3 real tokens (10 of 15 positions) go into rows of 5 (the longest), first fit decreasing:
    [row 0], [row 2, row 1]. Positions restart per sequence; a response token at padded column c is predicted from
    column c - 1's slot."""
    sequences = torch.tensor([[11, 12, 13, 14, 15],   # prompt 11 12 13, response 14 15
                              [0, 0, 21, 22, 0],      # prompt 21, response 22, then a pad
                              [0, 31, 32, 33, 0]])    # prompt 31 32, response 33
    mask = (sequences > 0).long()
    packed = pack_rows(sequences, mask, prompt_length=3)
    assert packed.input_ids.tolist() == [[11, 12, 13, 14, 15], [31, 32, 33, 21, 22]]
    assert packed.position_ids.tolist() == [[0, 1, 2, 3, 4], [0, 1, 2, 0, 1]]
    # Predicting slots: row 0 -> (0, 2), (0, 3); row 1 -> (1, 3); row 2 -> (1, 1). Columns kept: 1, 2, 3.
    assert packed.logits_columns.tolist() == [1, 2, 3]
    assert packed.tokens.tolist() == [14, 15, 22, 33]
    assert packed.response_index.tolist() == [0, 1, 2, 4]  # flat into [3 rows, 2 response columns]
    assert packed.logits_index.tolist() == [0 * 3 + 1, 0 * 3 + 2, 1 * 3 + 2, 1 * 3 + 0]
    assert packed.shape == (3, 2)


def test_pack_rows_declines_a_row_with_a_hole_or_no_prompt():
    sequences = torch.tensor([[5, 6, 7, 8]])
    assert pack_rows(sequences, torch.tensor([[1, 0, 1, 1]]), prompt_length=2) is None  # not one span
    assert pack_rows(sequences, torch.tensor([[0, 0, 1, 1]]), prompt_length=2) is None  # no prompt token
    assert pack_rows(sequences, torch.tensor([[0, 1, 1, 1]]), prompt_length=2) is not None


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_padding_free_gives_the_padded_numbers_and_gradients(family):
    """Uneven prompts and responses (one response empty, one full): log-probabilities, entropies and every
    parameter's gradient of a masked loss match the padded forward's at temperature 0.7; the reference's scoring
    forward too, in chunks of 3 rows."""
    model = build_causal_lm(ModelSpec(config=FAMILIES[family], init_seed=0))
    sequences, mask = batch_of([5, 2, 7, 1, 4, 7], [3, 9, 0, 1, 9, 5], prompt_width=7, response_width=9)
    assert pack_rows(sequences, mask, prompt_length=7) is not None  # 5 x 13 packed positions of 6 x 16
    experience = Experience(sequences=sequences, attention_mask=mask, response_mask=mask[:, 7:],
                            logprobs=torch.zeros(6, 9), values=torch.zeros(6, 9), advantages=torch.zeros(6, 9),
                            returns=torch.zeros(6, 9), prompt_length=7, iteration=0)
    response_mask = mask[:, 7:].bool()
    weights = torch.randn(6, 9, generator=torch.Generator().manual_seed(1))

    def run(padding_free: bool) -> tuple[torch.Tensor, torch.Tensor, list[torch.Tensor]]:
        model.zero_grad()
        logprobs, entropy = policy_logprobs(model, experience, 0.7, entropy_grad=True, padding_free=padding_free)
        ((logprobs + 0.1 * entropy) * weights * response_mask).sum().backward()
        return logprobs.detach(), entropy.detach(), [p.grad.clone() for p in model.parameters()]

    (padded_lp, padded_entropy, padded_grads), (free_lp, free_entropy, free_grads) = run(False), run(True)
    assert_close(free_lp * response_mask, padded_lp * response_mask, rtol=0, atol=1e-5)
    assert_close(free_entropy * response_mask, padded_entropy * response_mask, rtol=0, atol=1e-5)
    assert (free_lp[~response_mask] == 0).all() and (free_entropy[~response_mask] == 0).all()
    for free, padded in zip(free_grads, padded_grads, strict=True):
        assert_close(free, padded, rtol=1e-4, atol=1e-6)

    rollout = Rollout(sequences=sequences, attention_mask=mask, response_mask=mask[:, 7:],
                      logprobs=torch.zeros(6, 9), prompt_length=7)
    with torch.no_grad():
        logits = response_logits(model, sequences, mask, 7)
        expected = functional.logprobs_from_logits(logits[:, :-1], sequences[:, 7:], 0.7) * mask[:, 7:]
    for batch_size in (None, 3):
        got = reference_forward(model, rollout, 0.7, batch_size=batch_size, padding_free=True)
        assert_close(got, expected, rtol=0, atol=1e-5)


def run_grpo(tmp_path: Path, name: str, padding_free: bool) -> list[dict[str, float]]:
    """Three GRPO iterations of the demo task (G=4, a k3 KL to the reference in the loss, 2 epochs x 2
    minibatches), logged to CSV."""
    module = make_module(algorithm="grpo", generation=GenerationConfig(max_new_tokens=16, num_samples=4),
                         ppo=PPOConfig(ppo_epochs=2, num_minibatches=2, kl_coef=0.0, kl_loss_coef=0.01,
                                       padding_free=padding_free))
    trainer = pl.Trainer(max_steps=3, accelerator="cpu", logger=CSVLogger(tmp_path, name=name), log_every_n_steps=1,
                         enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*num_workers.*")
        trainer.fit(module, datamodule=PromptDataModule(prompts=demo.prompts(), tokenizer=module.tokenizer,
                                                        batch_size=3))
    return [row for row in metrics_rows(tmp_path / name) if "reward/mean" in row]


def test_a_run_with_padding_free_logs_the_padded_runs_values(tmp_path, monkeypatch):
    """GRPO on the demo task, the actor's training and the reference's scoring forwards packed (every batch, so that
    the packed path runs whatever the lengths): every logged value matches the padded run's within float rounding."""
    packed_batches = []

    def counting_pack_rows(*args):
        packed = pack_rows(*args, only_where_it_pays=False)
        packed_batches.append(packed is not None)
        return packed

    padded = run_grpo(tmp_path, "padded", padding_free=False)
    assert not packed_batches
    monkeypatch.setattr(calls, "pack_rows", counting_pack_rows)
    free = run_grpo(tmp_path, "padding_free", padding_free=True)
    # Per iteration: one reference forward, then 2 epochs x 2 minibatches of the actor.
    assert packed_batches == [True] * 15
    assert len(padded) == len(free) == 3
    for got, want in zip(free, padded, strict=True):
        assert set(got) == set(want)
        for name, value in want.items():
            if not name.startswith(("time/", "perf/", "memory/")):
                assert got[name] == pytest.approx(value, rel=1e-4, abs=1e-5), name


def test_pack_rows_keeps_a_batch_padded_where_packing_would_not_pay():
    """Packing that would keep more than PACKING_PAYS_BELOW of the positions is not worth its mask and gathers; nor
    is one that runs the LM head at more positions than the padded forward (long, uneven prompts before one-token
    answers: the padded head runs at 2 positions per row, the packed one at every column that predicts an answer)."""
    sequences, mask = batch_of([5, 6, 7, 7], [9, 9, 8, 9], prompt_width=7, response_width=9)  # 60 of 64 real
    assert pack_rows(sequences, mask, prompt_length=7) is None
    sequences, mask = batch_of([2, 9, 3, 8, 12, 1, 11, 4], [1] * 8, prompt_width=12, response_width=1)
    assert mask.sum() <= PACKING_PAYS_BELOW * mask.numel()
    assert pack_rows(sequences, mask, prompt_length=12) is None
    assert pack_rows(*batch_of([5, 3, 3, 3], [9, 1, 1, 2], prompt_width=7, response_width=9), prompt_length=7)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_padding_free_on_cuda_gives_the_padded_numbers(family):
    """On a GPU (sdpa's CUDA kernels with the packed block-diagonal mask): the padded log-probabilities, entropies
    and gradients, in float32, and under bf16 autocast within bf16's rounding."""
    model = build_causal_lm(ModelSpec(config=FAMILIES[family], init_seed=0)).cuda()
    sequences, mask = (t.cuda() for t in batch_of([5, 2, 7, 1, 4, 7], [3, 9, 0, 1, 9, 5], 7, 9))
    zeros = torch.zeros(6, 9, device="cuda")
    experience = Experience(sequences=sequences, attention_mask=mask, response_mask=mask[:, 7:], logprobs=zeros,
                            values=None, advantages=zeros, returns=None, prompt_length=7, iteration=0)
    valid = mask[:, 7:].bool()
    for dtype, atol in ((None, 1e-4), (torch.bfloat16, 0.1)):
        results = []
        for padding_free in (False, True):
            model.zero_grad()
            with torch.autocast("cuda", dtype=dtype or torch.float32, enabled=dtype is not None):
                logprobs, entropy = policy_logprobs(model, experience, 1.0, padding_free=padding_free)
            (logprobs * valid).sum().backward()
            results.append((logprobs.detach() * valid, entropy.detach() * valid,
                            [p.grad.float().clone() for p in model.parameters()]))
        (padded_lp, padded_entropy, padded_grads), (free_lp, free_entropy, free_grads) = results
        assert_close(free_lp, padded_lp, rtol=0, atol=atol)
        assert_close(free_entropy, padded_entropy, rtol=0, atol=atol)
        if dtype is None:
            for free, padded in zip(free_grads, padded_grads, strict=True):
                assert_close(free, padded, rtol=1e-3, atol=1e-5)
