from __future__ import annotations

import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import sqlalchemy as sa

from tuner.errors import StorageError
from tuner.load import RequestRecord
from tuner.store import (
    VERSION_TABLE,
    current_revision,
    flag_key,
    head_revision,
    make_engine,
    open_store,
)


def records(n: int) -> list[RequestRecord]:
    return [
        RequestRecord(
            index=i,
            start_s=i * 0.5,
            ttft_s=0.1 + i,
            itl_s=[0.01, 0.02],
            e2e_s=1.5 + i,
            prompt_tokens=100,
            completion_tokens=3,
            ok=i % 2 == 0,
            error_class=None if i % 2 == 0 else "http_5xx",
            error_message=None if i % 2 == 0 else "HTTP 500",
            warmup=i == 0,
        )
        for i in range(n)
    ]


def roundtrip(url: str) -> None:
    with open_store(url) as store:
        assert store.trial_detail("s", 0) is None
        store.save_trial("s", 0, flags={"max_num_seqs": 64}, baseline=True, outcome="measured")
        store.save_trial(
            "s",
            0,
            load_summary={"output_throughput": 123.5},
            startup_facts={"kv_tokens": 1000},
            prediction={"ok": True, "kv_tokens": 992},
            diagnosis="bottleneck: KV cache",
            log_tail="INFO ...",
            server_seconds=12.5,
        )
        store.save_requests("s", 0, records(5))
        store.save_requests("s", 0, records(3), step=1)
        d = store.trial_detail("s", 0)
        assert d is not None
        assert d.flags == {"max_num_seqs": 64} and d.baseline and d.outcome == "measured"
        assert d.load_summary == {"output_throughput": 123.5} and d.startup_facts == {"kv_tokens": 1000}
        assert d.diagnosis == "bottleneck: KV cache" and d.server_seconds == 12.5
        assert store.request_records("s", 0) == records(5)
        assert store.request_records("s", 0, step=1) == records(3)
        store.save_trial("s", 0, scored_step=1)
        assert store.request_records("s", 0) == records(3)
        assert store.request_steps("s", 0) == [0, 1]
        # A retried trial replaces its records rather than adding to them.
        store.save_requests("s", 0, records(2))
        assert len(store.request_records("s", 0, step=0)) == 2
        assert [t.number for t in store.trial_details("s")] == [0]
        with pytest.raises(TypeError, match="unknown trial fields: bogus"):
            store.save_trial("s", 0, bogus=1)
        store.delete_study("s")
        assert store.trial_detail("s", 0) is None and store.request_records("s", 0) == []


def test_a_trial_round_trips_and_a_second_open_migrates_nothing(storage_url: str) -> None:
    roundtrip(storage_url)
    engine = make_engine(storage_url)
    try:
        assert current_revision(engine) == head_revision()
        with engine.connect() as conn:
            tables = set(sa.inspect(conn).get_table_names())
        assert {"tuner_trial", "tuner_request", "tuner_flag_claim", VERSION_TABLE} <= tables
        assert "alembic_version" not in tables  # left to Optuna's own migrations
    finally:
        engine.dispose()
    open_store(storage_url).close()  # a second open migrates nothing and fails nothing


@pytest.mark.postgres
def test_postgres_parallel_first_opens_migrate_once(postgres_url: str) -> None:
    # PostgreSQL's alone: commands on several machines may open one new database at once, and an advisory lock
    # serialises their upgrades; a SQLite file's `--parallel` workers start after the process that opened it first.
    errors: list[BaseException] = []

    def open_one() -> None:
        try:
            open_store(postgres_url).close()
        except BaseException as e:
            errors.append(e)

    threads = [threading.Thread(target=open_one) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []


def claims(url: str) -> None:
    with open_store(url) as store:
        k = flag_key({"max_num_seqs": 64, "max_model_len": 8192})
        assert k == flag_key({"max_model_len": 8192, "max_num_seqs": 64})
        assert k != flag_key({"max_model_len": 8192, "max_num_seqs": 64.0})
        assert store.claim("s", k, 3) == 3
        assert store.claim("s", k, 7) == 3  # owned by trial 3
        assert not store.take_over_claim("s", k, old=5, new=7)
        assert store.take_over_claim("s", k, old=3, new=7)
        assert store.claim("s", k, 9) == 7
        store.release_claim("s", k, 7)
        assert store.claim("s", k, 9) == 9


def test_flag_claims(storage_url: str) -> None:
    claims(storage_url)


def test_exclusive_lock_serialises_workers_across_processes(storage_url: str, tmp_path: Path) -> None:
    """Two workers' processes (PostgreSQL: an advisory lock; SQLite: a lock file beside the database)."""
    released = tmp_path / "released"
    code = (
        "import sys; from pathlib import Path; from tuner.store import open_store\n"
        f"s = open_store({storage_url!r})\n"
        "with s.exclusive('s'):\n"
        "    print('locked', flush=True); sys.stdin.readline()\n"
        f"    Path({str(released)!r}).touch()\n"
        "s.close()\n"
    )
    child = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    seen: list[bool] = []

    def take() -> None:
        with open_store(storage_url) as store, store.exclusive("s"):
            seen.append(released.exists())

    try:
        assert child.stdin is not None and child.stdout is not None
        assert child.stdout.readline().strip() == "locked"
        waiter = threading.Thread(target=take)
        waiter.start()
        time.sleep(0.3)  # time to reach the lock; on a busy machine less of it only weakens the check
        child.stdin.write("\n")
        child.stdin.flush()
        waiter.join(30)
        # Taken only once the other process let go: never while it held the lock.
        assert seen == [True]
    finally:
        child.wait(10)
        for pipe in (child.stdin, child.stdout):
            if pipe is not None:
                pipe.close()


@pytest.mark.parametrize(
    ("url", "message"),
    [
        ("not a url", "is not a database URL; use sqlite:///PATH.db or postgresql"),
        ("mongodb://localhost/x", "unknown database kind 'mongodb'"),
        ("sqlite:////nonexistent-dir/x.db", "cannot open storage 'sqlite:////nonexistent-dir/x.db'"),
        (
            "postgresql+psycopg://tuner:secret@127.0.0.1:1/nodb",
            r"cannot open storage 'postgresql\+psycopg://tuner:\*\*\*@127.0.0.1:1/nodb'",
        ),
    ],
)
def test_bad_storage_url_is_one_clear_error_without_the_password(url: str, message: str) -> None:
    with pytest.raises(StorageError, match=message) as info:
        open_store(url)
    assert "secret" not in str(info.value)
