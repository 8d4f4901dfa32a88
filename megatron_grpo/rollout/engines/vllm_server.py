"""vLLM server backend: the same engine behind vLLM's OpenAI-compatible server.

For disaggregated runs the generator lives in another process or node: ``url`` points
at a running server, or the engine launches one on 127.0.0.1. Generation and scoring
use ``/v1/completions`` with token-id prompts. Weights (``weight_transfer``):

- ``gloo`` / ``nccl`` / ``ipc``: vLLM's RL weight-sync routes (dev mode): ``/pause`` ->
  ``/init_weight_transfer_engine`` (the first push) -> ``/start_weight_update`` ->
  ``/update_weights`` while the trainer sends the buckets -> ``/finish_weight_update`` with our
  version -> ``/resume``; the parity probe reads ``/weight_info`` and ``/weight_checker``. Works
  for a server on another host (its workers connect back to ``transfer_address``).
- ``file``: each bucket a safetensors file (``fanout.py``) whose path goes through
  ``/collective_rpc`` into our worker extension, then ``/reset_prefix_cache``: same host only.

Every idempotent request is retried with back-off for at most ``retry_timeout_s``; a dead
server ends in a ``GeneratorError`` that says so, never a hang.
"""

from __future__ import annotations

import ctypes
import json
import logging
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from typing import Iterable, List, Optional, Sequence, Tuple

import torch

from megatron_grpo import faults
from megatron_grpo.compat.vllm import json_safe_update_payload
from megatron_grpo.models.fp8_hf import engine_keeps_bytes
from megatron_grpo.rollout.engines.vllm_engine import DTYPE_NAMES, fp8_engine_options
from megatron_grpo.rollout.transfer.fanout import UNKNOWN_VERSION, fan_out
from megatron_grpo.rollout.transfer.stage_push import StagePushEngine
from megatron_grpo.rollout.transfer.transport import DELTA_TRANSPORTS, VLLMTransfer, default_address, digesting
from megatron_grpo.rollout.types import GeneratorError, Rollout, RolloutEngine, Rollouts, Sampling

logger = logging.getLogger(__name__)


NEUTRAL_PENALTIES = dict(repetition_penalty=1.0, presence_penalty=0.0, frequency_penalty=0.0, min_p=0.0)
"""Sent with every generation request: the server fills each sampling field a request leaves unset from the
model's ``generation_config.json`` (``--generation-config auto``, its default; Qwen2.5-7B-Instruct's sets
``repetition_penalty`` 1.05), and its processed log-probs are then those of the penalised distribution, not the
``log_softmax(logits / T)`` the trainer computes (measured on the tiny Qwen3, fp32, ``repetition_penalty`` 1.3:
max |rollout - trainer| log-prob 0.075, against 1e-6 with these values sent)."""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _die_with_parent() -> None:
    """Linux: the server gets SIGTERM when the trainer dies (even by SIGKILL), so none is orphaned."""
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except Exception:  # noqa: BLE001 - best effort on other platforms
        pass


class ServerWeightSyncClient:
    """vLLM's ``VLLMWeightSyncClient`` protocol over the server's RL routes (dev mode), with our
    retry and error handling; the weight-update requests are never retried (not idempotent)."""

    def __init__(self, engine: "VLLMServerEngine"):
        self.engine = engine

    def init_weight_transfer_engine(self, init_info: dict) -> None:
        self.engine._post("/init_weight_transfer_engine", dict(init_info=init_info), retry=False)

    def start_weight_update(self) -> None:
        self.engine._post("/start_weight_update", {}, retry=False)

    def update_weights(self, update_info) -> None:
        infos = update_info if isinstance(update_info, list) else [update_info]
        if any("ipc_handles" in info for info in infos):  # ipc: the handles travel pickled, as vLLM's client does
            update_info = json_safe_update_payload(update_info)
        self.engine._post("/update_weights", dict(update_info=update_info), retry=False)

    def finish_weight_update(self, weight_version: Optional[str] = None) -> None:
        body = {} if weight_version is None else dict(weight_version=weight_version)
        self.engine._post("/finish_weight_update", body, retry=False)

    def update_weight_version(self, new_version: str) -> None:
        self.engine._post("/update_weight_version", dict(new_version=new_version))


def server_args(quantization: Optional[dict]) -> List[str]:
    """``vllm serve`` arguments of an FP8 engine (``vllm_engine.fp8_engine_options``): what this engine launches
    with, and what a server started elsewhere (``generation.server_urls``) needs for ``generation_dtype: fp8``."""
    options = fp8_engine_options(quantization)
    if not options:
        return []
    return ["--quantization", options["quantization"], "--hf-overrides", json.dumps(options["hf_overrides"]),
            "--load-format", options["load_format"]]


class VLLMServerEngine(StagePushEngine, RolloutEngine):
    """Client of a vLLM OpenAI-compatible server (launched here unless ``url`` is given)."""

    def __init__(self, model_dir: str, dtype: torch.dtype, *, url: Optional[str] = None, max_model_len: int = 512,
                 seed: int = 0, kv_cache_gib: int = 1, gpu_memory_utilization: float = 0.5,
                 start_timeout_s: float = 600.0, request_timeout_s: float = 600.0, retry_timeout_s: float = 60.0,
                 is_moe: bool = False, log_path: Optional[str] = None, tensor_parallel_size: int = 1,
                 cpu_bind: Optional[str] = None, devices: Optional[List[int]] = None, sleep_mode: bool = False,
                 weight_transfer: str = "file", transfer_address: Optional[str] = None, transfer_senders: int = 1,
                 launch_prefix: Sequence[str] = (), launch_host: str = "127.0.0.1",
                 quantization: Optional[dict] = None):
        """``weight_transfer``: ``file`` or a vLLM weight-transfer backend (``transport.py``);
        ``transfer_address``: where the server's workers reach this process (null: loopback for a
        launched server, this host's address for ``url``); ``transfer_senders``: gloo senders (this
        process is sender 0; one per pipeline stage); ``launch_prefix``: a command the launched
        server runs under (e.g. ``ip netns exec``, ``unshare ...``: its own network / mount namespace);
        ``launch_host``: the address the launched server listens on (that namespace's); ``quantization``: fp8
        generation (``vllm_engine.fp8_engine_options``; a running server must have been started with
        ``server_args``)."""
        self.dtype, self.model_dir, self.is_moe, self.quantization = dtype, model_dir, is_moe, quantization
        self.weight_transfer, self.pushed_digests = weight_transfer, {}
        address = transfer_address or default_address(url or f"http://{launch_host}")
        self._transfer = None if weight_transfer == "file" else VLLMTransfer(
            weight_transfer, ServerWeightSyncClient(self), address=address, num_workers=tensor_parallel_size,
            num_senders=transfer_senders, timeout_s=request_timeout_s)
        self.launch_prefix, self.launch_host = list(launch_prefix), launch_host
        self.tensor_parallel_size, self.cpu_bind, self.devices, self.sleep_mode = (tensor_parallel_size, cpu_bind,
                                                                                   devices, sleep_mode)
        self.request_timeout_s, self.retry_timeout_s = request_timeout_s, retry_timeout_s
        self._proc = None
        if url is None:
            port = _free_port()
            self.url = f"http://{launch_host}:{port}"
            self._launch(port, max_model_len, seed, kv_cache_gib, gpu_memory_utilization, log_path)
        else:
            self.url = url.rstrip("/")
            if quantization is not None:
                logger.info("generation_dtype fp8: the vLLM server at %s must have been started with %s", self.url,
                            " ".join(server_args(quantization)))
        self._wait_healthy(start_timeout_s)
        if self._transfer is not None:  # the group needs every worker of the server, as it was launched (a remote
            self._transfer.endpoint.num_workers = self.num_workers()  # one's TP/PP/DP are not in our config)

    def _launch(self, port, max_model_len, seed, kv_cache_gib, gpu_memory_utilization, log_path) -> None:
        cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", self.model_dir,
               "--dtype", DTYPE_NAMES[self.dtype], "--host", self.launch_host, "--port", str(port), "--enforce-eager",
               "--max-model-len", str(max_model_len), "--logprobs-mode", "processed_logprobs", "--seed", str(seed),
               "--tensor-parallel-size", str(self.tensor_parallel_size), "--distributed-executor-backend",
               "uni" if self.tensor_parallel_size == 1 else "mp", "--gpu-memory-utilization", str(gpu_memory_utilization),
               "--worker-extension-cls", "megatron_grpo.rollout.engines.server_ext.WeightLoaderExtension"]
        cmd += ["--enable-sleep-mode"] if self.sleep_mode else []
        cmd += server_args(self.quantization)
        if self._transfer is not None:  # the gloo engine comes from our vllm.general_plugins entry point
            cmd += ["--weight-transfer-config", json.dumps({"backend": self.weight_transfer})]
        env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR",
                                                                 "MASTER_PORT", "LOCAL_WORLD_SIZE")}
        env.update(VLLM_SERVER_DEV_MODE="1", VLLM_ENABLE_V1_MULTIPROCESSING="0",
                   VLLM_CPU_KVCACHE_SPACE=str(max(1, int(kv_cache_gib))))
        if self.weight_transfer == "ipc":  # the ipc handles cross HTTP pickled (vLLM's HTTP client does the same)
            env["VLLM_ALLOW_INSECURE_SERIALIZATION"] = "1"
        if self.cpu_bind:
            env["VLLM_CPU_OMP_THREADS_BIND"] = self.cpu_bind
        if self.devices:
            env["CUDA_VISIBLE_DEVICES"] = ",".join(str(d) for d in self.devices)
        self._own_log = log_path is None  # a temporary log (engine used on its own) is removed on close
        if log_path is None:
            fd, log_path = tempfile.mkstemp(prefix="megatron-grpo-vllm-server-", suffix=".log")
            os.close(fd)
        else:
            os.makedirs(os.path.dirname(os.path.abspath(log_path)), exist_ok=True)
        self._log_path = log_path
        self._log = open(self._log_path, "a")  # a restarted server appends: the crash stays readable
        self._proc = subprocess.Popen(self.launch_prefix + cmd, stdout=self._log, stderr=subprocess.STDOUT, env=env,
                                      start_new_session=True, preexec_fn=_die_with_parent)
        faults.maybe_kill_starting_generator(self._proc)

    def _wait_healthy(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self._proc is not None and self._proc.poll() is not None:
                raise GeneratorError(f"vLLM server exited with code {self._proc.returncode} during start-up; "
                                     f"log: {self._log_path}\n{self._log_tail()}")
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=5) as resp:
                    if resp.status == 200:
                        logger.info("vLLM server at %s is healthy", self.url)
                        return
            except (urllib.error.URLError, ConnectionError, OSError):
                pass
            time.sleep(1.0)
        raise GeneratorError(f"vLLM server at {self.url} not healthy within {timeout_s:.0f} s")

    def _log_tail(self, lines: int = 20) -> str:
        try:
            with open(self._log_path) as f:
                return "".join(f.readlines()[-lines:])
        except OSError:
            return ""

    def _post(self, path: str, body: Optional[dict], retry: bool = True):
        """POST with bounded retries: connection errors and 5xx are retried for ``retry_timeout_s``
        (``retry=False``: once, for requests that must not run twice, e.g. a weight update)."""
        data = None if body is None else json.dumps(body).encode()
        deadline, attempts, last = time.monotonic() + self.retry_timeout_s, 0, None
        while True:
            attempts += 1
            try:
                req = urllib.request.Request(self.url + path, data=data, method="POST" if body is not None else "GET",
                                             headers={"Content-Type": "application/json"})
                with urllib.request.urlopen(req, timeout=self.request_timeout_s) as resp:
                    raw = resp.read()
                    return json.loads(raw) if raw else None
            except urllib.error.HTTPError as exc:
                if exc.code < 500:
                    raise GeneratorError(f"vLLM server {self.url}{path} refused the request ({exc.code}): "
                                         f"{exc.read().decode(errors='replace')[:2000]}") from exc
                last = exc
            except (urllib.error.URLError, ConnectionError, OSError) as exc:
                last = exc
            if time.monotonic() > deadline or not retry:
                raise GeneratorError(f"vLLM server {self.url} did not answer {path} after {attempts} attempts over "
                                     f"{self.retry_timeout_s:.0f} s (dead or restarting): {last}")
            time.sleep(min(2.0, 0.2 * attempts))

    def generate(self, prompt_token_ids: Sequence[Sequence[int]], n: int, sampling: Sampling) -> Rollouts:
        """One request per prompt with vLLM's ``n``: vLLM seeds its i-th sample ``seed + i``, so sample i of
        prompt p draws with ``seed + p * n + i``, the offline engine's scheme (a request per sample over
        every prompt would give each prompt the same noise, and a prompt repeated in a step the same group)."""
        def one_prompt(p: int):
            body = dict(model=self.model_dir, prompt=list(prompt_token_ids[p]), n=n, max_tokens=sampling.max_tokens,
                        temperature=sampling.temperature, top_p=sampling.top_p, top_k=sampling.top_k, logprobs=0,
                        **NEUTRAL_PENALTIES, return_token_ids=True, ignore_eos=sampling.ignore_eos,
                        stop_token_ids=None if sampling.ignore_eos else list(sampling.stop_token_ids) or None,
                        seed=None if sampling.seed is None else sampling.seed + p * n)
            return sorted(self._post("/v1/completions", body)["choices"], key=lambda c: c["index"])

        with ThreadPoolExecutor(max_workers=max(1, min(len(prompt_token_ids), 64))) as pool:
            per_prompt = list(pool.map(one_prompt, range(len(prompt_token_ids))))
        items = []
        for p, (prompt, choices) in enumerate(zip(prompt_token_ids, per_prompt)):
            if len(choices) != n:
                raise ValueError(f"vLLM server {self.url} returned {len(choices)} samples for prompt {p}, asked for {n}")
            for choice in choices:
                ids = list(choice["token_ids"])
                items.append(Rollout(prompt_index=p, prompt_ids=list(prompt), completion_ids=ids,
                                     logprobs=list(choice["logprobs"]["token_logprobs"])[: len(ids)],
                                     finish_reason=str(choice["finish_reason"]), policy_version=self.policy_version))
        return Rollouts(items)

    def submit_generate(self, prompt_token_ids, n, sampling):
        """The server backend generates synchronously; the handle carries the result."""
        return self.generate(prompt_token_ids, n, sampling)

    def collect(self, handle) -> Rollouts:
        return handle

    def score(self, sequences: Sequence[Sequence[int]], prompt_lens: Sequence[int]) -> List[List[float]]:
        body = dict(model=self.model_dir, prompt=[list(s) for s in sequences], max_tokens=1, prompt_logprobs=0,
                    temperature=1.0)
        choices = sorted(self._post("/v1/completions", body)["choices"], key=lambda c: c["index"])
        out = []
        for choice, seq, start in zip(choices, sequences, prompt_lens):
            entries = choice["prompt_logprobs"]
            out.append([entries[t][str(seq[t])]["logprob"] for t in range(start, len(seq))])
        return out

    def update_weights(self, buckets: Iterable[List[Tuple[str, torch.Tensor]]], version: int) -> List[str]:
        """``file``: each bucket a safetensors file (``fanout.fan_out``, one reader). Otherwise vLLM's
        weight-transfer round between ``/pause`` and ``/resume``."""
        if self._transfer is None:
            return fan_out(buckets, [self], version, stages=self.take_stage_files())
        self.pushed_digests = {}
        self._post("/pause?mode=wait", {}, retry=False)  # finish what runs, then clear the prefix cache
        try:
            keep = None if self.quantization is None else (lambda n, t: engine_keeps_bytes(n, t, self.quantization))
            names = self._transfer.push(digesting(buckets, self.pushed_digests, keep), version)
        except BaseException:
            self.policy_version = UNKNOWN_VERSION  # some buckets may have loaded: no version holds
            raise
        finally:
            self._post("/resume", {})
        self.policy_version = version
        return names

    @property
    def transfer(self):
        """The ``transfer.VLLMTransfer`` of this engine (None with ``file``); ``transfer.endpoint`` is where
        the other senders join."""
        return self._transfer

    def num_workers(self) -> int:
        """The server's vLLM workers, data parallelism included (``/get_world_size``): each joins the transfer."""
        return int(self._post("/get_world_size", None)["world_size"])

    def weight_version(self) -> Optional[str]:
        """The server's committed weights version (``/weight_info``)."""
        return self._post("/weight_info", None)["weight_version"]

    def weight_checksums(self) -> dict:
        """sha256 per vLLM parameter, keys prefixed ``dp0:pp0:pcp0:tp0:`` (``/weight_checker``)."""
        return self._post("/weight_checker", dict(action="checksum"))["checksums"]

    # ---- the file-push seam (``fanout.fan_out``) -----------------------------------------------------------

    def begin_weight_push(self) -> None:
        """One layerwise reload for the whole push (``server_ext``: no per-bucket finalize)."""
        self._post("/collective_rpc", dict(method="megatron_grpo_begin_push", args=[]))

    def push_file(self, path: str) -> None:
        """The server's workers load ``path`` (``/collective_rpc``); unlinked once loaded."""
        try:
            self._post("/collective_rpc", dict(method="megatron_grpo_load", args=[path, "0"]))
        finally:
            try:
                os.unlink(path)
            except FileNotFoundError:
                pass

    def end_weight_push(self, version: int) -> None:
        self._post("/collective_rpc", dict(method="megatron_grpo_end_push", args=[]))
        if self.is_moe:
            self._post("/collective_rpc", dict(method="megatron_grpo_repack_moe", args=[]))
        self._post("/reset_prefix_cache", {})
        self.policy_version = version

    def sleep(self, level: int = 1) -> None:
        """vLLM sleep mode (GPU; launched with ``sleep_mode``, or a server started with --enable-sleep-mode)."""
        self._post(f"/sleep?level={level}", {})

    def wake_up(self) -> None:
        self._post("/wake_up", {})

    @property
    def accepts_delta_push(self) -> bool:
        """Whether pushes may carry delta patches (``delta.py``): the file transport's worker extension
        and our gloo engine apply them; vLLM's nccl and ipc engines do not."""
        return self.weight_transfer in DELTA_TRANSPORTS

    def describe(self) -> str:
        return f"vllm_server {self.url}"

    def alive(self) -> bool:
        return self._proc is None or self._proc.poll() is None

    def kill_process(self) -> None:
        """SIGKILL the server and its children (fault drills)."""
        if self._proc is not None and self._proc.poll() is None:
            os.killpg(self._proc.pid, signal.SIGKILL)
            self._proc.wait(timeout=30)

    def close(self) -> None:
        if getattr(self, "_transfer", None) is not None:
            self._transfer.close()
        if self._proc is None:
            return
        if self._proc.poll() is None:
            self._proc.terminate()
            try:
                self._proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self._proc.kill()
                self._proc.wait(timeout=10)
        self._log.close()
        if self._own_log:
            try:
                os.remove(self._log_path)
            except OSError:
                pass
        self._proc = None
