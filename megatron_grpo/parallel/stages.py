"""How the decoder layers split over pipeline stages: even, or Megatron-Core's uneven first / last stages.

Pure arithmetic (no torch.distributed, no Megatron import): ``--dry-run``, the memory plan and layout
validation use it before anything is built; the model builder hands the same fields to Megatron's
``TransformerConfig``, whose ``get_num_layers_to_build`` / ``get_transformer_layer_offset`` then place
the layers (``tests/test_pipeline.py`` checks this module against them). With interleaved virtual
stages (``virtual_pipeline_model_parallel_size`` = V > 1) each stage holds V model chunks, not one contiguous
block: the layers are cut into V rounds, round v holding every stage's v-th chunk in stage order
(``chunk_layers`` / ``chunk_offsets``).
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Dict, List, Optional

KEY = "policy.megatron_cfg"


@dataclass(frozen=True)
class PipelineSplit:
    """Megatron-Core's uneven pipeline fields (``TransformerConfig``, 0.16.1 and 0.19 alike): a fixed
    number of layers on the first and / or last stage and the rest split evenly over the stages between;
    or the embedding and / or the loss counted as one layer each, the ``num_layers (+1) (+1)`` split
    evenly and the first (last) stage building one decoder layer fewer. The two forms exclude each other."""

    num_layers_in_first_pipeline_stage: Optional[int] = None
    num_layers_in_last_pipeline_stage: Optional[int] = None
    account_for_embedding_in_pipeline_split: bool = False
    account_for_loss_in_pipeline_split: bool = False
    virtual_pipeline_model_parallel_size: Optional[int] = None
    """Interleaved virtual stages: model chunks per pipeline stage (None or 1: one contiguous block)."""

    @property
    def is_even(self) -> bool:
        """No uneven field set (the virtual stages are not one)."""
        return PipelineSplit(virtual_pipeline_model_parallel_size=self.virtual_pipeline_model_parallel_size) == self

    @property
    def vpp(self) -> int:
        """Model chunks per pipeline stage (1 without interleaving)."""
        return self.virtual_pipeline_model_parallel_size or 1

    def describe(self) -> str:
        """The fields set, as ``key=value`` (empty for an even split)."""
        return ", ".join(f"{f.name}={getattr(self, f.name)}" for f in fields(self)
                         if getattr(self, f.name) not in (None, False))

    def config_kwargs(self, pp: int) -> Dict[str, object]:
        """The ``TransformerConfig`` keyword arguments of this split at ``pp`` stages (none at PP = 1,
        where there is nothing to split)."""
        if pp == 1:
            return {}
        kwargs = {f.name: getattr(self, f.name) for f in fields(self) if getattr(self, f.name) not in (None, False)}
        if self.vpp == 1:
            kwargs.pop("virtual_pipeline_model_parallel_size", None)
        return kwargs

    def layers_per_stage(self, num_layers: int, pp: int) -> List[int]:
        """Decoder layers of each pipeline stage; ``ValueError`` naming the keys when the split is impossible."""
        if pp == 1:
            return [num_layers]
        first, last = self.num_layers_in_first_pipeline_stage, self.num_layers_in_last_pipeline_stage
        accounted = int(self.account_for_embedding_in_pipeline_split) + int(self.account_for_loss_in_pipeline_split)
        if first is not None or last is not None:
            stages = self._fixed_ends(num_layers, pp)
        elif accounted:
            if (num_layers + accounted) % pp:
                raise ValueError(f"{KEY}.pipeline_model_parallel_size={pp} does not divide num_hidden_layers="
                                 f"{num_layers} + {accounted} (the embedding / loss counted as layers: "
                                 f"{self.describe()})")
            stages = [(num_layers + accounted) // pp] * pp
            stages[0] -= int(self.account_for_embedding_in_pipeline_split)
            stages[-1] -= int(self.account_for_loss_in_pipeline_split)
        elif num_layers % pp:
            raise ValueError(f"{KEY}.pipeline_model_parallel_size={pp} does not divide num_hidden_layers={num_layers}: "
                             f"set {KEY}.num_layers_in_first_pipeline_stage / num_layers_in_last_pipeline_stage, or "
                             f"{KEY}.account_for_embedding_in_pipeline_split / account_for_loss_in_pipeline_split")
        else:
            stages = [num_layers // pp] * pp
        if min(stages) < 1:
            raise ValueError(f"{KEY}: {self.describe()} leaves pipeline stage {stages.index(min(stages))} without "
                             f"a decoder layer ({stages} of {num_layers}); every stage needs at least one")
        return stages

    def _fixed_ends(self, num_layers: int, pp: int) -> List[int]:
        first, last = self.num_layers_in_first_pipeline_stage, self.num_layers_in_last_pipeline_stage
        rest = num_layers - (first or 0) - (last or 0)
        middle = pp - (first is not None) - (last is not None)
        if rest < 0 or (rest > 0) != (middle > 0) or (middle and rest % middle):
            raise ValueError(f"{KEY}: {self.describe()} cannot split num_hidden_layers={num_layers} over "
                             f"pipeline_model_parallel_size={pp} stages: the {rest} layers left must split evenly "
                             f"over the {middle} stage(s) in between")
        stages = [rest // middle] * middle if middle else []
        if first is not None:
            stages.insert(0, first)
        if last is not None:
            stages.append(last)
        return stages

    def offsets(self, num_layers: int, pp: int) -> List[int]:
        """The global index of each stage's first decoder layer."""
        stages = self.layers_per_stage(num_layers, pp)
        return [sum(stages[:s]) for s in range(pp)]

    def chunk_layers(self, num_layers: int, pp: int) -> List[List[int]]:
        """Decoder layers of each stage's model chunks (``[stage][chunk]``; one chunk per stage without
        virtual stages), as Megatron-Core's ``get_num_layers_to_build(config, vp_stage, pp_rank)``: each stage's
        count (the embedding / loss counted as a layer where the split says so) splits evenly over its chunks,
        the embedding's slot in the first chunk of the first stage, the loss's in the last chunk of the last."""
        stages, vpp = self.layers_per_stage(num_layers, pp), self.vpp
        if vpp == 1:
            return [[n] for n in stages]
        if pp == 1:
            raise ValueError(f"{KEY}.virtual_pipeline_model_parallel_size={vpp} needs pipeline_model_parallel_size > 1")
        slots = list(stages)
        slots[0] += int(self.account_for_embedding_in_pipeline_split)
        slots[-1] += int(self.account_for_loss_in_pipeline_split)
        for stage, n in enumerate(slots):
            if n % vpp:
                raise ValueError(f"{KEY}.virtual_pipeline_model_parallel_size={vpp} does not divide pipeline stage "
                                 f"{stage}'s {n} layers ({stages} of num_hidden_layers={num_layers} over "
                                 f"pipeline_model_parallel_size={pp}{'; ' + self.describe() if not self.is_even else ''})"
                                 f": every model chunk needs the same number of layers")
        chunks = [[n // vpp] * vpp for n in slots]
        chunks[0][0] -= int(self.account_for_embedding_in_pipeline_split)
        chunks[-1][-1] -= int(self.account_for_loss_in_pipeline_split)
        if min(min(c) for c in chunks) < 1:
            raise ValueError(f"{KEY}: {self.describe()} leaves a model chunk without a decoder layer ({chunks} of "
                             f"{num_layers}); every chunk needs at least one")
        return chunks

    def chunk_offsets(self, num_layers: int, pp: int) -> List[List[int]]:
        """The global index of each model chunk's first decoder layer (``[stage][chunk]``): chunk v of every
        stage comes after chunk v - 1 of every stage (Megatron-Core's ``get_transformer_layer_offset``)."""
        chunks, offsets, first = self.chunk_layers(num_layers, pp), [[0] * self.vpp for _ in range(pp)], 0
        for v in range(self.vpp):
            for stage in range(pp):
                offsets[stage][v], first = first, first + chunks[stage][v]
        return offsets


def check_split(split: PipelineSplit, pp: int = 1) -> None:
    """What can be checked without the model: positive counts, one form at a time, virtual stages with PP > 1."""
    vpp = split.virtual_pipeline_model_parallel_size
    if vpp is not None and vpp < 1:
        raise ValueError(f"{KEY}.virtual_pipeline_model_parallel_size must be >= 1 (or null), got {vpp}")
    if split.vpp > 1 and pp == 1:
        raise ValueError(f"{KEY}.virtual_pipeline_model_parallel_size={vpp} needs {KEY}.pipeline_model_parallel_size "
                         f"> 1 (interleaved virtual stages split each pipeline stage's layers into model chunks)")
    for name in ("num_layers_in_first_pipeline_stage", "num_layers_in_last_pipeline_stage"):
        value = getattr(split, name)
        if value is not None and value < 1:
            raise ValueError(f"{KEY}.{name} must be >= 1 (or null), got {value}")
    if (split.num_layers_in_first_pipeline_stage is not None or split.num_layers_in_last_pipeline_stage is not None) \
            and (split.account_for_embedding_in_pipeline_split or split.account_for_loss_in_pipeline_split):
        raise ValueError(f"{KEY}.num_layers_in_first_pipeline_stage / num_layers_in_last_pipeline_stage cannot be "
                         f"combined with account_for_embedding_in_pipeline_split / account_for_loss_in_pipeline_split "
                         f"(Megatron-Core refuses the mix): {split.describe()}")


def check_micro_batches(split: PipelineSplit, pp: int, num_micro_batches: int, where: str) -> None:
    """Megatron's interleaved schedule runs the micro-batches through each model chunk in groups of
    ``microbatch_group_size_per_vp_stage`` (PP, its default) and refuses a step whose count is below PP or
    leaves a last group smaller than PP: with virtual stages the count must be a multiple of PP.
    ``where``: how the count came about (the keys that set it)."""
    if split.vpp > 1 and num_micro_batches % pp:
        raise ValueError(f"{KEY}.virtual_pipeline_model_parallel_size={split.vpp}: Megatron's interleaved schedule "
                         f"needs the micro-batches of a step to be a multiple of {KEY}.pipeline_model_parallel_size="
                         f"{pp}, got {num_micro_batches} ({where})")
