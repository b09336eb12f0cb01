"""The box's GPU pool and the launchers built on a borrowed set: who gets which GPUs, what each server is told."""

from __future__ import annotations

import asyncio
import fcntl
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from tuner.config import parse_job
from tuner.emulator.config import parse_config
from tuner.errors import ConfigError, GpuLost, LaunchError
from tuner.flags import VllmFlags
from tuner.launch import DockerLauncher, EmulatorLauncher, ProcessLauncher
from tuner.launch.docker import gpu_create_kwargs
from tuner.launch.factory import build_launcher
from tuner.launch.gpu_pool import GpuPool, visible_ids
from tuner.launch.pooled import PooledLauncher, gpus_needed


def pool(tmp_path: Path, n: int = 4) -> GpuPool:
    return GpuPool([str(i) for i in range(n)], tmp_path / "gpus", poll_s=0.01)


def test_borrowers_get_disjoint_sets_their_own_first(tmp_path: Path) -> None:
    async def main() -> None:
        p = pool(tmp_path)
        async with p.borrow(2, prefer=("2", "3")) as a, p.borrow(1) as b, p.borrow(1, prefer=("3",)) as c:
            assert a == ("2", "3") and b == ("0",) and c == ("1",)  # "3" was taken: the lowest free instead
            assert sorted(p.busy()) == ["0", "1", "2", "3"]
        assert p.busy() == []

    asyncio.run(main())


def test_a_large_trial_waits_for_enough_gpus_while_a_narrow_one_backfills_the_idle_ones(tmp_path: Path) -> None:
    """While a 4-GPU trial waits at the head of the queue for the one GPU a running trial holds, a 1-GPU trial asking
    after it starts at once on one of the three idle GPUs (a backfill); then the large one runs on all four."""

    async def main() -> list[str]:
        p = pool(tmp_path)
        order: list[str] = []

        async def late_small() -> None:
            async with p.borrow(1) as got:
                order.append(f"late small {','.join(got)}")

        release_small, running = await _large_queued_behind_one_busy_gpu(p, order)
        await asyncio.wait_for(late_small(), 600)  # returns: it did not wait for the large one (a hang's guard)
        assert order == ["late small 1"]
        release_small.set()
        await asyncio.gather(*running)
        return order

    assert asyncio.run(main()) == ["late small 1", "large 0,1,2,3"]


def test_past_its_count_of_backfills_the_head_is_not_overtaken(tmp_path: Path) -> None:
    """A stream of narrow trials cannot starve a wide one: once the head has let its count of backfills by (here
    one), the next narrow trial waits behind it although GPUs are idle, then runs when the wide one is done."""

    async def main() -> list[str]:
        p = GpuPool([str(i) for i in range(4)], tmp_path / "gpus", poll_s=0.01, backfills=1)
        order: list[str] = []

        async def narrow(name: str) -> None:
            async with p.borrow(1):
                order.append(name)

        release_small, running = await _large_queued_behind_one_busy_gpu(p, order)
        await narrow("backfill")  # the one backfill the head allows
        late = asyncio.create_task(narrow("late"))
        await asyncio.sleep(0.05)
        assert order == ["backfill"]  # three GPUs idle, yet the late one waits behind the head
        release_small.set()
        await asyncio.gather(*running, late)
        return order

    assert asyncio.run(main()) == ["backfill", "large 0,1,2,3", "late"]


async def _large_queued_behind_one_busy_gpu(
    p: GpuPool, order: list[str]
) -> tuple[asyncio.Event, tuple[asyncio.Task[None], asyncio.Task[None]]]:
    """A 1-GPU trial holding GPU 0 until the event is set, and a 4-GPU one queued at the head behind it (it writes
    `large <its GPUs>` to `order` when it runs); the event and both tasks."""
    started, release = asyncio.Event(), asyncio.Event()

    async def small() -> None:
        async with p.borrow(1):
            started.set()
            await release.wait()

    async def large() -> None:
        async with p.borrow(4) as got:
            order.append(f"large {','.join(got)}")

    first = asyncio.create_task(small())
    await started.wait()
    big = asyncio.create_task(large())
    await asyncio.sleep(0.05)  # the large one is queued first (ordering only; nothing is timed)
    return release, (first, big)


def test_a_killed_holder_gives_its_gpus_back(tmp_path: Path) -> None:
    p = pool(tmp_path, 1)
    (tmp_path / "gpus").mkdir()
    lock = tmp_path / "gpus" / "gpu-0.lock"
    holder = subprocess.Popen(
        [sys.executable, "-c", f"import fcntl,sys,time; f=open({str(lock)!r},'a+'); fcntl.flock(f, fcntl.LOCK_EX); "
         "print('held', flush=True); time.sleep(600)"],
        stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        assert holder.stdout is not None and holder.stdout.readline() == "held\n"
        assert p.busy() == ["0"]
        os.kill(holder.pid, signal.SIGKILL)
        holder.wait()

        async def main() -> tuple[str, ...]:
            async with p.borrow(1) as got:
                return got

        assert asyncio.run(main()) == ("0",)
    finally:
        holder.kill()
        holder.wait()
        if holder.stdout is not None:
            holder.stdout.close()
    with lock.open("a+") as f:  # and the pool gave it back in turn
        fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)


def test_borrowing_more_than_the_pool_is_refused(tmp_path: Path) -> None:
    async def main() -> None:
        async with pool(tmp_path, 2).borrow(3):
            pass

    with pytest.raises(ValueError, match="cannot borrow 3 of 2"):
        asyncio.run(main())


def test_visible_ids_are_cuda_visible_devices_when_the_tuner_was_given_some() -> None:
    assert visible_ids([0, 1, 2, 3], {}) == ("0", "1", "2", "3")
    assert visible_ids([0, 1, 2, 3], {"CUDA_VISIBLE_DEVICES": "2,3"}) == ("2", "3")
    assert visible_ids([0, 1], {"CUDA_VISIBLE_DEVICES": " "}) == ("0", "1")


def test_a_trial_needs_tensor_times_pipeline_parallel_gpus() -> None:
    assert gpus_needed(VllmFlags()) == 1
    assert gpus_needed(VllmFlags(tensor_parallel_size=2)) == 2
    assert gpus_needed(VllmFlags(tensor_parallel_size=2, extra={"pipeline_parallel_size": 2})) == 4


def _job(launcher: str) -> dict[str, object]:
    return {
        "study": {"name": "pool"},
        "target": {"launcher": launcher, "model": "llama-3.1-8b", "gpu": "l4"},
        "space": {"max_model_len": 2048, "max_num_seqs": {"choices": [8, 16]}},
        "workload": {"input_len": 64, "output_len": 8},
        "arrival": {"concurrency": 1, "requests": 2},
        "slos": ["success_rate >= 0.9"],
    }


def test_each_launcher_kind_is_told_its_devices(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    monkeypatch.delenv("CUDA_DEVICE_ORDER", raising=False)
    process = build_launcher(parse_job(_job("process")), ("1", "3"))
    assert isinstance(process, ProcessLauncher)
    assert process._environment()["CUDA_VISIBLE_DEVICES"] == "1,3"
    assert process._environment()["CUDA_DEVICE_ORDER"] == "PCI_BUS_ID"  # NVML's numbering, which the pool counts
    docker = build_launcher(parse_job(_job("docker")), ("1", "3"))
    assert isinstance(docker, DockerLauncher) and docker.gpus == ["1", "3"]
    (request,) = gpu_create_kwargs(docker.gpus)["device_requests"]
    assert request["DeviceIDs"] == ["1", "3"]  # Docker's device_ids: the container sees these two only
    emulator = build_launcher(parse_job(_job("emulator")), ("2",))
    assert isinstance(emulator, EmulatorLauncher)
    assert emulator._process._environment()["CUDA_VISIBLE_DEVICES"] == "2"
    # Without a borrowed set nothing is narrowed: every GPU the machine shows.
    plain = build_launcher(parse_job(_job("process")))
    assert isinstance(plain, ProcessLauncher) and "CUDA_VISIBLE_DEVICES" not in plain._environment()


def test_the_emulator_refuses_a_world_size_beyond_its_gpus_as_vllm_does(monkeypatch: pytest.MonkeyPatch) -> None:
    args = ["--model", "llama-3.1-8b", "--gpu", "l4", "--tensor-parallel-size", "2"]
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0")
    with pytest.raises(ConfigError, match=r"World size \(2\) is larger than the number of available GPUs \(1\)"):
        parse_config(args)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1")
    assert parse_config(args).flags.tensor_parallel_size == 2
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES")
    assert parse_config(args).flags.tensor_parallel_size == 2  # unset: it imitates a box with enough


@pytest.mark.slow
def test_a_pooled_server_runs_on_the_gpus_its_flags_need(tmp_path: Path) -> None:
    job = parse_job(_job("emulator") | {"target": {**_job("emulator")["target"], "emulator": {"time_scale": 50}}})  # type: ignore[dict-item]
    p = pool(tmp_path)
    borrowed: list[tuple[str, ...]] = []
    launcher = PooledLauncher(
        lambda devices: build_launcher(job, devices),
        p,
        home=("2",),
        on_borrow=lambda _trial, devices: borrowed.append(devices),
    )

    async def main() -> tuple[tuple[str, ...], list[str]]:
        async with launcher.start(VllmFlags(max_model_len=2048, tensor_parallel_size=2), trial=1) as server:
            return server.devices, sorted(p.busy())

    devices, busy = asyncio.run(main())
    assert devices == ("0", "2") and busy == ["0", "2"] and borrowed == [("0", "2")]
    assert p.busy() == []
    # A set the flags do not fit is vLLM's refusal, from the server itself.
    narrow = build_launcher(job, ("0",))

    async def refused() -> None:
        async with narrow.start(VllmFlags(max_model_len=2048, tensor_parallel_size=2)):
            pass

    with pytest.raises(LaunchError, match="World size"):
        asyncio.run(refused())


def _lost(*indices: int) -> GpuLost:
    return GpuLost("NVML no longer reads GPU 1 (NVIDIA L4): GPU is lost", "GPU 1 (NVIDIA L4)", lambda: False, indices)


def test_a_gpu_lost_under_a_trial_leaves_the_pool_until_the_next_run(tmp_path: Path) -> None:
    """Lost under a 2-GPU trial: that GPU, and only it, is given to no later borrower (another worker would stop on
    it too); a trial that cannot be placed without it stops as on a lost GPU; a new run reads the GPUs afresh."""
    p = pool(tmp_path, 3)
    launcher = PooledLauncher(lambda devices: build_launcher(parse_job(_job("emulator")), devices), p)
    with pytest.raises(GpuLost), launcher.hold(VllmFlags(tensor_parallel_size=2)) as (_, devices):
        assert devices == ("0", "1")
        raise _lost(1)
    assert p.lost() == ["1"]
    with p.hold(2) as got:
        assert got == ("0", "2")  # past the lost one
    with pytest.raises(GpuLost, match=r"needs 3 GPUs and 1 of the 3 given are lost \(1\)"), p.hold(3):
        pass
    GpuPool(p.ids, p.dir).clear_lost()
    with p.hold(3) as got:
        assert got == ("0", "1", "2")


def test_a_lost_gpu_the_pool_cannot_name_takes_the_trials_whole_set_out(tmp_path: Path) -> None:
    # The pool's ids are CUDA_VISIBLE_DEVICES' entries, UUIDs here: NVML's index names none of them.
    p = GpuPool(["GPU-aa", "GPU-bb", "GPU-cc"], tmp_path / "gpus", poll_s=0.01)
    launcher = PooledLauncher(lambda devices: build_launcher(parse_job(_job("emulator")), devices), p)
    with pytest.raises(GpuLost), launcher.hold(VllmFlags(tensor_parallel_size=2)):
        raise _lost(0)
    assert p.lost() == ["GPU-aa", "GPU-bb"]


def test_a_single_worker_given_some_gpus_waits_on_and_watches_only_those(monkeypatch: pytest.MonkeyPatch) -> None:
    # A GPU lost elsewhere on the box is not this study's: only the ones its servers inherit are read.
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "4,5")
    process = build_launcher(parse_job(_job("process")))
    assert isinstance(process, ProcessLauncher)
    assert process.gpu_idle._probe._indices == [4, 5]  # type: ignore[attr-defined]
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES")
    every = build_launcher(parse_job(_job("process")))
    assert isinstance(every, ProcessLauncher) and every.gpu_idle._probe._indices is None  # type: ignore[attr-defined]
