"""vLLM worker extension for the server backend: load pushed weight buckets from files.

Mixed into vLLM's worker with ``--worker-extension-cls`` (server) or ``worker_extension_cls``
(the offline engine); called through ``collective_rpc`` (the server's dev-mode endpoint passes
only strings), so a bucket travels as a safetensors file (under /dev/shm when available, one
file read by every engine of the pool) and its path is the argument.
"""

from __future__ import annotations

import logging

from vllm.config import set_current_vllm_config

from megatron_grpo.compat.vllm import begin_layerwise_reload, finish_layerwise_reload
from megatron_grpo.rollout.engines.vllm_worker import _repack_moe
from megatron_grpo.rollout.transfer.delta import DeltaReceiver


class WeightLoaderExtension:
    """Adds ``megatron_grpo_begin_push()``, ``megatron_grpo_load(path, is_moe)``, ``megatron_grpo_end_push()`` and
    ``megatron_grpo_repack_moe()`` to the vLLM worker."""

    def megatron_grpo_begin_push(self) -> None:
        """Opens one layerwise reload for a whole push (vLLM's checkpoint-format protocol: initialize once,
        load every bucket, finalize once). Reloading bucket by bucket instead finalizes every layer at each
        bucket and warns "<Layer>: Failed to load weights" for each layer of the other buckets (thousands of
        lines per push at Qwen3-0.6B's shape); a layer that no bucket of the push loads still warns, once."""
        with set_current_vllm_config(self.vllm_config):
            begin_layerwise_reload(self.model_runner.get_model())
        self.megatron_grpo_push_open = True

    def megatron_grpo_load(self, path: str, is_moe: str = "0") -> int:
        from safetensors.torch import load_file

        tensors = load_file(path)  # memory-mapped views (measured: 384 MB in 5 ms), copied once into the params
        if not hasattr(self, "megatron_grpo_delta"):
            self.megatron_grpo_delta = DeltaReceiver()
        pairs = self.megatron_grpo_delta.apply(list(tensors.items()))  # delta patches -> full tensors
        if getattr(self, "megatron_grpo_push_open", False):
            with set_current_vllm_config(self.vllm_config):
                self.model_runner.get_model().load_weights(iter(pairs))
        else:  # a push of one bucket: its own reload
            self.model_runner.reload_weights(weights_iterator=iter(pairs))
        if is_moe == "1":
            _repack_moe(self)
        return len(tensors)

    def megatron_grpo_end_push(self, failed: str = "0") -> None:
        """Closes the push's reload: every layer is processed (repacked) and the layers no bucket loaded get
        their current weights back (vLLM warns about those; not after a refused push, ``failed="1"``, whose
        error already names the tensor and after which nothing of the rest was loaded)."""
        if not getattr(self, "megatron_grpo_push_open", False):
            return
        self.megatron_grpo_push_open = False
        layerwise = logging.getLogger("vllm.model_executor.model_loader.reload.layerwise")
        level = layerwise.level
        if failed == "1":
            layerwise.setLevel(logging.ERROR)
        try:
            with set_current_vllm_config(self.vllm_config):
                finish_layerwise_reload(self.model_runner.get_model(), self.vllm_config.model_config)
        finally:
            layerwise.setLevel(level)
        for reset in ("reset_lora_state", "reset_encoder_cache", "reset_mm_cache"):  # what reload_weights does
            getattr(self.model_runner, reset, lambda: None)()

    def megatron_grpo_repack_moe(self) -> None:
        """Once after a push of several buckets loaded with ``is_moe="0"`` (see ``_repack_moe``)."""
        _repack_moe(self)
