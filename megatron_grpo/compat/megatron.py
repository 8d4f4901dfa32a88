"""Every call into Megatron-Core whose name, signature or presence depends on its version.

Tested: 0.16.1 (Python 3.11, the newest release there) and 0.19.x (Python >= 3.12). Each shim says
what each version needs; one that is the same on both is here because it reaches into an internal
(a private name, an attribute of a live object) that a later release may move. ``megatron.core`` is
imported inside each shim: importing this module costs nothing.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import importlib.util
import re
from importlib.metadata import version as dist_version
from typing import Callable, Iterator, List, Optional, Tuple

import torch


@functools.lru_cache(maxsize=1)
def version() -> Tuple[int, int, int]:
    """The installed megatron-core's ``(major, minor, patch)``, from its package metadata (importing
    ``megatron.core`` costs seconds; this does not)."""
    major, minor, patch = re.match(r"(\d+)\.(\d+)\.(\d+)", dist_version("megatron-core")).groups()
    return int(major), int(minor), int(patch)


MODULES_WITH_CUDA_FACTORIES = (
    "megatron.core.pipeline_parallel.schedules",
    "megatron.core.optimizer.optimizer",
    "megatron.core.optimizer.clip_grads",
    "megatron.core.optimizer.grad_scaler",
    "megatron.core.optimizer.distrib_optimizer",
    "megatron.core.utils",
    "megatron.core.dist_checkpointing.exchange_utils",
)
"""0.16.1 and 0.19: the modules whose module-level ``torch`` builds tensors with ``device="cuda"``
(the pipeline schedules' loss scale, the optimizers' and grad clipping's buffers, the local
multi-tensor L2 norm, the fully parallel load's exchange buffers); the CPU shims hand them a
``torch`` that maps ``"cuda"`` to ``"cpu"``."""


def cuda_factory_modules() -> list:
    """The imported ``MODULES_WITH_CUDA_FACTORIES`` (see there)."""
    return [importlib.import_module(name) for name in MODULES_WITH_CUDA_FACTORIES]


def define_missing_te_general_gemm() -> None:
    """0.16.1: ``moe/router.py`` and ``moe/moe_utils.py`` reference the module-level name
    ``te_general_gemm`` unguarded, which is only bound when Transformer Engine imports (without TE:
    ``NameError`` in the router's gating); binds it to None, Megatron's own "no TE" value.
    0.19: bound to None without TE already; this is a no-op there."""
    for name in ("megatron.core.transformer.moe.router", "megatron.core.transformer.moe.moe_utils"):
        try:
            module = importlib.import_module(name)
        except ImportError:
            continue
        if not hasattr(module, "te_general_gemm"):
            module.te_general_gemm = None


def mla_without_te() -> None:
    """0.16.1: ``transformer/multi_latent_attention.py`` sets its ``HAVE_TE = True`` when importing
    ``megatron.core.extensions.transformer_engine`` succeeds, which it does without Transformer Engine
    (its ``TELinear`` is then a ``MagicMock``, and ``MLASelfAttention.__init__``'s
    ``isinstance(self.linear_proj, TELinear)`` raises ``TypeError``); sets it to the extension's own
    ``HAVE_TE``. 0.19: the module takes ``HAVE_TE`` from the extension; a no-op there."""
    extension = importlib.import_module("megatron.core.extensions.transformer_engine")
    mla = importlib.import_module("megatron.core.transformer.multi_latent_attention")
    if not extension.HAVE_TE:
        mla.HAVE_TE = False


def te_mla_adds_a_q_norm() -> bool:
    """Whether Megatron's MLA with Transformer Engine and ``qk_layernorm`` fuses a norm into ``linear_q_proj``
    when there is no q LoRA (a norm DeepSeek-V2-Lite / Moonlight do not have). 0.16.1: no (``linear_q_proj``
    is a plain column-parallel linear). 0.19: yes (``transformer/mla_qk_norm_config.py`` resolves it to
    ``TELayerNormColumnParallelLinear``)."""
    return importlib.util.find_spec("megatron.core.transformer.mla_qk_norm_config") is not None


def identity_op() -> type:
    """Megatron's ``IdentityOp`` (a spec's "no module"). 0.16.1 builds MLA's ``q_layernorm`` even without a
    q LoRA (never called); 0.19 refuses a non-identity one there (``mla_qk_norm_config.py``)."""
    return importlib.import_module("megatron.core.transformer.identity_op").IdentityOp


def gpt_layer_spec(use_te: bool, num_experts: Optional[int], qk_layernorm: bool = True,
                   normalization: str = "RMSNorm", multi_latent_attention: bool = False, block_config=None):
    """The GPT decoder layer's ``ModuleSpec`` with Transformer Engine or local (torch) layers; with
    ``block_config`` (a ``TransformerConfig``) the decoder block's ``TransformerBlockSubmodules`` instead:
    this pipeline stage's layers, dense or MoE as ``config.moe_layer_freq`` says (a list: DeepSeek's first
    dense layers), each built with the config's QK-layernorm and multi-latent attention.
    0.16.1: ``get_gpt_layer_{with_transformer_engine,local}_spec(...)`` build the spec themselves;
    ``get_gpt_decoder_block_spec(config, use_transformer_engine, normalization)`` the block's.
    0.19: the same names wrap the new ``get_gpt_layer_*_submodules`` helpers in a ``ModuleSpec``
    (same arguments); ``*_spec`` is kept for GPTModel, the ``*_submodules`` are what HybridModel's
    stacks take (see docs/megatron-versions.md); the block spec's signature is unchanged."""
    from megatron.core.models.gpt import gpt_layer_specs as specs

    if block_config is not None:
        return specs.get_gpt_decoder_block_spec(block_config, use_transformer_engine=use_te,
                                                normalization=normalization)
    if use_te:
        return specs.get_gpt_layer_with_transformer_engine_spec(num_experts=num_experts, qk_layernorm=qk_layernorm,
                                                                multi_latent_attention=multi_latent_attention)
    return specs.get_gpt_layer_local_spec(num_experts=num_experts, qk_layernorm=qk_layernorm,
                                          normalization=normalization, multi_latent_attention=multi_latent_attention)


def gpt_model(**kwargs):
    """``GPTModel(**kwargs)``. 0.16.1: the decoder model. 0.19: the same class and arguments, frozen
    ("only accepting critical bug fixes") in favour of ``HybridModel``; it logs a deprecation warning
    per construction (``megatron.core.models.gpt.gpt_model``, WARNING), which ``quiet`` lists as known.
    Why we stay on it and when we move: docs/megatron-versions.md."""
    from megatron.core.models.gpt import GPTModel

    return GPTModel(**kwargs)


def distributed_optimizer_ranges(opt) -> Iterator[Tuple[object, object, int, int]]:
    """``(model_param, main_param, start, end)`` for every parameter range this rank's
    ``DistributedOptimizer`` owns (``[start, end)`` of the flattened parameter). 0.16.1 and 0.19:
    the private ``gbuf_ranges[model chunk][dtypes][bucket]["param_map"]`` (param -> ranges, of which
    ``"param"`` is the range within the parameter) and ``model_param_group_index_map`` (param ->
    ``(group index, order)`` into the inner optimizer's param groups)."""
    for gbuf_range_maps in opt.gbuf_ranges:
        for buckets in gbuf_range_maps.values():
            for bucket in buckets:
                for model_param, ranges in bucket["param_map"].items():
                    group_index, group_order = opt.model_param_group_index_map[model_param]
                    main = opt.optimizer.param_groups[group_index]["params"][group_order]
                    yield model_param, main, ranges["param"].start, ranges["param"].end


LEFT_SET_BY_DESTROY = ("_INTRA_PARTIAL_DATA_PARALLEL_GROUP_WITH_CP", "_INTRA_PARTIAL_DATA_PARALLEL_GROUP_WITH_CP_GLOO")
"""``parallel_state`` globals holding process groups that ``destroy_model_parallel`` leaves set."""


def destroy_model_parallel() -> None:
    """``parallel_state.destroy_model_parallel()``, then the groups it forgets. 0.16.1 and 0.19: it
    resets every group global but ``LEFT_SET_BY_DESTROY`` (without partial data parallelism: the
    data-parallel-with-CP group and its gloo twin themselves), so those groups, and a gloo group's
    worker threads, outlive the teardown; they are reset here too (private module globals)."""
    from megatron.core import parallel_state as ps

    ps.destroy_model_parallel()
    for name in LEFT_SET_BY_DESTROY:
        if getattr(ps, name, None) is not None:
            setattr(ps, name, None)


def clear_module_caches() -> None:
    """Empties the caches through which Megatron keeps model modules alive after the model is dropped.
    0.16.1 and 0.19: ``RotaryEmbedding.forward`` is an ``lru_cache(maxsize=32)`` method, so its cache
    holds every rotary embedding (``self``) that ran, and with it the model's context-parallel group
    (``self.cp_group``), until the process ends."""
    from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding

    RotaryEmbedding.forward.cache_clear()


@contextlib.contextmanager
def rotary_positions(gpt, position_ids: torch.Tensor):
    """Makes ``gpt``'s RoPE rotate each token by its own position in ``position_ids`` ``[b, s]`` (restarting
    per packed sequence) during the enclosed forward, as the padded forward rotates position p of each row.
    0.16.1 and 0.19: ``GPTModel._preprocess`` calls ``self.rotary_pos_emb(rotary_seq_len, packed_seq=...,
    cp_group=...)`` (``position_embedding_type="rope"``) and ignores ``position_ids``: it rotates by the row
    position, so a sequence at offset o of a packed row got angles (o + i) * inv_freq, whose fp32 rounding
    grows with o. Its ``RotaryEmbedding`` returns ``get_emb(n)`` ``[s, 1, 1, d]`` (row p = p * inv_freq in
    fp32, the same whatever n; CP-sliced, but the local attention refuses CP > 1), which
    ``_apply_rotary_pos_emb_bshd`` broadcasts over ``[s, b, heads, d]``; so the per-token ``[s, b, 1, d]``
    made here from the same rows gives each sequence exactly the padded forward's rotation. Transformer
    Engine's THD path restarts positions itself."""
    rope = gpt.rotary_pos_emb
    assert gpt.position_embedding_type == "rope", gpt.position_embedding_type
    assert gpt.config.context_parallel_size == 1, "the local DotProductAttention refuses CP > 1 itself"

    def per_token(max_seq_len: int, offset: int = 0, packed_seq: bool = False, cp_group=None):
        assert offset == 0 and not packed_seq, (offset, packed_seq)
        table = rope.get_emb(position_ids.shape[1])[:, 0, 0]  # positions restart: each < the row's length
        return table[position_ids.t()].unsqueeze(2)

    rope.forward = per_token  # an instance attribute shadows the class's (lru-cached) forward
    try:
        yield
    finally:
        del rope.forward


def set_write_results_queue(make_queue: Callable[[], object]) -> None:
    """Makes ``torch_dist``'s filesystem writer collect its writers' results through ``make_queue()``
    instead of a spawn-mode ``multiprocessing.Manager().Queue()`` (a helper process).
    0.16.1: ``filesystem_async._get_write_results_queue()``, called per save.
    0.17+: renamed ``get_write_results_queue(mp_mode="spawn")`` and cached module-wide in
    ``_results_queue`` (the cache is cleared so the next save asks ``make_queue``)."""
    from megatron.core.dist_checkpointing.strategies import filesystem_async

    def factory(*args, **kwargs):
        return make_queue()

    if version() < (0, 17, 0):
        filesystem_async._get_write_results_queue = factory
    else:
        filesystem_async.get_write_results_queue = factory
        filesystem_async._results_queue = None


def keep_checkpoint_writer_errors() -> None:
    """Makes a failed ``torch_dist`` shard write report its error (a full disk says so).
    0.16.1: the writer's exception reaches the caller as the cause of "Worker failure: ...".
    0.17+: ``write_preloaded_data`` returns ``(index, exception)`` and
    ``write_preloaded_data_multithread``'s ``check_local_output`` then fails on
    ``assert isinstance(..., list), type(...)``: the error becomes "An error is caught while starting
    worker 0, error: <class 'OSError'>", errno and message lost. The in-line writer (the last bucket,
    the only one at the default ``thread_count=1``) is wrapped to raise its exception instead, which
    that ``except`` turns into the same message with the error's text; worker threads (more buckets)
    keep Megatron's behaviour (raising there would leave its queue joins waiting)."""
    if version() < (0, 17, 0):
        return
    from megatron.core.dist_checkpointing.strategies.filesystem_async import FileSystemWriterAsync

    write = FileSystemWriterAsync.write_preloaded_data
    if getattr(write, "_megatron_grpo", False):
        return

    def write_preloaded_data(*args, **kwargs):
        output = write(*args, **kwargs)
        in_line = kwargs.get("results_queue") is None and kwargs.get("count_queue") is None
        if in_line and output is not None and isinstance(output[1], BaseException):
            raise output[1]
        return output

    write_preloaded_data._megatron_grpo = True
    FileSystemWriterAsync.write_preloaded_data = staticmethod(write_preloaded_data)


def async_save_kwargs() -> dict:
    """Extra ``dist_checkpointing.save`` arguments for an asynchronous save (``async_sharded_save=True``).
    0.16.1: none (Megatron's own ``AsyncRequest`` machinery is the only one). 0.17+: the default
    ``async_strategy="nvrx"`` needs ``nvidia-resiliency-ext`` (``ModuleNotFoundError`` otherwise; not a
    dependency of ours: no CPU build); ``"mcore"`` keeps the 0.16.1 machinery, deprecated in 0.19
    (docs/megatron-versions.md)."""
    return {} if version() < (0, 17, 0) else {"async_strategy": "mcore"}


def set_router_replay(router, hook) -> None:
    """Installs ``hook`` as ``TopKRouter``'s top-k source. 0.16.1 and 0.19: the attribute
    ``router.router_replay`` (None unless ``moe_enable_routing_replay``), whose
    ``get_replay_topk(scores, topk, num_groups, group_topk, default_compute_topk)`` the routing
    function calls; 0.19 also sets ``hook.layer_number`` when the router's layer number is set."""
    router.router_replay = hook


def mask_padding_in_expert_counts(router) -> None:
    """Makes ``TopKRouter._apply_expert_bias`` (the per-expert token count behind the expert-bias update)
    take a padding mask. 0.16.1 and 0.19: it computes ``routing_map & ~padding_mask`` with ``routing_map``
    ``[tokens, experts]`` and the flattened mask ``[tokens]`` (a ``RuntimeError`` unless the two sizes
    happen to agree); the mask is broadcast over the experts here, the rest as Megatron's."""
    def apply_expert_bias(routing_map, padding_mask=None):
        if router.enable_expert_bias and torch.is_grad_enabled():
            with torch.no_grad():
                if padding_mask is not None:
                    routing_map = routing_map & ~padding_mask.reshape(-1, 1)
                router.local_tokens_per_expert += routing_map.sum(dim=0)

    router._apply_expert_bias = apply_expert_bias


def static_inference_context(max_batch_size: int, max_sequence_length: int):
    """Megatron's KV-cache context for a fixed batch. 0.16.1 and 0.19:
    ``StaticInferenceContext(max_batch_size, max_sequence_length)`` (0.19 builds its
    ``InferenceConfig`` itself; 0.16.1 took ``materialize_only_last_token_logits`` directly)."""
    from megatron.core.inference.contexts import StaticInferenceContext

    return StaticInferenceContext(max_batch_size, max_sequence_length)


def keep_kv_rows(context, keep: List[int]) -> None:
    """Drops every other batch row from ``context``'s KV cache (finished sequences). 0.16.1 and 0.19:
    ``context.key_value_memory_dict[layer_number] = (key, value)``, each ``[seq, batch, heads, dim]``."""
    for layer, (key, value) in context.key_value_memory_dict.items():
        index = torch.tensor(keep, device=key.device)
        context.key_value_memory_dict[layer] = (key.index_select(1, index), value.index_select(1, index))


def stage_output_dtype(compute_dtype, params_dtype):
    """The dtype of the hidden states a pipeline stage hands on (what ``config.pipeline_dtype`` must
    be: the receiving stage allocates its buffer in it) when the stage runs under autocast to
    ``compute_dtype`` with ``params_dtype`` weights; every layer ends in Megatron's bias-dropout-add
    of the layer output (autocast dtype) onto the residual stream (the embedding's, params dtype).
    0.16.1: ``_bias_dropout_add_func`` casts the residual to the layer output's dtype -> the
    autocast dtype. 0.17+: it casts the layer output to the residual's dtype ("fp32 residual
    connections", ``fusions/fused_bias_dropout.py``) -> the params dtype. Without autocast (compute
    dtype = params dtype, or fp32 compute) both give the params dtype."""
    autocast = not (compute_dtype == params_dtype or compute_dtype == torch.float32)
    if autocast and version() < (0, 17, 0):
        return compute_dtype
    return params_dtype


def moe_aux_loss_token_multiplier(num_local_tokens: int, tp_cp_size: int) -> int:
    """The factor Megatron's router multiplies each rank's MoE aux and z losses by under
    ``calculate_per_token_loss`` (to undo ``finalize_model_grads``' division by the global token
    count), for a rank whose router sees ``num_local_tokens`` tokens (its sequence-parallel shard).
    0.16.1-0.18: ``num_local_tokens``. 0.19: ``num_local_tokens * tp_cp_group.size()``
    (``transformer/moe/router.py``, ``attach_and_log_load_balancing_loss`` and ``apply_z_loss``):
    the TP ranks' partial router gradients are summed, so 0.19 scales by the TP x CP group's tokens."""
    if version() < (0, 19, 0):
        return num_local_tokens
    return num_local_tokens * tp_cp_size


FP8_TRAINING_FORMATS = ("e4m3", "hybrid")
FP8_TRAINING_RECIPES = ("blockwise", "tensorwise", "delayed")
"""``policy.megatron_cfg.fp8`` / ``fp8_recipe`` choices: ``TransformerConfig.fp8`` is ``Literal['e4m3', 'hybrid']``
and ``fp8_recipe`` ``Literal['tensorwise', 'delayed', 'mxfp8', 'blockwise', 'custom']`` in 0.16.1 and 0.19.2
(mxfp8 is Blackwell-only, custom needs a quantizer factory: not offered)."""


def fp8_training_fields(fp8: str, recipe: str) -> dict:
    """The ``TransformerConfig`` fields of FP8 training through Transformer Engine: ``fp8`` (the format, Megatron's
    ``--fp8-format``) and ``fp8_recipe`` (``--fp8-recipe``). Same names and values in 0.16.1 and 0.19.2; with
    them set, Megatron-Core's ``TransformerBlock`` runs every layer under TE's ``fp8_autocast``
    (``fp8_utils.get_fp8_context``: per layer for blockwise / tensorwise, around the block for delayed).
    Without TE that context is a no-op, which is why a run refuses them there (``trainer/layout.check_machine``)."""
    assert fp8 in FP8_TRAINING_FORMATS and recipe in FP8_TRAINING_RECIPES, (fp8, recipe)
    return {"fp8": fp8, "fp8_recipe": recipe}
