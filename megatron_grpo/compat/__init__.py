"""Version-dependent calls into third-party internals, one small shim each, and nowhere else.

- ``compat.megatron``: Megatron-Core (0.16.1 on Python 3.11; 0.19.x on Python >= 3.12, the
  versions CI's two lanes test; pyproject pins that range);
- ``compat.vllm``: vLLM's weight-transfer and layerwise-reload internals (0.32-0.33).

Each shim's docstring names the versions and what differs ("0.16.1: X; 0.19: Y"). These modules
import only third-party packages, each inside the shim that needs it, so importing them is free.
"""
