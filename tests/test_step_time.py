"""benchmarks/step_time.py runs end to end at a tiny shape (about 90 s on 2 cores); no timing is asserted.

Its 5 torchrun launches (one a variant) are the benchmark's own, as it runs them to time each variant. They run on
1 rank (--tp 1): what the test checks is the benchmark's output, not a layout, and on 2 idle cores the smoke took
48 CPU-seconds against 81 with its default TP=2 (the same 57 s wall)."""

import csv
import os
import subprocess
import sys

import pytest

from conftest import REPO, check


@pytest.mark.slow
def test_step_time_smoke(tmp_path):
    proc = subprocess.run([sys.executable, "benchmarks/step_time.py", "--smoke", "--tp", "1", "--out", str(tmp_path)], cwd=REPO,
                          capture_output=True, text=True, timeout=600, env={**os.environ, "OMP_NUM_THREADS": "1"})
    check(proc)

    with open(tmp_path / "step_time.csv") as f:
        rows = {r["variant"]: r for r in csv.DictReader(f)}
    assert set(rows) == {"ce", "grpo_beta0", "grpo_beta0_unfused", "grpo_beta", "forward"}
    for r in rows.values():
        assert float(r["median_step_s"]) > 0 and int(r["steps_timed"]) > 0, r
    assert float(rows["ce"]["ratio_to_ce"]) == 1.0
    # only the beta > 0 job scores a reference: its pass time comes from the plugin's grpo/ref_time(s)
    assert float(rows["grpo_beta"]["ref_pass_s"]) > 0 and rows["grpo_beta0"]["ref_pass_s"] == ""
    assert rows["grpo_beta0"]["target_ratio"] == rows["grpo_beta0_unfused"]["target_ratio"] == "1.05"
    assert rows["grpo_beta"]["target_ratio"] != "" and rows["grpo_beta0_unfused"]["ref_pass_s"] == ""
    assert (tmp_path / "step_time.png").stat().st_size > 0
    assert "| grpo_beta |" in proc.stdout
