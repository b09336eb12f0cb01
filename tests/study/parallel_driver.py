"""`tuner tune ARGS...` as the command line runs it, with one change: each trial's load phase first waits at a
barrier in $TUNER_TEST_BARRIER (it writes `arrived-PORT.json`, then waits for a file `release`).

While every worker waits there its server is up, so a test can see all of them at once (their pids, their
CUDA_VISIBLE_DEVICES), then release them or interrupt the run. Run as `python parallel_driver.py tune JOB ...`;
the worker processes import this file again as their main module (multiprocessing's spawn), which finds the
barrier by name.
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
import time
from pathlib import Path

from tuner.flags import VllmFlags
from tuner.launch import Server
from tuner.study.measure import Measurement, measure_load

BARRIER_WAIT_S = 600.0  # a bound on a broken test, not a timing assertion


async def barrier_measure(server: Server, job: object, flags: VllmFlags) -> Measurement:
    barrier = Path(os.environ["TUNER_TEST_BARRIER"])
    port = int(server.base_url.rsplit(":", 1)[1])
    arrived = {"worker_pid": os.getpid(), "port": port, "devices": list(server.devices)}
    (barrier / f"arrived-{port}.json").write_text(json.dumps(arrived))
    deadline = time.monotonic() + BARRIER_WAIT_S
    while not (barrier / "release").exists():
        if time.monotonic() > deadline:
            raise RuntimeError("the test never released the barrier")
        await asyncio.sleep(0.05)
    return await measure_load(server, job, flags)  # type: ignore[arg-type]


if __name__ == "__main__":
    import tuner.cli.tune as tune
    from tuner.cli import main

    tune.measure_load = barrier_measure  # type: ignore[assignment]
    sys.argv = ["tuner", *sys.argv[1:]]
    main()
