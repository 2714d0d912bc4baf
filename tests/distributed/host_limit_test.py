"""The default host_memory_limit is split across the node's local ranks (LOCAL_WORLD_SIZE,
set by torchrun and accelerate); explicit limits are per process as given."""

import pytest

import ckpt_offload
from ckpt_offload import config

RAM = 64 << 30
GIB = 1 << 30
READ_CGROUP_LIMIT = config.cgroup_memory_limit  # the reader itself; the fixture replaces it


@pytest.fixture(autouse=True)
def fixed_ram(monkeypatch):
    """A 64 GiB machine outside any memory cgroup, whatever this one is."""
    monkeypatch.setattr(config, "total_host_memory_bytes", lambda: RAM)
    monkeypatch.setattr(config, "cgroup_memory_limit", lambda: None)
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)


@pytest.mark.parametrize("local_ranks, expected", [(None, RAM // 2), ("1", RAM // 2),
                                                   ("2", RAM // 4), ("8", RAM // 16),
                                                   ("3", RAM // 2 // 3)])
def test_default_is_half_of_ram_split_across_local_ranks(monkeypatch, local_ranks, expected):
    if local_ranks is not None:
        monkeypatch.setenv("LOCAL_WORLD_SIZE", local_ranks)
    assert config.local_world_size() == int(local_ranks or 1)
    assert ckpt_offload.parse_host_memory_limit(None) == expected
    assert ckpt_offload.OffloadConfig().host_memory_limit_bytes() == expected


@pytest.mark.parametrize("cgroup_limit, expected", [(16 * GIB, 16 * GIB // 2 // 2),
                                                     (128 * GIB, RAM // 2 // 2)])
def test_default_takes_half_of_a_lower_cgroup_limit(monkeypatch, cgroup_limit, expected):
    """In a container the pool's pinned pages count against the cgroup's limit, not RAM."""
    monkeypatch.setattr(config, "cgroup_memory_limit", lambda: cgroup_limit)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    assert ckpt_offload.parse_host_memory_limit(None) == expected
    assert ckpt_offload.parse_host_memory_limit(0.5) == RAM // 2  # a fraction stays of RAM


def test_cgroup_memory_limit_reads_v2_then_v1(tmp_path):
    root = tmp_path / "cgroup"
    (root / "memory").mkdir(parents=True)
    assert READ_CGROUP_LIMIT(str(root)) is None  # neither file
    (root / "memory" / "memory.limit_in_bytes").write_text("9223372036854771712\n")
    assert READ_CGROUP_LIMIT(str(root)) is None  # v1's "no limit"
    (root / "memory" / "memory.limit_in_bytes").write_text("8589934592\n")
    assert READ_CGROUP_LIMIT(str(root)) == 8 * GIB
    (root / "memory.max").write_text("max\n")  # v2 without a limit: v1's file decides
    assert READ_CGROUP_LIMIT(str(root)) == 8 * GIB
    (root / "memory.max").write_text("4294967296\n")
    assert READ_CGROUP_LIMIT(str(root)) == 4 * GIB


@pytest.mark.parametrize("bad", ["", "two", "0", "-4", "2.5"])
def test_unusable_local_world_size_counts_as_one_process(monkeypatch, bad):
    monkeypatch.setenv("LOCAL_WORLD_SIZE", bad)
    assert config.local_world_size() == 1
    assert ckpt_offload.parse_host_memory_limit(None) == RAM // 2


def test_limit_follows_the_environment_when_read(monkeypatch):
    """The split is taken when the engine is made, not when the config is."""
    settings = ckpt_offload.OffloadConfig()
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    assert settings.host_memory_limit_bytes() == RAM // 8


@pytest.mark.parametrize("value, expected", [(24 * GIB, 24 * GIB), ("24GiB", 24 * GIB),
                                             ("512MB", 512 * 10**6)])
def test_explicit_limits_are_per_process_and_not_split(monkeypatch, value, expected):
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "8")
    assert ckpt_offload.parse_host_memory_limit(value) == expected


def test_engine_gets_the_split_default(monkeypatch):
    """Each process's engine pool is capped at its share: a block past it is refused."""
    import torch

    share = 8 << 20
    monkeypatch.setattr(config, "total_host_memory_bytes", lambda: share * 2 * 4)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    a = torch.randn(1 << 20, requires_grad=True)  # 4 MiB: fits the 8 MiB share
    b = torch.randn(3 << 20, requires_grad=True)  # 12 MiB: does not
    settings = dict(backend="host", scope="all", min_offload_bytes=0, keep_last=0)
    with pytest.warns(UserWarning, match=f"refused by host_memory_limit = {share} bytes"):
        with ckpt_offload.offload_activations(**settings) as engine:
            loss = (a * 1.0).sin().sum() + (b * 1.0).sin().sum()  # sin saves a*1, b*1
    stats = engine.stats()
    assert (stats["offloaded_tensors"], stats["cap_fallbacks"]) == (1, 1)
    assert 4 << 20 <= stats["host_reserved_bytes"] <= share
    loss.backward()
    assert engine.stats()["host_live_bytes"] == 0
