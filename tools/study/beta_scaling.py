"""The beta scaling law: the trainer/generator precision gap vs model depth L and width d.

For every model (tiny random-init Qwen3 shapes made here, or ``--model-dirs`` pointing at
HF Qwen3 checkpoints, e.g. the locally pretrained models of issue 16 item 1 once they
exist), this tool

1. samples FIXED text from the model itself in fp32 (``--num-seqs`` sequences of
   ``--seq-len`` tokens, temperature 1, seeded, each starting from the BOS/EOS token);
2. scores that text in fp32 and under bf16 / fp16 autocast (fp32 params), and takes
   beta = lp_fp32 - lp_lowp per sampled token (MECHANISM.md's beta, fp32 trainer vs a
   low-precision generator);
3. reports mean |beta|, std, max |beta|, signed mean and mean |beta| per rarity bucket
   (bucketed on the low-precision log-prob, i.e. the generator's "rollout" log-prob, with
   the thresholds of ``megatron_grpo.loss.metrics``);
4. fits log(mean |beta|) = log c + a log L + b log d (and the one-exponent form
   mean |beta| ~ (L d)^g) per dtype, next to the write-up's prediction |beta| ~ sqrt(L d)
   (a = b = g = 0.5).

Writes OUT/beta_scaling.md, OUT/beta_scaling.csv and OUT/beta_scaling.png (if matplotlib
imports). bf16/fp16 are emulated on most CPUs (5-45x slower than fp32): keep grids small.

    python tools/study/beta_scaling.py --out runs/beta-scaling
    python tools/study/beta_scaling.py --out runs/beta-scaling-pretrained --model-dirs DIR1 DIR2 ...
"""

from __future__ import annotations

import argparse
import csv
import math
import os
import sys
import time
from typing import Dict, List, Optional, Sequence

import numpy as np
import torch

DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16}
PREDICTED_EXPONENT = 0.5
"""The write-up: |beta| ~ sqrt(L * d) * sigma * 2^-8, i.e. a = b = 0.5."""
WRITEUP_POINT = dict(model="Qwen3-0.6B (write-up)", L=28, d=1536, dtype="bfloat16", beta_abs_mean=0.076)
"""The write-up's single measured point (MECHANISM.md: FP32 trainer vs BF16 vLLM, hidden as it states)."""
COLUMNS = ["model", "kind", "L", "d", "params", "dtype", "tokens", "beta_abs_mean", "beta_std", "beta_abs_max",
           "beta_mean", "beta_abs_common", "n_common", "beta_abs_medium", "n_medium", "beta_abs_rare", "n_rare",
           "lp_mean", "lowp_score_s"]


def tiny_shape(L: int, d: int) -> Dict[str, int]:
    """Qwen3-shaped overrides for depth L and width d: head_dim 32 (16 below d=64), GQA 2:1, FFN 3d."""
    head_dim = 32 if d >= 64 else 16
    heads = max(1, d // head_dim)
    return dict(num_hidden_layers=L, hidden_size=d, intermediate_size=3 * d, num_attention_heads=heads,
                num_key_value_heads=max(1, heads // 2), head_dim=head_dim)


def make_grid(root: str, depths: Sequence[int], widths: Sequence[int], seed: int) -> List[str]:
    """Writes one random-init tiny Qwen3 per (L, d) under ``root``; returns the dirs."""
    from megatron_grpo.models.tiny import make_tiny_model

    dirs = []
    for d in widths:
        for L in depths:
            out = os.path.join(root, f"qwen3-L{L}-d{d}")
            if not os.path.isfile(os.path.join(out, "model.safetensors")):
                make_tiny_model(out, "qwen3", seed=seed, overrides=tiny_shape(L, d))
            dirs.append(out)
    return dirs


def pretrain_grid(root: str, shapes: Sequence[str], steps: int, seed: int) -> List[str]:
    """Pretrains one Qwen3 per ``LxD`` shape with ``tools/study/pretrain.py`` (stdlib corpus, ``steps`` steps; skipped when
    ``root/qwen3-L{L}-d{D}/config.json`` exists) and returns its random-init (``init/``) and pretrained dirs."""
    import subprocess

    dirs = []
    for spec in shapes:
        L, d = (int(v) for v in spec.lower().split("x"))
        shape, out = tiny_shape(L, d), os.path.join(root, f"qwen3-L{L}-d{d}")
        if not os.path.isfile(os.path.join(out, "config.json")):
            cmd = [sys.executable, os.path.join(os.path.dirname(os.path.abspath(__file__)), "pretrain.py"),
                   "--out", out, "--steps", str(steps), "--seed", str(seed), "--layers", str(L), "--hidden", str(d),
                   "--heads", str(shape["num_attention_heads"]), "--kv-heads", str(shape["num_key_value_heads"]),
                   "--head-dim", str(shape["head_dim"]), "--ffn", str(shape["intermediate_size"]), "--log-every", "0"]
            print("[beta_scaling] " + " ".join(cmd), flush=True)
            subprocess.run(cmd, check=True)
        dirs += [os.path.join(out, "init"), out]
    return dirs


def model_kind(model_dir: str) -> tuple:
    """(name, kind): ``X/init`` (tools/study/pretrain.py's starting point) is X's random init, else as pretrained when
    the dir has a MODEL_CARD.json, random-init otherwise."""
    path = os.path.normpath(model_dir)
    if os.path.basename(path) == "init" and os.path.isfile(os.path.join(os.path.dirname(path), "MODEL_CARD.json")):
        return os.path.basename(os.path.dirname(path)), "random-init"
    pretrained = os.path.isfile(os.path.join(path, "MODEL_CARD.json"))
    return os.path.basename(path), "pretrained" if pretrained else "random-init"


def sample_text(model, start_id: int, num_seqs: int, seq_len: int, seed: int) -> torch.Tensor:
    """``[num_seqs, 1 + seq_len]`` ids: ``start_id`` then tokens sampled from the model in fp32 (temperature 1)."""
    from megatron_grpo.models.forward import model_device
    from megatron_grpo.models import forward_logits

    gen = torch.Generator().manual_seed(seed)
    ids = torch.full((num_seqs, 1), start_id, dtype=torch.long)
    with torch.no_grad():
        for _ in range(seq_len):
            logits = forward_logits(model, ids.to(model_device(model)))[:, -1].float().cpu()
            nxt = torch.multinomial(torch.softmax(logits, dim=-1), 1, generator=gen)
            ids = torch.cat([ids, nxt], dim=1)
    return ids


def score(model, ids: torch.Tensor, compute_dtype: torch.dtype) -> torch.Tensor:
    """Per-token log-probs ``[n_tokens]`` of the sampled tokens of ``ids`` with fp32 params in ``compute_dtype``."""
    from megatron_grpo.models.forward import forward_log_probs, pack

    batch = pack(ids.tolist(), [1] * ids.shape[0])
    lp = forward_log_probs(model, batch, compute_dtype=compute_dtype, params_dtype=torch.float32)
    return lp.cpu()[batch.mask].double()


def beta_stats(lp_ref: torch.Tensor, lp_lowp: torch.Tensor) -> Dict[str, float]:
    """beta = lp_ref - lp_lowp: mean |beta|, std, max |beta|, signed mean, |beta| by rarity of ``lp_lowp``."""
    from megatron_grpo.loss.metrics import COMMON_LOGPROB, RARE_LOGPROB

    beta = lp_ref - lp_lowp
    out = dict(tokens=beta.numel(), beta_abs_mean=beta.abs().mean().item(), beta_std=beta.std().item(),
               beta_abs_max=beta.abs().max().item(), beta_mean=beta.mean().item(), lp_mean=lp_lowp.mean().item())
    buckets = {"common": lp_lowp > COMMON_LOGPROB, "medium": (lp_lowp > RARE_LOGPROB) & (lp_lowp <= COMMON_LOGPROB),
               "rare": lp_lowp <= RARE_LOGPROB}
    for name, sel in buckets.items():
        out[f"n_{name}"] = int(sel.sum())
        out[f"beta_abs_{name}"] = beta[sel].abs().mean().item() if sel.any() else float("nan")
    return out


def measure_model(model_dir: str, dtypes: Sequence[str], num_seqs: int, seq_len: int, seed: int) -> List[Dict]:
    """One row per low-precision dtype for the model in ``model_dir`` (parallel state must be set)."""
    from megatron_grpo.models import build_from_hf, load_hf_config

    cfg = load_hf_config(model_dir)
    model, shape = build_from_hf(model_dir)
    model.eval()
    start_id = cfg.get("bos_token_id") if cfg.get("bos_token_id") is not None else cfg.get("eos_token_id", 0)
    ids = sample_text(model, int(start_id), num_seqs, seq_len, seed)
    lp_ref = score(model, ids, torch.float32)
    name, kind = model_kind(model_dir)
    base = dict(model=name, kind=kind, L=shape.num_layers, d=shape.hidden_size,
                params=sum(p.numel() for p in model.parameters()))
    rows = []
    for name in dtypes:
        t0 = time.perf_counter()
        stats = beta_stats(lp_ref, score(model, ids, DTYPES[name]))
        rows.append(dict(base, dtype=name, lowp_score_s=time.perf_counter() - t0, **stats))
    return rows


def fit_power_law(L: Sequence[float], d: Sequence[float], y: Sequence[float]) -> Dict[str, float]:
    """Least squares on log y = log c + a log L + b log d, and log y = log c' + g log(L d).

    A variable that takes a single value is left out of the joint fit (its exponent is NaN);
    ``g`` needs only L*d to vary. Returns a, b, c, g, c_g, r2 (of the joint fit) and n.
    """
    L, d, y = (np.asarray(v, dtype=float) for v in (L, d, y))
    ok = np.isfinite(y) & (y > 0)
    L, d, ly = L[ok], d[ok], np.log(y[ok])
    out = dict(a=float("nan"), b=float("nan"), c=float("nan"), g=float("nan"), c_g=float("nan"),
               r2=float("nan"), n=int(ok.sum()))
    varying = [(k, np.log(v)) for k, v in (("a", L), ("b", d)) if len(np.unique(v)) > 1]
    if len(ly) > len(varying):
        design = np.column_stack([np.ones_like(ly)] + [col for _, col in varying])
        coef, *_ = np.linalg.lstsq(design, ly, rcond=None)
        out["c"] = float(np.exp(coef[0]))
        out.update({k: float(v) for (k, _), v in zip(varying, coef[1:])})
        resid, total = ly - design @ coef, ly - ly.mean()
        out["r2"] = float(1 - (resid @ resid) / (total @ total)) if total @ total > 0 else float("nan")
    if len(np.unique(L * d)) > 1:
        g, lc = np.polyfit(np.log(L * d), ly, 1)
        out["g"], out["c_g"] = float(g), float(np.exp(lc))
    return out


def fits_by_dtype(rows: List[Dict]) -> Dict[str, Dict[str, float]]:
    """``fit_power_law`` of mean |beta| per (kind, dtype), keyed ``"dtype"`` or ``"dtype, kind"`` if kinds mix."""
    fits, kinds = {}, list(dict.fromkeys(r["kind"] for r in rows))
    for kind in kinds:
        for name in dict.fromkeys(r["dtype"] for r in rows):
            sel = [r for r in rows if r["dtype"] == name and r["kind"] == kind]
            key = name if len(kinds) == 1 else f"{name}, {kind}"
            fits[key] = fit_power_law([r["L"] for r in sel], [r["d"] for r in sel], [r["beta_abs_mean"] for r in sel])
    return fits


def _fmt(v) -> str:
    if isinstance(v, float):
        return "n/a" if math.isnan(v) else f"{v:.4g}"
    return str(v)


def write_csv(path: str, rows: List[Dict]) -> None:
    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=COLUMNS)
        writer.writeheader()
        writer.writerows({k: r[k] for k in COLUMNS} for r in rows)


def markdown(rows: List[Dict], fits: Dict[str, Dict[str, float]], command: str) -> str:
    """The table, the fits next to the prediction, and the fit's extrapolation to the write-up's model."""
    lines = [f"Command: `{command}`", "", "| " + " | ".join(COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
    lines += ["| " + " | ".join(_fmt(r[k]) for k in COLUMNS) + " |" for r in rows]
    lines += ["", "beta = lp_fp32 - lp_lowp per sampled token; rarity buckets on lp_lowp (common > -5, "
              "medium (-20, -5], rare <= -20; n_* = token counts; lp_mean = mean lp_lowp; "
              "lowp_score_s = wall time of the low-precision scoring pass).", "",
              f"Fit of mean |beta| = c * L^a * d^b (least squares in log space) and mean |beta| = c' * (L*d)^g; "
              f"the write-up predicts a = b = g = {PREDICTED_EXPONENT}.", "",
              "| dtype | points | a (depth) | b (width) | c | R^2 | g (L*d) | predicted a = b = g | "
              f"fit at L={WRITEUP_POINT['L']}, d={WRITEUP_POINT['d']} |", "|---|---|---|---|---|---|---|---|---|"]
    for name, f in fits.items():
        extrap = f["c"] * WRITEUP_POINT["L"] ** f["a"] * WRITEUP_POINT["d"] ** f["b"]
        lines.append(f"| {name} | {f['n']} | {_fmt(f['a'])} | {_fmt(f['b'])} | {_fmt(f['c'])} | {_fmt(f['r2'])} | "
                     f"{_fmt(f['g'])} | {PREDICTED_EXPONENT} | {_fmt(float(extrap))} |")
    lines += ["", f"The write-up's one point: {WRITEUP_POINT['model']}, L={WRITEUP_POINT['L']}, "
              f"d={WRITEUP_POINT['d']}, {WRITEUP_POINT['dtype']}: mean |beta| = {WRITEUP_POINT['beta_abs_mean']}.", ""]
    return "\n".join(lines)


def plot(path: str, rows: List[Dict]) -> Optional[str]:
    """mean |beta| vs sqrt(L*d), one series per dtype, log-log, with the write-up's point; None without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    fig, ax = plt.subplots(figsize=(6, 4.5))
    for name, kind in dict.fromkeys((r["dtype"], r["kind"]) for r in rows):
        sel = sorted((math.sqrt(r["L"] * r["d"]), r["beta_abs_mean"]) for r in rows
                     if r["dtype"] == name and r["kind"] == kind)
        ax.plot(*zip(*sel), "o" if kind == "pretrained" else "x", label=f"fp32 vs {name}, {kind}")
        x0, y0 = sel[0]
        xs = np.array([x0, math.sqrt(WRITEUP_POINT["L"] * WRITEUP_POINT["d"])])
        ax.plot(xs, y0 * xs / x0, ":", color=ax.lines[-1].get_color(), alpha=0.6)
    ax.plot([math.sqrt(WRITEUP_POINT["L"] * WRITEUP_POINT["d"])], [WRITEUP_POINT["beta_abs_mean"]], "k*",
            markersize=12, label=f"{WRITEUP_POINT['model']}, bf16")
    ax.set(xscale="log", yscale="log", xlabel="sqrt(L * d)", ylabel="mean |beta| per token",
           title="precision gap vs model size (dotted: slope 1 = write-up's sqrt(L d))")
    ax.title.set_fontsize(9)
    ax.legend(fontsize=8)
    ax.grid(True, which="both", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def parse_args(argv: Optional[Sequence[str]]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True, help="output folder (table, csv, figure; random-init models)")
    parser.add_argument("--depths", type=int, nargs="+", default=[2, 4, 8])
    parser.add_argument("--widths", type=int, nargs="+", default=[64, 128, 256])
    parser.add_argument("--num-seqs", type=int, default=4)
    parser.add_argument("--seq-len", type=int, default=64)
    parser.add_argument("--dtypes", nargs="+", default=list(DTYPES), choices=list(DTYPES))
    parser.add_argument("--seed", type=int, default=0, help="seed of the random-init weights and of the sampling")
    parser.add_argument("--model-dirs", nargs="+", default=None,
                        help="HF Qwen3 checkpoint dirs to measure instead of the random-init grid (e.g. pretrained)")
    parser.add_argument("--pretrained-shapes", nargs="+", default=None, metavar="LxD",
                        help="pretrain one model per shape (tools/study/pretrain.py, OUT/pretrained/) and measure it and "
                             "its random init (with --model-dirs: in addition), instead of the random-init grid")
    parser.add_argument("--pretrain-steps", type=int, default=400, help="with --pretrained-shapes")
    return parser.parse_args(argv)


def main(argv: Optional[Sequence[str]] = None) -> Dict:
    args = parse_args(argv)
    from megatron_grpo.parallel import state

    os.makedirs(args.out, exist_ok=True)
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", torch.get_num_threads())))
    dirs = list(args.model_dirs or [])
    if args.pretrained_shapes:
        dirs += pretrain_grid(os.path.join(args.out, "pretrained"), args.pretrained_shapes, args.pretrain_steps,
                              args.seed)
    dirs = dirs or make_grid(os.path.join(args.out, "models"), args.depths, args.widths, args.seed)
    state.initialize_model_parallel(state.Layout(world_size=1))
    start, rows = time.perf_counter(), []
    for model_dir in dirs:
        rows += measure_model(model_dir, args.dtypes, args.num_seqs, args.seq_len, args.seed)
        print(" ".join(f"{k}={_fmt(rows[-1][k])}" for k in ("model", "L", "d")), " ".join(
            f"{r['dtype']}:|beta|={_fmt(r['beta_abs_mean'])}" for r in rows[-len(args.dtypes):]), flush=True)
    rows.sort(key=lambda r: (r["kind"], r["dtype"], r["d"], r["L"]))
    fits = fits_by_dtype(rows)
    command = "python tools/study/beta_scaling.py " + " ".join(argv if argv is not None else sys.argv[1:])
    text = markdown(rows, fits, command) + f"Measured in {time.perf_counter() - start:.0f} s.\n"
    with open(os.path.join(args.out, "beta_scaling.md"), "w") as f:
        f.write("# beta scaling\n\n" + text)
    write_csv(os.path.join(args.out, "beta_scaling.csv"), rows)
    figure = plot(os.path.join(args.out, "beta_scaling.png"), rows)
    print(text + (f"figure: {figure}" if figure else "figure: skipped (no matplotlib)"))
    return dict(rows=rows, fits=fits, figure=figure)


if __name__ == "__main__":
    main()
