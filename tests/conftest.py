"""Shared fixtures. Real services (PostgreSQL, Docker) are used where the test command brought them up; a test
that needs one skips with the reason when it is missing, unless TUNER_REQUIRE_SERVICES=1 (CI), where it fails."""

from __future__ import annotations

import gc
import os
import sys
import uuid
import warnings
from collections.abc import Iterator

import pytest

REQUIRE_SERVICES = os.environ.get("TUNER_REQUIRE_SERVICES") == "1"

# The real-vLLM tier's fixtures: its tests sit in the package folders they test (`tests/<package>/test_*_real.py`).
pytest_plugins = ["tests.real_vllm"]

# The suite runs on busy machines (2 cores, real vLLM beside it): an emulator run there may lag more than a study
# accepts (5%), and a test about something else would stop with "cannot hold time_scale". The lag is still read
# and recorded; the lag tests set the product's own limit (tests/emulator/test_emulator_lag.py).
os.environ.setdefault("TUNER_EMULATOR_LAG_LIMIT", "0.5")


def run_main(
    args: list[str], capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> tuple[int, str, str]:
    """`tuner ARGS` through its real entry point (`tuner.cli.main`, error handling included) in this process: the
    exit code, stdout and stderr."""
    from tuner.cli import main

    monkeypatch.setattr(sys, "argv", ["tuner", *args])
    with pytest.raises(SystemExit) as exc:
        main()
    out, err = capsys.readouterr()
    code = exc.value.code
    return (code if isinstance(code, int) else 1), out, err


def missing_service(what: str, why: str) -> None:
    message = f"{what} is not available: {why}"
    if REQUIRE_SERVICES:
        pytest.fail(f"{message} (TUNER_REQUIRE_SERVICES=1 requires it)", pytrace=False)
    pytest.skip(message)


@pytest.fixture(scope="session")
def postgres_server_url() -> str:
    """URL of a PostgreSQL database the test command created (TUNER_TEST_POSTGRES_URL)."""
    url = os.environ.get("TUNER_TEST_POSTGRES_URL")
    if not url:
        missing_service("PostgreSQL", "TUNER_TEST_POSTGRES_URL is not set (scripts/test sets it)")
    assert url is not None
    try:
        import sqlalchemy as sa

        engine = sa.create_engine(url)
        with engine.connect() as conn:
            conn.execute(sa.text("SELECT 1"))
        engine.dispose()
    except Exception as e:  # any failure to connect means "not available"
        missing_service("PostgreSQL", f"cannot connect to {url}: {e}")
    return url


@pytest.fixture
def postgres_url(postgres_server_url: str) -> Iterator[str]:
    """A fresh, empty schema-less database for one test, dropped afterwards."""
    import sqlalchemy as sa

    name = f"t_{uuid.uuid4().hex[:12]}"
    # pre-ping: a test may restart the server, leaving this pool's connection dead for the DROP afterwards
    admin = sa.create_engine(postgres_server_url, isolation_level="AUTOCOMMIT", pool_pre_ping=True)
    with admin.connect() as conn:
        conn.execute(sa.text(f'CREATE DATABASE "{name}"'))
    base = sa.engine.make_url(postgres_server_url)
    yield base.set(database=name).render_as_string(hide_password=False)
    with admin.connect() as conn:
        conn.execute(sa.text(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))
    admin.dispose()


@pytest.fixture(scope="session")
def docker_client():  # type: ignore[no-untyped-def]
    """A Docker SDK client to an engine that answers a ping."""
    client = None
    try:
        import docker

        client = docker.from_env(timeout=30)
        client.ping()
        return client
    except Exception as e:
        why = f"{type(e).__name__}: {e}"
    if client is not None:
        client.close()
    # The SDK leaves the socket of a refused connect open: collect it here, quietly, not at pytest's exit, where
    # filterwarnings=error turns its ResourceWarning into a failed session (a machine without Docker, not required).
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ResourceWarning)
        gc.collect()
    missing_service("Docker engine", why)
