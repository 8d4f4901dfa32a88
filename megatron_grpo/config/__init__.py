"""The recipe schema and its loading: one dataclass per component, YAML with ``defaults:`` inheritance.

Imports nothing heavy (no megatron.core, no vLLM): ``--help``, ``--dry-run`` and recipe validation use it.
"""
