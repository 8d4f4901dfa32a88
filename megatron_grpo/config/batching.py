"""How a step's sequences become micro-batches (``policy.sequence_packing``,
``policy.dynamic_batching``), with NeMo-RL's key names. Re-exported by ``megatron_grpo.config.schema``.
The plans themselves are ``megatron_grpo.models.packing``."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class SequencePackingConfig:
    """NeMo-RL's ``policy.sequence_packing``: several sequences per row, no attention across them."""

    enabled: bool = False
    """Pack the step's sequences into rows (first fit, longest first), one row per micro-batch,
    positions restarting per sequence; a block-diagonal causal mask on the local spec, THD
    ``PackedSeqParams`` (``cu_seqlens``) with Transformer Engine. Losses and metrics equal the padded path's."""
    train_mb_tokens: int = 0
    """Tokens per packed row, i.e. per micro-batch (0 = the step's longest sequence; never below it).
    NeMo-RL's key. Packing cannot be combined with ``policy.dynamic_batching`` (an error, as in NeMo-RL):
    this key alone sets the row length."""

    def __post_init__(self):
        if self.train_mb_tokens < 0:
            raise ValueError(f"policy.sequence_packing.train_mb_tokens must be >= 0, got {self.train_mb_tokens}")


@dataclass
class DynamicBatchingConfig:
    """NeMo-RL's ``policy.dynamic_batching``: micro-batches by a token budget instead of a row count."""

    enabled: bool = False
    """Group the sequences (longest first) so that rows x the micro-batch's width stay within
    ``max_tokens_per_microbatch``; data-parallel ranks get sequences balanced by tokens and the same
    number of micro-batches (the largest are split). Replaces ``policy.train_micro_batch_size``.
    Not with ``policy.sequence_packing`` (an error, as in NeMo-RL: a packed row's length is
    ``policy.sequence_packing.train_mb_tokens``) nor with pipeline parallelism (micro-batches differ in shape)."""
    max_tokens_per_microbatch: int = 4096
    """Token budget of one micro-batch (padding included); a longer sequence gets a micro-batch of its own."""

    def __post_init__(self):
        if self.max_tokens_per_microbatch < 1:
            raise ValueError("policy.dynamic_batching.max_tokens_per_microbatch must be >= 1, "
                             f"got {self.max_tokens_per_microbatch}")
