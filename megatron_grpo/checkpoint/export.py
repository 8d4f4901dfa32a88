"""``megatron-grpo export-hf CHECKPOINT_DIR OUT_DIR [--dtype bfloat16]``: a training checkpoint as
a Hugging Face model (sharded safetensors, ``model.safetensors.index.json``, ``config.json``,
tokenizer and generation files).

Streaming with bounded memory: the torch_dist files are read directly (their metadata gives each
saved chunk's file, offset and length), one unit at a time (the embeddings, each decoder layer,
the final norm and head), each written to its own safetensors file from the tensors' memory (no
serialised copy). At most one unit's HF tensors plus one parameter's checkpoint tensor (and one
saved chunk of it) are held, so the peak stays below twice the largest unit. Weights come from
the optimizer's fp32 main params when the checkpoint has them (half params with master weights),
else from the model weights; Megatron -> HF names, the fused QKV and the GLU's ``[gate; up]``
are undone with ``models/weights.py``'s maps (the weight push's). No process group and no
Megatron import are needed: this runs on one CPU process next to (or after) training.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import struct
from dataclasses import dataclass, field
from typing import Callable, Dict, Iterator, List, Optional, Tuple

import torch
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.metadata import MetadataIndex
from torch.distributed.checkpoint.utils import _create_file_view

from megatron_grpo.checkpoint import folders as ckpt
from megatron_grpo.checkpoint.folders import (
    NORM_KEY_ALIASES,
    CheckpointError,  # noqa: F401  (export-hf's error)
    read_trainer_state,
)
from megatron_grpo.models.qwen3 import load_hf_config, shape_from_hf
from megatron_grpo.models.weight_maps import MAPPED_BUFFERS
from megatron_grpo.models.weights import RankPlacement, param_maps, unshard

logger = logging.getLogger(__name__)

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
_SAFETENSORS_DTYPES = {torch.float32: "F32", torch.bfloat16: "BF16", torch.float16: "F16"}
_LAYER_RENAMES = {"input_layernorm.weight": "self_attention.linear_qkv.layer_norm_weight",
                  "pre_mlp_layernorm.weight": "mlp.linear_fc1.layer_norm_weight"}
"""Megatron's local layer spec saves its norms under Transformer Engine's fused names (the spec's
``sharded_state_dict_keys_map``); TE's MoE layers save their pre-MLP norm as ``pre_mlp_layernorm.weight``
(a separate ``TENorm``): ``checkpoint_key`` takes whichever the checkpoint holds (``NORM_KEY_ALIASES``)."""
_NOT_WEIGHTS = (".safetensors", ".bin", ".pt", ".pth", ".msgpack", ".h5")
MAIN_PARAM_PREFIX = "optimizer.state.fp32_param."


@dataclass
class ExportReport:
    """What ``export_hf`` wrote and held: ``peak_bytes`` of tensors held at once, ``largest_unit_bytes``
    (the largest unit's bytes, as read from the checkpoint or as written, whichever is more), the
    files and the HF tensor names."""

    out_dir: str
    files: List[str] = field(default_factory=list)
    names: List[str] = field(default_factory=list)
    peak_bytes: int = 0
    largest_unit_bytes: int = 0


class _Meter:
    """Bytes of the tensor storages the exporter holds (a storage shared by views counts once)."""

    def __init__(self):
        self.held, self.peak, self._refs = 0, 0, {}

    def hold(self, t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        key = storage.data_ptr()
        if key not in self._refs:
            self._refs[key] = [0, storage.nbytes()]
            self.held += storage.nbytes()
            self.peak = max(self.peak, self.held)
        self._refs[key][0] += 1
        return t

    def release(self, t: torch.Tensor) -> None:
        key = t.untyped_storage().data_ptr()
        self._refs[key][0] -= 1
        if self._refs[key][0] == 0:
            self.held -= self._refs.pop(key)[1]


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


class DistCheckpointReader:
    """Reads (parts of) tensors of a torch_dist checkpoint folder without a process group."""

    def __init__(self, path: str):
        self.path = path
        try:
            self.metadata = FileSystemReader(path).read_metadata()
        except Exception as exc:  # noqa: BLE001 - a missing or broken .metadata
            raise ckpt.CheckpointError(f"checkpoint {path}: cannot read its torch_dist metadata "
                                       f"({os.path.join(path, '.metadata')}): {exc}") from exc
        self.tensors = {k: v for k, v in self.metadata.state_dict_metadata.items() if hasattr(v, "chunks")}

    def read(self, key: str, index: Tuple[int, ...], meter: _Meter) -> torch.Tensor:
        """``tensor[index]`` of global tensor ``key``: the chunks under the leading ``index`` only
        (held in ``meter``; the caller releases the result). A single chunk covering it is returned
        as loaded (no copy)."""
        if key not in self.tensors:
            raise ckpt.CheckpointError(f"checkpoint {self.path}: no tensor {key!r} in its torch_dist metadata")
        md, k = self.tensors[key], len(index)
        shape = tuple(md.size)[k:]
        out = None
        for chunk in md.chunks:
            offsets, sizes = tuple(chunk.offsets), tuple(chunk.sizes)
            if offsets[:k] != index:
                continue
            assert all(s == 1 for s in sizes[:k]), f"{key}: a chunk spans several leading indices {sizes}"
            data = self._load_chunk(md, MetadataIndex(key, chunk.offsets), meter).reshape(sizes[k:])
            if sizes[k:] == shape:  # the whole tensor in one chunk
                return data
            if out is None:
                out = meter.hold(torch.empty(shape, dtype=data.dtype))
            out[tuple(slice(o, o + s) for o, s in zip(offsets[k:], sizes[k:]))] = data
            meter.release(data)
        if out is None:
            raise ckpt.CheckpointError(f"checkpoint {self.path}: tensor {key!r} has no chunk at index {index}")
        return out

    def _load_chunk(self, md, index, meter: _Meter) -> torch.Tensor:
        info = self.metadata.storage_data[index]
        if getattr(info, "transform_descriptors", None):
            raise NotImplementedError(f"checkpoint {self.path}: transformed (compressed) items are not supported")
        file = os.path.join(self.path, info.relative_path)
        try:
            with open(file, "rb") as f:
                tensor = torch.load(_create_file_view(f, info.offset, info.length), map_location="cpu",
                                    weights_only=True)
        except (OSError, RuntimeError, EOFError) as exc:
            raise ckpt.CheckpointError(f"checkpoint file {file}: cannot read {index.fqn}: {exc}") from exc
        return meter.hold(tensor)


def checkpoint_key(mcore_name: str, saved=()) -> Tuple[str, Tuple[int, ...]]:
    """The checkpoint key and leading index of a (TP = EP = 1) Megatron parameter name: layers are
    stacked on a leading axis, experts on a second one; models with dense and MoE layers mixed
    (DeepSeek's first dense layers) save each layer under its own key (``decoder.layers.<i>.``), experts
    stacked. ``saved``: the checkpoint's keys; where it holds the key under the other layer spec's name
    (or unrenamed: MLA's local layers have no renames, or per layer) only, that name."""
    if not mcore_name.startswith("decoder.layers."):
        return mcore_name, ()
    layer, rest = mcore_name[len("decoder.layers."):].split(".", 1)
    expert: Tuple[int, ...] = ()
    if rest.startswith("mlp.experts.local_experts."):
        number, tail = rest[len("mlp.experts.local_experts."):].split(".", 1)
        rest, expert = f"mlp.experts.experts.{tail}", (int(number),)
    renamed = _LAYER_RENAMES.get(rest, rest)
    alias = NORM_KEY_ALIASES.get(f"decoder.layers.{renamed}", "")[len("decoder.layers."):]
    for name in dict.fromkeys(n for n in (renamed, alias, rest) if n):
        for key, index in ((f"decoder.layers.{name}", (int(layer), *expert)), (f"decoder.layers.{layer}.{name}", expert)):
            if key in saved:
                return key, index
    return f"decoder.layers.{renamed}", (int(layer), *expert)


def _units(shape) -> Iterator[Tuple[str, list]]:
    """``(unit name, ParamMaps)``: the embeddings, each decoder layer, the final norm and head."""
    maps = param_maps(shape, RankPlacement(num_local_layers=shape.num_layers))
    units: Dict[str, list] = {}
    for pm in maps:
        if pm.mcore_name.startswith("embedding."):
            name = "embed"
        elif pm.mcore_name.startswith("decoder.layers."):
            name = f"layer{int(pm.mcore_name.split('.')[2]):05d}"
        else:
            name = "head"
        units.setdefault(name, []).append(pm)
    order = ["embed"] + [f"layer{i:05d}" for i in range(shape.num_layers)] + ["head"]
    return ((name, units[name]) for name in order if name in units)


def resolve_checkpoint(path: str) -> str:
    """A checkpoint folder (``step_<N>``) from ``path``: itself, or the ``latest`` of a
    ``checkpointing.checkpoint_dir``; verified against its manifest."""
    if not os.path.isdir(path):
        raise FileNotFoundError(f"CHECKPOINT_DIR {path} does not exist")
    if not os.path.isfile(os.path.join(path, ckpt.STATE_FILE)):
        resolved = ckpt.resolve_for_load(path, fallback_to_previous=False)
        if resolved is None:
            raise FileNotFoundError(f"CHECKPOINT_DIR {path} holds no checkpoint (no {ckpt.STATE_FILE}, no step_* folder)")
        return resolved
    ckpt.verify(path)
    return path


def export_hf(checkpoint_dir: str, out_dir: str, dtype: Optional[str] = None, model_dir: Optional[str] = None,
              progress: Optional[Callable[[str], None]] = None) -> ExportReport:
    """Writes checkpoint ``checkpoint_dir`` as an HF model folder ``out_dir`` (see the module doc).
    ``dtype``: float32 | bfloat16 | float16 (default: the checkpoint's weight dtype); ``model_dir``:
    the HF folder whose config and tokenizer are copied (default: the one the run used);
    ``progress(name)`` is called after each parameter is converted and each unit written."""
    path = resolve_checkpoint(checkpoint_dir)
    if dtype is not None and dtype not in DTYPES:
        raise ValueError(f"--dtype must be one of {', '.join(DTYPES)}, got {dtype!r}")
    model_dir = model_dir or read_trainer_state(path).get("model_dir")
    if not model_dir or not os.path.isfile(os.path.join(model_dir, "config.json")):
        raise FileNotFoundError(f"the model dir recorded in {os.path.join(path, ckpt.STATE_FILE)} ({model_dir}) has no "
                                f"config.json: pass --model-dir with the run's HF model folder (config + tokenizer)")
    hf_config = load_hf_config(model_dir)
    shape = shape_from_hf(hf_config)
    reader = DistCheckpointReader(path)
    target = DTYPES[dtype] if dtype else reader.tensors["embedding.word_embeddings.weight"].properties.dtype
    tmp = out_dir.rstrip("/") + ".tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    os.makedirs(tmp)
    report, meter, weight_map = ExportReport(out_dir), _Meter(), {}
    units = list(_units(shape))
    used = set()
    for i, (unit, maps) in enumerate(units):
        filename = f"model-{i + 1:05d}-of-{len(units):05d}.safetensors"
        names, size, read_bytes = _export_unit(reader, maps, shape, target, meter, used, os.path.join(tmp, filename),
                                               progress)
        report.largest_unit_bytes = max(report.largest_unit_bytes, size, read_bytes)
        weight_map.update({name: filename for name in names})
        report.files.append(filename)
        if progress:
            progress(unit)
    _check_all_used(reader, used)
    report.names, report.peak_bytes = list(weight_map), meter.peak
    total = sum(_file_bytes(tmp, report.files))
    with open(os.path.join(tmp, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f, indent=2)
    _write_config(hf_config, target, os.path.join(tmp, "config.json"))
    _copy_tokenizer(model_dir, tmp)
    shutil.rmtree(out_dir, ignore_errors=True)
    os.replace(tmp, out_dir)
    logger.info("exported %s to %s (%d files, %s)", path, out_dir, len(report.files), str(target).replace("torch.", ""))
    return report


def _export_unit(reader: DistCheckpointReader, maps, shape, dtype, meter: _Meter, used: set, path: str,
                 progress) -> Tuple[List[str], int, int]:
    """Converts and writes one unit; returns its HF names, the bytes written and the bytes read.
    Every tensor is local to this call (and released in ``meter``) when it returns."""
    out: Dict[str, torch.Tensor] = {}
    read_bytes = 0
    for pm in maps:
        converted, nbytes = _convert_param(reader, pm, shape, dtype, meter, used)
        out.update(converted)
        read_bytes += nbytes
        if progress:
            progress(pm.mcore_name)
    size = _write_safetensors(path, out)
    for tensor in out.values():
        meter.release(tensor)
    return list(out), size, read_bytes


def _convert_param(reader: DistCheckpointReader, pm, shape, dtype, meter: _Meter, used: set):
    """One Megatron parameter's HF tensors in ``dtype`` (views of the loaded tensor where no copy
    is needed) and the bytes read for it. DeepSeek's expert bias (``MAPPED_BUFFERS``) stays fp32 whatever
    ``dtype``: transformers keeps ``e_score_correction_bias`` fp32 (``_keep_in_fp32_modules_strict``), as vLLM
    and the trainer do; a bf16 copy would load rounded and route otherwise than the trained model."""
    dtype = torch.float32 if pm.mcore_name.endswith(MAPPED_BUFFERS) else dtype
    key, index = checkpoint_key(pm.mcore_name, reader.tensors)
    main = MAIN_PARAM_PREFIX + key
    source = main if main in reader.tensors else key
    used.update({key, main} & set(reader.tensors))
    full = reader.read(source, index, meter)
    nbytes = _nbytes(full)
    parts = [meter.hold(part) for part in unshard(pm, [full], shape)]  # views of ``full`` or copies
    meter.release(full)
    del full  # from here only ``parts`` keep its memory
    converted = {name: meter.hold(part.to(dtype).contiguous()) for name, part in zip(pm.hf_names, parts)}
    while parts:
        meter.release(parts.pop())
    return converted, nbytes


def _check_all_used(reader: DistCheckpointReader, used: set) -> None:
    """Every model tensor of the checkpoint must have gone into the export."""
    left = sorted(k for k in reader.tensors if not k.startswith("optimizer.") and k not in used)
    if left:
        raise ckpt.CheckpointError(f"checkpoint {reader.path}: tensors without an HF name: {', '.join(left[:5])}")


def _write_safetensors(path: str, tensors: Dict[str, torch.Tensor]) -> int:
    """A safetensors file written tensor by tensor from the tensors' own memory; returns the data bytes."""
    header, offset = {}, 0
    for name, t in tensors.items():
        header[name] = {"dtype": _SAFETENSORS_DTYPES[t.dtype], "shape": list(t.shape),
                        "data_offsets": [offset, offset + _nbytes(t)]}
        offset += _nbytes(t)
    header["__metadata__"] = {"format": "pt"}
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(text)))
        f.write(text)
        for t in tensors.values():
            f.write(t.reshape(-1).view(torch.uint8).numpy().data)
        f.flush()
        os.fsync(f.fileno())
    return offset


def _file_bytes(folder: str, files: List[str]) -> Iterator[int]:
    for name in files:
        with open(os.path.join(folder, name), "rb") as f:
            (header_len,) = struct.unpack("<Q", f.read(8))
        yield os.path.getsize(os.path.join(folder, name)) - 8 - header_len


def _write_config(hf_config: dict, dtype: torch.dtype, path: str) -> None:
    config = dict(hf_config)
    name = str(dtype).replace("torch.", "")
    for key in ("torch_dtype", "dtype"):
        if key in config or key == "torch_dtype":
            config[key] = name
    with open(path, "w") as f:
        json.dump(config, f, indent=2)


def _copy_tokenizer(model_dir: str, out: str) -> None:
    """Every file of the model dir but its weights and config: tokenizer, generation config, chat template."""
    for name in sorted(os.listdir(model_dir)):
        src = os.path.join(model_dir, name)
        if (os.path.isfile(src) and not name.endswith(_NOT_WEIGHTS) and name != "config.json"
                and name != "model.safetensors.index.json"):
            shutil.copy2(src, os.path.join(out, name))
