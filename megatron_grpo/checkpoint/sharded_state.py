"""Model + optimizer state as ``megatron.core.dist_checkpointing`` sharded state dicts.

The model part is the ``GPTModel``'s own ``sharded_state_dict()``: global keys that do not depend
on the layout (TP shards, layers stacked on a leading axis, experts by global index, the GLU's
``[gate; up]`` split into its two halves).

The optimizer part is in *model space*, the same whatever the optimizer: for every parameter,
``optimizer.state.<name>.<model key>`` holds Adam's ``exp_avg`` / ``exp_avg_sq`` (SGD's
``momentum_buffer``) and, when the optimizer keeps main params apart from the weights (half
params with master weights), ``optimizer.state.fp32_param.<model key>``: tensors of the model
key's global shape. Each rank contributes exactly the elements it owns. Without the distributed
optimizer a rank owns its whole TP shard (DP replicas are deduplicated by ``replica_id``); with it,
a rank owns a contiguous flat range of each shard, which is written as up to three rectangles
(a partial first row, whole rows, a partial last row). Loading asks, on every rank, for the
rectangles its own layout needs, so a checkpoint written at one TP / DP / EP layout, with or
without the distributed optimizer, loads at any other, every rank reading only its part.

Why not ``optimizer.megatron.sharded_state_dict(...)`` (Megatron-Core 0.16.1): its only format
that saves and reshards TP, ``fully_reshardable``, gathers each model-parallel shard's whole
optimizer state on every data-parallel rank (or, ``..._mem_efficient``, on DP rank 0); the
fully parallel ``fully_sharded_model_space`` does not save (torch_dist refuses ``flattened_range``);
``dp_reshardable`` cannot change TP; and loading into a fresh optimizer fails or shares one step
tensor between all parameters (../shared/ENVIRONMENT.md). The rectangles above are
``ShardedTensor``s without a regular grid, which torch_dist stores and reshards as they are. Nor
does this path need Megatron's gloo data-parallel groups (its ``dp_zero`` gathers do; they are not
created on CUDA): every rank saves and loads its own pieces.

Adam's step count (the same for every parameter) is not a tensor here: the caller saves it with
the trainer state and passes it back to ``restore_step``. torch's Adam / AdamW keep it per parameter
(``state[p]["step"]``, ``optimizer_step``); TE's and Apex's FusedAdam in the param groups
(``param_groups[i]["step"]``, ``optimizer_group_step``): both forms are saved and restored.
"""

from __future__ import annotations

import dataclasses
from typing import Dict, Iterator, List, Optional, Tuple

import torch
from megatron.core import parallel_state as ps
from megatron.core.dist_checkpointing.dict_utils import nested_values
from megatron.core.dist_checkpointing.mapping import ShardedTensor, ShardedTensorFactory
from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer
from torch.distributed.checkpoint import FileSystemReader

from megatron_grpo.checkpoint.folders import NORM_KEY_ALIASES
from megatron_grpo.compat.megatron import distributed_optimizer_ranges
from megatron_grpo.models import model_chunks, unwrap
from megatron_grpo.parallel.stages import PipelineSplit

STATE_PREFIX = "optimizer.state"
MAIN_PARAM = "fp32_param"
"""The name of the main (fp32) params, as Megatron's own optimizer checkpoints call them."""


@dataclasses.dataclass
class ParamState:
    """One parameter as one optimizer sees it: the model weight, the main param the optimizer
    updates (the weight itself for fp32 params without master copies) and the flat range
    ``[start, end)`` of the weight's local (TP) shard that this rank owns (all of it without the
    distributed optimizer)."""

    model_param: torch.nn.Parameter
    main_param: torch.Tensor
    start: int
    end: int
    state: dict
    distributed: bool = False
    """Owned by this data-parallel rank alone (the distributed optimizer)."""

    @property
    def separate_main(self) -> bool:
        """The main param has its own storage (an fp32 copy of a half weight)."""
        return self.main_param.untyped_storage().data_ptr() != self.model_param.untyped_storage().data_ptr()


@dataclasses.dataclass(frozen=True)
class Block:
    """Rows ``[row_start, row_end)`` of a weight's local shard and the model ``ShardedTensor``
    (the template: key, global shape, offset, replica id) they are saved as."""

    row_start: int
    row_end: int
    template: object


def model_sharded_state_dict(model) -> dict:
    """The ``GPTModel``'s sharded state dict (inside Megatron's DDP / ``Float16Module``); with interleaved
    virtual stages ``{"model0": chunk 0's, "model1": ...}`` as Megatron-LM saves them. The tensors' keys are
    global (a chunk's layers under their global index), so the files are the same at any VPP and reshard."""
    chunks = model_chunks(model)
    if len(chunks) == 1:
        return unwrap(chunks[0]).sharded_state_dict()
    return {f"model{i}": unwrap(chunk).sharded_state_dict() for i, chunk in enumerate(chunks)}


def load_model_state(model, loaded: dict) -> None:
    """Copies a loaded ``model_sharded_state_dict`` into the model (every chunk), strictly."""
    chunks = model_chunks(model)
    if len(chunks) == 1:
        unwrap(chunks[0]).load_state_dict(loaded, strict=True)
        return
    for i, chunk in enumerate(chunks):
        unwrap(chunk).load_state_dict(loaded[f"model{i}"], strict=True)


def checkpoint_keys(path: str) -> set:
    """Every key of the torch_dist checkpoint folder ``path`` (its ``.metadata``; no process group)."""
    return set(FileSystemReader(path).read_metadata().state_dict_metadata)


def match_checkpoint_keys(model_sd: dict, saved: set) -> None:
    """Renames, in place, the model's ``ShardedTensor`` keys that the checkpoint holds under the
    other spec's name (``NORM_KEY_ALIASES``), so a checkpoint of TE layers loads into local layers and
    the reverse; the optimizer's keys, built from these, follow."""
    for value in nested_values(model_sd):
        alias = NORM_KEY_ALIASES.get(value.key) if isinstance(value, ShardedTensor) else None
        if alias is not None and value.key not in saved and alias in saved:
            value.key = alias


def layout_record(model) -> dict:
    """The parallel layout this rank's model is built at and the shape of the model it holds: what a
    checkpoint records (``trainer_state.pt``'s ``layout``) so that a load that cannot be served names both."""
    gpt = unwrap(model_chunks(model)[0])
    c = gpt.config
    split = PipelineSplit(c.num_layers_in_first_pipeline_stage, c.num_layers_in_last_pipeline_stage,
                          c.account_for_embedding_in_pipeline_split, c.account_for_loss_in_pipeline_split,
                          c.virtual_pipeline_model_parallel_size)
    dp = ps.get_data_parallel_world_size()
    return {"world_size": c.tensor_model_parallel_size * c.pipeline_model_parallel_size * c.context_parallel_size * dp,
            "tp": c.tensor_model_parallel_size, "pp": c.pipeline_model_parallel_size, "cp": c.context_parallel_size,
            "ep": c.expert_model_parallel_size, "etp": c.expert_tensor_parallel_size, "dp": dp,
            "layers_per_stage": split.layers_per_stage(c.num_layers, c.pipeline_model_parallel_size), "vpp": split.vpp,
            "num_layers": c.num_layers, "hidden_size": c.hidden_size, "num_experts": c.num_moe_experts or 0,
            "vocab_size": gpt.vocab_size}


def format_layout(layout: Optional[dict]) -> str:
    """``layout_record`` as one line (checkpoints written before layouts were recorded: unknown)."""
    if not layout:
        return "an unrecorded layout (written before checkpoints recorded theirs)"
    stages = "+".join(map(str, layout["layers_per_stage"]))
    virtual = f" VPP={layout['vpp']}" if layout.get("vpp", 1) > 1 else ""
    return (f"TP={layout['tp']} PP={layout['pp']}{virtual} (layers {stages}) CP={layout['cp']} EP={layout['ep']} "
            f"ETP={layout['etp']} DP={layout['dp']} on {layout['world_size']} ranks, a model of {layout['num_layers']} "
            f"layers, hidden {layout['hidden_size']}, {layout['num_experts']} experts, vocab {layout['vocab_size']}")


def check_model_shapes(model_sd: dict, path: str) -> None:
    """``ValueError`` naming the first model tensor this layout needs that checkpoint ``path`` does not
    hold, or holds with another global shape (another model, not another layout: dist_checkpointing
    reshards TP / PP / DP / EP but cannot turn one model into another)."""
    saved = FileSystemReader(path).read_metadata().state_dict_metadata
    for value in nested_values(model_sd):
        if not isinstance(value, ShardedTensor):
            continue
        if value.key not in saved:
            raise ValueError(f"it holds no tensor {value.key!r}")
        size = tuple(saved[value.key].size)
        if size != tuple(value.global_shape):
            raise ValueError(f"{value.key!r} has the global shape {size} there, {tuple(value.global_shape)} here")


def chained(optimizer) -> List:
    """The underlying Megatron optimizers (dense and expert params), stubs left out."""
    opts = list(getattr(optimizer, "chained_optimizers", [optimizer]))
    return [opt for opt in opts if not getattr(opt, "is_stub_optimizer", False)]


def param_states(optimizer) -> Iterator[ParamState]:
    """Every parameter this rank's optimizers update (``optimizer`` is ``Optimizer.megatron``)."""
    for opt in chained(optimizer):
        if isinstance(opt, DistributedOptimizer):
            yield from _distributed_param_states(opt)
        elif hasattr(opt, "float16_groups"):  # Float16OptimizerWithFloat16Params: fp32 main copies
            for model_group, main_group, fp32_group in zip(opt.float16_groups, opt.fp32_from_float16_groups,
                                                           opt.fp32_from_fp32_groups):
                for model_param, main in zip(model_group, main_group):
                    yield ParamState(model_param, main, 0, model_param.numel(), opt.optimizer.state[main])
                for param in fp32_group:
                    yield ParamState(param, param, 0, param.numel(), opt.optimizer.state[param])
        else:  # FP32Optimizer: the optimizer updates the weights themselves (any dtype)
            for group in opt.optimizer.param_groups:
                for param in group["params"]:
                    yield ParamState(param, param, 0, param.numel(), opt.optimizer.state[param])


def _distributed_param_states(opt) -> Iterator[ParamState]:
    for model_param, main, start, end in distributed_optimizer_ranges(opt):
        yield ParamState(model_param, main, start, end, opt.optimizer.state[main], distributed=True)


def state_names(optimizer) -> Tuple[str, ...]:
    """The per-parameter state tensors of the optimizer kind (``step`` apart)."""
    config = chained(optimizer)[0].config if chained(optimizer) else optimizer.config
    if config.optimizer == "adam":
        return ("exp_avg", "exp_avg_sq")
    return ("momentum_buffer",) if config.sgd_momentum else ()


def keeps_group_step(opt) -> bool:
    """The Megatron optimizer ``opt``'s inner Adam counts its steps in ``param_groups[i]["step"]``
    (TE's / Apex's FusedAdam, which Megatron picks when they import; advanced for groups with params
    only) rather than in a per-parameter ``state[p]["step"]`` (torch's Adam / AdamW)."""
    inner = getattr(opt, "optimizer", None)
    return (inner is not None and opt.config.optimizer == "adam"
            and not isinstance(inner, (torch.optim.Adam, torch.optim.AdamW)))


def _stepped_groups(opt) -> Iterator[dict]:
    """The param groups (with params) of ``opt`` whose ``step`` counts its updates."""
    if keeps_group_step(opt):
        yield from (group for group in opt.optimizer.param_groups if group["params"])


def optimizer_step(optimizer) -> int:
    """This rank's per-parameter Adam step count (0 before the first update, for SGD and for
    FusedAdam, which counts in its param groups); the same for every param."""
    steps = {int(ps.state["step"]) for ps in param_states(optimizer) if "step" in ps.state}
    assert len(steps) <= 1, f"optimizer steps differ between parameters: {sorted(steps)}"
    return steps.pop() if steps else 0


def optimizer_group_step(optimizer) -> Optional[int]:
    """This rank's param-group Adam step count (FusedAdam's ``param_groups[i]["step"]``), None when
    no param group keeps one (torch's optimizers, SGD, before the first update)."""
    steps = {int(group["step"]) for opt in chained(optimizer) for group in _stepped_groups(opt) if "step" in group}
    assert len(steps) <= 1, f"optimizer steps differ between param groups: {sorted(steps)}"
    return steps.pop() if steps else None


def has_state(optimizer) -> bool:
    """This rank's optimizer holds state tensors (it has made an update)."""
    names = state_names(optimizer)
    return any(ps.state.get(name) is not None for ps in param_states(optimizer) for name in names)


def param_blocks(model_sd: dict) -> Dict[int, List[Block]]:
    """``id(weight) -> blocks`` of the model's sharded state dict (factories such as the GLU's
    ``[gate; up]`` split are built: each half is a block with its own global placement)."""
    blocks: Dict[int, List[Block]] = {}
    for value in nested_values(model_sd):
        if isinstance(value, ShardedTensor):
            rows = value.data.shape[0] if value.data.dim() else 1
            blocks.setdefault(id(value.data), []).append(Block(0, rows, value))
        elif isinstance(value, ShardedTensorFactory):
            weight = value.data
            for built in nested_values(value.build()):
                blocks.setdefault(id(weight), []).append(_factory_block(weight, built))
    return blocks


def _factory_block(weight: torch.Tensor, built) -> Block:
    """The rows of ``weight`` that a factory-built ``ShardedTensor`` (a row slice of it) covers."""
    data = built.data
    assert data.is_contiguous() and data.shape[1:] == weight.shape[1:], \
        f"{built.key}: only factories that split a weight by rows are supported"
    row_elements = weight[0].numel() if weight.dim() > 1 else 1
    start = (data.data_ptr() - weight.data_ptr()) // (row_elements * weight.element_size())
    return Block(start, start + data.shape[0], built)


def _rectangles(start: int, end: int, row_start: int, row_end: int, cols: int) -> Iterator[Tuple[int, int, int, int]]:
    """``[start, end)`` of a flat ``[rows, cols]`` tensor intersected with rows ``[row_start, row_end)``,
    as rectangles ``(row, num_rows, col, num_cols)`` (row relative to ``row_start``)."""
    lo, hi = max(start, row_start * cols), min(end, row_end * cols)
    while lo < hi:
        row, col = divmod(lo, cols)
        if col or hi - lo < cols:  # a partial row
            width = min(cols - col, hi - lo)
            yield row - row_start, 1, col, width
            lo += width
        else:
            num_rows = (hi - lo) // cols
            yield row - row_start, num_rows, 0, cols
            lo += num_rows * cols


def _pieces(key: str, flat: torch.Tensor, ps: ParamState, blocks: List[Block]) -> List:
    """The ``ShardedTensor`` rectangles of ``flat`` (the owned range ``[ps.start, ps.end)`` of a
    tensor shaped like the weight's local shard) under ``<key>.<model key>``."""
    shape = ps.model_param.shape
    assert len(shape) <= 2, f"{blocks[0].template.key}: weights of {len(shape)} dims are not supported"
    cols = shape[1] if len(shape) == 2 else 1
    out = []
    for block in blocks:
        t = block.template
        prepend = t.prepend_axis_num
        for row, num_rows, col, num_cols in _rectangles(ps.start, ps.end, block.row_start, block.row_end, cols):
            begin = (block.row_start + row) * cols + col - ps.start
            local = (num_rows, num_cols) if len(shape) == 2 else (num_rows,)
            offset = list(t.global_offset)
            offset[prepend] += row
            if len(shape) == 2:
                offset[prepend + 1] += col
            data = flat[begin:begin + num_rows * num_cols].view((1,) * prepend + local)
            out.append(ShardedTensor(
                key=f"{key}.{t.key}", data=data, dtype=data.dtype, local_shape=tuple(data.shape),
                global_shape=tuple(t.global_shape), global_offset=tuple(offset), axis_fragmentations=None,
                replica_id=_owner_replica(t.replica_id) if ps.distributed else t.replica_id))
    return out


def _owner_replica(replica_id):
    """The distributed optimizer's ranges are disjoint over data parallelism: the model's replica
    id with its data-parallel component (the last) set to 0."""
    if isinstance(replica_id, int):
        return 0
    return tuple(replica_id[:-1]) + (0,)


def optimizer_sharded_state_dict(optimizer, model_sd: dict, with_state: bool, for_loading: bool = False,
                                 main_params: bool = True) -> dict:
    """``{key: [ShardedTensor, ...]}`` of the optimizer's model-space state (see the module doc).

    ``for_loading`` allocates missing state tensors (a fresh optimizer has none) so the load
    fills them in place; nothing is saved or loaded without ``with_state`` (no update yet).
    ``main_params=False`` leaves out separate main params (a checkpoint without them)."""
    if not with_state:
        return {}
    blocks = param_blocks(model_sd)
    names = state_names(optimizer)
    out: Dict[str, List] = {}
    for ps in param_states(optimizer):
        if ps.end <= ps.start:
            continue
        if id(ps.model_param) not in blocks:
            raise AssertionError(f"a parameter of shape {tuple(ps.model_param.shape)} has no model checkpoint key")
        tensors = {}
        if ps.separate_main and main_params:
            tensors[MAIN_PARAM] = ps.main_param
        for name in names:
            if for_loading and ps.state.get(name) is None:
                ps.state[name] = torch.zeros_like(ps.main_param, memory_format=torch.preserve_format)
            tensors[name] = ps.state[name]
        for name, tensor in tensors.items():
            flat = tensor.detach().view(-1)
            assert flat.numel() == ps.end - ps.start, (name, flat.numel(), ps.start, ps.end)
            for piece in _pieces(f"{STATE_PREFIX}.{name}", flat, ps, blocks[id(ps.model_param)]):
                out.setdefault(piece.key, []).append(piece)
    return out


def restore_step(optimizer, step: int, with_state: bool, group_step: Optional[int] = None) -> None:
    """Sets Adam's step count after a load, in the form each optimizer keeps it: torch's Adam / AdamW
    one tensor *per parameter* (a shared one would be advanced once per parameter by torch's AdamW),
    FusedAdam the ``step`` of every param group with params (else its bias correction restarts at
    step 1). ``step`` / ``group_step`` are the checkpoint's per-parameter / param-group counts: the
    same count, so either fills both forms (a checkpoint of one optimizer resumes into the other).
    No state at all without ``with_state``."""
    count = max(step, group_step or 0)
    for opt in chained(optimizer):
        grouped = keeps_group_step(opt)
        for ps in param_states(opt):
            if not with_state:
                ps.state.clear()
            elif "exp_avg" in ps.state and not grouped:  # Adam (SGD keeps no step)
                ps.state["step"] = torch.tensor(float(count), dtype=torch.float32)
        for group in _stepped_groups(opt):
            if with_state:
                group["step"] = count
            else:
                group.pop("step", None)


def has_separate_main_params(optimizer) -> bool:
    """The optimizer keeps main params apart from the weights (half params with master weights)."""
    return any(ps.separate_main for ps in param_states(optimizer))
