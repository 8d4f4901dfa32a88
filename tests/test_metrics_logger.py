"""metrics.jsonl under faults: a torn last row (a crash or full disk mid-write) is dropped, reported
and truncated on resume; readers tolerate it; an unparsable earlier line names the file and line."""

import json
import logging
import os

import pytest

from megatron_grpo.observe.metrics_logger import MetricsLogger, read_metrics_rows

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TORN = b'{"step": 3, "reward/me'


def _metrics_file(log_dir, steps, tail=b""):
    os.makedirs(log_dir, exist_ok=True)
    path = os.path.join(log_dir, "metrics.jsonl")
    with open(path, "wb") as f:
        f.write(b"".join(json.dumps({"step": s, "reward/mean": s / 10}).encode() + b"\n" for s in steps) + tail)
    return path


def _resume(log_dir, start_step):
    return MetricsLogger(str(log_dir), enabled=True, tensorboard=False, progress_bar=False, total_steps=9,
                         start_step=start_step, resumed=True)


def test_resume_drops_and_truncates_a_torn_last_line_with_a_warning(tmp_path, caplog):
    path = _metrics_file(str(tmp_path), [1, 2], TORN)
    with caplog.at_level(logging.WARNING):
        logger = _resume(tmp_path, start_step=2)
    assert f"{path} line 3: torn last row" in caplog.text
    with open(path, "rb") as f:
        assert f.read().endswith(b'"reward/mean": 0.2}\n')  # truncated before the torn row
    logger.log(3, {"reward/mean": 0.3})
    logger.close()
    assert [r["step"] for r in read_metrics_rows(path)] == [1, 2, 3]


def test_resume_with_a_torn_last_line_still_drops_rows_after_the_checkpoint(tmp_path):
    path = _metrics_file(str(tmp_path), [1, 2, 3], b"\x00" * 37)  # power loss: a zero-filled tail
    _resume(tmp_path, start_step=1).close()
    assert [r["step"] for r in read_metrics_rows(path)] == [1]


def test_a_last_row_missing_its_newline_is_kept_and_completed_on_resume(tmp_path):
    path = _metrics_file(str(tmp_path), [1], b'{"step": 2, "reward/mean": 0.2}')
    logger = _resume(tmp_path, start_step=2)
    logger.log(3, {"reward/mean": 0.3})
    logger.close()
    assert [r["step"] for r in read_metrics_rows(path)] == [1, 2, 3]


def test_an_unparsable_line_before_the_last_names_file_and_line(tmp_path):
    path = _metrics_file(str(tmp_path), [1], b"garbage\n" + json.dumps({"step": 2}).encode() + b"\n")
    with pytest.raises(ValueError, match=f"{path} line 2: not a JSON object"):
        _resume(tmp_path, start_step=2)
    with pytest.raises(ValueError, match="line 2"):
        read_metrics_rows(path)


def test_readers_ignore_a_torn_last_line_without_changing_the_file(tmp_path, caplog):
    from megatron_grpo.observe.doctor import read_metrics
    from megatron_grpo.observe.plots import load_runs
    from megatron_grpo.observe.experiments import read_rows
    from megatron_grpo.observe.summary import write_summary

    path = _metrics_file(str(tmp_path), [1, 2], TORN)
    with caplog.at_level(logging.WARNING):
        assert [r["step"] for r in read_metrics(str(tmp_path))] == [1, 2]
    assert f"{path} line 3: torn last row" in caplog.text and "ignored" in caplog.text
    assert [r["step"] for r in load_runs([str(tmp_path)])[os.path.basename(str(tmp_path))]] == [1, 2]
    assert [r["step"] for r in read_rows(str(tmp_path))] == [1, 2]
    assert write_summary(str(tmp_path), None)["steps"] == 2
    with open(path, "rb") as f:
        assert f.read().endswith(TORN)  # readers never modify a (possibly live) run's file


def test_log_writes_each_row_with_one_write_then_flush_and_fsync(tmp_path, monkeypatch):
    """A crash can tear only the row being written: it is one write, on disk before ``log`` returns."""
    logger = MetricsLogger(str(tmp_path), enabled=True, tensorboard=False, progress_bar=False, total_steps=2)
    calls = []
    real_write, real_fsync = logger._file.write, os.fsync
    monkeypatch.setattr(logger._file, "write", lambda text: calls.append(("write", text)) or real_write(text))
    monkeypatch.setattr(os, "fsync", lambda fd: calls.append(("fsync", fd)) or real_fsync(fd))
    logger.log(1, {"reward/mean": 0.5, "x": float("nan")})
    assert [c[0] for c in calls] == ["write", "fsync"] and calls[0][1].endswith("}\n")
    with open(logger.path) as f:
        assert json.loads(f.read()) == {"step": 1, "reward/mean": 0.5, "x": None}
    logger.close()
