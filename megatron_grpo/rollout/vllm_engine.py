"""vLLM rollout engine: an offline ``vllm.LLM`` hosted in a generator process.

dtype: the precision config's ``generation_dtype`` (matched to the trainer's compute
dtype by default). Log-probs: ``logprobs_mode="processed_logprobs"``, i.e. the
log-probs of the distribution actually sampled from (temperature applied; with
top-p/top-k < full vocabulary, of the truncated distribution), which is what the
importance ratio needs. The trainer computes ``log_softmax(logits / T)``; top-p/top-k
truncation is therefore not matched by the trainer and is warned about in the config.
"""

from __future__ import annotations

import logging
import queue as queue_module
import time
from typing import Iterable, List, Sequence, Tuple

import torch
import torch.multiprocessing as mp

from megatron_grpo.rollout.types import Rollout, RolloutEngine, Rollouts, Sampling

logger = logging.getLogger(__name__)

DTYPE_NAMES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}


class GeneratorError(RuntimeError):
    """The generator process failed, died, or did not answer in time."""


class VLLMEngine(RolloutEngine):
    """vLLM in a spawned process; ``generate``/``score``/``update_weights`` are blocking RPCs."""

    def __init__(self, model_dir: str, dtype: torch.dtype, *, max_model_len: int = 512, seed: int = 0,
                 gpu_memory_utilization: float = 0.5, kv_cache_gib: int = 1, start_timeout_s: float = 600.0,
                 request_timeout_s: float = 600.0, is_moe: bool = False,
                 return_routed_experts: bool = False):
        if dtype not in DTYPE_NAMES:
            raise ValueError(f"generation dtype must be one of {list(DTYPE_NAMES.values())}, got {dtype}")
        self.dtype = dtype
        self.is_moe = is_moe
        self.request_timeout_s = request_timeout_s
        self.options = dict(model=model_dir, dtype=DTYPE_NAMES[dtype], max_model_len=max_model_len, seed=seed,
                            gpu_memory_utilization=gpu_memory_utilization, kv_cache_gib=kv_cache_gib,
                            return_routed_experts=return_routed_experts)
        self._start(start_timeout_s)

    def _start(self, timeout_s: float) -> None:
        from megatron_grpo.rollout import vllm_worker

        ctx = mp.get_context("spawn")
        self._requests, self._responses = ctx.Queue(), ctx.Queue()
        self._proc = ctx.Process(target=vllm_worker.serve, args=(self.options, self._requests, self._responses),
                                 daemon=True, name="megatron-grpo-vllm")
        self._next_id, self._received = 1, {}
        started = time.monotonic()
        self._proc.start()
        self._wait(0, "start", timeout_s)
        logger.info("vLLM generator (%s, %s) ready in %.1f s", self.options["model"], self.options["dtype"],
                    time.monotonic() - started)

    def _wait(self, request_id: int, what: str, timeout_s: float):
        """Waits for the response to ``request_id`` (responses to other requests are kept)."""
        deadline = time.monotonic() + timeout_s
        while request_id not in self._received:
            try:
                rid, status, value = self._responses.get(timeout=1.0)
            except queue_module.Empty:
                if not self._proc.is_alive():
                    raise GeneratorError(f"vLLM generator process died during {what} (exit code {self._proc.exitcode})")
                if time.monotonic() > deadline:
                    raise GeneratorError(f"vLLM generator did not answer {what} within {timeout_s:.0f} s")
                continue
            self._received[rid] = (status, value)
        status, value = self._received.pop(request_id)
        if status == "error":
            raise GeneratorError(f"vLLM generator failed during {what}:\n{value}")
        return value

    def _submit(self, command: str, payload) -> int:
        if not self._proc.is_alive():
            raise GeneratorError(f"vLLM generator process is not running (exit code {self._proc.exitcode})")
        request_id, self._next_id = self._next_id, self._next_id + 1
        self._requests.put((request_id, command, payload))
        return request_id

    def _call(self, command: str, payload) -> object:
        return self._wait(self._submit(command, payload), command, self.request_timeout_s)

    def generate(self, prompt_token_ids: Sequence[Sequence[int]], n: int, sampling: Sampling) -> Rollouts:
        return self.collect(self.submit_generate(prompt_token_ids, n, sampling))

    def submit_generate(self, prompt_token_ids: Sequence[Sequence[int]], n: int, sampling: Sampling):
        """Starts generation without waiting (the generator works while the trainer trains)."""
        payload = dict(prompts=[list(p) for p in prompt_token_ids], n=n, temperature=sampling.temperature,
                       top_p=sampling.top_p, top_k=sampling.top_k, max_tokens=sampling.max_tokens, seed=sampling.seed,
                       stop_token_ids=tuple(sampling.stop_token_ids))
        return (self._submit("generate", payload), [list(p) for p in prompt_token_ids], n, self.policy_version)

    def collect(self, handle) -> Rollouts:
        """Waits for a ``submit_generate`` handle; rollouts carry the version they were generated with."""
        request_id, prompt_token_ids, n, version = handle
        results = self._wait(request_id, "generate", self.request_timeout_s)
        items = []
        for k, (ids, logprobs, reason, routes) in enumerate(results):
            p = k // n
            items.append(Rollout(prompt_index=p, prompt_ids=list(prompt_token_ids[p]), completion_ids=ids,
                                 logprobs=logprobs, finish_reason=str(reason), policy_version=version,
                                 routed_experts=routes))
        return Rollouts(items)

    def score(self, sequences: Sequence[Sequence[int]], prompt_lens: Sequence[int]) -> List[List[float]]:
        return self._call("score", dict(sequences=[list(s) for s in sequences], prompt_lens=list(prompt_lens)))

    def update_weights(self, buckets: Iterable[List[Tuple[str, torch.Tensor]]], version: int) -> List[str]:
        """Streams ``buckets`` (lists of (HF name, tensor in the generator dtype)) into vLLM."""
        if not self._proc.is_alive():
            raise GeneratorError(f"vLLM generator process is not running (exit code {self._proc.exitcode})")
        request_id = self._submit("load", dict(is_moe=self.is_moe))
        try:
            for bucket in buckets:
                self._requests.put([(name, t.share_memory_()) for name, t in bucket])
        finally:
            self._requests.put(None)
        loaded = self._wait(request_id, "load", self.request_timeout_s)
        self.policy_version = version
        return loaded

    def alive(self) -> bool:
        return self._proc.is_alive()

    def kill_process(self) -> None:
        """SIGKILL the generator process (fault drills)."""
        self._proc.kill()
        self._proc.join(timeout=30)

    def close(self) -> None:
        if getattr(self, "_proc", None) is None:
            return
        if self._proc.is_alive():
            try:
                self._requests.put((-1, "close", None))
                self._proc.join(timeout=30)
            except Exception:  # noqa: BLE001 - best effort
                pass
        if self._proc.is_alive():
            self._proc.kill()
            self._proc.join(timeout=10)
        self._proc = None
