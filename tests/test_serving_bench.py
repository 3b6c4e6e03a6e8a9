"""bench.serving runs every section end to end (tiny, on the CPU) and writes its result files with ratios."""
from __future__ import annotations

import json

import torch

from bench import serving


def test_serving_bench_smoke(tmp_path):
    status = serving.main(["--smoke", "--out", str(tmp_path)])
    result = json.loads((tmp_path / "serving-smoke.json").read_text())
    assert status == 0, result["errors"]
    assert set(result) >= {"ceiling", "replay_busy", "mixed_steps", "engine_steps", "lone_prompt", "offline",
                           "offline_steps", "offline_threads", "idle_penalty", "engine_loop", "engine_process_loop", "http", "ratios",
                           "machine"}
    steps = result["offline_steps"]
    for split in ("split_on", "split_off"):            # no graphs on the CPU: the split never applies there
        assert sum(steps[split]["steps"].values()) > 0 and steps[split]["graph_steps"] == 0
    assert result["mixed_steps"]["mixed_one_forward_ms"] > 0
    for section in ("engine_loop", "engine_process_loop"):  # the server's loop, in this process and its own
        for mode in ("all_at_once", "closed_loop"):
            loop = result[section][mode]
            assert loop["steps"]["decode_rows"] == 4 * (4 - 1) and loop["output_tok_s"] > 0, (section, mode)
            assert loop["cpu_share"]["this process"] >= 0
    assert "engine process" in result["engine_process_loop"]["closed_loop"]["cpu_share"]
    assert result["http"]["streams_n"]["server_steps"]["decode_rows"] == 4 * (4 - 1)
    assert result["offline"]["output_tokens"] == 4 * 4
    threads = result["offline_threads"]
    assert threads["duration_s_1_thread"] > 0 and threads["duration_s_default_threads"] > 0
    idle = result["idle_penalty"]["rows"]
    assert [row["pause_s"] for row in idle] == [0.0, 0.05, 0.2] and all(row["ttft_ms"] > 0 for row in idle)
    assert any(name.startswith("idle: ttft after") for name in result["ratios"])
    assert result["http"]["streams_n"]["output_tokens_per_s"] > 0
    assert "offline output tok/s / ceiling" in result["ratios"]
    web = result["http"]
    assert len(web["repeat_ttft_ms_all"]) == serving.REPEATS and web["repeat_ttft_ms"] in web["repeat_ttft_ms_all"]
    assert sorted(web["repeat_ttft_ms_all"])[serving.REPEATS // 2] == web["repeat_ttft_ms"]
    assert (tmp_path / "serving-smoke.md").read_text().startswith("# Serving against its ceilings")


def test_a_twin_model_that_does_not_fit_fails_only_its_section(tmp_path, monkeypatch):
    """lone_prompt builds a second model beside the first (k3-mini twice does not fit an 80 GB H100): its out of
    memory is recorded as that section's error and the sections after it still run."""
    import k3core

    real = k3core.LLM

    def llm(model, **options):
        if options.get("prefix_cache") is False:
            raise torch.OutOfMemoryError("CUDA out of memory (test)")
        return real(model, **options)

    monkeypatch.setattr(k3core, "LLM", llm)
    status = serving.main(["--smoke", "--out", str(tmp_path), "--sections", "lone_prompt,offline"])
    result = json.loads((tmp_path / "serving-smoke.json").read_text())
    assert status == 1 and result["errors"]["lone_prompt"].startswith("OutOfMemoryError")
    assert "offline" in result and "lone_prompt" not in result
