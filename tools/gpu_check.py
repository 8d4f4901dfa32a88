"""Body of ``tools/gpu_check.sh``: the one-H200 check, run through the real trainer.

    python tools/gpu_check.py --out OUT [--dry] [--work DIR] [--budget SECONDS]

1. Writes a random-init checkpoint of the Qwen3-0.6B shape (``recipes/model_configs/qwen3-0.6b``:
   config.json + model.safetensors in bf16, as the real checkpoint ships, HF's init: N(0, 0.02),
   norms 1) with safetensors alone: no transformers, no tokenizer (the trainer then prompts with
   token ids). A random-init model almost never samples EOS, so the reward -length would be the
   same for every completion (advantages 0): ``generation_config.json`` lists EOS plus every
   ``STOP_EVERY``-th token id as stop tokens (about 1 in 16 tokens ends a completion).
2. ``beta``: the fp32-vs-bf16 and fp32-vs-fp16 log-prob gap of that model (overall and by rarity
   bucket), in a child process (``python tools/gpu_check.py beta``).
3. Runs ``python -m megatron_grpo train`` (the real loop) twice with ``generation.backend=megatron``
   (the trainer's own model generates: no vLLM): run A = recipes/grpo-qwen3-0.6b-eos-A.yaml (bf16
   autocast trainer, bf16 generator: precision-matched, beta = 0 exactly) and run B =
   recipes/grpo-qwen3-0.6b-eos-B.yaml (fp32 trainer vs bf16 generator: the write-up's mismatch).
4. Reads each run's metrics.jsonl and prints beta, the phantom / legit clip fractions and the step
   times; writes ``OUT/gpu_check.json`` and copies the metrics files to OUT (small files only:
   the checkpoint and the run folders stay in the work dir).

Exit 0 only when every phase ran and the checks hold (A: beta exactly 0 on every step; B: beta
> 0; every step logged with a finite step time); otherwise exit 1 with the reasons printed.
``--dry`` (``GPU_CHECK_DRY=1``): the same phases on CPU with a tiny model of the same family and
2 steps, so CI runs this script (tests/test_tools.py).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from typing import Dict, List, Optional

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)
QWEN3_0_6B_CONFIG = os.path.join(ROOT, "recipes", "model_configs", "qwen3-0.6b", "config.json")
STOP_EVERY = 16
"""Every STOP_EVERY-th token id (and EOS) stops a completion (see the module docstring)."""
DRY_SHAPE = dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, head_dim=32, max_position_embeddings=1024, eos_token_id=511,
                 bos_token_id=510)
"""--dry: the Qwen3-0.6B config with these keys replaced (~0.13M params: emulated bf16 on CPU is slow);
heads x head_dim = 2 x hidden, as in Qwen3-0.6B (non-square q/o projections)."""
RUNS = {"A": "recipes/grpo-qwen3-0.6b-eos-A.yaml", "B": "recipes/grpo-qwen3-0.6b-eos-B.yaml"}
RUN_SIZE = {  # steps, prompts per step, generations per prompt, max new tokens; beta: sequences x length
    # gpu: the megatron engine draws each row's sampling noise on the host (vocab 151936 per row and
    # token), so generation dominates; 8 x 8 rollouts of <= 48 tokens keep both runs well inside 8 min.
    "gpu": dict(steps=4, prompts=8, generations=8, max_new_tokens=48, beta_seqs=16, beta_len=256),
    "dry": dict(steps=2, prompts=2, generations=4, max_new_tokens=8, beta_seqs=4, beta_len=32),
}
METRICS = ("precision/beta_abs_mean", "precision/beta_abs_max", "precision/beta_abs_mean_common",
           "precision/beta_abs_mean_medium", "precision/beta_abs_mean_rare", "precision/alpha_abs_mean",
           "clip/region_fraction", "clip/phantom_region_fraction", "clip/legit_region_fraction",
           "clip/zero_grad_fraction", "clip/phantom_zero_grad_fraction", "clip/legit_zero_grad_fraction",
           "reward/mean", "completion/length_mean", "time/step_s", "timing/generate_s", "timing/train_s")


# ---- the checkpoint ------------------------------------------------------------------------------------


def write_random_qwen3(path: str, overrides: Optional[Dict] = None, seed: int = 0,
                       stop_every: int = STOP_EVERY) -> str:
    """A random-init Qwen3 checkpoint (bf16 safetensors + config.json + generation_config.json) of the
    Qwen3-0.6B config with ``overrides``, written with torch + safetensors only."""
    import torch
    from safetensors.torch import save_file

    with open(QWEN3_0_6B_CONFIG) as f:
        cfg = dict(json.load(f), **(overrides or {}))
    cfg["torch_dtype"] = "bfloat16"
    hidden, inter, vocab = cfg["hidden_size"], cfg["intermediate_size"], cfg["vocab_size"]
    heads, kv, head_dim = cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"]
    gen = torch.Generator().manual_seed(seed)

    def normal(*shape):
        return (torch.randn(*shape, generator=gen) * 0.02).to(torch.bfloat16)

    def ones(n):
        return torch.ones(n, dtype=torch.bfloat16)

    tensors = {"model.embed_tokens.weight": normal(vocab, hidden), "model.norm.weight": ones(hidden)}
    if not cfg.get("tie_word_embeddings", False):
        tensors["lm_head.weight"] = normal(vocab, hidden)
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}."
        tensors.update({
            p + "input_layernorm.weight": ones(hidden), p + "post_attention_layernorm.weight": ones(hidden),
            p + "self_attn.q_proj.weight": normal(heads * head_dim, hidden),
            p + "self_attn.k_proj.weight": normal(kv * head_dim, hidden),
            p + "self_attn.v_proj.weight": normal(kv * head_dim, hidden),
            p + "self_attn.o_proj.weight": normal(hidden, heads * head_dim),
            p + "self_attn.q_norm.weight": ones(head_dim), p + "self_attn.k_norm.weight": ones(head_dim),
            p + "mlp.gate_proj.weight": normal(inter, hidden), p + "mlp.up_proj.weight": normal(inter, hidden),
            p + "mlp.down_proj.weight": normal(hidden, inter),
        })
    os.makedirs(path, exist_ok=True)
    save_file(tensors, os.path.join(path, "model.safetensors"), metadata={"format": "pt"})
    eos = cfg["eos_token_id"]
    stops = [eos] + [t for t in range(0, vocab, stop_every) if t != eos]
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(cfg, f, indent=1)
    with open(os.path.join(path, "generation_config.json"), "w") as f:
        json.dump({"eos_token_id": stops, "bos_token_id": cfg.get("bos_token_id")}, f)
    return path


# ---- phase 2: beta by rarity (child process) -----------------------------------------------------------


def measure_beta(model_dir: str, out_json: str, seqs: int, seq_len: int) -> None:
    """fp32 vs bf16 / fp16 log-probs of random sequences, through the trainer's forward (fp32 weights,
    autocast compute; true fp32 GEMMs for the reference: TF32 off before CUDA initialises)."""
    import torch

    from megatron_grpo.forward import forward_log_probs, pack
    from megatron_grpo.loss.metrics import COMMON_LOGPROB, RARE_LOGPROB
    from megatron_grpo.models import build_from_hf
    from megatron_grpo.models.spec import configure_fp32_matmul
    from megatron_grpo.parallel import state

    configure_fp32_matmul(torch.float32)
    state.initialize_model_parallel(state.Layout(world_size=1))
    cuda = torch.cuda.is_available()
    start = time.perf_counter()
    model, shape = build_from_hf(model_dir)
    model.eval()
    results = {"device": torch.cuda.get_device_name() if cuda else "cpu", "torch": torch.__version__,
               "params": sum(p.numel() for p in model.parameters()), "build_s": time.perf_counter() - start,
               "tokens": seqs * (seq_len - 16)}
    gen = torch.Generator().manual_seed(0)
    packed = pack(torch.randint(0, shape.vocab_size, (seqs, seq_len), generator=gen).tolist(), [16] * seqs)
    lp = {}
    for name, dtype in (("fp32", torch.float32), ("bf16", torch.bfloat16), ("fp16", torch.float16)):
        for attempt in ("warmup", "timed"):  # the first forward of each dtype pays kernel selection
            if cuda:
                torch.cuda.synchronize()
            start = time.perf_counter()
            lp[name] = forward_log_probs(model, packed, compute_dtype=dtype, params_dtype=torch.float32).float().cpu()
            results[f"forward_s_{name}"] = time.perf_counter() - start
    mask = packed.mask
    ref = lp["fp32"][mask]
    results["fp32_logprob_mean"] = ref.mean().item()
    buckets = {"common": ref > COMMON_LOGPROB, "medium": (ref > RARE_LOGPROB) & (ref <= COMMON_LOGPROB),
               "rare": ref <= RARE_LOGPROB}
    for name, sel in buckets.items():
        results[f"tokens_{name}"] = int(sel.sum())
    for low in ("bf16", "fp16"):
        beta = (lp["fp32"] - lp[low])[mask]
        results[f"beta_abs_mean_{low}"] = beta.abs().mean().item()
        results[f"beta_abs_max_{low}"] = beta.abs().max().item()
        for name, sel in buckets.items():
            results[f"beta_abs_mean_{low}_{name}"] = beta[sel].abs().mean().item() if sel.any() else None
    if cuda:
        results["max_memory_gib"] = torch.cuda.max_memory_allocated() / 2**30
    with open(out_json, "w") as f:
        json.dump(results, f, indent=1)


# ---- the orchestration ---------------------------------------------------------------------------------


class Phase:
    """One child process: output streamed to our stdout (prefixed) and to a log file; killed (its
    whole process group) when it outlives ``timeout_s``."""

    def __init__(self, name: str, cmd: List[str], log_path: str, env: Dict[str, str], timeout_s: float):
        self.name, self.cmd, self.log_path, self.env, self.timeout_s = name, cmd, log_path, env, timeout_s
        self.rc: Optional[int] = None
        self.wall_s = 0.0
        self.timed_out = False
        self.tail: List[str] = []

    def run(self) -> int:
        print(f"gpu_check: [{self.name}] {' '.join(self.cmd)}  (limit {self.timeout_s:.0f} s)", flush=True)
        start = time.perf_counter()
        if self.timeout_s <= 0:
            self.rc, self.timed_out = 124, True
            return self.rc
        with open(self.log_path, "w") as log:
            # its own process group (not session: a session would outlive the device command)
            proc = subprocess.Popen(self.cmd, cwd=ROOT, env=self.env, stdout=subprocess.PIPE,
                                    stderr=subprocess.STDOUT, text=True, errors="replace", process_group=0)
            timer = threading.Timer(self.timeout_s, self._kill, (proc,))
            timer.start()
            previous = signal.signal(signal.SIGTERM, lambda *_: (self._kill(proc), sys.exit(143)))
            try:
                for line in proc.stdout:
                    log.write(line)
                    sys.stdout.write(f"[{self.name}] {line}")
                    sys.stdout.flush()
                    self.tail = (self.tail + [line.rstrip()])[-25:]
                proc.wait()
            finally:
                timer.cancel()
                signal.signal(signal.SIGTERM, previous)
        self.wall_s = time.perf_counter() - start
        self.rc = 124 if self.timed_out else proc.returncode
        return self.rc

    def _kill(self, proc) -> None:
        """Time is up (or we were told to stop): the child and whatever it started."""
        self.timed_out = True
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass

    def error(self) -> Optional[str]:
        if self.rc == 0:
            return None
        why = f"timed out after {self.timeout_s:.0f} s" if self.timed_out else f"exited with status {self.rc}"
        return f"{self.name} {why} (log: {self.log_path}); its last lines:\n    " + "\n    ".join(self.tail[-12:])


def run_overrides(model_dir: str, log_dir: str, size: Dict) -> List[str]:
    return [f"policy.model_name={model_dir}", "generation.backend=megatron", f"grpo.max_num_steps={size['steps']}",
            f"grpo.num_prompts_per_step={size['prompts']}", f"grpo.num_generations_per_prompt={size['generations']}",
            f"generation.max_new_tokens={size['max_new_tokens']}", f"logger.log_dir={log_dir}",
            "logger.tensorboard=false", "logger.progress_bar=false", "checkpointing.checkpoint_dir=null"]


def summarize_run(metrics_path: str, steps: int) -> Dict:
    """Per-step series of METRICS plus means; the step time mean leaves out step 1 (warm-up)."""
    from megatron_grpo.metrics_logger import read_metrics_rows

    rows = read_metrics_rows(metrics_path) if os.path.isfile(metrics_path) else []
    out: Dict = {"steps_logged": len(rows), "steps_planned": steps}
    for key in METRICS:
        values = [r.get(key) for r in rows]
        out[key] = values
        finite = [v for v in values if isinstance(v, (int, float)) and math.isfinite(v)]
        out[f"{key}:mean"] = sum(finite) / len(finite) if finite else None
    times = [t for t in out["time/step_s"][1:] if isinstance(t, (int, float))]
    out["step_s_mean_after_first"] = sum(times) / len(times) if times else None
    return out


def checks(results: Dict, size: Dict) -> List[str]:
    """The contract the check enforces (beyond every phase exiting 0)."""
    errors = []
    for name, run in results["runs"].items():
        if run["steps_logged"] != size["steps"]:
            errors.append(f"run {name}: {run['steps_logged']} of {size['steps']} steps in metrics.jsonl")
            continue
        times = run["time/step_s"]
        if not all(isinstance(t, (int, float)) and math.isfinite(t) and t > 0 for t in times):
            errors.append(f"run {name}: step times not all finite and > 0: {times}")
    a, b = results["runs"].get("A"), results["runs"].get("B")
    if a and a["steps_logged"]:
        if any(v != 0.0 for v in a["precision/beta_abs_mean"] + a["precision/beta_abs_max"]):
            errors.append(f"run A (precision-matched) must have beta exactly 0 on every step, got "
                          f"beta_abs_mean {a['precision/beta_abs_mean']}, max {a['precision/beta_abs_max']}")
    if b and b["steps_logged"]:
        if not (b["precision/beta_abs_mean:mean"] or 0.0) > 0.0:
            errors.append(f"run B (fp32 trainer vs bf16 generator) must have beta > 0, got "
                          f"{b['precision/beta_abs_mean']}")
    beta = results.get("beta") or {}
    for low in ("bf16", "fp16"):
        value = beta.get(f"beta_abs_mean_{low}")
        if beta and not (isinstance(value, float) and math.isfinite(value) and value > 0):
            errors.append(f"beta measurement: fp32 vs {low} mean |beta| should be finite and > 0, got {value}")
    return errors


def _fmt(value, spec: str = ".3e") -> str:
    return "-" if value is None else format(value, spec)


def report(results: Dict) -> str:
    lines = [f"== gpu_check ({results['mode']}) on {results.get('device', '?')}: model {results['model']['shape']} "
             f"({_fmt(results['model'].get('params'), ',')} params), wall {results['wall_s']:.0f} s =="]
    beta = results.get("beta")
    if beta:
        lines.append(f"beta (fp32 reference vs low precision, {beta['tokens']} tokens; buckets by fp32 log-prob: "
                     f"common {beta['tokens_common']}, medium {beta['tokens_medium']}, rare {beta['tokens_rare']} "
                     f"tokens):")
        for low in ("bf16", "fp16"):
            v = {k: _fmt(beta[f"beta_abs_{k}_{low}"]) for k in ("mean", "max")}
            v.update({k: _fmt(beta[f"beta_abs_mean_{low}_{k}"]) for k in ("common", "medium", "rare")})
            lines.append(f"  {low}: mean |beta| {v['mean']}  max {v['max']}  common {v['common']}  medium "
                         f"{v['medium']}  rare {v['rare']}")
        lines.append("  forward s (after warm-up): " + "  ".join(f"{d} {beta[f'forward_s_{d}']:.3f}"
                                                                for d in ("fp32", "bf16", "fp16")))
    for name, run in results["runs"].items():
        lines.append(f"run {name} ({RUNS[name]}, generation.backend=megatron): {run['steps_logged']} steps; "
                     f"step s mean after the first {_fmt(run['step_s_mean_after_first'], '.2f')}")
        lines.append("  step  |beta|mean  |beta|max  region  phantom_reg  legit_reg  zero_grad  phantom_zg  reward  "
                     "len  step_s  gen_s  train_s")
        for i in range(run["steps_logged"]):
            v = {k: run[k][i] for k in METRICS}
            lines.append(f"  {i + 1:>4}  {_fmt(v['precision/beta_abs_mean'])}  {_fmt(v['precision/beta_abs_max'])}  "
                         f"{_fmt(v['clip/region_fraction'], '.4f')}  {_fmt(v['clip/phantom_region_fraction'], '.4f')}"
                         f"       {_fmt(v['clip/legit_region_fraction'], '.4f')}     "
                         f"{_fmt(v['clip/zero_grad_fraction'], '.4f')}     "
                         f"{_fmt(v['clip/phantom_zero_grad_fraction'], '.4f')}      {_fmt(v['reward/mean'], '.2f')}  "
                         f"{_fmt(v['completion/length_mean'], '.1f')}  {_fmt(v['time/step_s'], '.2f')}  "
                         f"{_fmt(v['timing/generate_s'], '.2f')}  {_fmt(v['timing/train_s'], '.2f')}")
    for phase, info in results["phases"].items():
        lines.append(f"phase {phase}: exit {info['rc']}, {info['wall_s']:.1f} s")
    return "\n".join(lines)


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, help="results folder (small files only)")
    parser.add_argument("--work", default=None, help="checkpoint + run folders, kept out of OUT (default: a new "
                                                     "temporary folder)")
    parser.add_argument("--dry", action="store_true", help="CPU, tiny model, 2 steps (CI)")
    parser.add_argument("--budget", type=float, default=470.0, help="seconds for all phases together")
    args = parser.parse_args(argv)
    started = time.perf_counter()
    mode = "dry" if args.dry else "gpu"
    size = RUN_SIZE[mode]
    out = os.path.abspath(args.out)
    work = os.path.abspath(args.work or tempfile.mkdtemp(prefix="gpu_check_"))
    os.makedirs(out, exist_ok=True)
    os.makedirs(work, exist_ok=True)
    path = [ROOT] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    env = dict(os.environ, PYTHONUNBUFFERED="1", HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1",
               PYTHONPATH=os.pathsep.join(path))
    if args.dry:
        env["CUDA_VISIBLE_DEVICES"] = ""  # the dry run is the CPU path, also on a GPU machine
    else:
        try:
            import torch
        except ImportError as exc:
            print(f"gpu_check: FAILED: torch is not importable by {sys.executable}: {exc}", flush=True)
            return 1
        if not torch.cuda.is_available():
            print("gpu_check: FAILED: no CUDA device visible to torch "
                  f"(torch {torch.__version__}); GPU_CHECK_DRY=1 runs the CPU dry run", flush=True)
            return 1

    overrides = DRY_SHAPE if args.dry else None
    model_dir = os.path.join(work, "qwen3-tiny-random" if args.dry else "qwen3-0.6b-random")
    start = time.perf_counter()
    write_random_qwen3(model_dir, overrides)
    with open(os.path.join(model_dir, "config.json")) as f:
        cfg = json.load(f)
    shape_keys = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                  "num_key_value_heads", "head_dim", "tie_word_embeddings")
    results: Dict = {"mode": mode, "ok": False, "size": size, "runs": {}, "phases": {}, "errors": [],
                     "model": {"dir": model_dir, "shape": {k: cfg[k] for k in shape_keys},
                               "stop_token_ids": f"eos {cfg['eos_token_id']} + every {STOP_EVERY}th id",
                               "write_s": time.perf_counter() - start}}
    print(f"gpu_check: wrote {model_dir} in {results['model']['write_s']:.1f} s", flush=True)

    def remaining() -> float:
        return args.budget - (time.perf_counter() - started)

    phases = []
    beta_json = os.path.join(work, "beta.json")
    beta = Phase("beta", [sys.executable, os.path.abspath(__file__), "beta", "--model", model_dir, "--json", beta_json,
                          "--seqs", str(size["beta_seqs"]), "--seq-len", str(size["beta_len"])],
                 os.path.join(work, "beta.log"), env, min(150.0, remaining() * 0.4))
    phases.append(beta)
    beta.run()
    if beta.rc == 0:
        with open(beta_json) as f:
            results["beta"] = json.load(f)
        results["device"] = results["beta"]["device"]
        results["model"]["params"] = results["beta"]["params"]
    for i, (name, recipe) in enumerate(RUNS.items()):
        log_dir = os.path.join(work, f"run_{name}")
        shutil.rmtree(log_dir, ignore_errors=True)
        left = len(RUNS) - i
        phase = Phase(f"run{name}", [sys.executable, "-m", "megatron_grpo", "train", recipe]
                      + run_overrides(model_dir, log_dir, size), os.path.join(work, f"run_{name}.log"), env,
                      (remaining() - 5.0) / left)
        phases.append(phase)
        phase.run()
        results["runs"][name] = summarize_run(os.path.join(log_dir, "metrics.jsonl"), size["steps"])
        if os.path.isfile(os.path.join(log_dir, "metrics.jsonl")):
            shutil.copyfile(os.path.join(log_dir, "metrics.jsonl"), os.path.join(out, f"run_{name}.metrics.jsonl"))
    for phase in phases:
        results["phases"][phase.name] = {"rc": phase.rc, "wall_s": phase.wall_s, "timed_out": phase.timed_out,
                                         "log": phase.log_path}
    results["errors"] = [e for e in (p.error() for p in phases) if e] + checks(results, size)
    results["ok"] = not results["errors"]
    results["wall_s"] = time.perf_counter() - started
    with open(os.path.join(out, "gpu_check.json"), "w") as f:
        json.dump(results, f, indent=1)
    print(report(results), flush=True)
    print(f"gpu_check: results in {os.path.join(out, 'gpu_check.json')}", flush=True)
    if results["errors"]:
        print("gpu_check: FAILED:\n  " + "\n  ".join(results["errors"]), flush=True)
        return 1
    print("gpu_check: OK", flush=True)
    return 0


def beta_main(argv: List[str]) -> int:
    parser = argparse.ArgumentParser(prog="gpu_check.py beta")
    parser.add_argument("--model", required=True)
    parser.add_argument("--json", required=True)
    parser.add_argument("--seqs", type=int, default=16)
    parser.add_argument("--seq-len", type=int, default=256)
    args = parser.parse_args(argv)
    measure_beta(args.model, args.json, args.seqs, args.seq_len)
    return 0


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "beta":
        sys.exit(beta_main(sys.argv[2:]))
    sys.exit(main())
