"""k3core.host_threads: an engine beside a GPU runs 1 torch intra-op thread unless told otherwise; on the CPU an
in-process LLM keeps torch's setting; bad values are refused."""
from __future__ import annotations

import pytest
import torch

from k3core.host_threads import GPU_ENGINE_CPU_THREADS, set_engine_threads


@pytest.fixture
def threads(monkeypatch):
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(before)


def test_beside_a_gpu_one_thread(threads):
    assert set_engine_threads(torch.device("cuda"), None) == GPU_ENGINE_CPU_THREADS == torch.get_num_threads() == 1


def test_cpu_keeps_torch_setting_and_explicit_wins(threads):
    assert set_engine_threads(torch.device("cpu"), None) == 2 == torch.get_num_threads()
    assert set_engine_threads(torch.device("cuda"), 3) == 3 == torch.get_num_threads()


def test_omp_num_threads_is_respected(threads, monkeypatch):
    monkeypatch.setenv("OMP_NUM_THREADS", "2")
    assert set_engine_threads(torch.device("cuda"), None) == 2 == torch.get_num_threads()


@pytest.mark.parametrize("bad", [0, -1, 1.5, True])
def test_bad_values_refused(threads, bad):
    with pytest.raises(ValueError, match="cpu_threads"):
        set_engine_threads(torch.device("cpu"), bad)
