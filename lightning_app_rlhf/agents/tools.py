"""Tools: plain Python functions with type hints and docstrings, shown to the model through its chat template, called
from the tool calls in its turns, and :class:`ToolEnvironment`, the ready environment built from a list of them.
Plain Python.

A tool call is read with transformers' own response parsing (``tokenizer.parse_response``) where the tokenizer has a
response schema. Where it has none (SmolLM2's template, for one, ignores ``tools``), the fallback is the Hermes
format most open models are trained on (Qwen2.5, Hermes, Llama-3-Groq): the prompt lists the tools' JSON schemas in
``<tools></tools>``, and the model writes ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``.
"""

from __future__ import annotations

import json
import re
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from transformers.utils import get_json_schema

from lightning_app_rlhf.agents.environment import Environment, Messages, StepResult

TOOL_CALL = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.DOTALL)
"""The fallback format's tool call: a JSON object between ``<tool_call>`` tags."""


@dataclass(frozen=True)
class ToolCall:
    """One call the model wrote: a tool's name and its arguments; ``error`` when the call could not be read."""

    name: str
    arguments: dict[str, Any]
    error: str | None = None


def tool_schemas(tools: Sequence[Callable[..., Any]]) -> list[dict[str, Any]]:
    """The JSON schema of each tool, by transformers' ``get_json_schema`` (what ``apply_chat_template(tools=)``
    renders): a tool without type hints or an ``Args:`` docstring is refused there, with its message."""
    return [get_json_schema(tool) for tool in tools]


def template_renders_tools(tokenizer: Any) -> bool:
    """Whether the tokenizer's chat template reads ``tools`` (else they go into a system message, see
    :func:`tools_system_prompt`)."""
    template = tokenizer.chat_template
    texts = template.values() if isinstance(template, dict) else [template or ""]
    return any("tools" in text for text in texts)


def tools_system_prompt(tools: Sequence[Callable[..., Any]]) -> str:
    """The fallback's tool description (Hermes' wording), for a chat template that does not render tools."""
    schemas = "\n".join(json.dumps(schema) for schema in tool_schemas(tools))
    return ("You may call one or more functions to assist with the user query.\n\nYou are provided with function "
            f"signatures within <tools></tools> XML tags:\n<tools>\n{schemas}\n</tools>\n\nFor each function call, "
            "return a json object with function name and arguments within <tool_call></tool_call> XML tags:\n"
            '<tool_call>\n{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call>')


def parse_tool_calls(text: str, tokenizer: Any) -> list[ToolCall]:
    """The tool calls in an assistant turn: by ``tokenizer.parse_response`` where the tokenizer has a response schema,
    else in the fallback format. A call that cannot be read is kept, with its ``error``, so that the model is told."""
    if getattr(tokenizer, "response_schema", None):
        parsed = tokenizer.parse_response(text)
        return [_from_parsed(call) for call in (parsed.get("tool_calls") or [])]
    calls = []
    for body in TOOL_CALL.findall(text):
        try:
            call = json.loads(body)
        except json.JSONDecodeError as err:
            calls.append(ToolCall("", {}, f"the tool call is not valid JSON ({err.msg} at character {err.pos})"))
            continue
        calls.append(_from_parsed(call) if isinstance(call, dict) else
                     ToolCall("", {}, 'a tool call must be a JSON object {"name": ..., "arguments": {...}}'))
    return calls


def _from_parsed(call: dict[str, Any]) -> ToolCall:
    function = call.get("function", call)  # OpenAI's {"type": "function", "function": {...}} or the bare object
    name, arguments = function.get("name"), function.get("arguments", {})
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except json.JSONDecodeError:
            return ToolCall(str(name), {}, "the arguments are not a JSON object")
    if not isinstance(name, str) or not isinstance(arguments, dict):
        return ToolCall(str(name), {}, 'a tool call needs a string "name" and an object of "arguments"')
    return ToolCall(name, arguments)


def call_tool(call: ToolCall, tools: dict[str, Callable[..., Any]]) -> tuple[str, bool]:
    """Run one call: ``(the tool message's content, whether it failed)``. A failure (an unreadable call, an unknown
    tool, wrong arguments, or the tool raising) becomes the content, ``Error: ...``, so the model can react; the
    run goes on."""
    if call.error is not None:
        return f"Error: {call.error}.", True
    tool = tools.get(call.name)
    if tool is None:
        return f"Error: there is no tool {call.name!r}; the tools are {sorted(tools)}.", True
    try:
        return str(tool(**call.arguments)), False
    except Exception as err:  # noqa: BLE001 - any failure of the user's tool is the model's observation
        _report_first_tool_error(call.name, err)
        return f"Error: {type(err).__name__}: {err}", True


_tool_error_reported = False


def _report_first_tool_error(name: str, error: Exception) -> None:
    """Warn about the first tool of this process that raises: the model reads the error as the tool's answer, and
    ``episode/tool_errors`` counts them, but a bug in the tool itself would otherwise go unseen in the console."""
    global _tool_error_reported
    if _tool_error_reported:
        return
    _tool_error_reported = True
    warnings.warn(f"The tool {name!r} raised {type(error).__name__}: {error}. The model gets this error as the tool's "
                  "answer and the run goes on; episode/tool_errors counts the errors (this is the first, printed "
                  "once).", stacklevel=2)


class ToolEnvironment(Environment):
    """The ready environment of a tool-using task: the row's prompt opens the episode; each assistant turn's tool calls
    run and their results are the observation (one ``tool`` message per call); a turn without a tool call is the
    final answer and ends the episode. The environment gives no reward of its own: the run's reward function scores
    the final answer (it gets the final turn's text).

    Args:
        tools: The functions the model may call (type hints and an ``Args:`` docstring each).
        system_prompt: A system message put first when the row's prompt has none.
        describe_tools: Render the tools into the prompt (the chat template's ``tools``, or the Hermes description
            for a template without them). ``False``: the prompt itself shows how to call them (e.g. a solved
            example), and the calls still run.
    """

    def __init__(self, tools: Sequence[Callable[..., Any]], system_prompt: str | None = None,
                 describe_tools: bool = True) -> None:
        if not tools:
            raise ValueError("ToolEnvironment needs at least one tool: pass tools=[my_function, ...].")
        tool_schemas(tools)  # refuses a tool transformers cannot describe, with its message, before any episode
        self.tools = list(tools) if describe_tools else []  # what the prompt shows
        self.by_name = {tool.__name__: tool for tool in tools}  # what the calls can reach
        self.system_prompt = system_prompt

    def reset(self, row: dict[str, Any]) -> Messages:
        prompt = row["prompt"]
        messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else [dict(m) for m in prompt]
        if self.system_prompt is not None and messages[0]["role"] != "system":
            messages.insert(0, {"role": "system", "content": self.system_prompt})
        return messages

    def step(self, assistant_text: str) -> StepResult:
        calls = parse_tool_calls(assistant_text, self.tokenizer)
        if not calls:
            return StepResult(done=True)
        observation, errors = [], 0
        for call in calls:
            content, failed = call_tool(call, self.by_name)
            errors += failed
            observation.append({"role": "tool", "name": call.name, "content": content})
        return StepResult(observation, 0.0, False, {"tool_calls": len(calls), "tool_errors": errors})
