"""Name -> entry registries, as veRL's ``core_algos`` keeps its advantage estimators and policy losses: one for
algorithms, one for advantage estimators, one each for policy and value losses. Plain Python.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Generic, TypeVar

T = TypeVar("T")


class Registry(dict[str, T], Generic[T]):
    """A dict of registered entries that refuses a second entry under a taken name and, asked for an unknown name,
    says which names there are and how to add one.

    Args:
        kind: What an entry is, for messages (``"advantage estimator"``).
        decorator: The decorator that registers one, for messages (``"@register_advantage_estimator(name)"``).
        setting: Where a user picks an entry by name, for messages (``"Algorithm.advantage_estimator"``).
    """

    def __init__(self, kind: str, decorator: str, setting: str) -> None:
        super().__init__()
        self.kind, self.decorator, self.setting = kind, decorator, setting

    def add(self, name: str, entry: T) -> T:
        """Register ``entry`` as ``name`` and return it; the same entry again is a no-op (a module imported twice).

        Args:
            name: The name to find it by; one taken by another entry is refused (``ValueError``).
            entry: The function or class.
        """
        if name in self and self[name] is not entry:
            raise ValueError(
                f"A {self.kind} named {name!r} is registered already ({_describe(self[name])}): register "
                f"{_describe(entry)} under another name."
            )
        self[name] = entry
        return entry

    def decorator_for(self, name: str) -> Callable[[T], T]:
        """``@registry.decorator_for(name)``: register the decorated entry as ``name`` and return it unchanged.

        Args:
            name: The name to find it by; one taken by another entry is refused (``ValueError``).
        """
        return lambda entry: self.add(name, entry)

    def lookup(self, name: str) -> T:
        """The entry registered as ``name``; an unknown name raises a ``ValueError`` listing the registered ones.

        Args:
            name: A registered name.
        """
        if name not in self:
            raise ValueError(
                f"Unknown {self.kind} {name!r} ({self.setting}): choose one of {sorted(self)}, or register your own "
                f"with {self.decorator} before it is used."
            )
        return self[name]


def _describe(entry: object) -> str:
    module = getattr(entry, "__module__", None)
    name = getattr(entry, "__qualname__", None) or type(entry).__qualname__
    return f"{module}.{name}" if module else name
