"""What a load phase records about its machine: /proc read on a fake tree, the pure arithmetic, the comparison."""

from __future__ import annotations

from pathlib import Path

import pytest

from tuner.load.contention import Contention, contention_warning, holdable_time_scale, lag_share, pooled
from tuner.load.host_contention import HostReading, HostSampler, between


def _proc(root: Path, cpu: list[int], tree: dict[int, tuple[int, int]]) -> None:
    """A fake /proc: /proc/stat's cpu line (two CPUs) and per process (ppid, jiffies of utime)."""
    root.mkdir(exist_ok=True)
    fields = " ".join(str(x) for x in cpu)
    (root / "stat").write_text(f"cpu  {fields}\ncpu0 {fields}\ncpu1 {fields}\nintr 1\n")
    for pid, (ppid, jiffies) in tree.items():
        (root / str(pid)).mkdir(exist_ok=True)
        # comm with a space and a parenthesis, as a real one may hold: the fields start after the last ")"
        (root / str(pid) / "stat").write_text(f"{pid} (we (x)) S {ppid} 1 1 0 -1 0 0 0 0 0 {jiffies} 0 0 0 20 0\n")


def test_the_sampler_counts_the_study_tree_as_its_own_and_the_rest_as_others(tmp_path: Path) -> None:
    proc = tmp_path / "proc"
    # 100 is the study, 101 its server, 102 the server's worker; 200 someone else's busy loop.
    _proc(proc, [0, 0, 0, 1000, 0, 0, 0, 0], {100: (1, 10), 101: (100, 20), 102: (101, 30), 200: (1, 0)})
    sampler = HostSampler(proc, pid=100)
    before = sampler.read()
    assert before.own == 60 and before.cpus == 2 and before.total == 1000
    # 400 jiffies pass (200 per CPU): the tree uses 50, the busy loop 190 (nearly a core), the hypervisor 40
    _proc(proc, [240, 0, 0, 1120, 0, 0, 0, 40], {100: (1, 20), 101: (100, 40), 102: (101, 50), 200: (1, 190)})
    c = between(before, sampler.read())
    assert c.other_cores == pytest.approx(0.95)
    assert c.steal == pytest.approx(0.1)
    assert c.cpus == 2


def test_without_proc_only_the_load_is_known(tmp_path: Path) -> None:
    sampler = HostSampler(tmp_path / "absent", pid=1)
    c = between(sampler.read(), sampler.read())
    assert c.other_cores is None and c.steal is None


@pytest.mark.skipif(not Path("/proc/stat").exists(), reason="no /proc here")
def test_this_machine_reads() -> None:
    reading = HostSampler().read()
    assert reading.total is not None and reading.cpus is not None and reading.cpus >= 1
    assert reading.own is not None and reading.own >= 0


def test_a_quiet_span_shows_no_other_processes() -> None:
    before = HostReading(0.0, 0.1, total=1000, idle=900, steal=0, own=100, cpus=2)
    after = HostReading(10.0, 0.2, total=3000, idle=2000, steal=0, own=1000, cpus=2)
    c = between(before, after)
    assert c.other_cores == 0.0 and c.seconds == 10.0 and c.load_after == 0.2


def test_the_lag_share_and_the_time_scale_the_machine_holds() -> None:
    assert lag_share(3.0, 60.0) == pytest.approx(0.05)
    assert lag_share(None, 60.0) is None and lag_share(1.0, 0.0) is None
    # a run at 40 that lost a quarter of its time ran at 30; a fifth below that
    assert holdable_time_scale(40, 0.25) == 24
    assert holdable_time_scale(4, 0.0) == pytest.approx(3.2)
    assert 0 < holdable_time_scale(40, 1.0) < 40


def test_a_comparison_under_different_contention_says_so() -> None:
    quiet = Contention(other_cores=0.1, steal=0.0)
    busy = Contention(other_cores=1.9, steal=0.0)
    assert contention_warning(quiet, Contention(other_cores=0.3, steal=0.01), "#3", "the baseline") is None
    warning = contention_warning(quiet, busy, "#3", "the baseline")
    assert warning is not None and "1.9" in warning and "#3" in warning
    lagged = contention_warning(quiet, Contention(other_cores=0.1, lagged=True), "#3", "the baseline (#0)")
    assert lagged is not None and "lagged" in lagged and "the baseline (#0)" in lagged
    assert contention_warning(None, busy, "#3", "the baseline") is None


def test_starts_pool_into_one_contention() -> None:
    p = pooled([Contention(other_cores=0.0), None, Contention(other_cores=2.0, lagged=True, emulator_lag_share=0.2)])
    assert p is not None and p.other_cores == 1.0 and p.lagged and p.emulator_lag_share == 0.2
    assert pooled([None]) is None


def test_a_stored_contention_reads_back_and_an_odd_one_does_not() -> None:
    c = Contention(other_cores=1.5, cpus=2, load_before=0.5, load_after=2.5, steal=0.0, emulator_lag_share=0.01)
    assert Contention.of(c.model_dump(mode="json")) == c
    assert Contention.of("busy") is None and Contention.of({"other_cores": "lots"}) is None
    assert "other processes 1.5 of 2 cores" in c.describe() and "emulator lag 1.0%" in c.describe()


def test_a_containers_tree_counts_as_the_studys_own(tmp_path: Path) -> None:
    proc = tmp_path / "proc"
    # 300 is the server's container, started by the engine (ppid 1), 301 its worker; 200 someone else's
    tree = {100: (1, 0), 300: (1, 0), 301: (300, 0), 200: (1, 0)}
    _proc(proc, [0, 0, 0, 1000, 0, 0, 0, 0], tree)
    alone, with_container = HostSampler(proc, pid=100), HostSampler(proc, pid=100, also=(300,))
    before = (alone.read(), with_container.read())
    _proc(proc, [300, 0, 0, 1100, 0, 0, 0, 0], {100: (1, 0), 300: (1, 100), 301: (300, 150), 200: (1, 50)})
    assert between(before[0], alone.read()).other_cores == pytest.approx(1.5)
    assert between(before[1], with_container.read()).other_cores == pytest.approx(0.25)


def test_a_container_handle_names_its_first_process() -> None:
    from tuner.launch.docker import ContainerHandle

    class _Container:
        def __init__(self, state: dict[str, object]) -> None:
            self.attrs = {"State": state}

        def reload(self) -> None:
            return None

    assert ContainerHandle(_Container({"Status": "running", "Pid": 4242})).root_pid() == 4242
    assert ContainerHandle(_Container({"Status": "exited", "Pid": 0})).root_pid() is None


def test_the_lag_limit_is_the_products_unless_the_environment_gives_a_share(monkeypatch: pytest.MonkeyPatch) -> None:
    from tuner.errors import ConfigError
    from tuner.load.contention import LAG_SHARE_LIMIT, lag_share_limit

    monkeypatch.delenv("TUNER_EMULATOR_LAG_LIMIT", raising=False)
    assert lag_share_limit() == LAG_SHARE_LIMIT
    monkeypatch.setenv("TUNER_EMULATOR_LAG_LIMIT", "0.2")
    assert lag_share_limit() == 0.2
    for bad in ("0", "1.5", "lots"):
        monkeypatch.setenv("TUNER_EMULATOR_LAG_LIMIT", bad)
        with pytest.raises(ConfigError, match="TUNER_EMULATOR_LAG_LIMIT"):
            lag_share_limit()
