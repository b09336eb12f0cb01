"""`tuner tune --parallel` on a box study whose tensor parallel size is searched: trials of mixed shapes run side by
side on a box of 8 fake GPUs, each on as many as its shape needs, and each replica's share of the load is measured on
a real (emulated) server started with those GPUs. The runs are real command lines (test_parallel's Run)."""

from __future__ import annotations

import contextlib
import json
import sqlite3
import time
from collections import Counter
from pathlib import Path
from typing import Any

import optuna
import pytest
from optuna.trial import TrialState
from test_parallel import JOB, WAIT_S, Run, _alive, _trials

from tuner.capacity import plan_startup
from tuner.catalog import get_gpu, load_model
from tuner.flags import VllmFlags, resolve
from tuner.launch.gpu_pool import GpuPool
from tuner.record import TrialRecord
from tuner.twin.sampler import SAME_AS_ATTR

GPUS = 8
MODEL, L4 = load_model("llama-3.1-8b"), get_gpu("l4")
USERS = 16
BOX_JOB: dict[str, Any] = {
    **JOB,
    "target": {**JOB["target"], "gpus": GPUS},
    "space": {
        "tensor_parallel_size": {"choices": [1, 2, 4]},
        # Below the users a replica gets (2 to 8): both choices shape its batch, so the twin does not answer one from
        # the other's measurement (a known answer is not a launch) and the space holds the budget's 6 launches.
        "max_num_seqs": {"choices": [1, 2]},
        "max_model_len": 2048,
    },
    "arrival": {"concurrency": USERS, "requests": USERS},
    "budget": {"n_trials": 6, "confirm": 0},
}


def _tp(t: optuna.trial.FrozenTrial) -> int:
    return int(t.user_attrs.get("flags", {}).get("tensor_parallel_size") or 1)


def _running_sizes(tmp: Path) -> list[int]:
    """The TP sizes of the study's running trials that have their flags, read-only from the SQLite file (opening it
    through Optuna would race the run at making its tables); none before the run has made them."""
    db = tmp / "par.db"
    if not db.exists():
        return []
    query = (
        "SELECT a.value_json FROM trials t JOIN trial_user_attributes a ON a.trial_id = t.trial_id "
        "WHERE t.state = 'RUNNING' AND a.key = 'flags'"
    )
    try:
        with contextlib.closing(sqlite3.connect(f"file:{db}?mode=ro", uri=True, timeout=30)) as con:
            rows = con.execute(query).fetchall()
    except sqlite3.OperationalError:  # the tables are not there yet
        return []
    return [int(json.loads(v).get("tensor_parallel_size") or 1) for (v,) in rows]


def _settled(run: Run, pool: GpuPool, workers: int) -> tuple[list[dict[str, Any]], list[int], set[str]]:
    """Wait until every worker holds a trial that either waits at the barrier with its server up or waits for GPUs,
    and no trial is between the two (the GPUs held are the servers'). The arrived trials, the waiting trials'
    sizes, and the GPUs held."""
    deadline = time.monotonic() + WAIT_S
    while time.monotonic() < deadline:
        if run.proc.poll() is not None:
            pytest.fail(f"the run ended early:\n{run.proc.stdout.read()}")  # type: ignore[union-attr]
        arrived = run.arrived(0)
        running = _running_sizes(run.tmp)
        held = set(pool.busy())
        on_servers = {d for a in arrived for d in a["devices"]}
        # the trials not at the barrier, by size: every running trial's less the servers' (one per arrived trial)
        waiting = list((Counter(running) - Counter(len(a["devices"]) for a in arrived)).elements())
        if len(running) == workers and held == on_servers and len(arrived) + len(waiting) == workers:
            return arrived, waiting, held
        time.sleep(0.2)
    pytest.fail("the workers never settled")


@pytest.mark.slow
def test_parallel_runs_trials_of_mixed_shapes_side_by_side_each_replica_on_a_real_server(tmp_path: Path) -> None:
    run = Run(tmp_path, "--parallel", "4", job=BOX_JOB, gpus=GPUS)
    pool = GpuPool([str(i) for i in range(GPUS)], tmp_path / "state" / "gpus")  # the run's (TUNER_STATE_DIR)
    try:
        arrived, waiting, held = _settled(run, pool, 4)
        servers = run.servers()
        commands = {pid: p["cmdline"] for pid, p in run.processes().items() if pid in servers}
        run.release()
        code, out = run.wait()
        seen = set(run.processes())
    finally:
        run.kill_all()
    assert code == 0, out
    # Side by side: servers of different sizes at once, each on GPUs of its own, as many as its shape.
    sets = [a["devices"] for a in arrived]
    assert len({len(s) for s in sets}) >= 2, sets
    assert sorted(d for s in sets for d in s) == sorted(held)  # disjoint: no GPU lent twice
    assert sorted(len(v.split(",")) for v in servers.values()) == sorted(len(s) for s in sets), servers
    for pid, visible in servers.items():  # an emulator told its TP size and given that many GPUs
        tp = len(visible.split(","))
        assert f"--tensor-parallel-size {tp}" in commands[pid] or (tp == 1 and "--tensor-parallel" not in commands[pid])
    # Busy: a GPU is left idle only while the trial at the head of the pool's queue needs more than are free.
    free = GPUS - len(held)
    assert not waiting or max(waiting) > free, (waiting, held)
    # Every trial measured one replica under its share of the users, on the GPUs its shape needs; the box is the
    # replicas together.
    # A proposal of a flag set another worker measures (or measured) is answered with its figures, not launched, and
    # is not the budget's: the budget is 6 launches.
    complete = [t for t in _trials(tmp_path) if t.state == TrialState.COMPLETE]
    answered = [t for t in complete if TrialRecord.from_attrs(t.user_attrs).is_duplicate]
    trials = [t for t in complete if t not in answered]
    records = [TrialRecord.from_attrs(t.user_attrs) for t in trials]
    assert len(records) == 6 and {r.outcome for r in records} == {"measured"}
    by_number = {t.number: t for t in trials}
    for t in answered:
        owner = by_number[TrialRecord.from_attrs(t.user_attrs).duplicate_of or -1]
        # a sampler's repeat, or a flag set the twin simulates as the owner's (a known answer)
        assert t.user_attrs["flags"] == owner.user_attrs["flags"] or t.user_attrs.get(SAME_AS_ATTR) == owner.number
    for t, r in zip(trials, records, strict=True):
        tp = _tp(t)
        n = GPUS // tp
        assert len(r.devices) == tp and r.replicas == n and r.box_gpus == GPUS
        assert r.output_tok_s and r.box_output_tok_s == pytest.approx(n * r.output_tok_s)
        # the KV cache its server logged is the emulator's start-up for that shape: a real server of that size
        flags = VllmFlags.from_dict(r.flags)
        assert r.kv_tokens == plan_startup(MODEL, L4, resolve(flags, L4, MODEL)).kv_tokens
    assert {_tp(t) for t in trials} == {1, 2, 4}
    assert not _alive(seen)
