"""How a reward function is called: this package's positional convention or TRL's keywords, chosen once per function
from its signature, and checked against the dataset's fields before any generation.

- Positional (this package's): ``reward(prompts, responses, **fields)``. The two lists come positionally; the rows'
  other fields come by name when the function names them or takes ``**kwargs``.
- TRL's (``GRPOTrainer``'s ``reward_funcs``): ``reward(prompts=..., completions=..., completion_ids=...,
  **dataset_columns, trainer_state=...)``, everything by name. Chosen when the function has a parameter named
  ``completions``, or one named ``prompts`` and no room for a second positional argument (``(prompts, **kwargs)``).
  ``prompts`` and ``completions`` are plain text (TRL's standard format). Each keyword is passed only when the
  function names it or takes ``**kwargs`` (TRL would refuse ``(completions, answer)``; here it gets just those).

Plain Python, no torch.
"""

from __future__ import annotations

import inspect
import weakref
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

TRL_KEYS = ("prompts", "completions", "completion_ids", "trainer_state")
"""The keywords of TRL's call besides the dataset columns."""


class RewardSignatureError(ValueError):
    """A reward function's parameters cannot take what it would be called with: the message names the function, its
    signature, the dataset's fields and the fix."""


@dataclass(frozen=True)
class RewardState:
    """What a TRL-style reward function gets as ``trainer_state`` (TRL passes the ``transformers`` ``TrainerState``):
    the attribute reward functions read to shape by training progress."""

    global_step: int
    """The iteration being scored (0 outside training: validation, test, predict, profiling)."""


@dataclass(frozen=True)
class RewardSignature:
    """The calling convention of one reward function, read once from its signature (:meth:`of` caches it)."""

    signature: inspect.Signature | None
    """None: the callable has no signature Python can read (some builtins): it is called positionally, unchecked."""
    trl_style: bool
    """Everything by name, as TRL's ``GRPOTrainer`` calls it; else ``(prompts, responses, **fields)``."""

    @classmethod
    def of(cls, function: Callable[..., Any]) -> RewardSignature:
        """``function``'s convention, cached per function object (uncached when it cannot be weakly referenced)."""
        try:
            return _CACHE[function]
        except (KeyError, TypeError):
            pass
        found = cls._read(function)
        try:
            _CACHE[function] = found
        except TypeError:  # not hashable or not weakly referenceable: read again next time
            pass
        return found

    @classmethod
    def _read(cls, function: Callable[..., Any]) -> RewardSignature:
        try:
            signature = inspect.signature(function)
        except (TypeError, ValueError):  # builtins and some callables have no signature
            return cls(None, False)
        parameters = signature.parameters.values()
        names = {p.name for p in parameters if p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)}
        positional = [p for p in parameters if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
        takes_two = len(positional) >= 2 or any(p.kind is p.VAR_POSITIONAL for p in parameters)
        return cls(signature, "completions" in names or ("prompts" in names and not takes_two))

    @property
    def var_keyword(self) -> bool:
        """Whether the function takes ``**kwargs``."""
        return self.signature is not None and any(
            p.kind is p.VAR_KEYWORD for p in self.signature.parameters.values())

    def accepts(self, name: str) -> bool:
        """Whether the function takes a keyword argument ``name`` (by name, or through ``**kwargs``)."""
        if self.signature is None:
            return False
        parameter = self.signature.parameters.get(name)
        if parameter is not None:
            return parameter.kind in (parameter.POSITIONAL_OR_KEYWORD, parameter.KEYWORD_ONLY)
        return self.var_keyword

    def arguments(
        self,
        prompts: list[Any],
        completions: list[str],
        fields: Mapping[str, list[Any]],
        completion_ids: Callable[[], list[list[int]]] | None = None,
        iteration: int | None = None,
    ) -> tuple[tuple[Any, ...], dict[str, Any]]:
        """The positional and keyword arguments of one call.

        Args:
            prompts: The decoded prompts, one per completion.
            completions: The decoded completions (responses).
            fields: The rows' other fields, one list per name aligned with ``completions``; those the function does
                not take are left out.
            completion_ids: Builds the completions' token ids (without padding), called only when the function
                takes ``completion_ids`` (TRL-style).
            iteration: The iteration being scored, as ``trainer_state.global_step`` (TRL-style).
        """
        kwargs = {name: values for name, values in fields.items() if self.accepts(name)}
        if not self.trl_style:
            return (prompts, completions), kwargs
        kwargs = {name: values for name, values in kwargs.items() if name not in TRL_KEYS}  # TRL's own come next
        kwargs.update({key: value for key, value in (("prompts", prompts), ("completions", completions))
                       if self.accepts(key)})  # TRL passes both; a function that takes one only gets it alone
        if completion_ids is not None and self.accepts("completion_ids"):
            kwargs["completion_ids"] = completion_ids()
        if self.accepts("trainer_state"):
            kwargs["trainer_state"] = RewardState(iteration if iteration is not None else 0)
        return (), kwargs

    def check(self, function: Callable[..., Any], field_names: Iterable[str], where: str = "") -> None:
        """Bind representative arguments (one row with ``field_names``) without calling ``function``.

        Args:
            function: The reward function this signature was read from, named by the error.
            field_names: The dataset rows' fields besides the prompt.
            where: Which rows, for the message (e.g. ``"the training rows"``); empty: "the dataset rows".

        Raises:
            RewardSignatureError: The parameters cannot take the call: names the function, its signature, the
                fields and the fix.
        """
        if self.signature is None:
            return
        names = sorted(field_names)
        args, kwargs = self.arguments([""], [""], {name: [None] for name in names}, lambda: [[]], 0)
        try:
            self.signature.bind(*args, **kwargs)
        except TypeError as err:
            message = self._explain(function, names, kwargs, err, where or "the dataset rows")
            raise RewardSignatureError(message) from None

    def _explain(self, function: Callable[..., Any], fields: list[str], passed: Mapping[str, Any], err: TypeError,
                 where: str) -> str:
        assert self.signature is not None
        parameters = self.signature.parameters
        name = f"The reward function {_name_of(function, self.signature)}"
        convention = ("as TRL calls it: all by name (prompts=, completions=, the fields)" if self.trl_style else
                      "as (prompts, responses, **fields): the two lists positionally, the fields it names by name")
        required = [p for p in parameters.values()
                    if p.default is p.empty and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]
        slots = [p for p in parameters.values() if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
        filled = {p.name for p in slots[:0 if self.trl_style else 2]}
        missing = [p.name for p in required if p.name not in passed and p.name not in filled]
        clash = [p.name for p in slots[:0 if self.trl_style else 2] if p.name in passed]
        if missing:
            need = ", ".join(repr(m) for m in missing)
            return (f"{name} needs {need}, but {where} have the fields {fields} besides the prompt (it is called "
                    f"{convention}). Add {need} to every row, rename the parameter to one of the fields, or give it "
                    "a default.")
        if clash and clash[0] == slots[0].name:
            return (f"{name} takes the prompts positionally in its parameter {clash[0]!r} (it is called "
                    f"{convention}), but {clash[0]!r} is also a field of {where}, whose fields are {fields}. Rename "
                    "that field in the rows, or the parameter.")
        if clash:
            return (f"{name} takes the responses positionally in its parameter {clash[0]!r} (it is called "
                    f"{convention}), but {clash[0]!r} is also a field of {where}, whose fields are {fields}. Name the "
                    f"responses parameter `completions` for TRL's convention (e.g. `(completions, {clash[0]}, "
                    f"**kwargs)`), or write `(prompts, responses, {clash[0]})`.")
        var_positional = any(p.kind is p.VAR_POSITIONAL for p in parameters.values())
        if not self.trl_style and len(slots) < 2 and not var_positional:
            return (f"{name} cannot take the two lists (prompts, responses) positionally ({err}). Write "
                    "`(prompts, responses, **fields)`, or name TRL's keywords: `(completions, **kwargs)`.")
        return (f"{name} cannot be called {convention} on {where}, whose fields are {fields}: {err}. Fix its "
                "parameters.")


_CACHE: weakref.WeakKeyDictionary[Callable[..., Any], RewardSignature] = weakref.WeakKeyDictionary()


def _name_of(function: Any, signature: inspect.Signature) -> str:
    """``'module.name(parameters)'``, as the errors show a reward function."""
    name = getattr(function, "__qualname__", None) or type(function).__qualname__
    module = getattr(function, "__module__", None)
    return f"'{module}.{name}{signature}'" if module else f"'{name}{signature}'"


def check_reward_fields(function: Callable[..., Any], datasets: Sequence[tuple[str, Any]]) -> None:
    """Check at setup that ``function`` can take the fields of each dataset's rows (see
    :meth:`RewardSignature.check`).

    Args:
        function: The reward function.
        datasets: ``(description, dataset)`` pairs; a dataset without ``fields`` (a list of per-row dicts, as
            :class:`~lightning_app_rlhf.data.PromptDataset` has) is skipped.

    Raises:
        RewardSignatureError: ``function``'s parameters cannot take one dataset's call.
    """
    signature = RewardSignature.of(function)
    for where, dataset in datasets:
        rows = getattr(dataset, "fields", None)
        if isinstance(rows, list):
            signature.check(function, rows[0] if rows else {}, where)
