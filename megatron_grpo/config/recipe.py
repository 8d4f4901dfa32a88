"""Recipe loading: YAML with ``defaults:`` inheritance, interpolation and ``key=value`` overrides."""

from __future__ import annotations

import dataclasses
import os
from typing import List, Sequence

from megatron_grpo.config.schema import Config, check_keys, from_dict


def _load_tree(path: str, seen: List[str]):
    from omegaconf import OmegaConf

    path = os.path.abspath(path)
    if not os.path.isfile(path):
        raise FileNotFoundError(f"recipe not found: {path}")
    if path in seen:
        raise ValueError(f"recipe {path}: circular 'defaults:' ({' -> '.join(seen + [path])})")
    try:
        node = OmegaConf.load(path)
    except Exception as exc:  # noqa: BLE001 - YAML errors come in several types
        mark = getattr(exc, "problem_mark", None)  # the position only: never echo a file's content
        where = f" (line {mark.line + 1}, column {mark.column + 1})" if mark is not None else ""
        raise ValueError(f"recipe {path}: not a recipe: cannot parse it as YAML{where}") from None
    if node is not None and not OmegaConf.is_dict(node):
        raise ValueError(f"recipe {path}: not a recipe (expected a YAML mapping of config sections)")
    _check_is_recipe(path, node)
    defaults = node.pop("defaults", None) if node else None
    bases = [] if defaults is None else ([defaults] if isinstance(defaults, str) else list(defaults))
    merged = OmegaConf.create({})
    for base in bases:
        base_path = base if os.path.isabs(base) else os.path.join(os.path.dirname(path), base)
        merged = OmegaConf.merge(merged, _load_tree(base_path, seen + [path]))
    return OmegaConf.merge(merged, node or {})


def _check_is_recipe(path: str, node) -> None:
    """A file none of whose top-level keys is a config section (or ``defaults``) is not a recipe:
    say so without echoing its content (``defaults: /etc/passwd`` must not print the file)."""
    keys = list(node.keys()) if node else []
    known = {f.name for f in dataclasses.fields(Config)} | {"defaults"}
    if keys and not any(k in known for k in keys):
        raise ValueError(f"recipe {path}: not a recipe (none of its top-level keys is a config section: "
                         f"{', '.join(sorted(known))})")


def load_recipe(path: str, overrides: Sequence[str] = ()) -> Config:
    """The validated ``Config`` of recipe ``path`` with ``key=value`` ``overrides`` applied."""
    from omegaconf import OmegaConf

    tree = _load_tree(path, [])
    for item in overrides:
        if "=" not in item:
            raise ValueError(f"override {item!r} is not key=value")
    if overrides:
        over = OmegaConf.from_dotlist(list(overrides))
        check_keys(Config, OmegaConf.to_container(over, resolve=False), source="command-line overrides")
        tree = OmegaConf.merge(tree, over)
    data = OmegaConf.to_container(tree, resolve=True)
    return from_dict(Config, data, source=f"{path}{' + overrides' if overrides else ''}")
