"""``megatron-grpo parity-demo``: an HF Qwen3 / Llama checkpoint loaded into Megatron-Core, its logits
compared with transformers' forward of the same weights (fp32, one process)."""

from __future__ import annotations

from typing import Optional

import torch
import transformers

from megatron_grpo.models import build_from_hf, forward_logits
from megatron_grpo.models.tiny import default_model_dir
from megatron_grpo.parallel import state

TOLERANCE = 1e-4
"""Max |logit difference| that passes (fp32 on both sides: ~1e-6 measured)."""


def parity_demo(model_dir: Optional[str] = None) -> int:
    """Prints the max |logit difference| on 2 x 32 random tokens; 0 when within ``TOLERANCE``, else 1.
    ``model_dir`` None: the default tiny model."""
    model_dir = model_dir or default_model_dir()
    state.initialize_model_parallel(state.Layout(world_size=1))
    model, shape = build_from_hf(model_dir)
    ids = torch.randint(0, shape.vocab_size, (2, 32), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ours = forward_logits(model, ids)
        ref = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)(ids).logits
    diff = (ours - ref).abs().max().item()
    print(f"model {model_dir}: Megatron-Core vs transformers logits max |diff| = {diff:.3e}")
    return 0 if diff <= TOLERANCE else 1
