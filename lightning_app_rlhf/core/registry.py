"""Name -> entry registries for the extension points a setting selects by name. Plain Python: no Lightning, no torch.

A generation backend (``generation.backend``) and a placement preset (the planner's candidates, the strategies'
plans) are each one module that registers itself at import; the setting is a plain string checked against the
registry, so adding one touches no config type, no planner and no list of names.
"""

from __future__ import annotations

import difflib
from collections.abc import Iterator
from typing import Generic, TypeVar

T = TypeVar("T")


class Registry(Generic[T]):
    """Entries by name, in registration order (the order the planner evaluates presets in).

    Args:
        what: What a name selects, as an error names it: ``generation.backend``, ``placement preset``.
        how_to_register: The sentence that tells a user how to add a name, appended to an unknown name's error.
    """

    def __init__(self, what: str, how_to_register: str) -> None:
        self.what = what
        self.how_to_register = how_to_register
        self._entries: dict[str, T] = {}

    def register(self, name: str, entry: T) -> T:
        """Make ``name`` select ``entry``, replacing any entry of that name (so re-importing a module that registers
        does not fail, and a user's entry may stand in for a built-in one).

        Args:
            name: The name a setting selects it by: a non-empty string.
            entry: What the name selects.

        Returns:
            ``entry``.
        """
        if not isinstance(name, str) or not name:
            raise ValueError(f"A {self.what} is registered under a non-empty string name, got {name!r}.")
        self._entries[name] = entry
        return entry

    def unregister(self, name: str) -> T:
        """Remove ``name`` (e.g. a test's temporary entry) and return its entry."""
        return self._entries.pop(name) if name in self._entries else self._raise_unknown(name)

    def get(self, name: str) -> T:
        """The entry registered as ``name``.

        Raises:
            ValueError: ``name`` is not registered; the message lists the registered names, the closest one, and
                how to register another.
        """
        return self._entries[name] if name in self._entries else self._raise_unknown(name)

    def check(self, name: str) -> None:
        """Raise the error of :meth:`get` if ``name`` is not registered."""
        self.get(name)

    def names(self) -> list[str]:
        """The registered names, in registration order."""
        return list(self._entries)

    def entries(self) -> list[T]:
        """The registered entries, in registration order."""
        return list(self._entries.values())

    def __contains__(self, name: object) -> bool:
        return name in self._entries

    def __iter__(self) -> Iterator[str]:
        return iter(list(self._entries))

    def __len__(self) -> int:
        return len(self._entries)

    def _raise_unknown(self, name: object) -> T:
        close = difflib.get_close_matches(name, self.names(), n=1) if isinstance(name, str) else []
        suggestion = f" Did you mean {close[0]!r}?" if close else ""
        raise ValueError(f"{self.what} must be one of {self.names()}, got {name!r}.{suggestion} "
                         f"{self.how_to_register}")
