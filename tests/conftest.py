"""Test-session setup shared by every test module."""
import os

import pytest
import torch

# Without a GPU the Triton kernels can only run under Triton's interpreter; it must be chosen before triton is
# imported anywhere, so it is set here rather than in each module.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

# Under pytest-xdist (scripts/test.sh runs the suite on two workers) each worker is one of two processes sharing the
# cores: torch's default of one intra-op thread per core would put four spinning OpenMP threads on two cores.
if os.environ.get("PYTEST_XDIST_WORKER"):
    torch.set_num_threads(1)


# The tests that launch gloo rank processes (k3core.parallel.launch.spawn, `k3core.serve --tp`, torchrun): under
# `--dist loadfile` they are one unit of work, so that one worker runs them one after another and no two rank launches
# overlap (each takes a free port and binds it seconds later, from a rank that is still starting).
GLOO_TESTS = ("tests/test_parallel.py::", "tests/test_parallel_bench.py::test_parallel_bench_smoke",
              "tests/test_loader_streaming.py::test_rank_load_memory_opens_sizing_and_logits",
              "tests/test_structured_outputs.py::test_tp2_ranks_apply_the_same_constraint")


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config, log):
    """`--dist loadfile` (a worker runs a file's tests in their order and builds its module fixtures once), with
    GLOO_TESTS as one more unit across files. (xdist_group marks would say the same, but pytest-xdist 3.8 groups
    them by rewriting item._nodeid, which pytest 9 no longer reads.)"""
    if config.getvalue("dist") != "loadfile":
        return None
    from xdist.scheduler import LoadFileScheduling

    class LoadFileAndGlooScheduling(LoadFileScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return "gloo ranks" if nodeid.startswith(GLOO_TESTS) else super()._split_scope(nodeid)

    return LoadFileAndGlooScheduling(config, log)
