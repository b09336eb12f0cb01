"""Shared fixtures. Real services (PostgreSQL, Docker) are used where the test command brought them up; a test
that needs one skips with the reason when it is missing, unless TUNER_REQUIRE_SERVICES=1 (CI), where it fails."""

from __future__ import annotations

import gc
import os
import sys
import uuid
import warnings
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

import pytest
from morning_demo import Run, build_demo_study

REQUIRE_SERVICES = os.environ.get("TUNER_REQUIRE_SERVICES") == "1"

# The real-vLLM tier's fixtures: its tests sit in the package folders they test (`tests/<package>/test_*_real.py`).
# How the tests are shared out on several workers: tests/xdist_groups.py.
pytest_plugins = ["tests.real_vllm", "tests.xdist_groups"]

# The suite runs on busy machines (2 cores, real vLLM beside it): an emulator run there may lag more than a study
# accepts (5%), and a test about something else would stop with "cannot hold time_scale". The lag is still read
# and recorded; the lag tests set the product's own limit (tests/emulator/test_emulator_lag.py).
os.environ.setdefault("TUNER_EMULATOR_LAG_LIMIT", "0.5")


def run_main(
    args: Sequence[str | Path],
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
    *,
    columns: int | None = None,
) -> tuple[int, str, str]:
    """`tuner ARGS` through its real entry point (`tuner.cli.main`, error handling included) in this process: the
    exit code as the shell would see it, stdout and stderr (only this command's: what was printed before is
    dropped). `columns` sets the terminal's width (COLUMNS) where a test reads whole table rows."""
    from tuner.cli import main

    if columns is not None:
        monkeypatch.setenv("COLUMNS", str(columns))
    monkeypatch.setattr(sys, "argv", ["tuner", *map(str, args)])
    capsys.readouterr()
    try:
        main()
        code: object = 0
    except SystemExit as e:
        code = e.code
    out, err = capsys.readouterr()
    # sys.exit's own mapping: None is success, a message is 1
    return (0 if code is None else code if isinstance(code, int) else 1), out, err


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


# The databases the store runs on, as Optuna's own suite names its storages (optuna.testing.storages.STORAGE_MODES):
# a test taking `storage_url` runs once on each. PostgreSQL's is marked, so `-m "not postgres"` leaves it out.
STORAGE_MODES = ["sqlite", pytest.param("postgresql", marks=pytest.mark.postgres)]


@pytest.fixture(params=STORAGE_MODES)
def storage_url(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    """An empty database of each mode, for one test: a SQLite file of its own, or a PostgreSQL database created for
    it and dropped afterwards (skipped where the server is missing, a failure under TUNER_REQUIRE_SERVICES=1). For a
    test whose outcome could differ by database; one that cannot takes a SQLite file alone, to keep the suite short."""
    if request.param == "sqlite":
        return f"sqlite:///{tmp_path / 'study.db'}"
    url: str = request.getfixturevalue("postgres_url")
    return url


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


@pytest.fixture(scope="session")
def demo_url(tmp_path_factory: pytest.TempPathFactory) -> str:
    """The demo study the morning commands read (tests/morning_demo.py), written once for the session."""
    return build_demo_study(tmp_path_factory.mktemp("morning") / "demo.db")


@pytest.fixture
def tuner_cli(capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> Callable[..., Run]:
    """`tuner ARGS...` through the real entry point (run_main), 220 columns wide unless the test sets COLUMNS, and
    no storage from the environment: the morning commands' tests read whole rows and name their storage."""
    monkeypatch.setenv("COLUMNS", "220")
    monkeypatch.delenv("TUNER_STORAGE", raising=False)
    monkeypatch.delenv("TUNER_STORAGE_URL", raising=False)

    def run(*args: str | Path) -> Run:
        return Run(*run_main(args, capsys, monkeypatch))

    return run
