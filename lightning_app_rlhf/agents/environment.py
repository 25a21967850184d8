"""The environment interface of multi-turn rollouts: the gym-style ``reset`` / ``step`` / ``close`` the field converged
on (SkyRL-gym's ``BaseTextEnv``, NeMo-RL, ROLL/GEM, OpenRLHF's agents). Plain Python.

An episode is one environment instance: ``reset(row)`` gives the task's opening chat messages from a dataset row;
each assistant turn's text goes to ``step``, which answers with the observation messages (a tool's result, a game's
state, a user's reply), a reward, and whether the episode is over. What the environment returns is checked here, so
that a wrong type is an error naming the class and the method, not a failure deep in tokenization.
"""

from __future__ import annotations

import numbers
from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from lightning_app_rlhf.models.roles import resolve_import

Messages = list[dict[str, Any]]
"""Chat messages, ``[{"role": "user", "content": "..."}, ...]``, as ``tokenizer.apply_chat_template`` takes them."""


@dataclass
class StepResult:
    """What :meth:`Environment.step` answers to one assistant turn."""

    observation: Messages = field(default_factory=list)
    """The messages that follow the assistant's turn (e.g. ``{"role": "tool", "content": "42"}``); empty when done."""
    reward: float = 0.0
    """This turn's reward; an episode's score is the sum of its turns' rewards (plus the run's reward function)."""
    done: bool = False
    """True: the episode ends after this turn."""
    info: dict[str, Any] = field(default_factory=dict)
    """Anything to count: ``tool_calls`` and ``tool_errors`` (ints) are summed per episode and logged."""


class Environment(ABC):
    """One episode of a multi-turn task. The engine makes one instance per episode (``G`` per prompt), on the ranks
    that generate, and calls ``reset`` once, ``step`` after every assistant turn until it answers ``done`` (or the
    turn or token limit ends the episode), then ``close``.

    Subclass it and implement :meth:`reset` and :meth:`step`; ``tools`` (plain functions with type hints and
    docstrings) are shown to the model through the tokenizer's chat template.
    """

    tools: Sequence[Callable[..., Any]] = ()
    """Functions the model may call, rendered into the prompt by the chat template (``apply_chat_template(tools=)``)."""
    tokenizer: Any = None
    """The actor's tokenizer, set by the engine before ``reset`` (to read tool calls with its response schema)."""

    @abstractmethod
    def reset(self, row: dict[str, Any]) -> Messages:
        """The episode's opening messages, from the dataset row (``row["prompt"]`` is the row's prompt as the
        dataset holds it, a string or messages; the row's other fields are its other keys)."""

    @abstractmethod
    def step(self, assistant_text: str) -> StepResult | tuple[Messages, float, bool, dict[str, Any]]:
        """Answer the assistant's turn (its text, special tokens dropped): a :class:`StepResult`, or the gym tuple
        ``(observation, reward, done, info)``."""

    def close(self) -> None:
        """Release what the episode holds (a sandbox, a connection). Called once per episode, also after an error."""


EnvironmentFactory = Callable[[], Environment]
"""What makes one episode's environment: an :class:`Environment` subclass, or any callable returning an instance."""


class EnvironmentTypeError(TypeError):
    """An environment returned something of the wrong type; the message names the class, the method and the fix."""


def checked_messages(messages: Any, where: str, allow_empty: bool) -> Messages:
    """``messages`` if they are a list of ``{"role": str, "content": str, ...}`` dicts, else :class:`EnvironmentTypeError`
    naming ``where`` (``Class.method``)."""
    if not isinstance(messages, list) or not all(isinstance(m, Mapping) for m in messages):
        raise EnvironmentTypeError(f"{where} returned {type(messages).__name__} {_short(messages)}; it must return a list "
                                'of chat messages, like [{"role": "user", "content": "..."}].')
    if not messages and not allow_empty:
        raise EnvironmentTypeError(f"{where} returned no messages: return at least one, like "
                                '[{"role": "user", "content": "..."}].')
    for i, message in enumerate(messages):
        if not isinstance(message.get("role"), str) or not isinstance(message.get("content"), str):
            raise EnvironmentTypeError(f"{where} returned message #{i} {_short(message)}: each message needs a string "
                                    '"role" and a string "content" (str() a tool\'s result).')
    return [dict(m) for m in messages]


def checked_step(returned: Any, where: str) -> StepResult:
    """A :class:`StepResult` from what ``step`` returned (one, or the gym tuple), its fields' types checked."""
    if isinstance(returned, tuple):
        if len(returned) != 4:
            raise EnvironmentTypeError(f"{where} returned a tuple of {len(returned)}; return StepResult(...) or the gym "
                                    "tuple (observation, reward, done, info).")
        returned = StepResult(*returned)
    if not isinstance(returned, StepResult):
        raise EnvironmentTypeError(f"{where} returned {type(returned).__name__} {_short(returned)}; return "
                                "StepResult(observation, reward, done, info) or the tuple (observation, reward, done, "
                                "info).")
    observation = checked_messages(returned.observation, where + " (its observation)", allow_empty=True)
    if isinstance(returned.reward, bool) or not isinstance(returned.reward, numbers.Real):
        raise EnvironmentTypeError(f"{where} returned reward {_short(returned.reward)}; the reward must be a number.")
    if not isinstance(returned.done, bool):
        raise EnvironmentTypeError(f"{where} returned done={_short(returned.done)}; done must be True or False.")
    info = {} if returned.info is None else returned.info
    if not isinstance(info, Mapping):
        raise EnvironmentTypeError(f"{where} returned info {_short(info)}; info must be a dict (or None).")
    if not returned.done and not observation:
        raise EnvironmentTypeError(f"{where} returned done=False with no observation: the model's next turn needs "
                                "something to answer (return messages), or end the episode (done=True).")
    return StepResult(observation, float(returned.reward), returned.done, dict(info))


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def as_environment(environment: Environment | EnvironmentFactory | str | None) -> Environment | None:
    """The prototype each episode copies: ``environment`` itself, or what a factory (an :class:`Environment` class or
    a callable, or its import path) returns when called without arguments."""
    if environment is None or isinstance(environment, Environment):
        return environment
    if isinstance(environment, str):  # an import path, as a checkpoint's hyperparameters hold the class
        environment = resolve_import(environment)
    if callable(environment):
        made = environment()
        if isinstance(made, Environment):
            return made
        raise EnvironmentTypeError(f"The environment factory {environment!r} returned {type(made).__name__}: it must "
                                   "return an Environment (subclass lightning_app_rlhf.agents.Environment).")
    raise EnvironmentTypeError(f"environment is {type(environment).__name__} {_short(environment)}: pass an Environment "
                               "(subclass lightning_app_rlhf.agents.Environment), a factory returning one, or on the "
                               "command line its class_path and init_args.")


def environment_rewards_only(prompts: list[str], responses: list[str]) -> list[float]:
    """The reward function of a run whose environment gives every reward: 0 for each episode, to which the engine
    adds the environment's rewards."""
    return [0.0] * len(responses)
