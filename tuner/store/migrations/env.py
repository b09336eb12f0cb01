"""Alembic environment of the project's own tables. Run through `tuner db upgrade` (or automatically on open);
`alembic upgrade head` from the repository root works too (alembic.ini there points here)."""

from __future__ import annotations

import os

from sqlalchemy import Connection, create_engine

from alembic import context
from tuner.store.migrate import VERSION_TABLE
from tuner.store.models import Base

config = context.config
target_metadata = Base.metadata


def _run(connection: Connection) -> None:
    context.configure(
        connection=connection,
        target_metadata=target_metadata,
        # Optuna keeps its own `alembic_version` in the same database.
        version_table=VERSION_TABLE,
        # SQLite cannot ALTER most things in place: batch mode copies the table.
        render_as_batch=connection.dialect.name == "sqlite",
    )
    with context.begin_transaction():
        context.run_migrations()


def _url() -> str:
    url = context.get_x_argument(as_dictionary=True).get("url") or os.environ.get("TUNER_STORAGE_URL")
    url = url or config.get_main_option("sqlalchemy.url")
    if not url:
        raise SystemExit("no database URL: pass -x url=... or set TUNER_STORAGE_URL")
    return url


connection = config.attributes.get("connection")
if connection is not None:
    _run(connection)
elif context.is_offline_mode():
    context.configure(url=_url(), target_metadata=target_metadata, version_table=VERSION_TABLE, literal_binds=True)
    with context.begin_transaction():
        context.run_migrations()
else:
    engine = create_engine(_url())
    with engine.connect() as conn:
        _run(conn)
    engine.dispose()
