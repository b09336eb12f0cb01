"""Bring the project's tables to the newest schema: idempotent, safe when several workers start at once."""

from __future__ import annotations

import os

import sqlalchemy as sa
from alembic.config import Config
from alembic.runtime.migration import MigrationContext
from alembic.script import ScriptDirectory
from sqlalchemy.engine import Engine
from sqlalchemy.exc import SQLAlchemyError

from alembic import command
from tuner.errors import StorageError
from tuner.store.engine import safe_url

MIGRATIONS_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "migrations")
VERSION_TABLE = "tuner_alembic_version"
# Any constant: the advisory lock that serialises two workers' upgrades of one PostgreSQL database.
_PG_LOCK_KEY = 0x7475_6E65


def alembic_config() -> Config:
    cfg = Config()
    cfg.set_main_option("script_location", MIGRATIONS_DIR)
    return cfg


def head_revision() -> str:
    head = ScriptDirectory.from_config(alembic_config()).get_current_head()
    assert head is not None
    return head


def current_revision(engine: Engine) -> str | None:
    with engine.connect() as conn:
        return MigrationContext.configure(conn, opts={"version_table": VERSION_TABLE}).get_current_revision()


def upgrade(engine: Engine, revision: str = "head") -> str | None:
    """Migrate to `revision`; returns the revision now in force."""
    cfg = alembic_config()
    try:
        with engine.begin() as conn:
            if conn.dialect.name == "postgresql":
                conn.execute(sa.text("SELECT pg_advisory_xact_lock(:k)"), {"k": _PG_LOCK_KEY})
            cfg.attributes["connection"] = conn
            command.upgrade(cfg, revision)
        return current_revision(engine)
    except SQLAlchemyError as e:
        cause = str(getattr(e, "orig", None) or e).strip().splitlines()[0]
        raise StorageError(f"cannot migrate the tuner tables in {safe_url(str(engine.url))}: {cause}") from None


__all__ = ["MIGRATIONS_DIR", "VERSION_TABLE", "alembic_config", "current_revision", "head_revision", "upgrade"]
