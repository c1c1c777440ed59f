"""benchmarks/gpu_speed.py (the GPU speed run) works end to end with tiny shapes on the CPU."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

pytest.importorskip("transformers")
pytest.importorskip("peft")
sys.path.insert(0, str(Path(__file__).parents[1] / "benchmarks"))


@pytest.mark.slow  # imports transformers and peft (seconds), then one tiny row
def test_tiny_cpu_row_reports_every_method(tmp_path):
    import gpu_speed

    out = tmp_path / "speed.json"
    rc = gpu_speed.main(["--tiny", "--device", "cpu", "--rows", "minilm-lora", "--rounds", "1",
                         "--warmup", "1", "--json", str(out)])
    assert rc == 0
    row = json.loads(out.read_text())["minilm-lora"]
    for method in ("plain", "dpfy", "opacus_ghost", "opacus_hooks"):
        # a method either ran (time and ratio) or is reported with its error
        assert "median_ms" in row[method] or "error" in row[method]
    assert row["dpfy"]["median_ms"] > 0 and row["trainable"] > 0


def test_rows_are_in_priority_order():
    import gpu_speed

    names = [r.name for r in gpu_speed.ROWS]
    assert names == ["minilm-full", "minilm-lora", "gpt2s-full", "gpt2s-lora", "llama1b-lora"]
