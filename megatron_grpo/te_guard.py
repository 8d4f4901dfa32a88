"""A half-installed Transformer Engine must not break ``import megatron.core``.

Megatron-Core guards its TE imports with ``except ImportError``; a TE whose wheel is present but
whose CUDA library or build is broken raises ``RuntimeError`` / ``OSError`` / ``FileNotFoundError``
instead, and then every Megatron import fails. ``install()`` (run when ``megatron_grpo`` is
imported) adds a meta-path hook that, the first time anything imports ``megatron``, probes TE with
``except Exception``; a broken TE is then hidden (``sys.modules[...] = None``, which makes later
imports raise ``ImportError``), so Megatron falls back to its local layers with a warning. Nothing
is imported when TE is absent (CPU machines) or until Megatron is imported.
"""

from __future__ import annotations

import importlib.abc
import importlib.util
import logging
import sys

logger = logging.getLogger(__name__)

MODULES = ("transformer_engine", "transformer_engine.pytorch", "transformer_engine_torch")
broken: str = ""
"""Why TE was hidden ("" when it was not)."""


def probe() -> None:
    """Imports TE once; on any failure other than its absence, hides it from every later import."""
    global broken
    if any(name in sys.modules for name in MODULES) or importlib.util.find_spec("transformer_engine") is None:
        return
    try:
        import transformer_engine.pytorch  # noqa: F401
    except Exception as exc:  # noqa: BLE001 - RuntimeError, OSError, FileNotFoundError ...: all mean "no TE"
        broken = f"{type(exc).__name__}: {exc}"
        for name in [n for n in sys.modules if n.split(".")[0] in ("transformer_engine", "transformer_engine_torch")]:
            del sys.modules[name]
        for name in MODULES:
            sys.modules[name] = None  # later imports raise ImportError, which Megatron handles
        logger.warning("Transformer Engine is installed but does not import (%s); hidden, so Megatron-Core uses "
                       "its local layers", broken)


class _BeforeMegatron(importlib.abc.MetaPathFinder):
    """Runs ``probe`` the first time ``megatron`` is imported, then leaves the import to the other finders."""

    def find_spec(self, name, path=None, target=None):
        if name == "megatron" or name.startswith("megatron."):
            uninstall()
            probe()
        return None


_HOOK = _BeforeMegatron()


def install() -> None:
    if "megatron.core" not in sys.modules and _HOOK not in sys.meta_path:
        sys.meta_path.insert(0, _HOOK)


def uninstall() -> None:
    if _HOOK in sys.meta_path:
        sys.meta_path.remove(_HOOK)
