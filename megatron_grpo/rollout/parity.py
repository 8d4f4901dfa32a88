"""Parity probe: after a weight push, the generator and the trainer's shadow forward must agree.

A wrong name map, a missed TP shard or a dropped tensor shows up here as a log-prob gap
far above the dtype's tolerance, instead of as a silently flat reward curve.

The probe scores realistic sequences (completions sampled from the model at the start, not
uniform random tokens, whose rare-token gap says little about real text) at temperature 1
on both sides. The first probe records the baseline gap; later probes fail when the mean or
the max |diff| grows past ``growth`` x the baseline (and past the absolute floors), so the
check is relative to what this model and these kernels give, not a constant tuned on one
model.

Engines pushed through vLLM's weight-transfer API also answer ``weight_version`` (``/weight_info``)
and ``weight_checksums`` (``/weight_checker``): the probe checks that each holds the version
pushed and that its checksums equal the trainer's own of the pushed tensors that vLLM keeps as
they are (``transfer.compare_checksums``); a mismatch names the engine and the tensor.

Order: the trainer's probe forward runs first, on every rank (it is collective: TP all-gathers, PP
send/recv, EP dispatch). Only then does rank 0, which holds the engine, do what may raise on it alone
(the weight check, the engine's scoring), so its error reaches the other ranks through the verdict
the trainer broadcasts (``GRPOTrainer._probe_once``) instead of leaving them in the forward until the
collective timeout; nor do they wait inside the forward while vLLM hashes the model.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import torch

from megatron_grpo.rollout.transfer.transport import compare_checksums
from megatron_grpo.rollout.types import Sampling

DEFAULT_TOLERANCE = {torch.float32: 1e-4, torch.float16: 5e-3, torch.bfloat16: 2.5e-2, torch.float8_e4m3fn: 5e-2}
"""Mean |log-prob diff| allowed per dtype. Measured on the tiny Qwen3 (vLLM full low
precision vs our autocast shadow forward, 96 tokens): fp32 2e-7, fp16 2-4e-4, bf16
1.5-3e-3 (mean); ENVIRONMENT.md measured 1e-2 mean for bf16 vLLM vs bf16 transformers.
A stale down_proj in one layer gave 0.046; larger models and larger mistakes give more.
The first probe must pass it; later probes use max(this, growth x the baseline mean). fp8 (the
precision token ``torch.float8_e4m3fn``): the megatron generator's FP8 forward is the trainer's, exactly 0;
against vLLM's FP8 kernels not yet measured (GPU): twice bf16's, since a round-off difference in front of
an activation quantization can move a value by a whole e4m3 step."""

DEFAULT_MAX_TOLERANCE = {torch.float32: 1e-3, torch.float16: 0.1, torch.bfloat16: 0.5, torch.float8_e4m3fn: 1.0}
"""Max |log-prob diff| floor per dtype (ENVIRONMENT.md: bf16 vLLM vs bf16 transformers, max
5e-2 dense, 0.5 MoE with router flips); later probes use max(this, growth x the baseline max)."""

DEFAULT_GROWTH = 4.0
"""A probe fails when its mean or max |diff| exceeds this many times the first probe's."""


class ParityError(RuntimeError):
    """The generator's log-probs do not match the trainer's after a push."""


@dataclass
class ProbeBatch:
    """Fixed sequences to score: ``sequences[i][prompt_lens[i]:]`` are the scored tokens."""

    sequences: List[List[int]]
    prompt_lens: List[int]

    @classmethod
    def synthetic(cls, vocab_size: int, num: int = 4, length: int = 24, prompt_len: int = 4, seed: int = 1234):
        """Uniform random tokens (a fallback: the rare-token regime, not realistic text)."""
        gen = torch.Generator().manual_seed(seed)
        seqs = torch.randint(0, vocab_size, (num, length), generator=gen).tolist()
        return cls(seqs, [prompt_len] * num)

    @classmethod
    def sampled(cls, engine, prompts: Sequence[Sequence[int]], max_tokens: int, seed: int,
                stop_token_ids: Sequence[int] = ()) -> Optional["ProbeBatch"]:
        """Prompts plus completions the generator samples at temperature 1 (fixed seed); None when
        every completion came back empty."""
        rollouts = engine.generate([list(p) for p in prompts], 1, Sampling(
            max_tokens=max_tokens, temperature=1.0, seed=seed, stop_token_ids=tuple(stop_token_ids)))
        kept = [r for r in rollouts if r.completion_ids]
        if not kept:
            return None
        return cls([r.prompt_ids + r.completion_ids for r in kept], [len(r.prompt_ids) for r in kept])


def compare(engine_lp: Sequence[Sequence[float]], trainer_lp: Sequence[Sequence[float]]) -> Dict[str, float]:
    """Mean and max |diff| over all scored tokens; ``ParityError`` when the generator did not return one
    log-prob per scored token (``zip`` would compare the overlap only, and pass on what it never saw)."""
    got, want = [len(row) for row in engine_lp], [len(row) for row in trainer_lp]
    if got != want:
        bad = next((i for i, (a, b) in enumerate(zip(got, want)) if a != b), min(len(got), len(want)))
        raise ParityError(f"the generator scored {len(got)} probe sequences ({got[bad] if bad < len(got) else 'none'} "
                          f"log-probs for sequence {bad}), the trainer {len(want)} ("
                          f"{want[bad] if bad < len(want) else 'none'}): one log-prob per scored token expected")
    diffs = torch.tensor([abs(a - b) for ea, eb in zip(engine_lp, trainer_lp) for a, b in zip(ea, eb)],
                         dtype=torch.float64)
    return {"sync/logprob_abs_diff_mean": diffs.mean().item(), "sync/logprob_abs_diff_max": diffs.max().item()}


def limits(tolerance: float, max_tolerance: float, baseline: Optional[Dict[str, float]],
           growth: float = DEFAULT_GROWTH) -> Tuple[float, float]:
    """(mean limit, max limit): the absolute floors, raised to ``growth`` x the baseline."""
    if baseline is None:
        return tolerance, max_tolerance
    return (max(tolerance, growth * baseline["sync/logprob_abs_diff_mean"]),
            max(max_tolerance, growth * baseline["sync/logprob_abs_diff_max"]))


def check_parity(engine, probe: ProbeBatch, trainer_scores: Callable[[ProbeBatch], List[List[float]]],
                 pushed_names: Sequence[str], tolerance: float, version: int, *, max_tolerance: float = math.inf,
                 baseline: Optional[Dict[str, float]] = None, growth: float = DEFAULT_GROWTH,
                 checksums: bool = True) -> Dict[str, float]:
    """Scores ``probe`` with every engine replica (``score_replicas``: each engine of a pool) and,
    once, the trainer; raises ``ParityError`` naming the first replica whose mean or max |diff|
    exceeds its limit (``limits``). Returns the worst replica's diffs and, with a baseline, their
    ratio to it (``sync/logprob_diff_vs_baseline``). ``checksums``: also ``check_weights``, after the
    trainer's forward (collective over every rank: see the module docstring)."""
    ours = trainer_scores(probe)
    if checksums:
        check_weights(engine, version)
    replicas = getattr(engine, "score_replicas", None)
    scored = replicas(probe.sequences, probe.prompt_lens) if replicas else [
        (None, engine.score(probe.sequences, probe.prompt_lens))]
    mean_limit, max_limit = limits(tolerance, max_tolerance, baseline, growth)
    metrics = {}
    for name, theirs in scored:
        diffs = compare(theirs, ours)
        if diffs["sync/logprob_abs_diff_mean"] > mean_limit or diffs["sync/logprob_abs_diff_max"] > max_limit:
            message = parity_message(diffs, (mean_limit, max_limit), pushed_names, version, baseline)
            raise ParityError(message if name is None or len(scored) == 1 else f"{name}: {message}")
        metrics = {k: max(v, metrics.get(k, v)) for k, v in diffs.items()}
    if baseline is not None:
        base = baseline["sync/logprob_abs_diff_mean"]
        metrics["sync/logprob_diff_vs_baseline"] = metrics["sync/logprob_abs_diff_mean"] / base if base > 0 else math.nan
    return metrics


def check_weights(engine, version: int) -> int:
    """Each engine that can say (``weight_version``, ``weight_checksums``) holds ``version`` and the
    pushed bytes: ``ParityError`` naming the engine and the first differing tensor. Returns the
    number of tensors compared (0 for engines without checksums, e.g. the file transport)."""
    engines = getattr(engine, "engines", None)
    named = [(engine.name(i), e) for i, e in enumerate(engines)] if engines is not None else [("the generator", engine)]
    total = 0
    for who, e in named:
        ours = getattr(e, "pushed_digests", None)
        if not ours or not hasattr(e, "weight_checksums"):
            continue
        reported = e.weight_version()
        if reported != str(version):
            raise ParityError(f"{who} reports weights version {reported!r} after the push of version {version}")
        compared, mismatch = compare_checksums(e.weight_checksums(), ours)
        if mismatch is not None:
            raise ParityError(f"{who}: checksum of {mismatch} after the push of version {version} differs from the "
                              "tensor the trainer sent (a tensor loaded into the wrong parameter, or not loaded)")
        total += compared
    return total


def parity_message(metrics: Dict[str, float], limit: Tuple[float, float], pushed_names: Sequence[str], version: int,
                   baseline: Optional[Dict[str, float]] = None) -> str:
    shown = ", ".join(pushed_names[:12]) + (f", ... ({len(pushed_names)} in all)" if len(pushed_names) > 12 else "")
    base = "" if baseline is None else (f" (first probe: mean {baseline['sync/logprob_abs_diff_mean']:.4g}, "
                                        f"max {baseline['sync/logprob_abs_diff_max']:.4g})")
    return (f"weight push of version {version} failed the parity probe: generator vs trainer log-probs differ by "
            f"{metrics['sync/logprob_abs_diff_mean']:.4g} on average (max {metrics['sync/logprob_abs_diff_max']:.4g}), "
            f"limits: mean {limit[0]:.3g}, max {limit[1]:.3g}{base}. Pushed tensors: {shown}. A missing or "
            f"mis-named tensor, or a TP/EP shard gathered wrongly, gives this."
            + (_MAX_ONLY if metrics["sync/logprob_abs_diff_mean"] <= limit[0] else ""))


_MAX_ONLY = (" Only the max is over its limit, the mean is within its own: a wrong push moves the mean, while one "
             "token's gap between two kernels in low precision can grow as training sharpens the policy (seen on "
             "SmolLM2 with a bf16 vLLM at step 15: max 1.03, mean 0.06). If the mean stays near the first probe's, "
             "raise generation.parity_max_tolerance (or generation.parity_growth).")
