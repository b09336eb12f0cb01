"""Waiting out a database that went away (tuner.store.waiting): which errors are a lost connection, and the bounded
retry around a storage call, on a fake clock. A study through it: tests/study/test_storage_wait.py."""

from __future__ import annotations

import sqlite3
from collections.abc import Callable

import pytest
import sqlalchemy as sa
from optuna.exceptions import StorageInternalError

from tuner.store import safe_url
from tuner.store.waiting import StorageGone, StorageWait, connection_lost


class Dropped(Exception):
    """What a driver raises for a connection the server closed (psycopg's OperationalError, say)."""


def dropped() -> sa.exc.OperationalError:
    return sa.exc.OperationalError("SELECT 1", {}, Dropped("server closed the connection unexpectedly"))


# -- which errors are a lost connection ----------------------------------------------------------------------------


def test_a_dropped_connection_is_retried_and_a_bad_statement_is_not() -> None:
    assert connection_lost(dropped())
    try:
        try:
            raise dropped()
        except sa.exc.OperationalError as e:
            raise StorageInternalError("An exception is raised during the commit.") from e
    except StorageInternalError as wrapped:
        assert connection_lost(wrapped)  # what Optuna's commit raises around it
    assert connection_lost(sa.exc.DisconnectionError("gone"))
    assert not connection_lost(sa.exc.IntegrityError("INSERT", {}, Dropped("duplicate key")))
    assert not connection_lost(sa.exc.DataError("INSERT", {}, Dropped("value too long")))
    # SQLite's own (a locked or full file) does not come back by waiting.
    assert not connection_lost(sa.exc.OperationalError("INSERT", {}, sqlite3.OperationalError("disk is full")))
    assert not connection_lost(ValueError("no"))


# -- the bounded wait ----------------------------------------------------------------------------------------------


class FakeClock:
    def __init__(self) -> None:
        self.now = 0.0
        self.slept: list[float] = []

    def sleep(self, s: float) -> None:
        self.slept.append(s)
        self.now += s


def waiting(bound_s: float, lines: list[str], clock: FakeClock) -> StorageWait:
    where = safe_url("postgresql+psycopg://tuner:s3cret@db.example/tuner")
    return StorageWait(where, bound_s, lines.append, sleep=clock.sleep, clock=lambda: clock.now)


def flaky(failures: int) -> Callable[[], str]:
    left = {"n": failures}

    def call() -> str:
        if left["n"] > 0:
            left["n"] -= 1
            raise dropped()
        return "stored"

    return call


def test_a_short_outage_is_waited_out_with_backoff_and_said_once_each_way() -> None:
    lines: list[str] = []
    clock = FakeClock()
    wait = waiting(300, lines, clock)
    assert wait.call(flaky(5)) == "stored"
    assert clock.slept == sorted(clock.slept) and clock.slept[1] == 2 * clock.slept[0]  # backing off
    assert len(lines) == 2
    assert "lost the connection to storage" in lines[0] and "waiting up to 300 s" in lines[0]
    assert "answers again" in lines[1]
    assert all("s3cret" not in line and "db.example" in line for line in lines)
    assert wait.call(flaky(0)) == "stored" and len(lines) == 2  # nothing more to say while it answers
    # The workers' stale check holds off for a grace period after it (their heartbeats were cut off too).
    assert wait.back_within(60)
    clock.now += 61
    assert not wait.back_within(60)


def test_past_the_bound_the_call_fails_with_one_line_naming_the_storage() -> None:
    lines: list[str] = []
    clock = FakeClock()
    wait = waiting(60, lines, clock)
    with pytest.raises(StorageGone) as gone:
        wait.call(flaky(10_000))
    assert sum(clock.slept) == pytest.approx(60)
    assert "db.example" in str(gone.value) and "s3cret" not in str(gone.value) and "storage_wait_s" in str(gone.value)
    assert "\n" not in str(gone.value)
    with pytest.raises(StorageGone):  # the outage goes on: the next call does not start a wait of its own
        wait.call(flaky(1))
    assert sum(clock.slept) == pytest.approx(60)


def test_an_error_that_is_not_a_lost_connection_is_raised_at_once() -> None:
    lines: list[str] = []
    clock = FakeClock()

    def bad() -> None:
        raise sa.exc.IntegrityError("INSERT", {}, Dropped("duplicate key"))

    with pytest.raises(sa.exc.IntegrityError):
        waiting(300, lines, clock).call(bad)
    assert clock.slept == [] and lines == []
