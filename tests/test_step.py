"""step.py and its neighbours: detach_center over micro-batches, the metric path's devices, agreed
batch checks, fp16 overflow back-off, true-fp32 GEMMs, the parity probe's baseline, sampled diagnostics."""

import json
import math
import os
import subprocess
import sys

import pytest
import torch

from tests.test_routing import FP8, PROMPT, ROWS, _metrics, _sequences, _step_batch, _stepper


def _grads_after_step(model_dir, micro_batch_size, clip):
    torch.manual_seed(0)
    st = _stepper(model_dir, f"policy.train_micro_batch_size={micro_batch_size}", f"loss_fn.clip={clip}",
                  "policy.megatron_cfg.optimizer.clip_grad=0")
    old = torch.full((ROWS, 24), -7.0)
    st.current_step, st.nonfinite = 1, []
    batch = _step_batch(old, torch.linspace(-1.0, 1.0, ROWS, dtype=torch.float64))
    st.replay_routes = None
    center = st.weight_center(batch, None)
    st.optimizer.zero_grad()
    stats, _ = st.forward_backward(batch, None, None, None, center)
    return [p.main_grad.clone() for p in st.optimizer.params], center


@pytest.mark.parametrize("clip", ["detach_center", "ppo"])
def test_micro_batches_equal_one_batch(clip, tiny_dense, megatron_single):
    """detach_center centres every micro-batch on mu_W of the whole batch (the no-grad pre-pass),
    so 2 or 4 micro-batches give the gradient of 1 (per micro-batch centring differed by 1e-3)."""
    one, center = _grads_after_step(tiny_dense, ROWS, clip)
    assert (center is None) == (clip != "detach_center")
    for mbs in (4, 2):
        split, _ = _grads_after_step(tiny_dense, mbs, clip)
        for a, b in zip(split, one):
            torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-4)


CENTER_CASES = {
    "train": ("loss_fn.ratio=train", "policy.precision.generation_dtype=bfloat16"),
    "shadow": ("loss_fn.ratio=shadow", "policy.precision.generation_dtype=bfloat16"),
    "shadow-no-forward": ("loss_fn.ratio=shadow",),
    "gap_scaled": ("loss_fn.ratio=gap_scaled", "loss_fn.gap_scale=3", "policy.precision.generation_dtype=bfloat16"),
}
"""Every ratio source the centre can come from: the trainer's, the bf16 shadow's (with a shadow forward) or,
with shadow dtype = compute dtype (no shadow forward), the trainer's detached log-probs standing in for the
shadow's, and gap_scaled's exp(alpha + k beta) with k = 3."""


def _reference_center(case, train_lp, shadow, old, adv, mask, eps=0.2, k=3.0):
    """mu_W from the loss's own log-probs by the formulas of MECHANISM.md, in float64: W = min(rA, clip(r)A)
    with r = exp(lp - old) (train), exp(shadow - old) (shadow; the trainer's own without a shadow
    forward), exp(alpha + k beta) (gap_scaled: alpha = shadow - old, beta = lp - shadow)."""
    lp, old = train_lp.double(), old.double()
    shadow = lp if shadow is None else shadow.double()
    log_r = {"train": lp - old, "shadow": shadow - old, "shadow-no-forward": shadow - old,
             "gap_scaled": shadow - old + k * (lp - shadow)}[case]
    r, a = torch.exp(log_r), adv.double()[:, None].expand_as(lp)
    w = torch.minimum(r * a, r.clamp(1 - eps, 1 + eps) * a)
    return w[mask].mean()


@pytest.mark.parametrize("case", list(CENTER_CASES))
def test_detach_center_centres_on_the_loss_own_ratio(case, tiny_dense, megatron_single):
    """The step's mu_W (one no-grad pre-pass before the schedule) equals the mean of W computed from the
    ratio the loss itself used, for every ratio source and for 1 and 4 micro-batches. Before: gap_scaled
    centred on exp(alpha) (k = 0), and ratio=shadow without a shadow forward on ratio 1 (mu_W = mean(A))."""
    from megatron_grpo.models.forward import pack
    from tests.test_routing import PROMPT, _sequences

    packed = pack(_sequences(), [PROMPT] * ROWS, 0)
    g = torch.Generator().manual_seed(2)
    centers = []
    for micro_batch_size in (ROWS, 2):
        torch.manual_seed(0)
        st = _stepper(tiny_dense, f"policy.train_micro_batch_size={micro_batch_size}", "loss_fn.clip=detach_center",
                      *CENTER_CASES[case])
        assert st.needs_shadow == (case != "shadow-no-forward")
        if not centers:  # a lagged generator: its log-probs 0.3 (std) off the trainer's, so the ratio clips
            old = st.lowp_log_probs(packed, torch.float32) + torch.randn(packed.labels.shape, generator=g) * 0.3
        seen = {}
        forward_backward = st.forward_backward

        def spy(batch, shadow, ref, replay=None, center=None):
            stats, train_lp = forward_backward(batch, shadow, ref, replay, center)
            seen.update(shadow=shadow, center=center, train_lp=train_lp)
            return stats, train_lp

        st.forward_backward = spy
        batch = _step_batch(old, torch.linspace(-1.0, 1.0, ROWS, dtype=torch.float64))
        st.run(batch, step=1)
        assert len(st._plan_of(batch.packed)) == ROWS // micro_batch_size
        assert (seen["shadow"] is None) == (case == "shadow-no-forward")
        ref = _reference_center(case, seen["train_lp"], seen["shadow"], old, batch.advantages, batch.packed.mask)
        assert seen["center"].item() == pytest.approx(ref.item(), abs=1e-6)
        centers.append(seen["center"].item())
    assert centers[0] == pytest.approx(centers[1], abs=1e-6)
@pytest.mark.parametrize("loss", [
    ("loss_fn.ratio=shadow", "loss_fn.correction=tis", "loss_fn.clip=detach_center"),
    ("loss_fn.ratio=gap_scaled",),
    ("loss_fn.correction=icepop",),
    ("loss_fn.correction=seq_mask_tis", "loss_fn.correction_mode=bypass"),
], ids=["shadow-tis-detach_center", "gap_scaled", "icepop", "seq_mask_tis-bypass"])
def test_the_fp8_shadow_feeds_the_loss_and_the_probes(loss, tiny_dense, megatron_single):
    """shadow_dtype fp8 with an fp32 trainer: the step's shadow log-probs, beta, alpha and the deployed-
    improvement probe are those of an independent fp8 forward (bf16 autocast + the FP8 linears, one whole-batch
    forward) before and after the update, whatever the ratio source, clip family and correction."""
    from megatron_grpo.models.forward import pack
    from tests.test_fp8 import fp8_reference_log_probs

    st = _stepper(tiny_dense, *FP8, "grpo.deployed_improvement=true", *loss)
    packed = pack(_sequences(), [PROMPT] * ROWS, 0)
    m = packed.mask
    before = fp8_reference_log_probs(st.model, packed.input_ids, packed.labels)
    old = before + 0.02 * torch.randn(before.shape, generator=torch.Generator().manual_seed(4))  # alpha != 0
    metrics = _metrics(st, _step_batch(old, torch.linspace(-1.0, 1.0, ROWS, dtype=torch.float64)))
    after = fp8_reference_log_probs(st.model, packed.input_ids, packed.labels)
    train, shadow = st.last_log_probs
    torch.testing.assert_close(shadow[m], before[m], atol=1e-5, rtol=0)
    mean = lambda x: x[m].abs().mean().item()  # noqa: E731
    assert metrics["precision/beta_abs_mean"] == pytest.approx(mean(train - before), rel=1e-3)
    assert metrics["precision/beta_abs_mean"] > 5e-3  # fp32 vs fp8: the FP8 gap, not bf16's
    assert metrics["precision/alpha_abs_mean"] == pytest.approx(mean(before - old), rel=1e-3)
    sign = torch.sign(torch.linspace(-1.0, 1.0, ROWS)).unsqueeze(-1)
    deployed = ((after - before) * sign)[m].mean().item()
    assert metrics["policy/deployed_improvement"] == pytest.approx(deployed, rel=1e-2, abs=1e-8)
    assert abs(deployed) > 1e-4 or metrics["correction/masked_fraction"] == 1.0  # seq_mask_tis: a band of 1e-3
    empty = {f"precision/beta_abs_mean_{b}" for b in ("common", "medium", "rare")
             if not ((old[m] > -5) if b == "common" else (old[m] <= -20) if b == "rare"
                     else (old[m] > -20) & (old[m] <= -5)).any()}  # buckets by rollout log-prob
    assert empty and {k for k, v in metrics.items() if not math.isfinite(v)} == empty  # an empty bucket: NaN


def test_step_metrics_live_on_the_model_device():
    """Every tensor the step's metric path builds is made on the given device (``meta`` here, a
    second device type); ``to_host``'s stack names any stray tensor on another device."""
    from megatron_grpo.loss import StatSet, finalize
    from megatron_grpo.observe.metrics_logger import stack_metrics
    from megatron_grpo.rollout import Rollout, Rollouts
    from megatron_grpo.trainer.step import rollout_metrics

    meta = torch.device("meta")
    stats = StatSet()
    stats.add_sum("n_tokens", torch.ones((), device=meta))
    stats.add_sum("loss", torch.ones((), device=meta))
    rollouts = Rollouts([Rollout(0, [1], [2, 3], [-1.0, -2.0], "stop", 0)])
    metrics = finalize(*stats.reduce(None))
    metrics.update(rollout_metrics(rollouts, torch.tensor([1.0], dtype=torch.float64), meta))
    names, stacked = stack_metrics(metrics)
    assert stacked.device == meta and len(names) == len(metrics)
    metrics["time/step_s"] = torch.tensor(1.0)  # a CPU tensor among meta ones: named
    with pytest.raises(AssertionError, match="time/step_s"):
        stack_metrics(metrics)


def test_batch_checks_run_on_the_whole_batch(tiny_dense):
    """Checks every rank must agree on run before the schedule, on the batch all ranks hold."""
    from megatron_grpo.rollout import Rollout, Rollouts
    from megatron_grpo.trainer.step import build_step_batch

    def rollouts(completion, logprobs):
        return Rollouts([Rollout(i // 2, [5, 6], list(completion), list(logprobs), "stop", 0) for i in range(4)])

    adv = torch.zeros(4, dtype=torch.float64)
    batch = build_step_batch(rollouts([7], [-1.0]), adv, 1, 2, 0, step=3)
    assert batch.advantages.dtype == torch.float64 and batch.num_global_tokens.item() == 4
    with pytest.raises(ValueError, match="step 3: the batch has no valid completion token"):
        build_step_batch(rollouts([], []), adv, 0, 2, 0, step=3)
    with pytest.raises(ValueError, match="step 3: the generator returned 4 non-finite"):
        build_step_batch(rollouts([7], [float("-inf")]), adv, 0, 2, 0, step=3)
    for logprobs in ([], [-1.0, -2.0]):  # a token without its log-prob, a log-prob without its token
        with pytest.raises(ValueError, match=rf"step 3: the generator returned {len(logprobs)} log-probs for the 1 "
                                             r"tokens of completion 0 \(prompt 0\)"):
            build_step_batch(rollouts([7], logprobs), adv, 0, 2, 0, step=3)


@pytest.mark.parametrize("balance_tokens", [False, True])
def test_step_batch_counts_are_the_whole_batchs_on_every_dp_rank(balance_tokens):
    """The loss's normalisers (token_mean: valid tokens; seq_mean_*: sequences with a valid token) are the
    whole batch's on every DP rank, contiguous or token-balanced rows, so the ranks' summed gradients are the
    global batch's; the ranks' rows partition the batch. Completion lengths 1, 2, 0, 3: 6 tokens, 3 sequences."""
    from megatron_grpo.rollout import Rollout, Rollouts
    from megatron_grpo.trainer.step import build_step_batch

    completions = [[7], [7, 8], [], [7, 8, 9]]
    rollouts = Rollouts([Rollout(i // 2, [5, 6], c, [-1.0] * len(c), "stop", 0) for i, c in enumerate(completions)])
    ranks = [build_step_batch(rollouts, torch.zeros(4, dtype=torch.float64), r, 2, 0, balance_tokens=balance_tokens)
             for r in range(2)]
    for batch in ranks:
        assert (batch.num_global_tokens.item(), batch.num_global_seqs.item()) == (6, 3)
    assert sum(int(b.packed.mask.sum()) for b in ranks) == 6 and sum(b.packed.mask.shape[0] for b in ranks) == 4


@pytest.mark.parametrize("params_dtype", ["float32", "float16"])
def test_fp16_overflow_backs_off_without_counting_as_a_nonfinite_skip(params_dtype, tiny_dense, megatron_single):
    """Megatron's dynamic loss scaler (fp16 compute over fp32 params, and fp16 params with fp32
    main params): an overflow halves the scale and skips the update; at the minimum scale it is a
    non-finite skip."""
    from tests.test_routing import _stepper

    st = _stepper(tiny_dense, f"policy.precision.params_dtype={params_dtype}", "policy.precision.compute_dtype=float16",
                  "policy.precision.initial_loss_scale=4.0", "policy.precision.min_loss_scale=1.0",
                  params_dtype=getattr(torch, params_dtype))
    opt = st.optimizer
    before = [p.detach().clone() for p in opt.params]
    flags = []
    for _ in range(3):
        for p in opt.params:
            p.main_grad.fill_(float("inf"))
        out = opt.step()
        flags.append((out["train/skipped_overflow"].item(), out["train/skipped_nonfinite"].item(), opt.loss_scale()))
    # 4 -> 2 -> 1: back-off skips; at the minimum scale the overflow is a real non-finite skip
    assert flags == [(1.0, 0.0, 2.0), (1.0, 0.0, 1.0), (0.0, 1.0, 1.0)]
    assert all(torch.equal(a, p) for a, p in zip(before, opt.params))


def test_fp32_compute_means_true_fp32_gemms(monkeypatch):
    from megatron_grpo.models import spec

    monkeypatch.delenv("NVIDIA_TF32_OVERRIDE", raising=False)
    previous = (torch.get_float32_matmul_precision(), torch.backends.cudnn.allow_tf32)
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = True
    try:
        assert "true fp32" in spec.configure_fp32_matmul(torch.float32)
        assert not torch.backends.cuda.matmul.allow_tf32 and not torch.backends.cudnn.allow_tf32
        assert torch.get_float32_matmul_precision() == "highest"
        import os

        assert os.environ["NVIDIA_TF32_OVERRIDE"] == "0"
    finally:
        torch.set_float32_matmul_precision(previous[0])
        torch.backends.cudnn.allow_tf32 = previous[1]
    monkeypatch.setattr(spec, "te_usable", lambda: True)
    assert spec.resolve_backend("auto", torch.float32) == "local"  # TE's fp32 GEMMs may be TF32
    assert spec.resolve_backend("auto", torch.bfloat16) == "auto"
    assert spec.resolve_backend("te", torch.float32) == "te"


class _FakeEngine:
    def __init__(self, diffs):
        self.diffs = list(diffs)

    def score(self, sequences, prompt_lens):
        d = self.diffs.pop(0)
        return [[-1.0 - x for x in d] for _ in sequences]


def test_parity_probe_fails_on_growth_over_its_baseline_and_on_the_max():
    from megatron_grpo.rollout.parity import ParityError, ProbeBatch, check_parity

    probe = ProbeBatch([[1, 2, 3, 4, 5]], [2])
    ours = lambda _: [[-1.0, -1.0, -1.0]]  # noqa: E731
    engine = _FakeEngine([[0.01, 0.01, 0.01], [0.02, 0.02, 0.02], [0.05, 0.05, 0.05], [0.0, 0.0, 0.9]])
    base = check_parity(engine, probe, ours, ["w"], 0.025, 0, max_tolerance=0.5)
    assert base["sync/logprob_abs_diff_mean"] == pytest.approx(0.01)
    drift = check_parity(engine, probe, ours, ["w"], 0.025, 1, max_tolerance=0.5, baseline=base)
    assert drift["sync/logprob_diff_vs_baseline"] == pytest.approx(2.0)
    with pytest.raises(ParityError, match="first probe: mean 0.01"):  # 5x the baseline, above the floor
        check_parity(engine, probe, ours, ["w"], 0.025, 2, max_tolerance=0.5, baseline=base)
    with pytest.raises(ParityError, match="max 0.9") as failed:  # mean 0.3 within 1.0: the max alone fails
        check_parity(engine, probe, ours, ["w"], 1.0, 3, max_tolerance=0.5, baseline=base)
    assert "Only the max is over its limit" in str(failed.value) and "generation.parity_max_tolerance" in str(failed.value)
    engine.diffs = [[0.05, 0.05, 0.05]]  # the mean's failure does not suggest relaxing the max
    with pytest.raises(ParityError) as failed:
        check_parity(engine, probe, ours, ["w"], 0.025, 4, max_tolerance=0.5, baseline=base)
    assert "Only the max" not in str(failed.value)
    # an engine that returns fewer log-probs than scored tokens fails, instead of comparing the overlap
    engine.diffs = [[0.0, 0.0]]
    with pytest.raises(ParityError, match=r"\(2 log-probs for sequence 0\), the trainer 1 \(3\)"):
        check_parity(engine, probe, ours, ["w"], 0.025, 5, max_tolerance=0.5)


def _probe_on_tp_ranks_with_a_stale_engine():
    """One TP=2 gloo rank of ``GRPOTrainer.check_parity``: the trainer's probe forward is a TP
    all-reduce, and rank 0's engine reports the previous weights version (a 15 s collective timeout
    turns a hang into an error)."""
    import time
    import types

    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    from megatron_grpo.config.schema import Config, from_dict
    from megatron_grpo.parallel import state
    from megatron_grpo.rollout.parity import ParityError, ProbeBatch
    from megatron_grpo.trainer.loop import GRPOTrainer

    state.initialize_model_parallel(state.Layout(2, tp=2), timeout_minutes=0.25)

    class Engine:
        pushed_digests = {"w": "digest"}

        def weight_version(self):
            return "1"

        def weight_checksums(self):
            return {"w": "digest"}

        def score(self, sequences, prompt_lens):
            return [[-1.0] * 3 for _ in sequences]

    def trainer_scores(dtype):
        def score(probe):
            dist.all_reduce(torch.ones(4), group=ps.get_tensor_model_parallel_group())  # the TP forward
            return [[-1.0] * 3 for _ in probe.sequences]
        return score

    trainer = GRPOTrainer.__new__(GRPOTrainer)
    trainer.cfg = from_dict(Config, {})
    trainer.ctx = types.SimpleNamespace(engine=Engine() if dist.get_rank() == 0 else None,
                                        trainer_scores=trainer_scores, device=torch.device("cpu"))
    trainer.step, trainer.version, trainer.parity_baseline = 1, 2, None
    trainer.probe, trainer._last_push_names = ProbeBatch([[1, 2, 3, 4, 5]], [2]), ["w"]
    start = time.perf_counter()
    try:
        trainer.check_parity(force=True)
    except ParityError as exc:
        return str(exc), time.perf_counter() - start
    return None, time.perf_counter() - start


def test_parity_probe_weight_check_failure_raises_on_every_tp_rank():
    """A wrong weights version on rank 0's engine: every rank raises ``ParityError`` within seconds
    (the check ran before the collective forward the other ranks were in: a hang, then a timeout)."""
    from tests._dist import run_distributed

    for message, seconds in run_distributed(_probe_on_tp_ranks_with_a_stale_engine, 2, timeout=180):
        assert message is not None and "reports weights version '1' after the push of version 2" in message
        assert seconds < 10


def test_parity_probe_is_sampled_text_scored_at_temperature_one(tiny_dense, megatron_single):
    """The probe is a completion the model samples (not uniform random tokens), and the trainer
    scores it at T = 1 like the generator's ``score`` whatever the generation temperature."""
    from types import SimpleNamespace

    from megatron_grpo.models.forward import completion_scores, pack
    from megatron_grpo.rollout import Rollout, Rollouts
    from megatron_grpo.rollout.parity import ProbeBatch
    from megatron_grpo.trainer.build import TrainContext

    class Engine:
        def generate(self, prompts, n, sampling):
            assert sampling.temperature == 1.0 and sampling.seed is not None
            return Rollouts([Rollout(i, p, [7, 8, 9] if i else [], [-1.0] * (3 if i else 0), "stop", 0)
                             for i, p in enumerate(prompts)])

    probe = ProbeBatch.sampled(Engine(), [[1, 2], [3, 4]], 8, seed=1)
    assert probe.sequences == [[3, 4, 7, 8, 9]] and probe.prompt_lens == [2]  # the empty completion dropped
    st = _stepper(tiny_dense, "generation.temperature=0.7")
    ctx = SimpleNamespace(stepper=st, pad_id=0)
    scores = TrainContext.trainer_scores(ctx, torch.float32)(probe)
    packed = pack(probe.sequences, probe.prompt_lens, 0)
    t1 = completion_scores(st.lowp_log_probs(packed, torch.float32, temperature=1.0), packed)
    t07 = completion_scores(st.lowp_log_probs(packed, torch.float32), packed)
    assert scores == t1 and max(abs(a - b) for a, b in zip(t1[0], t07[0])) > 1e-3
    assert not math.isnan(scores[0][0])


ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SHADOW_METRICS = ("policy/kl_rollout", "policy/deployed_improvement", "clip/phantom_region_fraction",
                  "clip/legit_zero_grad_fraction", "clip/rescued_region_fraction")


def _train(model_dir, log_dir, *overrides):
    """4 steps of the tiny recipe on CPU with the megatron generator (no vLLM start-up) in bf16 and an
    fp32 trainer, so the shadow forward runs (shadow dtype bf16 != compute dtype fp32)."""
    recipe = os.path.join(ROOT, "recipes", "grpo-tiny-eos-megatron-cpu.yaml")
    cmd = [sys.executable, "-m", "megatron_grpo", "train", recipe,
           f"policy.model_name={model_dir}", "grpo.max_num_steps=4", f"logger.log_dir={log_dir}",
           "logger.progress_bar=false", "logger.tensorboard=false", "policy.precision.generation_dtype=bfloat16",
           *overrides]
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_PORT")}
    env["OMP_NUM_THREADS"] = "1"
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=env, cwd=ROOT)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    return [json.loads(line) for line in open(os.path.join(log_dir, "metrics.jsonl"))], proc.stdout


@pytest.fixture(scope="module")
def sampled_runs(tmp_path_factory, tiny_dense):
    every = {}
    for n in (1, 2):
        log_dir = str(tmp_path_factory.mktemp(f"diagnostics-every-{n}"))
        every[n] = (log_dir, *_train(tiny_dense, log_dir, f"grpo.diagnostics_every={n}"))
    return every


def test_diagnostics_every_samples_the_shadow_and_the_probe_without_changing_training(sampled_runs):
    (_, every1, _), (_, every2, _) = sampled_runs[1], sampled_runs[2]
    precision = [k for k in every1[0] if k.startswith("precision/")]
    assert len(precision) >= 10 and every1[0]["precision/beta_abs_mean"] > 0  # a real shadow forward
    assert [r["step"] for r in every2] == [1, 2, 3, 4]
    for row in every1:
        assert all(k in row for k in precision + list(SHADOW_METRICS))
    for row in every2:
        sampled = row["step"] in (1, 2, 4)  # step 1 and every 2nd step
        for key in precision + list(SHADOW_METRICS):
            assert (key in row) == sampled, (row["step"], key)  # absent, not zero or null
        # what does not need the shadow is logged at every step
        for key in ("loss/policy", "clip/region_fraction", "clip/zero_grad_fraction", "compat/gen_kl_error",
                    "reward/mean", "train/grad_norm", "sync/logprob_abs_diff_mean"):
            assert key in row, (row["step"], key)
    # with ratio=train the shadow never touches the training path: same loss, gradient and rollouts
    for a, b in zip(every1, every2):
        for key in ("loss/policy", "train/grad_norm", "reward/mean", "completion/length_mean"):
            assert a[key] == b[key], (a["step"], key, a[key], b[key])
        if b["step"] != 3:
            assert all(a[k] == b[k] for k in precision if a[k] is not None), a["step"]


def test_summary_doctor_and_plots_read_a_sampled_run(sampled_runs, tmp_path, capsys):
    from megatron_grpo.cli import main

    log_dir, _, out = sampled_runs[2]
    summary = json.load(open(os.path.join(log_dir, "summary.json")))
    assert summary["steps"] == 4 and summary["diagnostics_steps"] == {"precision": 3, "deployed_improvement": 3}
    assert summary["beta_abs_mean"]["first"] > 0 and summary["deployed_improvement_mean"] is not None
    assert "first -> last 5 sampled steps (3 of 4 steps sampled): mean |beta|" in out
    assert main(["doctor", log_dir]) in (0, 1)
    assert "(3 of 4 steps sampled)" in capsys.readouterr().out
    pytest.importorskip("matplotlib")
    figures = str(tmp_path / "figs")
    assert main(["plot", log_dir, "--out", figures]) == 0
    assert {"beta.png", "deployed_improvement.png", "clip_fractions.png"} <= set(os.listdir(figures))
