"""`--parallel`: a worker that stops on a lost GPU of its own stops alone; the others, on their own GPUs, go on.
Any other failure still stops them all. Worker processes stood in for by plain child processes."""

from __future__ import annotations

import queue
import subprocess
import sys

from tuner.study.parallel import ParallelReport, WorkerEvent, _follow


class Worker:
    """A child process as `_follow` sees a worker: its pid and, once it has ended, its exit code."""

    def __init__(self, code: int, after_s: float) -> None:
        script = f"import sys, time; time.sleep({after_s}); sys.exit({code})"
        self._p = subprocess.Popen([sys.executable, "-c", script])
        self.pid = self._p.pid

    @property
    def exitcode(self) -> int | None:
        return self._p.poll()


def follow(events: list[WorkerEvent], workers: list[Worker]) -> tuple[WorkerEvent | None, list[WorkerEvent]]:
    q: queue.Queue[WorkerEvent] = queue.Queue()
    for e in events:
        q.put(e)
    seen: list[WorkerEvent] = []
    failure = _follow(workers, q, seen.append, ParallelReport())
    for w in workers:
        w._p.wait()
    return failure, seen


LOST = "NVML no longer reads GPU 1 (NVIDIA L4): GPU is lost: this worker stops"


def test_a_lost_gpu_stops_its_worker_alone() -> None:
    workers = [Worker(1, 0), Worker(0, 2)]  # worker 2 finishes its trials after worker 1 stopped
    failure, seen = follow(
        [WorkerEvent(0, "failed", ("gpu_lost", LOST)), WorkerEvent(1, "done", (3, "budget"))], workers
    )
    assert workers[1].exitcode == 0  # not stopped by the parent
    assert failure is not None and failure.args == ("gpu_lost", LOST)
    assert [e.kind for e in seen] == ["failed", "done"]  # the lost GPU's line reaches the terminal


def test_any_other_failure_still_stops_every_worker() -> None:
    workers = [Worker(1, 0), Worker(0, 60)]
    failure, _ = follow([WorkerEvent(0, "failed", ("TunerError", "image missing"))], workers)
    assert failure is not None and failure.args[0] == "TunerError"
    assert workers[1].exitcode not in (None, 0)  # SIGTERM'd by the parent
