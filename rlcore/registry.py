"""Named extension points: one small registry class for every "name in the job spec -> code" table
(advantage estimators, policy losses, aggregation modes, KL estimators and controllers, rollout
corrections).

A registry reads like a dict (``registry[name]``, ``name in registry``, ``list(registry)`` in
registration order) and adds what a plain dict does not: registering a name twice is an error (a
second plug-in can not silently replace the first), an unknown name is an error naming the config key
and the valid names, and each entry may declare metadata (e.g. what an estimator needs) next to its
code, where it cannot drift out of sync with a separate table.
"""
from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Callable, Generic, Iterator, Optional, TypeVar

T = TypeVar("T")


class DuplicateNameError(ValueError):
    """A name registered twice."""


class UnknownNameError(KeyError, ValueError):
    """A name that is not registered. A KeyError, as a Mapping's lookup raises; a ValueError, as the
    callers that check a user's choice raise."""

    def __str__(self) -> str:  # KeyError would show the message in quotes
        return str(self.args[0])


class Registry(Mapping, Generic[T]):
    """``key``: the dotted config key that names an entry (``algorithm.adv_estimator``), for messages.
    ``meta``: the type of the metadata each entry declares (called with the keywords given at
    registration, so a misspelt keyword is an error); None: entries declare none."""

    def __init__(self, key: str, meta: Optional[Callable[..., Any]] = None):
        self.key = key
        self._meta_type = meta
        self._entries: dict[str, T] = {}
        self._meta: dict[str, Any] = {}

    def add(self, name: str, obj: T, **meta) -> T:
        if name in self._entries:
            raise DuplicateNameError(f"{self.key}: {name!r} is already registered")
        if meta and self._meta_type is None:
            raise TypeError(f"{self.key}: entries declare no metadata, got {sorted(meta)}")
        self._meta[name] = self._meta_type(**meta) if self._meta_type is not None else None
        self._entries[name] = obj
        return obj

    def register(self, name: str, **meta) -> Callable[[T], T]:
        """Decorator form of ``add``."""
        return lambda obj: self.add(name, obj, **meta)

    def check(self, name: str, key: Optional[str] = None) -> None:
        """Raise ``UnknownNameError`` unless ``name`` is registered; ``key`` names the config key when
        it is not the registry's own (one registry may serve several keys)."""
        if name not in self._entries:
            raise UnknownNameError(f"{key or self.key}={name!r} is not one of: {', '.join(self._entries)}")

    def meta(self, name: str) -> Any:
        """The metadata ``name`` declared when it was registered."""
        self.check(name)
        return self._meta[name]

    def __getitem__(self, name: str) -> T:
        self.check(name)
        return self._entries[name]

    def __contains__(self, name: object) -> bool:
        return name in self._entries

    def __iter__(self) -> Iterator[str]:
        return iter(self._entries)

    def __len__(self) -> int:
        return len(self._entries)

    def __repr__(self) -> str:
        return f"Registry({self.key!r}, {list(self._entries)})"
