"""`--log-file` keeps what the terminal's one line leaves out: the tuner's log records with their tracebacks, and
an error's chain of causes (also one hidden with `from None`); the terminal keeps one line per warning."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

from tuner.cli.trial_lines import TextLog
from tuner.errors import StorageError


def failing() -> None:
    try:
        raise ConnectionResetError("server closed the connection unexpectedly")
    except ConnectionResetError:
        raise StorageError("storage postgresql://tuner:***@db/tuner did not answer for 300 s") from None


def test_the_log_file_has_the_details_and_the_terminal_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "tune.log"
    log = TextLog(path)
    try:
        logger = logging.getLogger("tuner.store.waiting")
        try:
            failing()
        except StorageError as e:
            logger.debug("the storage call that found the database gone", exc_info=e)
            logger.warning("a warning a person should see", exc_info=e)
            log(f"error: {e}")
            log.details(e)
    finally:
        log.close()
    text = path.read_text()
    assert "debug tuner.store.waiting: the storage call that found the database gone" in text
    assert text.count("Traceback") >= 3 and "ConnectionResetError: server closed the connection" in text
    assert "error: storage postgresql://tuner:***@db/tuner did not answer" in text
    err = capsys.readouterr().err
    assert err == "a warning a person should see\n"  # one line, no traceback
    # Closed, the file takes nothing more and the tuner's logger is as it was.
    assert logging.getLogger("tuner").handlers == []
    logging.getLogger("tuner.x").debug("after")
    assert "after" not in path.read_text()


def test_without_a_log_file_nothing_is_captured() -> None:
    log = TextLog(None)
    log.details(ValueError("x"))
    log.close()
    assert logging.getLogger("tuner").handlers == []
