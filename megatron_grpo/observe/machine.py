"""What a machine offers a run: versions, the device, free disk, whether a module imports (used by
``tools/cluster/gpu_check.py``'s preflight). torch is imported only by :func:`device_info`; nothing of the rest of
the package is imported."""

from __future__ import annotations

import importlib
import importlib.util
import os
import shutil
import time
from typing import Dict


def import_probe(module: str) -> Dict:
    """Imports ``module`` (any exception counts: a half-installed package raises more than ImportError)."""
    start = time.perf_counter()
    try:
        mod = importlib.import_module(module)
    except Exception as exc:  # noqa: BLE001 - the reason is the result
        return {"ok": False, "error": f"{type(exc).__name__}: {exc}"}
    version = getattr(mod, "__version__", None)
    if module == "megatron.core":
        version = importlib.import_module("megatron.core.package_info").__version__
    return {"ok": True, "version": version, "path": os.path.dirname(getattr(mod, "__file__", "") or ""),
            "seconds": round(time.perf_counter() - start, 2)}


def optional_probe(package: str, module: str, cuda: bool) -> Dict:
    """Present or not, without importing what is absent (vLLM's import alone costs ~20 s: not imported)."""
    if importlib.util.find_spec(package) is None:
        return {"installed": False, "usable": False, "why": f"{package} is not installed"}
    if package == "vllm":
        return {"installed": True, "usable": cuda, "why": "installed (not imported by this check)"}
    probe = import_probe(module)
    usable = probe["ok"] and cuda
    why = "imports" + ("" if cuda else ", but there is no CUDA device") if probe["ok"] else probe["error"]
    return {"installed": True, "usable": usable, "why": why}


def device_info() -> Dict:
    """torch's version and CUDA build; the first device's name, capability and memory (``cpu`` without one)."""
    import torch

    info = {"torch": torch.__version__, "torch_cuda": torch.version.cuda, "cuda_available": torch.cuda.is_available()}
    if info["cuda_available"]:
        props = torch.cuda.get_device_properties(0)
        free, total = torch.cuda.mem_get_info()
        info.update(device=props.name, capability=f"{props.major}.{props.minor}", memory_gib=total / 2**30,
                    memory_free_gib=free / 2**30, bf16_supported=torch.cuda.is_bf16_supported(),
                    device_count=torch.cuda.device_count())
    else:
        info["device"] = "cpu"
    return info


def disk_info(paths: Dict[str, str]) -> Dict:
    """``{label}_free_gib`` per ``{label: folder}`` (None for a missing folder)."""
    out = {}
    for label, path in paths.items():
        out[f"{label}_free_gib"] = shutil.disk_usage(path).free / 2**30 if os.path.isdir(path) else None
    return out
