"""tools.tune.ncu_report on small exports shaped like Nsight Compute's raw and source pages (the profiler itself runs
only on the GPU machine, through `scripts/gpu.sh tune ncu`), and tools.tune.ncu_targets' argument check."""
from __future__ import annotations

import csv
import io

import pytest

from tools.tune.ncu_report import main, source_tables, stall_table


def _csv(rows: list[list[str]]) -> str:
    buffer = io.StringIO()
    csv.writer(buffer, quoting=csv.QUOTE_ALL).writerows(rows)
    return buffer.getvalue()


def test_stall_table_ranks_reasons_per_kernel_and_skips_other_metrics():
    header = ["Kernel Name", "gpu__time_duration.sum",
              "smsp__average_warps_issue_stalled_barrier_per_issue_active.ratio",
              "smsp__average_warps_issue_stalled_long_scoreboard_per_issue_active.ratio",
              "smsp__average_warps_issue_stalled_wait_per_issue_active.ratio", "sm__throughput.avg.pct"]
    rows = [header, ["", "usecond", "ratio", "ratio", "ratio", "%"],
            ["kda_chunk_intra_kernel", "800,000", "1.5", "7.25", "0.5", "99"],
            ["merge", "3000", "0.1", "0.2", "3", "1"]]
    lines = stall_table(rows, top=2)
    assert lines[0] == ("kda_chunk_intra_kernel: 800,000 usecond; stall cycles per issued instruction 9.25: "
                        "long_scoreboard 7.25, barrier 1.50")
    assert lines[1].startswith("merge: 3000 usecond; stall cycles per issued instruction 3.30: wait 3.00")
    assert stall_table(rows[:2]) == ["(no kernel rows in the raw page)"]


def test_source_tables_split_per_kernel_and_rank_lines_by_samples():
    header = ["Address", "Source", "Warp Stall Sampling (All Samples)", "Instructions Executed"]
    text = ("==PROF== noise line\n" + _csv([header, ["0x10", "LDG.E R2, [R4]", "30", "1"],
                                             ["0x20", "BAR.SYNC 0x0", "60", "1"], ["0x30", "EXIT", "10", "1"],
                                             header, ["0x10", "HMMA.16816", "5", "1"]]))
    out = source_tables(text.splitlines(), top=2)
    assert out[0].startswith("kernel table 0: 3 source lines, 100 stall samples; the top 2 ")
    assert out[1].split() == ["60.0%", "33.3%", "BAR.SYNC", "0x0"]
    assert out[2].split()[:2] == ["30.0%", "33.3%"]
    assert out[3].startswith("kernel table 1: 1 source lines")
    assert source_tables(["a,b", "1,2"]) == ["(no source table with a 'Warp Stall Sampling (All Samples)' column)"]


def test_main_refuses_an_unknown_page(capsys):
    assert main(["details"]) == 2
    assert "usage" in capsys.readouterr().err


def test_ncu_targets_names_its_targets_and_refuses_others():
    from tools.tune.ncu_targets import TARGETS, main as target_main
    assert {"kda_prefill_b1", "kda_decode_64", "mla_decode_b1"} <= set(TARGETS)
    with pytest.raises(SystemExit):
        target_main(["no_such_kernel"])
