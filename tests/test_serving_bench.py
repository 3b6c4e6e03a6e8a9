"""bench.serving runs every section end to end (tiny, on the CPU) and writes its result files with ratios."""
from __future__ import annotations

import json

from bench import serving


def test_serving_bench_smoke(tmp_path):
    status = serving.main(["--smoke", "--out", str(tmp_path)])
    result = json.loads((tmp_path / "serving-smoke.json").read_text())
    assert status == 0, result["errors"]
    assert set(result) >= {"ceiling", "engine_steps", "lone_prompt", "offline", "http", "ratios", "machine"}
    assert result["offline"]["output_tokens"] == 4 * 4
    assert result["http"]["streams_n"]["output_tokens_per_s"] > 0
    assert "offline output tok/s / ceiling" in result["ratios"]
    assert (tmp_path / "serving-smoke.md").read_text().startswith("# Serving against its ceilings")
