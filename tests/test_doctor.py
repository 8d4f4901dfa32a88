"""The precision doctor on recorded (synthetic) metrics.jsonl files: a matched bf16 run is healthy,
an fp32-vs-bf16 run gets phantom clipping and the ranked fixes (a short one a mismatch warning), growth
and masking are flagged."""

import json
import math

import pytest
import yaml

from megatron_grpo.observe import doctor
from megatron_grpo.observe.doctor import LiveDoctor, diagnose, read_config, read_metrics


def precision_config(compute, generation, ratio="train", correction=None, replay="none"):
    return {"policy": {"precision": {"params_dtype": "float32", "compute_dtype": compute,
                                     "generation_dtype": generation, "shadow_dtype": generation},
                       "megatron_cfg": {"moe_routing_replay": replay}},
            "loss_fn": {"ratio": ratio, "clip": "ppo", "ratio_clip_min": 0.2, "ratio_clip_max": 0.2,
                        "correction": correction},
            "logger": {"tensorboard": True}, "checkpointing": {"checkpoint_dir": None}}


def write_run(path, rows, config=None):
    """Writes rows as the trainer does (NaN/inf -> null) and the resolved config."""
    path.mkdir(parents=True, exist_ok=True)
    with open(path / "metrics.jsonl", "w") as f:
        for step, row in enumerate(rows, 1):
            clean = {k: (v if math.isfinite(v) else None) for k, v in row.items()}
            f.write(json.dumps({"step": step, **clean}) + "\n")
    if config is not None:
        (path / "config.yaml").write_text(yaml.safe_dump(config))
    return str(path)


def step_row(step, beta=0.0, phantom=0.0, legit=0.004, drift=2e-3, **extra):
    row = {"reward/mean": -16.0 + step, "completion/length_mean": 16.0 - step * 0.5,
           "precision/beta_abs_mean": beta, "precision/snr": math.nan if beta == 0 else 3.0,
           "clip/phantom_region_fraction": phantom * 1.2, "clip/phantom_zero_grad_fraction": phantom,
           "clip/legit_region_fraction": legit * 2, "clip/legit_zero_grad_fraction": legit,
           "policy/deployed_improvement": 1e-3, "sync/logprob_abs_diff_mean": drift,
           "train/skipped_nonfinite": 0.0}
    row.update(extra)
    return row


@pytest.fixture
def matched_run(tmp_path):
    rows = [step_row(s) for s in range(1, 13)]
    return write_run(tmp_path / "bf16-matched", rows, precision_config("bfloat16", "bfloat16"))


@pytest.fixture
def mismatch_run(tmp_path):
    rows = [step_row(s, beta=0.076, phantom=0.12, legit=0.004) for s in range(1, 13)]
    return write_run(tmp_path / "fp32-vs-bf16", rows, precision_config("float32", "bfloat16"))


def test_matched_bf16_run_is_healthy(matched_run, capsys):
    rows, config = read_metrics(matched_run), read_config(matched_run)
    assert math.isnan(rows[0]["precision/snr"])  # null comes back as NaN
    assert diagnose(rows, config) == []
    assert doctor.doctor(matched_run) == 0
    out = capsys.readouterr().out
    assert "healthy" in out and "bfloat16" in out and "beta = 0 exactly" in out


def test_mismatch_run_names_phantom_clipping_dtypes_and_ranked_fixes(mismatch_run, capsys):
    findings = diagnose(read_metrics(mismatch_run), read_config(mismatch_run))
    assert [f.kind for f in findings] == ["phantom_clipping"]
    message, fixes = findings[0].message, findings[0].fixes
    assert "phantom clipping zeroes 12.0% of token gradients (legitimate: 0.4%" in message
    assert "trainer computes in float32 while the generator runs bfloat16" in message
    # MECHANISM.md's order: fp16 both, match the generator (bf16 autocast), shadow ratio, no clip, detach
    expected = ["policy.precision.compute_dtype=float16 policy.precision.generation_dtype=float16",
                "policy.precision.compute_dtype=bfloat16", "loss_fn.ratio=shadow",
                "loss_fn.ratio_clip_min=10 loss_fn.ratio_clip_max=10", "loss_fn.clip=detach_center"]
    assert len(fixes) == len(expected)
    assert all(fix.endswith(override) for fix, override in zip(fixes, expected))
    assert doctor.doctor(mismatch_run) == 1
    out = capsys.readouterr().out
    assert "Fixes, strongest first:" in out and "1. fp16 training" in out


def test_a_short_mismatched_run_is_never_called_healthy(tmp_path, capsys):
    """3 steps of an fp32 trainer against a bf16 generator, little damage so far (mean |beta| 1.5e-3,
    0.3% of gradients zeroed): the mismatch is named with its measured severity and the write-up's
    fixes in order; without config.yaml a non-zero beta still names it."""
    rows = [step_row(s, beta=1.5e-3, phantom=0.003) for s in range(1, 4)]
    run = write_run(tmp_path / "fp32-vs-bf16-3steps", rows, precision_config("float32", "bfloat16"))
    findings = diagnose(read_metrics(run), read_config(run))
    assert [(f.kind, f.severity) for f in findings] == [("precision_mismatch", "warning")]
    message = findings[0].message
    assert "the trainer computes in float32 while the generator runs bfloat16" in message
    assert "mean |beta| 1.50e-03" in message and "zeroes 0.3% of token gradients" in message
    assert "over 3 steps" in message
    expected = ["policy.precision.compute_dtype=float16 policy.precision.generation_dtype=float16",
                "policy.precision.compute_dtype=bfloat16", "loss_fn.ratio=shadow",
                "loss_fn.ratio_clip_min=10 loss_fn.ratio_clip_max=10", "loss_fn.clip=detach_center"]
    assert len(findings[0].fixes) == len(expected)
    assert all(fix.endswith(override) for fix, override in zip(findings[0].fixes, expected))
    assert doctor.doctor(run) == 1
    out = capsys.readouterr().out
    assert "healthy" not in out and "warning: " in out and "1. fp16 training" in out
    bare = write_run(tmp_path / "noconfig", rows)
    assert [f.kind for f in diagnose(read_metrics(bare), None)] == ["precision_mismatch"]


def test_phantom_threshold_is_strict(tmp_path):
    below = [step_row(s, beta=0.01, phantom=0.9 * doctor.PHANTOM_ZERO_GRAD) for s in range(1, 7)]
    above = [step_row(s, beta=0.01, phantom=1.5 * doctor.PHANTOM_ZERO_GRAD) for s in range(1, 7)]
    config = precision_config("float32", "bfloat16")
    assert [(f.kind, f.severity) for f in diagnose(below, config)] == [("precision_mismatch", "warning")]
    assert [f.kind for f in diagnose(above, config)] == ["phantom_clipping"]  # it names the precisions


def test_fixes_already_in_effect_are_left_out():
    config = precision_config("float32", "bfloat16", ratio="shadow")
    fixes = doctor.precision_fixes(config)
    assert not any("loss_fn.ratio=shadow" in f for f in fixes)
    bf16_params = precision_config("bfloat16", "float16")
    bf16_params["policy"]["precision"]["params_dtype"] = "bfloat16"
    assert "policy.precision.params_dtype=float32 policy.precision.compute_dtype=float16" in doctor.precision_fixes(
        bf16_params)[0]


def test_growing_parity_drift_is_flagged(tmp_path):
    rows = [step_row(s, drift=2e-3 * (1.25 ** s)) for s in range(1, 13)]
    run = write_run(tmp_path / "drift", rows, precision_config("bfloat16", "bfloat16"))
    findings = diagnose(read_metrics(run), read_config(run))
    assert [f.kind for f in findings] == ["parity_drift"]
    assert "parity-probe drift" in findings[0].message
    flat = [step_row(s, drift=2e-3 * (1 + 0.05 * (s % 2))) for s in range(1, 13)]
    assert diagnose(flat, None) == []


def test_growing_beta_is_flagged():
    rows = [step_row(s, beta=0.002 * s) for s in range(1, 13)]
    findings = diagnose(rows, precision_config("float32", "bfloat16"))
    assert [f.kind for f in findings] == ["precision_mismatch", "beta_growing"]
    assert "NeMo-RL #1801" in findings[1].message


def test_moe_routing_mismatch_and_masking_correction(tmp_path):
    rows = [step_row(s, **{"moe/route_mismatch_fraction": 0.04, "correction/masked_fraction": 0.8})
            for s in range(1, 7)]
    run = write_run(tmp_path / "moe", rows, precision_config("bfloat16", "bfloat16", correction="icepop"))
    findings = {f.kind: f for f in diagnose(read_metrics(run), read_config(run))}
    assert set(findings) == {"moe_route_mismatch", "correction_masks_most"}
    assert "4.0% of (token, layer)" in findings["moe_route_mismatch"].message
    assert "moe_routing_replay=R2" in findings["moe_route_mismatch"].fixes[0]
    assert "icepop masks 80.0% of valid tokens" in findings["correction_masks_most"].message
    replayed = precision_config("bfloat16", "bfloat16", replay="R2")
    assert [f.fixes for f in diagnose(rows, replayed) if f.kind == "moe_route_mismatch"] == [[]]


def test_without_config_the_verdict_still_gives_fixes(tmp_path):
    rows = [step_row(s, beta=0.05, phantom=0.1) for s in range(1, 7)]
    run = write_run(tmp_path / "noconfig", rows)
    assert read_config(run) is None
    findings = diagnose(read_metrics(run), None)
    assert findings[0].kind == "phantom_clipping" and "no config.yaml" in findings[0].message
    assert any("loss_fn.ratio=shadow" in f for f in findings[0].fixes)


def test_live_doctor_reports_a_finding_once_when_it_first_triggers():
    live = LiveDoctor(precision_config("float32", "bfloat16"))
    said = [live.update(s, step_row(s, beta=0.07, phantom=0.2)) for s in range(1, 7)]
    assert said[:2] == [[], []]  # too few steps to judge
    assert len(said[2]) == 1 and said[2][0].startswith("doctor (step 3): problem: phantom clipping")
    assert all(m == [] for m in said[3:])


def test_missing_metrics_file_names_the_path(tmp_path):
    with pytest.raises(FileNotFoundError, match="metrics.jsonl"):
        read_metrics(str(tmp_path))


def sampled_rows(n=10, every=2, beta=0.02, phantom=0.05):
    """Rows as ``grpo.diagnostics_every=every`` writes them: the shadow's and the probe's metrics only at
    step 1 and every ``every``-th step; the other metrics at every step."""
    rows = []
    for step in range(1, n + 1):
        row = {"step": step, **step_row(step, beta=beta * step, phantom=phantom)}
        if step != 1 and step % every:
            for key in [k for k in row if k.startswith(("precision/", "clip/phantom", "clip/legit", "policy/"))]:
                del row[key]
        rows.append(row)
    return rows


def test_rows_without_the_sampled_diagnostics_use_the_rows_that_have_them(tmp_path, capsys):
    rows = sampled_rows()
    run = write_run(tmp_path / "run", rows, precision_config("float32", "bfloat16"))
    found = {f.kind: f for f in diagnose(read_metrics(run), read_config(run))}
    # 6 of 10 steps carry the diagnostics (1, 2, 4, 6, 8, 10): means and growth use only those
    assert "(6 of 10 steps sampled)" in found["phantom_clipping"].message
    assert "mean |beta| 1.03e-01" in found["phantom_clipping"].message  # mean of 0.02 * (1, 2, 4, ..., 10)
    assert "first vs last 5 sampled steps) (6 of 10 steps sampled)" in found["beta_growing"].message
    assert doctor.doctor(run) == 1
    assert "10 steps" in capsys.readouterr().out
    live = LiveDoctor(None)
    messages = [m for step, row in enumerate(rows, 1) for m in live.update(step, row)]
    assert any("phantom clipping" in m for m in messages)
    healthy = sampled_rows(beta=0.0, phantom=0.0)
    assert doctor.healthy_sentence(healthy, None).endswith("beta = 0 exactly (6 of 10 steps sampled), phantom "
                                                             "clipping zeroes 0.00% of token gradients)")
    bare = [{k: v for k, v in row.items() if not k.startswith(("precision/", "clip/"))} for row in healthy]
    assert "no precision metrics logged" in doctor.healthy_sentence(bare, None)


def fp8_config(compute="bfloat16", shadow="fp8", ratio="train", correction=None, first=0, last=0):
    config = precision_config(compute, "fp8", ratio=ratio, correction=correction)
    config["policy"]["precision"].update(shadow_dtype=shadow, fp8={
        "weight_block_size": [32, 32], "activation_block_size": 32, "use_weight_pow2_scale": False,
        "use_activation_pow2_scale": False, "num_first_layers_in_bf16": first, "num_last_layers_in_bf16": last})
    return config


def test_an_fp8_generator_beside_a_bf16_or_fp32_trainer_gets_fp8s_fixes(tmp_path, capsys):
    rows = [step_row(s, beta=0.0117, phantom=0.02, **{"precision/beta_abs_max": 0.05 + 0.01 * s})
            for s in range(1, 4)]
    run = write_run(tmp_path / "fp8", rows, fp8_config())
    [finding] = diagnose(read_metrics(run), read_config(run))
    assert finding.kind == "phantom_clipping"
    assert ("an fp8 generator (blockwise e4m3, blocks [32, 32] / 32) beside a bfloat16 trainer" in finding.message
            and "mean |beta| 1.17e-02, max |beta| 8.00e-02" in finding.message
            and "zeroes 2.0% of token gradients" in finding.message)
    # strongest first: the ratio from the generator's own FP8 forward, a correction, bf16 first / last layers
    expected = ["policy.precision.shadow_dtype=fp8 loss_fn.ratio=shadow", "loss_fn.correction=tis",
                "policy.precision.fp8.num_first_layers_in_bf16=2 policy.precision.fp8.num_last_layers_in_bf16=2"]
    assert len(finding.fixes) == 3 and all(f.endswith(o) for f, o in zip(finding.fixes, expected))
    assert not any("compute_dtype=fp8" in f or "float16" in f for f in finding.fixes)  # no impossible fix
    # little damage so far (fp32 trainer): the mismatch warning names fp8 too; fixes in effect are left out
    small = [step_row(s, beta=0.01, phantom=0.001) for s in range(1, 4)]
    [warning] = diagnose(small, fp8_config("float32", ratio="shadow", correction="tis"))
    assert warning.kind == "precision_mismatch" and "beside a float32 trainer" in warning.message
    assert len(warning.fixes) == 1 and warning.fixes[0].endswith(expected[2])
    assert doctor.fp8_fixes(fp8_config(ratio="shadow", correction="icepop", first=2, last=2)) == []
    assert doctor.doctor(run) == 1 and "1. take the PPO ratio from the generator's FP8 forward" in capsys.readouterr().out
