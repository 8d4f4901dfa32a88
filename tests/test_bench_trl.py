"""tools/bench/bench_trl.py and tools/bench/trl_grpo_run.py: their pure parts (arguments, the settings both trainers get,
the timing and the ratio table), without installing TRL or training."""

import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "tools", "bench"))

import bench_trl  # noqa: E402
import trl_grpo_run  # noqa: E402


def test_arguments_defaults_and_errors(capsys):
    args = bench_trl.parse_args(["--out", "/tmp/x"])
    shape = (args.hidden, args.layers, args.prompts_per_step, args.num_generations, args.max_new_tokens)
    assert shape == (512, 8, 4, 16, 16) and args.venv == "/tmp/x/venv" and args.overrides == []
    assert args.runs == ["trl", "ours", "ours-diag10", "ours-all10"]
    assert bench_trl.parse_args(["--runs", "ours", "a=1"]).overrides == ["a=1"]
    for bad in (["--runs", "ours,nemo"], ["--warmup", "0"], ["--micro-batch-size", "5"]):
        with pytest.raises(SystemExit):
            bench_trl.parse_args(bad)
    assert "--runs: unknown nemo" in capsys.readouterr().err


def test_the_trl_script_needs_no_trl_to_import_and_gets_the_same_shape():
    assert "trl" not in sys.modules  # trl_grpo_run imports TRL inside main only
    args = bench_trl.parse_args(["--steps", "5", "--warmup", "2", "--max-new-tokens", "12", "--lr", "1e-3"])
    cmd = bench_trl.trl_command("/venv/bin/python", args, "/m", "/p.jsonl", "/o/times.json")
    assert cmd[:2] == ["/venv/bin/python", bench_trl.TRL_SCRIPT]
    trl_args = trl_grpo_run.parse_args(cmd[2:])
    kw = trl_grpo_run.grpo_config_kwargs(trl_args, "/o/trl-out")
    assert kw["max_steps"] == 7 and kw["per_device_train_batch_size"] == 8 and kw["gradient_accumulation_steps"] == 8
    assert kw["num_generations"] == 16 and kw["max_completion_length"] == 12
    assert kw["generation_kwargs"] == {"min_new_tokens": 12}  # exactly 12 tokens: EOS suppressed until then
    assert kw["learning_rate"] == 1e-3 and kw["epsilon"] == 0.2 and kw["beta"] == 0.0 and kw["loss_type"] == "dapo"
    assert not kw["bf16"] and kw["use_cpu"] and not kw["gradient_checkpointing"] and kw["num_iterations"] == 1
    assert trl_grpo_run.negative_length(["ab", "c"], [[1, 2], [3]]) == [-2.0, -1.0]
    with pytest.raises(ValueError, match="multiple of --micro-batch-size"):
        trl_grpo_run.grpo_config_kwargs(trl_grpo_run.parse_args(
            ["--model", "m", "--prompts", "p", "--out", "o", "--micro-batch-size", "6"]), "/o")


def test_our_overrides_make_a_valid_recipe_of_the_same_shape(tiny_dense, tmp_path):
    from megatron_grpo.config.recipe import load_recipe

    args = bench_trl.parse_args(["--steps", "5", "--warmup", "2", "--max-new-tokens", "12", "logger.tensorboard=false"])
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"prompt": "a b"}\n')
    for name in ("ours", "ours-diag10", "ours-all10"):
        overrides = bench_trl.ours_overrides(args, tiny_dense, str(prompts), str(tmp_path), bench_trl.RUNS[name])
        cfg = load_recipe(args.recipe, overrides)
        assert cfg.generation.ignore_eos and cfg.generation.max_new_tokens == 12 and cfg.grpo.max_num_steps == 7
        assert (cfg.grpo.num_prompts_per_step, cfg.grpo.num_generations_per_prompt) == (4, 16)
        assert cfg.policy.train_micro_batch_size == 8 and cfg.policy.megatron_cfg.optimizer.lr == 2e-3
        loss = cfg.loss_fn
        assert (loss.ratio_clip_min, loss.ratio_clip_max, loss.aggregation) == (0.2, 0.2, "token_mean")
        assert cfg.grpo.diagnostics_every == (1 if name == "ours" else 10) and not cfg.logger.tensorboard
        assert cfg.generation.parity_probe_every == (10 if name == "ours-all10" else 1)
        assert cfg.generation.backend == "vllm"  # the recipe's generator


def test_prompts_have_exactly_the_asked_token_count():
    texts = bench_trl.prompt_texts(str.split, 20, 5)
    assert len(set(texts)) == 20 and all(len(t.split()) == 5 for t in texts)
    assert texts == bench_trl.prompt_texts(str.split, 20, 5)  # seeded
    with pytest.raises(ValueError, match="exactly 4 tokens"):
        bench_trl.prompt_texts(lambda text: [0, 0, 0], 1, 4)


def test_step_times_and_the_ratio_table():
    times = {"step_start": [0.0, 10.0, 20.0, 30.0], "step_end": [1.0, 12.0, 23.0, 34.0]}
    assert bench_trl.step_seconds(times, warmup=2) == [3.0, 4.0]  # steps 3 and 4, each end - start
    results = {"trl": bench_trl.summary([2.0, 2.0, 5.0], 1536), "ours": bench_trl.summary([1.0, 3.0, 3.5], 1536),
               "ours-diag10": bench_trl.summary([1.0, 1.0, 1.0], 1536)}
    assert results["trl"] == {"median": 2.0, "mean": 3.0, "tokens": 1536, "steps": 3}
    header, trl, ours, diag = bench_trl.ratio_table(results)
    assert header.split()[:2] == ["run", "tokens/step"]
    assert trl.split() == ["trl", "1536", "2.000", "3.000"]  # no ratio to itself
    assert ours.split() == ["ours", "1536", "3.000", "2.500", "1.50", "0.83"]
    assert diag.split() == ["ours-diag10", "1536", "1.000", "1.000", "0.50", "0.33"]
    assert [line.split()[-1] for line in bench_trl.ratio_table({"ours": results["ours"]})] == ["mean", "2.500"]


def test_runs_take_turns_and_a_finished_run_passes_its_turn_on(tmp_path):
    a, b, c = (trl_grpo_run.Baton(str(tmp_path), n, ["a", "b", "c"], timeout_s=0.2) for n in "abc")
    a.acquire()  # no turn yet: the first to ask steps
    a.release()
    assert (tmp_path / "turn").read_text() == "b"
    with pytest.raises(TimeoutError, match="held by b"):
        a.acquire()
    b.acquire()
    b.done()  # b finished: the turn goes to c, and b is skipped from now on
    c.acquire()
    c.release()
    a.acquire()
    a.release()
    assert (tmp_path / "turn").read_text() == "c"
    c.done()
    a.acquire()  # alone: its own turn again and again
    a.release()
    a.acquire()
    (tmp_path / "stop").touch()  # the benchmark stopped: waiting ends with an error
    with pytest.raises(RuntimeError, match="stopped"):
        a.acquire()


def test_commands_carry_turns_threads_and_each_runs_settings():
    args = bench_trl.parse_args(["--out", "/o", "--threads", "1", "x=1"])
    runs = bench_trl.commands(args, "/v/bin/python", "/m", "/p")
    assert list(runs) == ["trl", "ours", "ours-diag10", "ours-all10"]
    for name, (cmd, folder) in runs.items():
        assert folder == f"/o/{name}" and cmd[-6:] == ["--baton", "/o/baton", "--order",
                                                       "trl,ours,ours-diag10,ours-all10", "--name", name]
    assert runs["trl"][0][:2] == ["/v/bin/python", bench_trl.TRL_SCRIPT]
    assert "grpo.diagnostics_every=10" in runs["ours-diag10"][0] and "x=1" in runs["ours-diag10"][0]
    assert not any(a.startswith("grpo.diagnostics_every") for a in runs["ours"][0])
    worker = bench_trl.parse_args(runs["ours"][0][2:])  # the worker reads its turn options and the overrides
    assert (worker.ours_worker, worker.baton, worker.name) == ("/o/ours", "/o/baton", "ours")
    assert worker.order == "trl,ours,ours-diag10,ours-all10"
    assert worker.overrides[-1] == "x=1" and all("=" in o for o in worker.overrides)
    assert trl_grpo_run.parse_args(runs["trl"][0][2:]).name == "trl"
    sequential = bench_trl.commands(bench_trl.parse_args(["--sequential"]), "/v/bin/python", "/m", "/p")
    assert not any("--baton" in cmd for cmd, _ in sequential.values())
    assert bench_trl.thread_env(0) == {}
    assert bench_trl.thread_env(1) == {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1",
                                       "VLLM_CPU_OMP_THREADS_BIND": "nobind"}


def test_a_venv_made_for_this_trl_version_is_reused(tmp_path, monkeypatch):
    (tmp_path / "bench-trl.json").write_text(json.dumps({"trl": "1.16.0"}))

    def no_install(*a, **kw):
        raise AssertionError("installs")

    monkeypatch.setattr(subprocess, "run", no_install)
    assert bench_trl.ensure_venv(str(tmp_path), "1.16.0") is None
    with pytest.raises(AssertionError, match="installs"):
        bench_trl.ensure_venv(str(tmp_path), "1.17.0")
