"""``generation.backend: megatron``: the trainer's own model generates (rollout/megatron_engine.py)."""

import json
import os
import subprocess
import sys

import pytest
import torch

from megatron_grpo.rollout import Sampling
from tests._dist import run_distributed

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RECIPE = os.path.join(ROOT, "recipes", "grpo-tiny-eos-megatron-cpu.yaml")
PROMPTS = [[5, 6, 7, 8], [9, 10, 11], [12, 13, 14, 15, 16, 17], [18, 19, 20, 21]]
"""Three prompt lengths: rows are batched by prompt length."""


def _engine(model_dir, model, dtype=torch.float32):
    from megatron_grpo.rollout.engines.megatron_engine import MegatronEngine

    return MegatronEngine(model_dir, dtype, model=model, max_model_len=128)


def _trainer_logprobs(model, rollouts, temperature, dtype=torch.float32):
    from megatron_grpo.models.forward import completion_scores, forward_log_probs, pack

    packed = pack([r.prompt_ids + r.completion_ids for r in rollouts], [len(r.prompt_ids) for r in rollouts])
    lp = forward_log_probs(model, packed, compute_dtype=dtype, params_dtype=torch.float32, temperature=temperature)
    return completion_scores(lp, packed)


@pytest.fixture(scope="module")
def dense(tiny_dense, megatron_single):
    """The tiny model, with one torch thread for this module (restored after): its decode loop is
    hundreds of tiny GEMMs, which two threads contending for 2 shared cores make ~30x slower."""
    from megatron_grpo.models import build_from_hf

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    model, _ = build_from_hf(tiny_dense, backend="local")
    yield tiny_dense, model
    torch.set_num_threads(threads)


def test_fp32_logprobs_equal_the_trainers_and_stops_are_honoured(dense):
    model_dir, model = dense
    engine = _engine(model_dir, model)
    sampling = Sampling(max_tokens=12, temperature=0.7, seed=11)
    rollouts = engine.generate(PROMPTS, 4, sampling)
    assert [r.prompt_index for r in rollouts] == [p for p in range(4) for _ in range(4)]
    for r in rollouts:  # the model's EOS stops a completion (a random-init model rarely samples it)
        assert len(r.completion_ids) == len(r.logprobs) and r.policy_version == 0
        at_eos = r.completion_ids[-1] in engine.eos_ids
        assert r.finish_reason == ("stop" if at_eos else "length") and (at_eos or len(r.completion_ids) == 12)
    assert len({tuple(r.completion_ids) for r in rollouts.items[:4]}) == 4  # n distinct samples
    ref = _trainer_logprobs(model, rollouts, 0.7)
    assert max(abs(a - b) for r, row in zip(rollouts, ref) for a, b in zip(r.logprobs, row)) <= 1e-6
    assert engine.decode_gap_max <= 2e-6  # the KV-cached logits sampled from: fp32 round-off only
    assert model.training  # generation switched to eval mode and back
    # a stop token ends a completion right after its first occurrence, the rest of the row unchanged
    row = rollouts.items[5]
    stop = row.completion_ids[3]
    stopped = engine.generate(PROMPTS, 4, Sampling(max_tokens=12, temperature=0.7, seed=11, stop_token_ids=(stop,)))
    cut = stopped.items[5]
    assert cut.finish_reason == "stop"
    assert cut.completion_ids == row.completion_ids[: row.completion_ids.index(stop) + 1]
    assert all((r.finish_reason == "stop") == (r.completion_ids[-1] in {stop} | engine.eos_ids) for r in stopped)
    # ignore_eos: neither the stop token nor EOS ends a row; the rows are the unstopped ones
    forced = engine.generate(PROMPTS, 4, Sampling(max_tokens=12, temperature=0.7, seed=11, stop_token_ids=(stop,),
                                                  ignore_eos=True))
    assert all(len(r.completion_ids) == 12 and r.finish_reason == "length" for r in forced)
    assert forced.items[5].completion_ids == row.completion_ids


def test_same_seeds_same_completions_whatever_the_batch(dense):
    model_dir, model = dense
    engine = _engine(model_dir, model)
    batch = engine.generate(PROMPTS, 3, Sampling(max_tokens=10, temperature=1.0, seed=100))
    for p in (0, 2):  # completion i of prompt p uses seed + p * n + i
        alone = engine.generate([PROMPTS[p]], 3, Sampling(max_tokens=10, temperature=1.0, seed=100 + p * 3))
        same = batch.items[3 * p: 3 * p + 3]
        assert [r.completion_ids for r in alone] == [r.completion_ids for r in same]
        assert [r.logprobs for r in alone] == [r.logprobs for r in same]
    pair = engine.generate(PROMPTS[1:3], 3, Sampling(max_tokens=10, temperature=1.0, seed=103))
    assert [r.completion_ids for r in pair] == [r.completion_ids for r in batch.items[3:9]]


def test_score_versions_and_async_handles(dense):
    model_dir, model = dense
    engine = _engine(model_dir, model)
    assert engine.shares_trainer_weights
    assert engine.update_weights((), 3) == [] and engine.policy_version == 3
    handle = engine.submit_generate(PROMPTS[:2], 2, Sampling(max_tokens=6, seed=1))
    engine.update_weights((), 4)  # generated at submit time, with the weights of version 3
    rollouts = engine.collect(handle)
    assert {r.policy_version for r in rollouts} == {3}
    seqs = [r.prompt_ids + r.completion_ids for r in rollouts]
    scores = engine.score(seqs, [len(r.prompt_ids) for r in rollouts])
    assert scores == _trainer_logprobs(model, rollouts, 1.0)
    assert scores == [r.logprobs for r in rollouts]  # temperature 1: the same numbers
    with pytest.raises(ValueError, match="top_p"):
        engine.generate(PROMPTS, 1, Sampling(top_p=0.9))


@pytest.mark.parametrize("arch", ["qwen3", "llama", "qwen2", "mistral", "mixtral", "deepseek-v3"])
def test_fp8_generator_decodes_and_scores_on_one_quantization(dense, tiny_llama, tiny_family, arch, monkeypatch):
    """generation_dtype fp8, in every family (Qwen2's QKV biases added after the FP8 GEMM, Mistral's window,
    Mixtral's and DeepSeek-V3's experts, DeepSeek's MLA, dense first layer and shared experts): the decode loop and
    the scoring forward run the FP8 linears on one quantization per generate call; the reported log-probs are the
    fp8 shadow forward's (the trainer's, same bytes) bit for bit, and the tokens were sampled from FP8 logits (the
    KV-cached decode agrees with them)."""
    from megatron_grpo.models import build_from_hf, fp8
    from tests.test_fp8 import RECIPE

    model_dir = {"qwen3": dense[0], "llama": tiny_llama}.get(arch) or tiny_family(arch)
    model, _ = build_from_hf(model_dir, backend="local", fp8_recipe=RECIPE)
    calls = []
    quantize = fp8.quantize_model
    monkeypatch.setattr(fp8, "quantize_model", lambda *a: calls.append(1) or quantize(*a))
    engine = _engine(model_dir, model, torch.float8_e4m3fn)
    rollouts = engine.generate(PROMPTS, 3, Sampling(max_tokens=10, temperature=0.8, seed=7))
    assert len(calls) == 1
    shadow = _trainer_logprobs(model, rollouts, 0.8, torch.float8_e4m3fn)
    assert shadow == [r.logprobs for r in rollouts]
    bf16 = _trainer_logprobs(model, rollouts, 0.8, torch.bfloat16)
    gap = max(abs(a - b) for r, row in zip(rollouts, bf16) for a, b in zip(r.logprobs, row))
    # sampled from fp8 logits: the KV-cached decode differs from the scoring by round-off (measured 0-3.7e-3, bf16's
    # spread), the bf16 forward by the FP8 gap (4.3e-2 Mixtral - 6.8e-2 DeepSeek-V3)
    assert engine.decode_gap_max <= 1e-2 and gap > 3e-2
    assert engine.score([r.prompt_ids + r.completion_ids for r in rollouts], [len(r.prompt_ids) for r in rollouts]) \
        == _trainer_logprobs(model, rollouts, 1.0, torch.float8_e4m3fn)  # the parity probe's two sides


def test_recipe_config_and_memory_plan(tiny_dense):
    from megatron_grpo.config.schema import Config, from_dict
    from megatron_grpo.models import load_hf_config, shape_from_hf
    from megatron_grpo.trainer.plan import memory_plan
    from megatron_grpo.config.recipe import load_recipe

    cfg = load_recipe(RECIPE, [])
    assert cfg.generation.backend == "megatron" and cfg.grpo.num_generations_per_prompt == 16  # the tiny recipe's
    names = {t.name for t in memory_plan(cfg, shape_from_hf(load_hf_config(tiny_dense)), 1).terms}
    assert "generator (colocated)" not in names  # no weights of its own
    for bad in ({"num_engines": 2}, {"top_k": 5}):
        with pytest.raises(ValueError, match="backend=megatron"):
            from_dict(Config, {"generation": {"backend": "megatron", **bad}})


def _rank_rollouts(model_dir, layouts):
    """On each rank: for every (tp, dp) layout, the engine's rollouts for PROMPTS (same inputs everywhere)."""
    from megatron_grpo.models import build_from_hf
    from megatron_grpo.parallel import state

    out = []
    for tp in layouts:
        state.initialize_model_parallel(state.Layout(world_size=2, tp=tp))
        model, _ = build_from_hf(model_dir, backend="local")
        rollouts = _engine(model_dir, model).generate(PROMPTS, 4, Sampling(max_tokens=12, temperature=0.7, seed=11))
        out.append([(r.completion_ids, r.logprobs, r.finish_reason) for r in rollouts])
    return out


@pytest.mark.slow
def test_tp2_and_dp2_ranks_match_the_single_process(dense):
    model_dir, model = dense
    ref = _engine(model_dir, model).generate(PROMPTS, 4, Sampling(max_tokens=12, temperature=0.7, seed=11))
    ranks = run_distributed(_rank_rollouts, 2, model_dir, [2, 1])  # TP=2, then DP=2 (completions sharded)
    for layout in range(2):
        got = ranks[0][layout]
        assert ranks[1][layout] == got  # every rank ends with the whole batch
        assert [c for c, _, _ in got] == [r.completion_ids for r in ref]
        assert [f for _, _, f in got] == [r.finish_reason for r in ref]
        diff = max(abs(a - b) for (_, lp, _), r in zip(got, ref) for a, b in zip(lp, r.logprobs))
        assert diff <= (1e-5 if layout == 0 else 0.0), diff  # TP changes GEMM round-off; DP does not


FP8_RECIPE = os.path.join(ROOT, "recipes", "grpo-tiny-fp8-cpu.yaml")


def _train(recipe, log_dir, *overrides, nproc=1):
    """``megatron-grpo train`` (under torchrun for nproc > 1); returns the metrics rows and the summary."""
    from tests._dist import free_port

    base = [sys.executable, "-m", "megatron_grpo"] if nproc == 1 else [
        sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc), "--master-port",
        str(free_port()), "-m", "megatron_grpo"]
    cmd = base + ["train", recipe, f"logger.log_dir={log_dir}", "logger.progress_bar=false",
                  "logger.tensorboard=false", *overrides]
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_PORT")}
    env["OMP_NUM_THREADS"] = "1"  # 2 shared cores: one thread is faster than two contending ones
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=900, env=env, cwd=ROOT)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    with open(log_dir / "summary.json") as f:
        return [json.loads(line) for line in open(log_dir / "metrics.jsonl")], json.load(f)


def test_tiny_fp8_recipe_phantom_clips_and_the_fp8_shadow_ratio_removes_them(tmp_path, tiny_dense):
    """The tiny fp8 recipe (bf16 trainer, fp8 megatron generator, fp8 shadow, synchronous): generator and shadow
    are one computation, so alpha and the parity probe are exactly 0 at TP = 1 and TP = 2, while beta (bf16 vs
    fp8) is not: with loss_fn.ratio=train it phantom-clips; with the ratio from the fp8 shadow ("unified FP8")
    nothing is phantom-clipped. TP = 2 runs without sequence parallelism: bf16 autocast training with SP fails
    in Megatron's reduce-scatter (bf16 gradient into an fp32 buffer) whatever the generator."""
    train, summary = _train(FP8_RECIPE, tmp_path / "train", f"policy.model_name={tiny_dense}", "grpo.max_num_steps=3")
    shadow, _ = _train(FP8_RECIPE, tmp_path / "shadow", f"policy.model_name={tiny_dense}", "grpo.max_num_steps=2",
                       "loss_fn.ratio=shadow", "policy.megatron_cfg.tensor_model_parallel_size=2",
                       "policy.megatron_cfg.sequence_parallel=false", nproc=2)
    for r in train + shadow:
        assert r["precision/alpha_abs_mean"] == 0.0 and r["sync/logprob_abs_diff_max"] == 0.0
        assert r["policy/kl_rollout"] == 0.0 and r["precision/beta_abs_mean"] > 5e-3
    assert all(r["clip/phantom_region_fraction"] > 0 for r in train)
    assert sum(r["clip/phantom_zero_grad_fraction"] for r in train) > 0
    assert all(r["clip/phantom_zero_grad_fraction"] == 0.0 and r["clip/phantom_region_fraction"] == 0.0
               for r in shadow)
    assert "generator fp8, shadow fp8 (fp8: e4m3 weight blocks [32, 32]" in summary["precision"]
    assert "an fp8 generator (blockwise e4m3, blocks [32, 32] / 32) beside a bfloat16 trainer" in summary["doctor"]


def test_tiny_recipe_learns_with_megatron_backend(tmp_path, tiny_dense):
    """12 steps with packed sequences (several per 96-token row): the generator scores its rollouts in the
    step's own packed layout, so its log-probs are the trainer's bit for bit (scored padded, they differed
    by RoPE round-off: alpha 1.2e-7, parity 4.8e-7)."""
    steps = 12  # ~2 s each on 2 shared cores; seeded, the mean length falls 15.9 -> 13.2 (first vs last 3)
    cmd = [sys.executable, "-m", "megatron_grpo", "train", RECIPE, f"policy.model_name={tiny_dense}",
           f"grpo.max_num_steps={steps}", f"logger.log_dir={tmp_path}", "logger.progress_bar=false",
           "logger.tensorboard=false", "grpo.deployed_improvement=false", "policy.sequence_packing.enabled=true",
           "policy.sequence_packing.train_mb_tokens=96"]
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_PORT")}
    env["OMP_NUM_THREADS"] = "1"  # 2 shared cores: one thread is faster than two contending ones
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=env, cwd=ROOT)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    rows = [json.loads(line) for line in open(tmp_path / "metrics.jsonl")]
    assert [r["step"] for r in rows] == list(range(1, steps + 1))
    lengths = [r["completion/length_mean"] for r in rows]
    assert sum(lengths[-3:]) / 3 < sum(lengths[:3]) / 3 - 1.5, lengths
    # the generator's log-probs are the trainer's own: no precision gap, no parity gap, on-policy
    for r in rows:
        assert r["precision/beta_abs_mean"] == 0.0 and r["precision/beta_abs_max"] == 0.0
        assert r["sync/logprob_abs_diff_max"] == 0.0 and r["policy/kl_rollout"] == 0.0
        assert r["precision/alpha_abs_mean"] == 0.0 and r["compat/rollout_corr/kl"] == 0.0
        assert r["sync/push_s"] == 0.0 and r["rollout/policy_version_lag"] == 0.0


def _rank_fp8(model_dir, moe_dir, mla_dir):
    """On each rank, at TP = 2 (sequence parallel) on the dense model, then EP = 2 on the MoE, then TP = 2 on
    DeepSeek-V3 (MLA's projections, its down projections too, and the shared experts split over TP): whether the
    fp8 generator's log-probs equal the fp8 shadow forward's (vocab-parallel over TP), and this rank's FP8 bytes."""
    from megatron.core import parallel_state as ps

    from megatron_grpo.models import build_from_hf, fp8, unwrap
    from megatron_grpo.models.forward import completion_scores, forward_log_probs, pack
    from megatron_grpo.parallel import state
    from tests.test_fp8 import RECIPE

    out = {}
    for name, path, layout in (("tp2", model_dir, state.Layout(world_size=2, tp=2)),
                               ("ep2", moe_dir, state.Layout(world_size=2, ep=2)),
                               ("mla-tp2", mla_dir, state.Layout(world_size=2, tp=2))):
        state.initialize_model_parallel(layout)
        model, _ = build_from_hf(path, backend="local", fp8_recipe=RECIPE)
        rollouts = _engine(path, model, torch.float8_e4m3fn).generate(
            PROMPTS[:3], 2, Sampling(max_tokens=8, temperature=0.8, seed=7))
        packed = pack([r.prompt_ids + r.completion_ids for r in rollouts], [len(r.prompt_ids) for r in rollouts])
        lp = forward_log_probs(model, packed, compute_dtype=torch.float8_e4m3fn, params_dtype=torch.float32,
                               temperature=0.8, tp_group=ps.get_tensor_model_parallel_group())
        shards = {k: (w.q.view(torch.uint8).clone(), w.scale_inv.clone())
                  for k, w in fp8.quantize_model(unwrap(model), RECIPE).items()}
        out[name] = (completion_scores(lp, packed) == [r.logprobs for r in rollouts], len(rollouts), shards)
    return out


@pytest.mark.slow
def test_fp8_generator_equals_the_fp8_shadow_at_tp2_and_ep2(dense, tiny_moe, tiny_family):
    """generator fp8 == shadow fp8 bit for bit at TP = 2 (with sequence parallelism: the activation groups
    are per token, so quantizing before or after the sequence all-gather is the same), at EP = 2 (MoE;
    every rank decodes every row) and on DeepSeek-V3 at TP = 2 (MLA); each TP rank's FP8 bytes are the shards of
    the TP = 1 model's (QKV rows
    by query group, fc1 = [gate_r; up_r], proj / fc2 columns): the same bytes the generator's HF blocks hold."""
    from megatron_grpo.models import build_from_hf, fp8, unwrap
    from tests.test_fp8 import RECIPE

    model_dir, _ = dense
    whole = fp8.quantize_model(unwrap(build_from_hf(model_dir, backend="local")[0]), RECIPE)
    ranks = run_distributed(_rank_fp8, 2, model_dir, tiny_moe, tiny_family("deepseek-v3"))
    for rank, result in enumerate(ranks):
        for name in ("tp2", "ep2", "mla-tp2"):
            equal, rows, _ = result[name]
            assert equal and rows == 6, (rank, name)
        local = result["tp2"][2]
        assert sorted(local) == sorted(whole)
        for key, w in whole.items():
            q, s = w.q.view(torch.uint8), w.scale_inv
            if key.endswith("linear_fc1"):  # [gate; up], each split over TP
                want = [torch.cat([half.chunk(2)[rank] for half in t.chunk(2)]) for t in (q, s)]
            elif key.endswith("linear_qkv"):  # whole query groups per TP rank: contiguous rows
                want = [t.chunk(2)[rank] for t in (q, s)]
            else:  # row-parallel: input columns split
                want = [t.chunk(2, dim=1)[rank] for t in (q, s)]
            assert torch.equal(local[key][0], want[0]) and torch.equal(local[key][1], want[1]), (rank, key)
    ep0, ep1 = ranks[0]["ep2"][2], ranks[1]["ep2"][2]  # each EP rank quantizes its own experts (local names)
    expert = "decoder.layers.0.mlp.experts.local_experts.0.linear_fc1"
    attention = "decoder.layers.0.self_attention.linear_qkv"
    assert torch.equal(ep0[attention][0], ep1[attention][0]) and not torch.equal(ep0[expert][0], ep1[expert][0])
