"""tools/study/beta_scaling.py: the power-law fit on synthetic data, and the tool end to end on four tiny sizes."""

import csv
import math
import os
import subprocess
import sys

import numpy as np
import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "tools", "study"))


def test_fit_recovers_known_exponents():
    from beta_scaling import fit_power_law

    rng = np.random.default_rng(0)
    L, d = (v.ravel().astype(float) for v in np.meshgrid([1, 2, 4, 8], [32, 64, 128, 256]))
    y = 3e-5 * L ** 0.3 * d ** 0.7 * np.exp(rng.normal(0, 0.01, L.shape))
    fit = fit_power_law(L, d, y)
    assert fit["a"] == pytest.approx(0.3, abs=0.02) and fit["b"] == pytest.approx(0.7, abs=0.02)
    assert fit["c"] == pytest.approx(3e-5, rel=0.1) and fit["r2"] > 0.99 and fit["n"] == 16
    exact = fit_power_law([1, 2, 4], [64, 64, 64], [2.0, 2.0 * 2 ** 0.5, 4.0])  # a single width: b unidentified
    assert exact["a"] == pytest.approx(0.5) and math.isnan(exact["b"]) and exact["g"] == pytest.approx(0.5)


@pytest.fixture(scope="module")
def scaling_run(tmp_path_factory):
    out = str(tmp_path_factory.mktemp("beta-scaling"))
    cmd = [sys.executable, "tools/study/beta_scaling.py", "--out", out, "--depths", "1", "2", "--widths", "32", "64",
           "--num-seqs", "2", "--seq-len", "24"]
    env = dict(os.environ, OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "2"))
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600, env=env)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    with open(os.path.join(out, "beta_scaling.csv")) as f:
        rows = list(csv.DictReader(f))
    return out, rows


def test_tool_writes_a_row_per_size_and_dtype(scaling_run):
    out, rows = scaling_run
    assert {(r["L"], r["d"], r["dtype"]) for r in rows} == {
        (L, d, t) for L in ("1", "2") for d in ("32", "64") for t in ("bfloat16", "float16")}
    assert all(int(r["tokens"]) == 48 and float(r["beta_abs_mean"]) > 0 and r["kind"] == "random-init" for r in rows)
    with open(os.path.join(out, "beta_scaling.md")) as f:
        table = f.read()
    assert sum(line.startswith("| qwen3-L") for line in table.splitlines()) == 8
    if os.path.exists(os.path.join(out, "beta_scaling.png")):
        with open(os.path.join(out, "beta_scaling.png"), "rb") as f:
            assert f.read(8) == b"\x89PNG\r\n\x1a\n"


def test_fp16_gap_is_smaller_than_bf16_and_the_fit_is_finite(scaling_run):
    from beta_scaling import fits_by_dtype

    _, rows = scaling_run
    rows = [dict(r, L=int(r["L"]), d=int(r["d"]), beta_abs_mean=float(r["beta_abs_mean"])) for r in rows]
    for L, d in {(r["L"], r["d"]) for r in rows}:
        gap = {r["dtype"]: r["beta_abs_mean"] for r in rows if (r["L"], r["d"]) == (L, d)}
        assert gap["float16"] < gap["bfloat16"], (L, d, gap)  # 10 vs 7 mantissa bits
    for fit in fits_by_dtype(rows).values():
        assert all(math.isfinite(fit[k]) for k in ("a", "b", "c", "g")), fit


def test_pretrained_and_random_init_are_told_apart_and_fitted_separately(tmp_path):
    from beta_scaling import fits_by_dtype, model_kind

    (tmp_path / "m" / "init").mkdir(parents=True)
    (tmp_path / "m" / "MODEL_CARD.json").write_text("{}")  # tools/study/pretrain.py's output: X/ and its start X/init
    (tmp_path / "plain").mkdir()
    assert model_kind(str(tmp_path / "m")) == ("m", "pretrained")
    assert model_kind(str(tmp_path / "m" / "init")) == ("m", "random-init")
    assert model_kind(str(tmp_path / "plain")) == ("plain", "random-init")
    rows = [dict(kind=k, dtype="bfloat16", L=L, d=d, beta_abs_mean=s * (L * d) ** g)
            for k, s, g in (("pretrained", 1e-4, 0.5), ("random-init", 1e-5, 0.25)) for L in (2, 4) for d in (64, 128)]
    fits = fits_by_dtype(rows)
    assert set(fits) == {"bfloat16, pretrained", "bfloat16, random-init"}
    assert fits["bfloat16, pretrained"]["g"] == pytest.approx(0.5) and fits["bfloat16, random-init"]["g"] == \
        pytest.approx(0.25)
