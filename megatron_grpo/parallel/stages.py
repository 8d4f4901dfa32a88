"""How the decoder layers split over pipeline stages: even, or Megatron-Core's uneven first / last stages.

Pure arithmetic (no torch.distributed, no Megatron import): ``--dry-run``, the memory plan and layout
validation use it before anything is built; the model builder hands the same fields to Megatron's
``TransformerConfig``, whose ``get_num_layers_to_build`` / ``get_transformer_layer_offset`` then place
the layers (``tests/test_pipeline.py`` checks this module against them). Interleaved virtual stages
are not wired: a split here is one contiguous block of layers per stage.
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

    @property
    def is_even(self) -> bool:
        return self == PipelineSplit()

    def describe(self) -> str:
        """The fields set, as ``key=value`` (empty for an even split)."""
        return ", ".join(f"{f.name}={getattr(self, f.name)}" for f in fields(self)
                         if getattr(self, f.name) not in (None, False))

    def config_kwargs(self, pp: int) -> Dict[str, object]:
        """The ``TransformerConfig`` keyword arguments of this split at ``pp`` stages (none at PP = 1,
        where there is nothing to split)."""
        if pp == 1:
            return {}
        return {f.name: getattr(self, f.name) for f in fields(self) if getattr(self, f.name) not in (None, False)}

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


def check_split(split: PipelineSplit) -> None:
    """What can be checked without the model: positive counts, one form at a time."""
    for name in ("num_layers_in_first_pipeline_stage", "num_layers_in_last_pipeline_stage"):
        value = getattr(split, name)
        if value is not None and value < 1:
            raise ValueError(f"{KEY}.{name} must be >= 1 (or null), got {value}")
    if (split.num_layers_in_first_pipeline_stage is not None or split.num_layers_in_last_pipeline_stage is not None) \
            and (split.account_for_embedding_in_pipeline_split or split.account_for_loss_in_pipeline_split):
        raise ValueError(f"{KEY}.num_layers_in_first_pipeline_stage / num_layers_in_last_pipeline_stage cannot be "
                         f"combined with account_for_embedding_in_pipeline_split / account_for_loss_in_pipeline_split "
                         f"(Megatron-Core refuses the mix): {split.describe()}")
