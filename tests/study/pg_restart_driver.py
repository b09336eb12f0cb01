"""`tuner tune ARGS...` as the command line runs it, with one change: the first statement the study sends that
matches $TUNER_TEST_RESTART_AT waits until the real PostgreSQL cluster has been restarted under it
(`pg_ctlcluster $TUNER_TEST_CLUSTER restart`), so that statement, and the transaction it is part of, meets a database
that dropped every connection: the restart lands at that moment of a trial's write, every run, not by timing.

$TUNER_TEST_RESTART_AT is `SQL:<start of the statement>` ("SQL:INSERT INTO trial_values": Optuna's tell) or
`ATTR:<name>` (the first write of the trial user attribute <name>: "ATTR:outcome", the trial's record). The hook is
SQLAlchemy's own event seam; nothing of the tuner is replaced.
"""

from __future__ import annotations

import os
import subprocess
import sys
from typing import Any

import sqlalchemy as sa
from sqlalchemy.engine import Engine

_done: list[str] = []


def _matches(statement: str, parameters: Any) -> bool:
    kind, _, what = os.environ["TUNER_TEST_RESTART_AT"].partition(":")
    if kind == "SQL":
        return statement.lstrip().upper().startswith(what.upper())
    rows = parameters if isinstance(parameters, list | tuple) else [parameters]
    writes_attr = statement.lstrip().upper().startswith(("INSERT INTO TRIAL_USER_ATTRIBUTES", "UPDATE TRIAL_USER"))
    return writes_attr and any(isinstance(r, dict) and r.get("key") == what for r in rows)


def restart_first(_conn: Any, _cursor: Any, statement: str, parameters: Any, *_rest: Any) -> None:
    if _done or not _matches(statement, parameters):
        return
    _done.append(statement)
    version, name = os.environ["TUNER_TEST_CLUSTER"].split()
    subprocess.run(["pg_ctlcluster", version, name, "restart"], check=True, capture_output=True, timeout=120)
    print(f"[test] PostgreSQL restarted before: {statement.split('(')[0].strip()}", flush=True)


if __name__ == "__main__":
    from tuner.cli import main

    sa.event.listen(Engine, "before_cursor_execute", restart_first)
    sys.argv = ["tuner", *sys.argv[1:]]
    main()
