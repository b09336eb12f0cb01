"""A Docker engine that restarted under a container and answers again before the container is looked at: the dead
container is the engine's doing (EngineGone, the trial run again), not the flags' crash. Told by a long-lived
connection to the engine (`EngineWatch`) ending; fakes of the engine's stream and of a container."""

from __future__ import annotations

import queue
import threading
from collections.abc import Iterator
from typing import Any

import pytest

from tuner.errors import EngineGone
from tuner.launch.docker import ContainerHandle
from tuner.launch.engine_watch import EngineWatch

WAIT_S = 60.0  # a bound on a broken test, not a timing assertion


class Stream:
    """An engine's event stream: blocks until the engine restarts (`end()`) or we close it."""

    def __init__(self) -> None:
        self._q: queue.Queue[bool] = queue.Queue()

    def __iter__(self) -> Iterator[Any]:
        self._q.get(timeout=WAIT_S)
        return iter(())

    def end(self) -> None:
        self._q.put(True)

    close = end


class Engine:
    """Opens streams; `restart()` ends the open one; while `down`, opening fails as on a refused socket."""

    def __init__(self) -> None:
        self.streams: list[Stream] = []
        self.down = False
        self.opened = threading.Event()

    def events(self) -> Stream:
        if self.down:
            raise ConnectionRefusedError("engine down")
        self.streams.append(Stream())
        self.opened.set()
        return self.streams[-1]

    def restart(self) -> None:
        """The engine goes away and comes back: the stream ends, a new one is opened by the watch."""
        self.opened.clear()
        self.streams[-1].end()
        assert self.opened.wait(WAIT_S), "the watch never opened its stream again"


def test_the_watch_counts_an_engine_restart_done_before_anyone_looks() -> None:
    engine = Engine()
    watch = EngineWatch(engine.events, retry_s=0.01)
    try:
        mark = watch.mark()
        assert mark == 0 and not watch.restarted_since(mark)
        engine.restart()
        assert watch.restarted_since(mark)
        later = watch.mark()
        assert not watch.restarted_since(later)  # a container started after it has nothing to do with it
        assert len(engine.streams) == 2
    finally:
        watch.close()


def test_an_engine_without_a_stream_tells_nothing_apart() -> None:
    def refused() -> Stream:
        raise ConnectionRefusedError("no engine")

    watch = EngineWatch(refused)
    assert watch.mark() is None and not watch.restarted_since(None)


class Container:
    """What docker-py gives for a container: its state reloaded, its logs, its stop and removal."""

    def __init__(self, status: str = "running", code: int = 0) -> None:
        self.attrs: dict[str, Any] = {"State": {"Status": status, "ExitCode": code}}
        self.removed = False

    def reload(self) -> None:
        pass

    def logs(self, **_kw: Any) -> bytes:
        return b"INFO ready\n"

    def stop(self, timeout: int) -> None:
        self.attrs["State"] = {"Status": "exited", "ExitCode": 143}

    def remove(self, force: bool) -> None:
        self.removed = True


def gone_if(restarted: bool) -> Any:
    def check(code: int) -> EngineGone | None:
        if not restarted:
            return None
        return EngineGone(f"the engine restarted (exited with code {code})", "the engine", lambda: True)

    return check


def test_a_container_that_died_across_an_engine_restart_is_engine_gone() -> None:
    handle = ContainerHandle(Container("exited", 137), gone_if(True))
    with pytest.raises(EngineGone) as gone:
        handle.exit_code()
    assert "exited with code 137" in str(gone.value) and gone.value.reason == "engine_gone"
    handle.remove()  # its removal does not raise it again
    assert handle.container.removed


def test_a_container_that_died_on_its_own_or_that_we_stopped_is_what_it_was() -> None:
    assert ContainerHandle(Container("exited", 1), gone_if(False)).exit_code() == 1
    assert ContainerHandle(Container("running"), gone_if(True)).exit_code() is None
    stopped = ContainerHandle(Container("running"), gone_if(True))
    stopped._stop_sync(1)
    assert stopped.stopped_by_us and stopped.exit_code() == 143  # our own stop is never the engine's
