"""vLLM worker extension for the server backend: load pushed weight buckets from files.

Mixed into vLLM's worker with ``--worker-extension-cls``; called through the dev-mode
``/collective_rpc`` endpoint, which passes only strings, so a bucket travels as a
safetensors file (under /dev/shm when available) and its path is the argument.
"""

from __future__ import annotations


class WeightLoaderExtension:
    """Adds ``megatron_grpo_load(path, is_moe)`` to the vLLM worker."""

    def megatron_grpo_load(self, path: str, is_moe: str = "0") -> int:
        from safetensors.torch import load_file

        from megatron_grpo.rollout.vllm_worker import _repack_moe

        tensors = load_file(path)
        self.model_runner.reload_weights(weights_iterator=iter(tensors.items()))
        if is_moe == "1":
            _repack_moe(self)
        return len(tensors)
