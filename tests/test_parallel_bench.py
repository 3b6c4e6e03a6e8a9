"""The parallel benchmark's plumbing (bench/parallel_bench.py) on CPU processes over gloo: the GPU run is one device
call, so a crash in its bookkeeping must show up here first."""
from __future__ import annotations

import json

from bench import parallel_bench


def test_parallel_bench_smoke_gates_on_correctness_and_reports_every_plan(tmp_path):
    assert parallel_bench.main(["--smoke", "--out", str(tmp_path)]) == 0
    report = json.loads((tmp_path / "parallel-smoke.json").read_text())
    correctness = report["correctness"]
    assert correctness["all_passed"]
    assert {key.split()[0] for key in correctness["plans"]} == {"tp2", "pp2"}
    for row in correctness["plans"].values():
        assert row["tokens_identical"] and row["leaked_bytes"] == 0
    plans = report["speed"]["plans"]
    assert set(plans) == {"1gpu", "tp2", "pp2"}
    for name, row in plans.items():
        assert "error" not in row, row.get("error")
        assert row["decode_batch"] == parallel_bench.SMOKE["decode_batch"], f"{name}: requests were retracted"
        assert row["decode_tok_s"] > 0 and row["prefill_64_tok_s"] > 0
    # DCP is not in the smoke run; PP halves the layers, so the MLA KV per token per rank halves
    assert plans["pp2"]["kv_bytes_per_token"] < plans["1gpu"]["kv_bytes_per_token"]
    assert "exposed_comm_ms_per_1k_prefill_tokens" in plans["tp2"]
    # the no-comm timing really ran without its collectives (TP all-reduces, PP sends and receives)
    assert plans["tp2"]["nocomm_swallowed_calls"] > 0 and plans["pp2"]["nocomm_swallowed_calls"] > 0
    markdown = (tmp_path / "parallel-smoke.md").read_text()
    assert "| tp2 | float32 | True |" in markdown


def test_markdown_says_when_correctness_comes_from_another_commit_and_prints_notes():
    """A results file merged from two runs must say which commit each section is from."""
    report = {"environment": {"commit": "bbbbbbb", "date": "d2", "gpus": "2", "smoke": "False"},
              "correctness": {"commit": "aaaaaaa", "date": "d1", "model": "k3-tiny", "backend": "cuda",
                              "logit_rtol": 1e-4, "plans": {}},
              "notes": ["first reading", "second reading"]}
    text = parallel_bench.markdown(report)
    assert "earlier run at commit aaaaaaa (d1)" in text
    assert "- first reading\n- second reading" in text
    report["correctness"]["commit"] = "bbbbbbb"
    assert "earlier run" not in parallel_bench.markdown(report)


def test_markdown_survives_a_plan_that_decoded_nothing():
    row = {"gpus": 2, "prefill_64_tok_s": 10.0, "decode_tok_s": 0.0, "decode_batch": 0, "kv_tokens_per_gib": 1,
           "weights_gib": 1.0}
    report = {"environment": {"gpus": "2"},
              "speed": {"model": "m", "dtype": "float32", "backend": "torch",
                        "decode": {"batch": 2, "context": 8, "steps": 1},
                        "plans": {"tp2": dict(row), "pp2": dict(row, decode_tok_s=5.0)}}}
    assert "tp2 decoded nothing" in parallel_bench.markdown(report)
