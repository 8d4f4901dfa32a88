"""GPU check body (see tools/gpu_check.sh): beta of a Qwen3-0.6B-shaped model, then a few steps."""

from __future__ import annotations

import argparse
import json
import os
import time

import torch


def qwen3_0_6b_dir(out: str) -> str:
    """A random-init Qwen3-0.6B-shaped checkpoint (config from recipes/model_configs)."""
    import transformers

    path = os.path.join(out, "qwen3-0.6b-random")
    if not os.path.isfile(os.path.join(path, "model.safetensors")):
        with open(os.path.join(os.path.dirname(__file__), "..", "recipes", "model_configs", "qwen3-0.6b",
                               "config.json")) as f:
            cfg = json.load(f)
        cfg.pop("architectures", None)
        cfg.pop("model_type", None)
        torch.manual_seed(0)
        transformers.Qwen3ForCausalLM(transformers.Qwen3Config(**cfg)).save_pretrained(path)
    return path


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--tokens", type=int, default=4096)
    args = parser.parse_args()
    from megatron_grpo.forward import pack, forward_log_probs
    from megatron_grpo.loss import LossConfig, policy_loss
    from megatron_grpo.models import build_from_hf
    from megatron_grpo.parallel import state

    state.initialize_model_parallel(state.Layout(world_size=1))
    model, shape = build_from_hf(qwen3_0_6b_dir(args.out))
    gen = torch.Generator().manual_seed(0)
    seqs = torch.randint(0, shape.vocab_size, (args.tokens // 256, 256), generator=gen).tolist()
    packed = pack(seqs, [16] * len(seqs))
    results = {"device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"}
    lp = {}
    for name, dtype in (("fp32", torch.float32), ("bf16", torch.bfloat16), ("fp16", torch.float16)):
        start = time.perf_counter()
        lp[name] = forward_log_probs(model, packed, compute_dtype=dtype, params_dtype=torch.float32).cpu()
        results[f"forward_s_{name}"] = time.perf_counter() - start
    mask = packed.mask
    for low in ("bf16", "fp16"):
        beta = (lp["fp32"] - lp[low])[mask]
        ref = lp[low][mask]
        results[f"beta_abs_mean_{low}"] = beta.abs().mean().item()
        results[f"beta_abs_max_{low}"] = beta.abs().max().item()
        for bucket, sel in (("common", ref > -5), ("medium", (ref > -20) & (ref <= -5)), ("rare", ref <= -20)):
            results[f"beta_abs_mean_{low}_{bucket}"] = beta[sel].abs().mean().item() if sel.any() else None
    opt = torch.optim.AdamW(model.parameters(), lr=1e-6)
    for step in range(3):
        start = time.perf_counter()
        shadow = forward_log_probs(model, packed, compute_dtype=torch.bfloat16, params_dtype=torch.float32)
        from megatron_grpo.models import forward_logits
        from megatron_grpo.logprobs import token_log_probs

        packed_dev = packed.to(shadow.device)
        ids = packed_dev.input_ids
        train_lp = token_log_probs(forward_logits(model, ids), packed_dev.labels)
        adv = torch.randn(len(seqs), device=shadow.device)
        loss, metrics = policy_loss(train_lp, shadow.detach(), adv, packed_dev.mask, LossConfig(),
                                    shadow_log_probs=shadow)
        opt.zero_grad()
        loss.backward()
        opt.step()
        results[f"step{step}_s"] = time.perf_counter() - start
        results[f"step{step}_clip_region_fraction"] = metrics["clip/region_fraction"].item()
    with open(os.path.join(args.out, "gpu_check.json"), "w") as f:
        json.dump(results, f, indent=1)
    print(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
