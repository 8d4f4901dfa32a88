"""A tiny name -> object registry used for every pluggable component.

Follows verl's ``register_policy_loss`` / ``get_policy_loss_fn`` pattern, with two
house rules: registering a name twice is an error (nothing is silently overwritten)
and an unknown name is a ``ValueError`` that lists the valid choices. Heavy backends
(vLLM, Transformer Engine) register a ``"module:attr"`` string that is imported only
when the name is looked up.
"""

from __future__ import annotations

import importlib
from typing import Any, Callable, Dict, List, TypeVar

T = TypeVar("T")


class Registry:
    """Maps names to objects (functions, classes) of one kind, e.g. ``"clip variant"``."""

    def __init__(self, kind: str):
        self.kind = kind
        self._entries: Dict[str, Any] = {}

    def register(self, name: str) -> Callable[[T], T]:
        """Decorator: ``@REGISTRY.register("name")``. Refuses duplicate names."""

        def decorator(obj: T) -> T:
            self.add(name, obj)
            return obj

        return decorator

    def add(self, name: str, obj: Any) -> None:
        """Registers ``obj`` (or a lazy ``"module:attr"`` string) under ``name``."""
        if not isinstance(name, str) or not name:
            raise ValueError(f"{self.kind} name must be a non-empty string, got {name!r}")
        if name in self._entries:
            raise ValueError(f"{self.kind} {name!r} is already registered")
        self._entries[name] = obj

    def get(self, name: str) -> Any:
        """Returns the object for ``name``; imports lazy entries on first use."""
        if name not in self._entries:
            raise ValueError(f"unknown {self.kind} {name!r}; valid choices: {', '.join(self.names())}")
        obj = self._entries[name]
        if isinstance(obj, str):
            obj = _import_dotted(obj)
            self._entries[name] = obj
        return obj

    def names(self) -> List[str]:
        """Sorted list of registered names."""
        return sorted(self._entries)

    def __contains__(self, name: object) -> bool:
        return name in self._entries


def _import_dotted(path: str) -> Any:
    """Imports ``"package.module:attr"``; raises ``ValueError`` naming the path on failure."""
    module_name, _, attr = path.partition(":")
    if not attr:
        raise ValueError(f"expected 'module:attribute', got {path!r}")
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise ValueError(f"cannot import {module_name!r} (from {path!r}): {exc}") from exc
    try:
        return getattr(module, attr)
    except AttributeError as exc:
        raise ValueError(f"module {module_name!r} has no attribute {attr!r} (from {path!r})") from exc
