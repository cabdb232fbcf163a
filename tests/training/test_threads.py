"""How a training process splits its cores: intra-op threads and `data.workers: auto` (training/threads.py)."""

from __future__ import annotations

import pytest

from magclip.config import ConfigError, load_config
from magclip.training import threads
from magclip.training.threads import AUTO_WORKERS, choose_loader_workers, choose_threads


@pytest.fixture
def cores(monkeypatch):
    """Pretend this process may use `n` cores, alone on its node, with no thread variable set."""
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)

    def set_cores(n: int) -> None:
        monkeypatch.setattr(threads, "available_cores", lambda: n)
    return set_cores


@pytest.mark.parametrize("n", [1, 2, 3, 4])
def test_auto_runs_a_cached_cpu_loader_in_the_training_process_on_few_cores(cores, n):
    cores(n)
    workers, why = choose_loader_workers("auto", "cpu", loader_cached=True)
    assert workers == 0, why
    assert "training process" in why
    assert choose_threads(None, workers)[0] == n  # every core goes to the step


def test_auto_keeps_workers_where_they_take_a_small_share_of_the_cores(cores):
    cores(2 * AUTO_WORKERS + 1)
    assert choose_loader_workers("auto", "cpu", loader_cached=True)[0] == AUTO_WORKERS
    assert choose_threads(None, AUTO_WORKERS)[0] == AUTO_WORKERS + 1


def test_auto_keeps_workers_without_the_cache_or_off_the_cpu(cores):
    cores(2)
    for device, cached in (("cpu", False), ("cuda", True), ("cuda", False)):
        workers, why = choose_loader_workers("auto", device, loader_cached=cached)
        assert workers == AUTO_WORKERS, (device, cached, why)


def test_the_node_shares_its_cores_among_its_processes(cores, monkeypatch):
    cores(8)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")  # 4 cores each: two workers would hold half of them
    assert choose_loader_workers("auto", "cpu", loader_cached=True)[0] == 0
    assert choose_threads(None, 0)[0] == 4


def test_a_configured_number_is_taken_as_it_is(cores):
    cores(2)
    assert choose_loader_workers(3, "cpu", loader_cached=True) == (3, "data.workers")
    assert choose_loader_workers(0, "cuda", loader_cached=False) == (0, "data.workers")


@pytest.mark.parametrize("value", ["-1", "two", "true"])
def test_config_refuses_other_workers_values(value):
    with pytest.raises(ConfigError, match="data.workers"):
        load_config(None, [f"data.workers={value}"])


def test_config_default_is_auto_and_takes_numbers():
    assert load_config(None, []).data.workers == "auto"
    assert load_config(None, ["data.workers=0"]).data.workers == 0
