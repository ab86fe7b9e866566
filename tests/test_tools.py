"""The benchmark scripts in tools/ run end to end on a tiny config (they are not imported by visppo)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from conftest import tiny_overrides

TOOLS = Path(__file__).resolve().parents[1] / "tools"


def test_bench_prints_every_figure_and_writes_json(tmp_path):
    out = tmp_path / "bench.json"
    overrides = [o for o in tiny_overrides() if not o.startswith("run.")]
    proc = subprocess.run([sys.executable, str(TOOLS / "bench.py"), *overrides, "env.vector=sync",
                           "--repeats", "1", "--iterations", "2", "--steps", "64", "--json", str(out)],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    for label in ("raw env, 1 process", "raw env, 2 async workers", "collection", "update",
                  "end to end", "per iteration", "peak memory"):
        assert label in proc.stdout, proc.stdout
    figures = json.loads(out.read_text())
    assert set(figures["raw_env_sps"]) == {"1 process", "2 async workers", "4 async workers"}
    assert all(v > 0 for v in figures["raw_env_sps"].values())
    for key in ("end_to_end_sps", "collect_sps", "update_samples_per_s", "peak_rss_bytes",
                "time/collect", "time/values", "time/update"):
        assert figures[key] > 0, key
    # the end-to-end rate cannot beat collection alone, and the ratio is against the fastest raw env
    assert figures["end_to_end_sps"] < figures["collect_sps"]
    assert abs(figures["ratio_to_raw"] - figures["end_to_end_sps"] / max(figures["raw_env_sps"].values())) < 1e-9


def test_bench_update_compares_a_plain_update_with_visppos_and_writes_json(tmp_path):
    out = tmp_path / "update.json"
    overrides = [o for o in tiny_overrides() if not o.startswith("run.")]
    proc = subprocess.run([sys.executable, str(TOOLS / "bench_update.py"), *overrides, "ppo.minibatch_size=16",
                           "--micro", "8,0", "--amp", "off", "--repeats", "2", "--json", str(out)],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    rows = json.loads(out.read_text())["rows"]
    # the plain baseline (NCHW, Adam's loop), then fused Adam alone, then the config's layout per micro-batch
    assert [(r["name"], r["channels_last"], r["fused_adam"], r["micro_batch_size"]) for r in rows] == [
        ("baseline", False, False, 16), ("fused Adam", False, True, 16),
        ("micro=8", True, True, 8), ("micro=mb", True, True, 16)]
    assert all(len(r["seconds"]) == 2 and r["samples_per_second"] > 0 and r["peak_bytes"] > 0 for r in rows)
    assert rows[0]["ratio"] == 1.0
