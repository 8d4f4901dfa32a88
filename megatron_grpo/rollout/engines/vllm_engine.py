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
from typing import Iterable, List, Optional, Sequence, Tuple

import torch
import torch.multiprocessing as mp

from megatron_grpo import faults
from megatron_grpo.models.fp8 import FP8_DTYPE
from megatron_grpo.models.fp8_hf import engine_keeps_bytes
from megatron_grpo.rollout.engines import vllm_worker
from megatron_grpo.rollout.transfer.fanout import UNKNOWN_VERSION, fan_out
from megatron_grpo.rollout.transfer.stage_push import StagePushEngine
from megatron_grpo.rollout.transfer.transport import DELTA_TRANSPORTS, VLLMTransfer, digesting
from megatron_grpo.rollout.types import GeneratorError, Rollout, RolloutEngine, Rollouts, Sampling

logger = logging.getLogger(__name__)

DTYPE_NAMES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16",
               FP8_DTYPE: "bfloat16"}
"""vLLM's ``dtype`` per generation precision: fp8 (the precision token) runs bf16 around its FP8 GEMMs."""


def fp8_engine_options(quantization: Optional[dict]) -> dict:
    """``LLM`` / server options of an FP8 engine: vLLM's block FP8 (``quantization: fp8``, the pushed weights'
    ``quantization_config`` as ``hf_overrides``: ``models/fp8_hf.py``) with placeholder weights at start
    (``load_format: dummy``: the checkpoint on disk is not FP8; the trainer pushes its bytes before the first
    rollout); {} otherwise."""
    if quantization is None:
        return {}
    return {"quantization": "fp8", "hf_overrides": {"quantization_config": quantization}, "load_format": "dummy"}


class VLLMEngine(StagePushEngine, RolloutEngine):
    """vLLM in a spawned process; ``generate``/``score``/``update_weights`` are blocking RPCs."""

    def __init__(self, model_dir: str, dtype: torch.dtype, *, max_model_len: int = 512, seed: int = 0,
                 gpu_memory_utilization: float = 0.5, kv_cache_gib: int = 1, start_timeout_s: float = 600.0,
                 request_timeout_s: float = 600.0, is_moe: bool = False,
                 return_routed_experts: bool = False, tensor_parallel_size: int = 1,
                 cpu_bind: Optional[str] = None, devices: Optional[List[int]] = None, sleep_mode: bool = False,
                 weight_transfer: str = "file", transfer_address: Optional[str] = None,
                 quantization: Optional[dict] = None):
        """``weight_transfer``: ``file`` (bucket files, same host) or a vLLM weight-transfer backend
        (``transport.py``: the ``LLM`` RL API; ``transfer_address`` = where its workers reach this
        process, default loopback); ``cpu_bind``: vLLM's ``VLLM_CPU_OMP_THREADS_BIND`` for this
        engine (one core list per TP worker, ``|``-separated; None = vLLM's automatic binding, which
        refuses TP > 1 on one NUMA node); ``devices``: the GPUs it runs on (None = inherited);
        ``sleep_mode``: GPU only, enables ``sleep``/``wake_up``; ``quantization``: fp8 generation, the
        ``quantization_config`` of the pushed FP8 weights (``fp8_engine_options``)."""
        if dtype not in DTYPE_NAMES or (dtype == FP8_DTYPE) != (quantization is not None):
            raise ValueError(f"generation dtype must be one of float32, bfloat16, float16 or fp8 (with its "
                             f"quantization_config), got {dtype}")
        self.dtype = dtype
        self.is_moe = is_moe
        self.request_timeout_s = request_timeout_s
        self.options = dict(model=model_dir, dtype=DTYPE_NAMES[dtype], max_model_len=max_model_len, seed=seed,
                            gpu_memory_utilization=gpu_memory_utilization, kv_cache_gib=kv_cache_gib,
                            return_routed_experts=return_routed_experts, tensor_parallel_size=tensor_parallel_size,
                            cpu_bind=cpu_bind, devices=devices, sleep_mode=sleep_mode, weight_transfer=weight_transfer,
                            fp8=fp8_engine_options(quantization))
        self.quantization = quantization
        self.weight_transfer, self.pushed_digests, self._transfer = weight_transfer, {}, None
        self._start(start_timeout_s)
        if weight_transfer != "file":
            self._transfer = VLLMTransfer(weight_transfer, OfflineWeightSyncClient(self),
                                          address=transfer_address or "127.0.0.1",
                                          num_workers=tensor_parallel_size, timeout_s=request_timeout_s)

    def _start(self, timeout_s: float) -> None:
        ctx = mp.get_context("spawn")
        self._requests, self._responses = ctx.Queue(), ctx.Queue()
        # TP > 1: vLLM spawns its workers from this process, which a daemonic process may not do (it still
        # dies with the trainer: ``vllm_worker._die_with_parent``)
        self._proc = ctx.Process(target=vllm_worker.serve, args=(self.options, self._requests, self._responses),
                                 daemon=self.options["tensor_parallel_size"] == 1, name="megatron-grpo-vllm")
        self._next_id, self._received = 1, {}
        started = time.monotonic()
        self._proc.start()
        faults.maybe_kill_starting_generator(self._proc)
        try:
            self._wait(0, "start", timeout_s)
        except BaseException:  # a start that timed out or failed leaves no process behind
            self._proc.kill()
            self._proc.join(timeout=30)
            raise
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
                       stop_token_ids=tuple(sampling.stop_token_ids), ignore_eos=sampling.ignore_eos)
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
        """Streams ``buckets`` (lists of (HF name, tensor in the generator dtype)) into vLLM: ``file``,
        each bucket as one file (``fanout.fan_out``, here with a single reader); otherwise one round
        of vLLM's weight-transfer API (``LLM.start_weight_update`` / ``update_weights`` / ``finish``)."""
        if self._transfer is None:
            return fan_out(buckets, [self], version, stages=self.take_stage_files())
        self.pushed_digests = {}
        try:
            names = self._transfer.push(digesting(buckets, self.pushed_digests, self.digest_filter), version)
        except BaseException:
            self.policy_version = UNKNOWN_VERSION  # some buckets may have loaded: no version holds
            raise
        self.policy_version = version
        return names

    @property
    def transfer(self):
        """The ``transfer.VLLMTransfer`` of this engine (None with ``file``)."""
        return self._transfer

    @property
    def digest_filter(self):
        """The pushed tensors whose digests vLLM's ``/weight_checker`` can match (all but FP8 scales, ...)."""
        q = self.quantization
        return None if q is None else (lambda name, tensor: engine_keeps_bytes(name, tensor, q))

    @property
    def accepts_delta_push(self) -> bool:
        """Whether pushes may carry delta patches (``delta.py``): the file transport's worker extension
        and our gloo engine apply them; vLLM's nccl and ipc engines do not."""
        return self.weight_transfer in DELTA_TRANSPORTS

    def weight_version(self) -> Optional[str]:
        """The engine's committed weights version (``LLM.get_weight_version``)."""
        return self._call("weight_sync", ("version", None))

    def weight_checksums(self) -> dict:
        """sha256 per vLLM parameter, as the server's ``/weight_checker`` gives them."""
        return self._call("weight_sync", ("checksums", None))

    # ---- the file-push seam (``fanout.fan_out``): begin, one path per bucket, end --------------------------

    def begin_weight_push(self) -> None:
        self._load_request = self._submit("load", dict(is_moe=self.is_moe))

    def push_file(self, path: str) -> None:
        """Hands one bucket file to the generator, which unlinks it once read (returns at once)."""
        self._requests.put(path)

    def end_weight_push(self, version: int) -> None:
        self._requests.put(None)
        self._wait(self._load_request, "load", self.request_timeout_s)
        self.policy_version = version

    def sleep(self, level: int = 1) -> None:
        """vLLM sleep mode (GPU; built with ``sleep_mode``): level 1 offloads the weights, frees the KV cache."""
        self._call("sleep", level)

    def wake_up(self) -> None:
        self._call("wake_up", None)

    def describe(self) -> str:
        pid = self._proc.pid if getattr(self, "_proc", None) is not None else None
        return f"vllm pid {pid}"

    def alive(self) -> bool:
        return self._proc.is_alive()

    def kill_process(self) -> None:
        """SIGKILL the generator process (fault drills)."""
        self._proc.kill()
        self._proc.join(timeout=30)

    def close(self) -> None:
        if getattr(self, "_transfer", None) is not None:
            self._transfer.close()
            self._transfer = None
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


class OfflineWeightSyncClient:
    """vLLM's ``VLLMWeightSyncClient`` protocol over the generator process's ``LLM`` RL methods."""

    def __init__(self, engine: VLLMEngine):
        self.engine = engine

    def init_weight_transfer_engine(self, init_info: dict) -> None:
        self.engine._call("weight_sync", ("init", init_info))

    def start_weight_update(self) -> None:
        self.engine._call("weight_sync", ("start", None))

    def update_weights(self, update_info) -> None:
        self.engine._call("weight_sync", ("update", update_info))

    def finish_weight_update(self, weight_version: Optional[str] = None) -> None:
        self.engine._call("weight_sync", ("finish", weight_version))

    def update_weight_version(self, new_version: str) -> None:
        self.engine._call("weight_sync", ("set_version", new_version))
