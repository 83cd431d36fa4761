"""benchmarks/images_bench.py runs end to end on a small dataset and judges its targets from the
figures it measured (the figures in benchmarks/RESULTS.md and docs/operations.md come from its
full run)."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parents[2] / "benchmarks" / "images_bench.py"


def test_a_small_run_prints_every_configuration_and_judges_the_targets_from_its_figures(
    tmp_path,
):
    out = tmp_path / "bench.json"
    run = subprocess.run(
        [
            sys.executable,
            str(BENCH),
            *("--images", "48", "--nodes", "4", "--node-capacity", "16", "--budget-gib", "40"),
            *("--epochs", "2", "--prompts", "8", "--samples", "4", "--replicas", "2"),
            *("--scale-cpu-ms", "0.8", "--json", str(out)),
        ],
        capture_output=True,
        text=True,
        timeout=240,
        check=True,
    )
    printed = run.stdout
    for heading in (
        "baseline: every image on every node needs",
        "k=2 prefetch on:",
        "k=2 prefetch off:",
        "baseline: least loaded, no affinity:",
        "targets (k=2):",
    ):
        assert heading in printed, printed
    results = json.loads(out.read_text())["results"]
    assert [(r["replicas"], r["prefetch"], r["affinity"]) for r in results] == [
        (2, True, True),
        (2, False, True),
        (2, False, False),
    ]
    for result in results:
        assert result["nodes_over_budget"] == 0
        assert result["max_node_used_gib"] <= 40
        assert len(result["epochs"]) == 2
        assert all(0.0 <= e["hit_rate"] <= 1.0 for e in result["epochs"])
    k2 = results[0]
    # Every verdict follows from the run's own figures.
    later = k2["epochs"][1:]
    expected = {
        "no node over budget": k2["nodes_over_budget"] == 0,
        "hit rate >= 90% from epoch 2": all(e["hit_rate"] >= 0.9 for e in later),
        "p99 acquire wait <= 1 s from epoch 2": all(e["wait_p99_s"] <= 1 for e in later),
        "CPU per acquire": k2["cpu_ms_per_acquire"] <= 2 * 0.8,
    }
    verdicts = re.findall(r"^  (MET   |MISSED) (.*)$", printed, re.MULTILINE)
    assert len(verdicts) == len(expected), printed
    for (word, line), (name, met) in zip(verdicts, expected.items(), strict=True):
        assert line.startswith(name), (line, name)
        assert (word.strip() == "MET") is met, line
    cpu = re.search(r"CPU per acquire ([0-9.]+) ms <= 2 x the scale run's 0.80 ms", printed)
    assert cpu is not None and float(cpu.group(1)) == round(k2["cpu_ms_per_acquire"], 2)
    assert "x the bytes of k=2" in printed or "where k=2 pulls none" in printed
