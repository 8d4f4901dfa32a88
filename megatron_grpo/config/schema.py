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
from typing import Any, Dict, List, Optional, Tuple

from megatron_grpo.compat.megatron import FP8_TRAINING_FORMATS, FP8_TRAINING_RECIPES
from megatron_grpo.config.batching import DynamicBatchingConfig, SequencePackingConfig
from megatron_grpo.config.generation import GenerationConfig
from megatron_grpo.config.logger import LoggerConfig, MLflowConfig, WandbConfig  # noqa: F401  (re-exported)
from megatron_grpo.config.optim import DDPConfig, OptimizerConfig, SchedulerConfig
from megatron_grpo.config.precision import DTYPES, FP8, PRECISIONS, Fp8Config, PrecisionConfig, to_dtype  # noqa: F401
from megatron_grpo.config.precision import check_vllm_fp8
from megatron_grpo.loss import ADVANTAGE_ESTIMATORS
from megatron_grpo.loss.config import LossConfig
from megatron_grpo.parallel.stages import PipelineSplit, check_split

logger = logging.getLogger(__name__)

VPP_NOT_WITH = "a MoE model (the routing control over several chunks) or an FP8 forward (fp8 shadow / generator / TE fp8)"
"""What ``policy.megatron_cfg.virtual_pipeline_model_parallel_size`` > 1 is refused with (not wired or not tested)."""


@dataclass
class MegatronConfig:
    """Megatron-Core parallel layout and backend (NeMo-RL's ``policy.megatron_cfg``)."""

    tensor_model_parallel_size: int = 1
    """TP: splits each GEMM across ranks."""
    pipeline_model_parallel_size: int = 1
    """PP: splits the layers across ranks (Megatron's 1F1B schedule; the loss runs on the last stage)."""
    num_layers_in_first_pipeline_stage: Optional[int] = None
    """Uneven PP (Megatron's name): decoder layers on the first stage, the rest split evenly over the
    others; null = even split (PP must then divide the layers)."""
    num_layers_in_last_pipeline_stage: Optional[int] = None
    """Uneven PP: decoder layers on the last stage (with or without the first stage's count)."""
    account_for_embedding_in_pipeline_split: bool = False
    """Uneven PP: the embedding counts as one layer, so the first stage builds one decoder layer fewer
    (layers + 1 [+ 1] split evenly; not with num_layers_in_first/last_pipeline_stage)."""
    account_for_loss_in_pipeline_split: bool = False
    """Uneven PP: the output layer and loss count as one layer, so the last stage builds one decoder layer fewer."""
    virtual_pipeline_model_parallel_size: Optional[int] = None
    """Interleaved PP (Megatron's name, VPP): model chunks per pipeline stage, each stage's layers split evenly
    over them and placed round-robin (stage s's chunk v holds the v-th round's s-th block), run by Megatron's
    interleaved 1F1B schedule: a smaller pipeline bubble for more point-to-point traffic. Needs
    pipeline_model_parallel_size > 1, every stage's layer count divisible by it, and the micro-batches per
    data-parallel rank a multiple of pipeline_model_parallel_size. null or 1 = off. Dense models only: refused with
    a MoE model (at the layout check) and with an FP8 forward (``VPP_NOT_WITH``)."""
    expert_model_parallel_size: int = 1
    """EP: splits MoE experts across ranks."""
    expert_tensor_parallel_size: int = 1
    """ETP: splits each expert's GEMMs."""
    context_parallel_size: int = 1
    """CP: splits the sequence (validated only)."""
    sequence_parallel: Optional[bool] = None
    """SP (Megatron's sequence parallelism, with TP): norms, residuals and dropout run on each TP rank's
    shard of the sequence (activations / TP). null = on when tensor_model_parallel_size > 1; MoE with
    TP > 1 needs it (false is then an error); no effect at TP = 1."""
    transformer_impl: str = "auto"
    """auto (Transformer Engine with CUDA+TE, else local), te, or local."""
    fp8: Optional[str] = None
    """FP8 training GEMMs through Transformer Engine (GPU, ``transformer_impl: te``): e4m3 (every FP8 tensor
    e4m3) or hybrid (e4m3 forward, e5m2 gradients); null = off. Megatron-Core's ``TransformerConfig.fp8``
    (``--fp8-format``). Every forward of the trainer's model then runs TE's FP8 GEMMs (Megatron-Core enters TE's
    ``fp8_autocast`` in its transformer block), the shadow and the parity probe's trainer side included, so
    ``policy.precision.shadow_dtype`` must equal ``compute_dtype`` (no separate shadow precision). Refused on
    CPU or without TE. Not the FP8 rollouts (``policy.precision.generation_dtype: fp8``)."""
    fp8_recipe: str = "blockwise"
    """With ``fp8``: how TE scales the FP8 tensors (``TransformerConfig.fp8_recipe``, ``--fp8-recipe``):
    blockwise (1 x 128 activation groups, 128 x 128 weight blocks: the rollouts' format; Hopper, TE >= 2.3),
    tensorwise (per-tensor current scaling) or delayed (per-tensor scales from an amax history)."""
    moe_router_dtype: str = "fp32"
    """MoE router-gate precision in the trainer's forward: fp32 or fp64 (autocast does not lower it)."""
    moe_aux_loss_coeff: float = 0.0
    """MoE load-balancing aux loss coefficient (0 = off; not with ``policy.sequence_packing`` or
    ``policy.dynamic_batching``: it depends on which sequences share a micro-batch)."""
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
        check_split(self.pipeline_split, self.pipeline_model_parallel_size)
        if self.pipeline_model_parallel_size == 1 and not self.pipeline_split.is_even:
            logger.warning("policy.megatron_cfg: %s has no effect with pipeline_model_parallel_size=1",
                           self.pipeline_split.describe())
        if self.transformer_impl not in ("auto", "te", "local"):
            raise ValueError(f"policy.megatron_cfg.transformer_impl must be auto, te or local, got {self.transformer_impl!r}")
        if self.moe_router_dtype not in ("fp32", "fp64"):
            raise ValueError(f"policy.megatron_cfg.moe_router_dtype must be fp32 or fp64, got {self.moe_router_dtype!r}")
        self._check_fp8()
        if self.moe_routing_replay not in ("none", "R2", "R3"):
            raise ValueError(f"policy.megatron_cfg.moe_routing_replay must be none, R2 or R3, "
                             f"got {self.moe_routing_replay!r}")
        if self.moe_aux_loss_coeff < 0 or self.moe_z_loss_coeff < 0:
            raise ValueError("policy.megatron_cfg.moe_aux_loss_coeff and moe_z_loss_coeff must be >= 0")

    def _check_fp8(self) -> None:
        key = "policy.megatron_cfg"
        if self.fp8 is not None and self.fp8 not in FP8_TRAINING_FORMATS:
            raise ValueError(f"{key}.fp8 must be null, {' or '.join(FP8_TRAINING_FORMATS)}, got {self.fp8!r}")
        if self.fp8_recipe not in FP8_TRAINING_RECIPES:
            raise ValueError(f"{key}.fp8_recipe must be one of {', '.join(FP8_TRAINING_RECIPES)}, got "
                             f"{self.fp8_recipe!r}")
        if self.fp8 is not None and self.transformer_impl != "te":
            raise ValueError(f"{key}.fp8={self.fp8} runs Transformer Engine's FP8 GEMMs: set {key}.transformer_impl=te "
                             f"(got {self.transformer_impl})")

    @property
    def fp8_training(self) -> Optional[Tuple[str, str]]:
        """(format, recipe) of FP8 training, None when off (``models.transformer_config``)."""
        return None if self.fp8 is None else (self.fp8, self.fp8_recipe)

    @property
    def pipeline_split(self) -> PipelineSplit:
        """The four uneven-PP fields as one ``PipelineSplit``."""
        return PipelineSplit(self.num_layers_in_first_pipeline_stage, self.num_layers_in_last_pipeline_stage,
                             self.account_for_embedding_in_pipeline_split, self.account_for_loss_in_pipeline_split,
                             self.virtual_pipeline_model_parallel_size)


@dataclass
class PolicyConfig:
    """The trained model."""

    model_name: Optional[str] = None
    """HF checkpoint dir (Qwen3 / Qwen3-MoE / Llama / Qwen2 / Mistral / Mixtral / DeepSeek-V3); ``tiny:<arch>``
    (``tiny:qwen3``, ``tiny:qwen3-moe``, ``tiny:llama``, ``tiny:qwen2``, ``tiny:mistral``, ``tiny:mixtral``,
    ``tiny:deepseek-v3``) = an embedded tiny model made on first use; null = ``tiny:qwen3``."""
    precision: PrecisionConfig = field(default_factory=PrecisionConfig)
    """Trainer/generator precisions."""
    megatron_cfg: MegatronConfig = field(default_factory=MegatronConfig)
    """Parallel layout and backend."""
    train_micro_batch_size: int = 8
    """Sequences per micro-batch (gradient accumulation over micro-batches)."""
    logprob_chunk_size: Optional[int] = None
    """Tokens per fp32 chunk in the log-prob kernel (null = its default)."""
    sequence_packing: SequencePackingConfig = field(default_factory=SequencePackingConfig)
    """Several sequences per row (``config/batching.py``)."""
    dynamic_batching: DynamicBatchingConfig = field(default_factory=DynamicBatchingConfig)
    """Token-budget micro-batches (``config/batching.py``)."""

    def __post_init__(self):
        if self.train_micro_batch_size < 1:
            raise ValueError(f"policy.train_micro_batch_size must be >= 1, got {self.train_micro_batch_size}")
        batching = [f"policy.{k}.enabled=true" for k, c in (("sequence_packing", self.sequence_packing),
                                                          ("dynamic_batching", self.dynamic_batching)) if c.enabled]
        if len(batching) == 2:
            raise ValueError("policy.sequence_packing.enabled=true cannot be combined with policy.dynamic_batching."
                             "enabled=true (as in NeMo-RL): a packed row's token budget is policy.sequence_packing."
                             f"train_mb_tokens (now {self.sequence_packing.train_mb_tokens}; 0 = the step's longest "
                             "sequence), policy.dynamic_batching.max_tokens_per_microbatch budgets padded rows; "
                             "enable one of them")
        if self.megatron_cfg.moe_aux_loss_coeff > 0 and batching:
            raise ValueError(f"policy.megatron_cfg.moe_aux_loss_coeff={self.megatron_cfg.moe_aux_loss_coeff} cannot be "
                             f"combined with {' and '.join(batching)}: the load-balancing loss is a product of sums "
                             "over each micro-batch's tokens, so it depends on which sequences share a micro-batch "
                             "and packed / token-budget plans cannot equal the padded one (set it to 0; the z-loss, "
                             "policy.megatron_cfg.moe_z_loss_coeff, is a per-token sum and is supported)")


@dataclass
class GRPOConfig:
    """The GRPO loop."""

    num_prompts_per_step: int = 8
    """Prompts per step."""
    num_generations_per_prompt: int = 8
    """Completions per prompt (the group size, >= 2: the advantage compares a prompt's completions)."""
    max_num_steps: int = 20
    """Steps to run."""
    seed: int = 42
    """Seed of everything (sampling, data order, init)."""
    advantage_estimator: str = "grpo"
    """grpo (std-normalised), dr_grpo (centred only), rloo."""
    deployed_improvement: bool = True
    """Measure ``policy/deployed_improvement`` (one extra shadow forward per step)."""
    diagnostics_every: int = 1
    """Run the diagnostic forwards only at step 1 and every N-th step: the shadow forward where the loss
    does not need it (``loss_fn.ratio: train`` without R2 routing replay; otherwise it runs every step)
    and the deployed-improvement probe. On the other steps the metrics they make (``precision/*``,
    ``policy/kl_rollout``, ``policy/deployed_improvement``, the phantom / legit / rescued clip fractions,
    MoE routing agreement) are absent from metrics.jsonl; the loss and its gradient do not change.
    1 = every step. ``generation.parity_probe_every`` is separate."""
    grad_cos_clean_every: int = 0
    """Every N steps log ``grad/cos_clean``: cosine between the actual gradient and the clean
    REINFORCE gradient of -(A * logp * mask).sum() / num_tokens (one extra forward-backward; 0 = off)."""
    max_consecutive_skips: int = 3
    """Steps with non-finite log-probs/loss/gradients are skipped and counted; this many in a row stop the run."""

    def __post_init__(self):
        if self.advantage_estimator not in ADVANTAGE_ESTIMATORS:
            raise ValueError(f"grpo.advantage_estimator: unknown {self.advantage_estimator!r}; valid choices: "
                             f"{', '.join(ADVANTAGE_ESTIMATORS.names())}")
        if self.diagnostics_every < 1:
            raise ValueError(f"grpo.diagnostics_every must be >= 1 (1 = every step), got {self.diagnostics_every}")
        if self.grad_cos_clean_every < 0:
            raise ValueError(f"grpo.grad_cos_clean_every must be >= 0, got {self.grad_cos_clean_every}")
        for key in ("num_prompts_per_step", "num_generations_per_prompt", "max_num_steps", "max_consecutive_skips"):
            if getattr(self, key) < 1:
                raise ValueError(f"grpo.{key} must be >= 1, got {getattr(self, key)}")
        if self.num_generations_per_prompt < 2:  # a group of one: the group-relative baseline is the sample itself
            raise ValueError(f"grpo.num_generations_per_prompt={self.num_generations_per_prompt}: "
                             f"grpo.advantage_estimator={self.advantage_estimator} compares a prompt's completions "
                             "with each other, so a group of one has advantage 0 (grpo, dr_grpo: nothing is learned) "
                             "or none (rloo); use >= 2")


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
    """Registered name (negative_length) or ``module:function`` called with completion ids and texts. The texts
    keep special tokens (a stopped completion ends with its stop token, e.g. ``<|im_end|>``; verl and TRL strip
    them: strip them in the function where it matters)."""
    timeout_s: Optional[float] = None
    """A reward call longer than this stops the run naming the function and the step. null: no limit on one
    process; with several ranks 90% of ``cluster.distributed_timeout_minutes`` (the others wait in a collective)."""

    def __post_init__(self):
        if self.timeout_s is not None and self.timeout_s <= 0:
            raise ValueError(f"reward.timeout_s must be > 0 or null, got {self.timeout_s}")


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
    fully_parallel_load: bool = True
    """Resume with Megatron's fully parallel load: a shard replicated over data parallelism is read by one
    DP rank and broadcast to the others (false: every replica reads it; Megatron-LM's ``--ckpt-fully-parallel-load``)."""

    def __post_init__(self):
        if (self.resume or self.save_period or self.export_hf) and not self.checkpoint_dir:
            raise ValueError("checkpointing.resume / checkpointing.save_period / checkpointing.export_hf need "
                             "checkpointing.checkpoint_dir")
        if self.keep_last_n < 1 or self.save_period < 0:
            raise ValueError("checkpointing.keep_last_n must be >= 1 and checkpointing.save_period >= 0")


@dataclass
class ClusterConfig:
    """The devices a run is planned for (the memory plan of ``--dry-run``, ``megatron_grpo/trainer/plan.py``)."""

    gpu_memory_gib: Optional[float] = None
    """Memory of one device in GiB (e.g. 80 for H100 / A100 80GB); the run stops before building anything
    when the memory plan of the most loaded rank exceeds it; null = no check."""
    gpus_per_node: Optional[int] = None
    """GPUs per node, for ``--dry-run``'s engine placement (rank 0 spawns every local engine on its own
    node, which must hold them); null = a single node. A real run reads LOCAL_WORLD_SIZE and the visible GPUs."""
    distributed_timeout_minutes: float = 30.0
    """Timeout of every collective (the default process group and Megatron's groups; Megatron's
    ``--distributed-timeout-minutes``). Rank 0 alone starts vLLM, generates, scores rewards and exports,
    while the other ranks wait in a collective: that wait must fit (NCCL's own default is 10 minutes)."""

    def __post_init__(self):
        if self.gpu_memory_gib is not None and self.gpu_memory_gib <= 0:
            raise ValueError(f"cluster.gpu_memory_gib must be > 0 or null, got {self.gpu_memory_gib}")
        if self.gpus_per_node is not None and self.gpus_per_node < 1:
            raise ValueError(f"cluster.gpus_per_node must be >= 1 or null, got {self.gpus_per_node}")
        if not self.distributed_timeout_minutes > 0:
            raise ValueError(f"cluster.distributed_timeout_minutes must be > 0, got {self.distributed_timeout_minutes}")


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
        _check_precision_against_the_rest(self)
        if m.pipeline_split.vpp > 1 and (p.uses_fp8 or m.fp8 is not None):
            raise ValueError(f"policy.megatron_cfg.virtual_pipeline_model_parallel_size={m.pipeline_split.vpp} with "
                             f"an FP8 forward (policy.precision generation_dtype={p.generation_dtype}, shadow_dtype="
                             f"{p.shadow_dtype}, policy.megatron_cfg.fp8={m.fp8}): interleaved stages are not tested "
                             f"with {VPP_NOT_WITH}; leave virtual_pipeline_model_parallel_size null")
        if self.generation.backend == "megatron" and m.pipeline_model_parallel_size > 1:
            raise ValueError("generation.backend=megatron needs policy.megatron_cfg.pipeline_model_parallel_size=1 "
                             f"(got {m.pipeline_model_parallel_size}): its KV-cached decode runs the whole model on "
                             "every rank; with pipeline parallelism use generation.backend=vllm or vllm_server")
        if self.reward.timeout_s is not None and self.reward.timeout_s >= 60 * self.cluster.distributed_timeout_minutes:
            raise ValueError(f"reward.timeout_s={self.reward.timeout_s} must be below cluster.distributed_timeout_minutes"
                             f"={self.cluster.distributed_timeout_minutes} x 60 s: rank 0 scores while every other "
                             f"rank waits in a collective")
        if self.grpo.diagnostics_every > 1 and (self.loss_fn.ratio != "train" or m.moe_routing_replay == "R2"):
            logger.info("grpo.diagnostics_every=%d: the loss needs the shadow forward (loss_fn.ratio=%s, "
                        "moe_routing_replay=%s), so it and its metrics run every step; only the deployed-improvement "
                        "probe is sampled", self.grpo.diagnostics_every, self.loss_fn.ratio, m.moe_routing_replay)
        if self.policy.dynamic_batching.enabled and m.pipeline_model_parallel_size > 1:
            raise ValueError("policy.dynamic_batching.enabled=true needs policy.megatron_cfg.pipeline_model_parallel_size"
                             f"=1 (got {m.pipeline_model_parallel_size}): its micro-batches differ in shape; with "
                             "pipeline parallelism use policy.sequence_packing.enabled=true (rows of one length)")
        if self.loss_fn.ratio == "gap_scaled" and not p.needs_shadow:
            raise ValueError("loss_fn.ratio=gap_scaled scales the gap between the trainer and its shadow forward, but "
                             f"policy.precision.shadow_dtype == compute_dtype ({p.compute_dtype}): there is no gap")
        if self.loss_fn.ratio == "shadow" and not p.needs_shadow:
            logger.info("loss_fn.ratio=shadow with shadow_dtype == compute_dtype: the shadow ratio equals the trainer's")


def _check_precision_against_the_rest(cfg: "Config") -> None:
    """``policy.precision`` against the layers and the loss: fp8 needs Megatron's local linears; a generator in
    another precision than the trainer's with the trainer's ratio gets a warning with the fixes."""
    p, m, ratio = cfg.policy.precision, cfg.policy.megatron_cfg, cfg.loss_fn.ratio
    if p.uses_fp8 and m.transformer_impl == "te":
        raise ValueError("policy.megatron_cfg.transformer_impl=te with policy.precision generation_dtype / "
                         "shadow_dtype fp8: the FP8 forward (shadow, megatron generator, parity probe) runs on "
                         "Megatron's local linears; set policy.megatron_cfg.transformer_impl=local (or auto)")
    check_vllm_fp8(p, cfg.generation.backend)
    if m.fp8 is not None and p.needs_shadow:
        raise ValueError(f"policy.megatron_cfg.fp8={m.fp8} with policy.precision.shadow_dtype={p.shadow_dtype} != "
                         f"compute_dtype={p.compute_dtype}: every forward of the trainer's model runs TE's FP8 "
                         "GEMMs, so no shadow runs in another precision; set policy.precision.shadow_dtype="
                         f"{p.compute_dtype} (the ratio and beta are then the FP8 trainer's own)")
    if p.generation_dtype == FP8 and ratio == "train":
        logger.warning(
            "policy.precision.generation_dtype=fp8 with compute_dtype=%s and loss_fn.ratio=train: phantom clipping "
            "is expected. Fixes: policy.precision.shadow_dtype=fp8 loss_fn.ratio=shadow (the trainer's ratio from "
            "the generator's FP8 forward), a correction (loss_fn.correction=tis), or bf16 first / last layers "
            "(policy.precision.fp8.num_first_layers_in_bf16=2 num_last_layers_in_bf16=2).", p.compute_dtype)
    elif p.compute_dtype != p.generation_dtype and ratio == "train":
        logger.warning(
            "policy.precision.compute_dtype=%s differs from generation_dtype=%s with loss_fn.ratio=train: "
            "phantom clipping is expected. Fixes: match the precisions (compute_dtype=%s, or float16 for both), "
            "or loss_fn.ratio=shadow.", p.compute_dtype, p.generation_dtype, p.generation_dtype)


# ---- building dataclasses from plain dicts, strictly -----------------------------------------------------


MOVED_KEYS = {
    "policy.optimizer": "policy.megatron_cfg.optimizer (Megatron's optimizer; same field names, plus "
                        "optimizer, min_lr, use_distributed_optimizer)",
    "cluster.assume_distributed_optimizer": "policy.megatron_cfg.optimizer.use_distributed_optimizer (the plan "
                                            "now counts what the run will really use)",
    "generation.vllm_cfg": "policy.precision.generation_dtype (NeMo-RL's generation.vllm_cfg.precision: fp8 is "
                           "policy.precision.generation_dtype: fp8 here, settings under policy.precision.fp8)",
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
