"""The measurements ``tools/gpu_check.py`` runs in child processes, and the checkpoint they run on.

    python tools/gpu_check_measure.py preflight --json PATH --work DIR --out DIR [--dry]
    python tools/gpu_check_measure.py beta --json PATH --model DIR [--seqs N] [--seq-len N]

- ``write_random_qwen3``: a random-init Qwen3 checkpoint of the Qwen3-0.6B shape
  (``recipes/model_configs/qwen3-0.6b``; bf16 safetensors as the real checkpoint ships; HF's init
  N(0, 0.02), norms 1) written with torch + safetensors alone: no transformers, no tokenizer. A random
  model almost never samples EOS, so ``generation_config.json`` lists EOS plus every ``STOP_EVERY``-th
  token id as stop tokens (the reward -length then varies).
- ``preflight_info``: versions, device, free disk, installed wheels, imports; ``problems`` lists what
  makes the later phases pointless.
- ``measure_beta``: fp32-vs-bf16/fp16 log-prob gaps through the trainer's forward, and each
  precision's error against an fp64 forward of the same weights, by rarity bucket.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import json
import os
import shutil
import sys
import time
from typing import Dict, List, Optional

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)
QWEN3_0_6B_CONFIG = os.path.join(ROOT, "recipes", "model_configs", "qwen3-0.6b", "config.json")
STOP_EVERY = 16
"""Every STOP_EVERY-th token id (and EOS) stops a completion (see the module docstring)."""
IMPORTS = ("megatron.core", "omegaconf", "yaml", "safetensors", "megatron_grpo")
"""What preflight imports: the train path's needs beyond torch (gpu_check.sh installs them from ./wheels)."""
MIN_FREE_GIB = {"gpu": 3.0, "dry": 0.2}
"""Free disk the work dir needs (the bf16 0.6B checkpoint is 1.2 GB)."""


# ---- the checkpoint ------------------------------------------------------------------------------------


def model_config(overrides: Optional[Dict] = None) -> Dict:
    """The Qwen3-0.6B config.json with ``overrides``."""
    with open(QWEN3_0_6B_CONFIG) as f:
        return dict(json.load(f), **(overrides or {}), torch_dtype="bfloat16")


def write_random_qwen3(path: str, overrides: Optional[Dict] = None, seed: int = 0,
                       stop_every: int = STOP_EVERY) -> str:
    """A random-init Qwen3 checkpoint (bf16 safetensors + config.json + generation_config.json) of the
    Qwen3-0.6B config with ``overrides``, written with torch + safetensors only."""
    import torch
    from safetensors.torch import save_file

    cfg = model_config(overrides)
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


# ---- preflight -----------------------------------------------------------------------------------------


def import_probe(module: str) -> Dict:
    """Imports ``module`` (any exception counts: a half-installed package raises more than ImportError)."""
    start = time.perf_counter()
    try:
        mod = importlib.import_module(module)
    except Exception as exc:  # noqa: BLE001 - the reason is the result
        return {"ok": False, "error": f"{type(exc).__name__}: {exc}"}
    version = getattr(mod, "__version__", None)
    if module == "megatron.core":
        version = importlib.import_module("megatron.core.package_info").__version__
    return {"ok": True, "version": version, "path": os.path.dirname(getattr(mod, "__file__", "") or ""),
            "seconds": round(time.perf_counter() - start, 2)}


def optional_probe(package: str, module: str, cuda: bool) -> Dict:
    """Present or not, without importing what is absent (vLLM's import alone costs ~20 s: not imported)."""
    if importlib.util.find_spec(package) is None:
        return {"installed": False, "usable": False, "why": f"{package} is not installed"}
    if package == "vllm":
        return {"installed": True, "usable": cuda, "why": "installed (not imported by this check)"}
    probe = import_probe(module)
    usable = probe["ok"] and cuda
    why = "imports" + ("" if cuda else ", but there is no CUDA device") if probe["ok"] else probe["error"]
    return {"installed": True, "usable": usable, "why": why}


def device_info() -> Dict:
    import torch

    info = {"torch": torch.__version__, "torch_cuda": torch.version.cuda, "cuda_available": torch.cuda.is_available()}
    if info["cuda_available"]:
        props = torch.cuda.get_device_properties(0)
        free, total = torch.cuda.mem_get_info()
        info.update(device=props.name, capability=f"{props.major}.{props.minor}", memory_gib=total / 2**30,
                    memory_free_gib=free / 2**30, bf16_supported=torch.cuda.is_bf16_supported(),
                    device_count=torch.cuda.device_count())
    else:
        info["device"] = "cpu"
    return info


def disk_info(paths: Dict[str, str]) -> Dict:
    out = {}
    for label, path in paths.items():
        out[f"{label}_free_gib"] = shutil.disk_usage(path).free / 2**30 if os.path.isdir(path) else None
    return out


def preflight_info(work: str, out: str, dry: bool) -> Dict:
    """Everything the later phases rely on; ``problems`` lists what makes them pointless."""
    mode = "dry" if dry else "gpu"
    info: Dict = {"python": sys.version.split()[0], "executable": sys.executable, "problems": [],
                  "wheels_installed": os.environ.get("GPU_CHECK_INSTALLED", "").split()}
    try:
        info.update(device_info())
    except Exception as exc:  # noqa: BLE001
        info["problems"].append(f"torch is not usable by {sys.executable}: {type(exc).__name__}: {exc}")
        return info
    if not dry and not info["cuda_available"]:
        info["problems"].append(f"no CUDA device visible to torch {info['torch']} (built for CUDA "
                                f"{info['torch_cuda']}); GPU_CHECK_DRY=1 runs the CPU dry run")
    info.update(disk_info({"work": work, "out": out, "dev_shm": "/dev/shm"}))
    if (info["work_free_gib"] or 0.0) < MIN_FREE_GIB[mode]:
        info["problems"].append(f"only {info['work_free_gib']:.2f} GiB free in the work dir {work} "
                                f"(needs {MIN_FREE_GIB[mode]} GiB; set GPU_CHECK_WORK)")
    info["imports"] = {m: import_probe(m) for m in IMPORTS}
    for module, probe in info["imports"].items():
        if not probe["ok"]:
            info["problems"].append(f"import {module} failed: {probe['error']} (installed from ./wheels: "
                                    f"{', '.join(info['wheels_installed']) or 'none'})")
    info["transformer_engine"] = optional_probe("transformer_engine", "transformer_engine.pytorch",
                                                info["cuda_available"])
    info["vllm"] = optional_probe("vllm", "vllm", info["cuda_available"])
    return info


# ---- beta by rarity, with an fp64 reference -----------------------------------------------------------


def fp64_log_probs(model, packed):
    """``[B, S]`` fp64 log-probs of ``packed.labels``: the model converted to fp64 in place (so call it
    last), Megatron's forward one row at a time, log-softmax in fp64 (the trainer's log-prob kernel is
    fp32 by design: it would cap the reference at fp32)."""
    import torch

    from megatron_grpo.models.forward import model_device
    from megatron_grpo.models import forward_logits

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
    import torch

    from megatron_grpo.models.forward import forward_log_probs

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


def gap_stats(diff, buckets: Dict, prefix: str) -> Dict:
    """Mean / max |diff| overall and the mean per rarity bucket (None for an empty bucket)."""
    out = {f"{prefix}_abs_mean": diff.abs().mean().item(), f"{prefix}_abs_max": diff.abs().max().item()}
    for name, sel in buckets.items():
        out[f"{prefix}_abs_mean_{name}"] = diff[sel].abs().mean().item() if sel.any() else None
    return out


def measure_beta(model_dir: str, out_json: str, seqs: int, seq_len: int) -> None:
    """Writes to ``out_json``: beta = lp_fp32 - lp_{bf16,fp16} (``beta_abs_*_{low}``) and each precision's
    error lp_d - lp_fp64 (``err_vs_fp64_abs_*_{d}``), overall and by rarity bucket of the fp64
    log-prob. True fp32 GEMMs (TF32 off before CUDA initialises)."""
    import torch

    from megatron_grpo.models.forward import pack
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
               "tokens": seqs * (seq_len - 16), "seqs": seqs, "seq_len": seq_len}
    gen = torch.Generator().manual_seed(0)
    packed = pack(torch.randint(0, shape.vocab_size, (seqs, seq_len), generator=gen).tolist(), [16] * seqs)
    measured = precision_log_probs(model, packed, cuda)
    lp, mask = {k: v[packed.mask] for k, v in measured["lp"].items()}, packed.mask
    results.update(measured["seconds"])
    ref = lp["fp64"]
    buckets = {"common": ref > COMMON_LOGPROB, "medium": (ref > RARE_LOGPROB) & (ref <= COMMON_LOGPROB),
               "rare": ref <= RARE_LOGPROB}
    results.update({f"tokens_{name}": int(sel.sum()) for name, sel in buckets.items()})
    results["fp64_logprob_mean"] = ref.mean().item()
    for low in ("bf16", "fp16"):
        results.update(gap_stats(lp["fp32"] - lp[low], buckets, f"beta_{low}"))
    for name in ("fp32", "bf16", "fp16"):
        results.update(gap_stats(lp[name] - ref, buckets, f"err_vs_fp64_{name}"))
    if cuda:
        results["max_memory_gib"] = torch.cuda.max_memory_allocated() / 2**30
    assert int(mask.sum()) == results["tokens"]
    with open(out_json, "w") as f:
        json.dump(results, f, indent=1)


def child_main(argv: List[str]) -> int:
    """``preflight ...`` / ``beta ...``: the measurements gpu_check.py runs in child processes."""
    parser = argparse.ArgumentParser(prog=f"gpu_check_measure.py {argv[0]}")
    parser.add_argument("--json", required=True)
    if argv[0] == "preflight":
        parser.add_argument("--work", required=True)
        parser.add_argument("--out", required=True)
        parser.add_argument("--dry", action="store_true")
        args = parser.parse_args(argv[1:])
        with open(args.json, "w") as f:
            json.dump(preflight_info(args.work, args.out, args.dry), f, indent=1)
        return 0
    parser.add_argument("--model", required=True)
    parser.add_argument("--seqs", type=int, default=16)
    parser.add_argument("--seq-len", type=int, default=256)
    args = parser.parse_args(argv[1:])
    measure_beta(args.model, args.json, args.seqs, args.seq_len)
    return 0


if __name__ == "__main__":
    if len(sys.argv) < 2 or sys.argv[1] not in ("preflight", "beta"):
        sys.exit("usage: gpu_check_measure.py {preflight,beta} ...")
    sys.exit(child_main(sys.argv[1:]))
