"""Log-prob gaps between precisions on one model: fp32 vs bf16 / fp16 through the trainer's forward (fp32
weights, autocast compute), and each precision's error against an fp64 forward of the same weights, overall
and by rarity bucket (``tools/cluster/gpu_check.py``'s ``beta`` phase). Imports megatron.core (through
``models.forward``): import this module in the process that measures."""

from __future__ import annotations

import time
from typing import Dict

import torch

from megatron_grpo.models import build_from_hf, forward_logits
from megatron_grpo.models.forward import forward_log_probs, model_device, pack
from megatron_grpo.models.spec import configure_fp32_matmul
from megatron_grpo.parallel import state

PROMPT_LEN = 16
"""Tokens of each random sequence that are prompt (not scored)."""


def fp64_log_probs(model, packed) -> torch.Tensor:
    """``[B, S]`` fp64 log-probs of ``packed.labels``: the model converted to fp64 in place (so call it
    last), Megatron's forward one row at a time, log-softmax in fp64 (the trainer's log-prob kernel is
    fp32 by design: it would cap the reference at fp32)."""
    model.double()
    device = model_device(model)
    rows = []
    with torch.no_grad():
        for i in range(packed.input_ids.shape[0]):
            logits = forward_logits(model, packed.input_ids[i:i + 1].to(device)).double()
            labels = packed.labels[i:i + 1].to(device).unsqueeze(-1)
            rows.append(torch.log_softmax(logits, dim=-1).gather(-1, labels).squeeze(-1).cpu())
    return torch.cat(rows)


def precision_log_probs(model, packed, cuda: bool) -> Dict:
    """Log-probs per precision (fp32 / bf16 / fp16 through the trainer's forward: fp32 weights, autocast
    compute; then the fp64 reference) and each one's forward seconds (the second, warm call)."""
    lp, seconds = {}, {}
    for name, dtype in (("fp32", torch.float32), ("bf16", torch.bfloat16), ("fp16", torch.float16), ("fp64", None)):
        for _ in ("warmup", "timed"):  # the first forward of each dtype pays kernel selection
            if cuda:
                torch.cuda.synchronize()
            start = time.perf_counter()
            if dtype is None:
                lp[name] = fp64_log_probs(model, packed)
            else:
                lp[name] = forward_log_probs(model, packed, compute_dtype=dtype,
                                             params_dtype=torch.float32).double().cpu()
            seconds[f"forward_s_{name}"] = time.perf_counter() - start
    return {"lp": lp, "seconds": seconds}


def gap_stats(diff: torch.Tensor, buckets: Dict[str, torch.Tensor], prefix: str) -> Dict:
    """Mean / max |diff| overall and the mean per rarity bucket (None for an empty bucket)."""
    out = {f"{prefix}_abs_mean": diff.abs().mean().item(), f"{prefix}_abs_max": diff.abs().max().item()}
    for name, sel in buckets.items():
        out[f"{prefix}_abs_mean_{name}"] = diff[sel].abs().mean().item() if sel.any() else None
    return out


def measure_precision_gaps(model_dir: str, seqs: int, seq_len: int, common_logprob: float,
                           rare_logprob: float) -> Dict:
    """beta = lp_fp32 - lp_{bf16,fp16} (``beta_{low}_abs_*``) and each precision's error lp_d - lp_fp64
    (``err_vs_fp64_{d}_abs_*``) on ``seqs`` random token sequences of ``seq_len``, overall and by rarity
    bucket of the fp64 log-prob (common > ``common_logprob`` >= medium > ``rare_logprob`` >= rare). True
    fp32 GEMMs (TF32 off before CUDA initialises); sets up a one-rank model-parallel state."""
    configure_fp32_matmul(torch.float32)
    state.initialize_model_parallel(state.Layout(world_size=1))
    cuda = torch.cuda.is_available()
    start = time.perf_counter()
    model, shape = build_from_hf(model_dir)
    model.eval()
    results = {"device": torch.cuda.get_device_name() if cuda else "cpu", "torch": torch.__version__,
               "params": sum(p.numel() for p in model.parameters()), "build_s": time.perf_counter() - start,
               "tokens": seqs * (seq_len - PROMPT_LEN), "seqs": seqs, "seq_len": seq_len}
    gen = torch.Generator().manual_seed(0)
    packed = pack(torch.randint(0, shape.vocab_size, (seqs, seq_len), generator=gen).tolist(), [PROMPT_LEN] * seqs)
    measured = precision_log_probs(model, packed, cuda)
    lp = {k: v[packed.mask] for k, v in measured["lp"].items()}
    results.update(measured["seconds"])
    ref = lp["fp64"]
    buckets = {"common": ref > common_logprob, "medium": (ref > rare_logprob) & (ref <= common_logprob),
               "rare": ref <= rare_logprob}
    results.update({f"tokens_{name}": int(sel.sum()) for name, sel in buckets.items()})
    results["fp64_logprob_mean"] = ref.mean().item()
    for low in ("bf16", "fp16"):
        results.update(gap_stats(lp["fp32"] - lp[low], buckets, f"beta_{low}"))
    for name in ("fp32", "bf16", "fp16"):
        results.update(gap_stats(lp[name] - ref, buckets, f"err_vs_fp64_{name}"))
    if cuda:
        results["max_memory_gib"] = torch.cuda.max_memory_allocated() / 2**30
    assert int(packed.mask.sum()) == results["tokens"]
    return results
