"""An SQLAlchemy engine from a storage URL, with every way that can go wrong turned into one StorageError."""

from __future__ import annotations

from typing import Any

import sqlalchemy as sa
from sqlalchemy.engine import Engine, make_url
from sqlalchemy.exc import ArgumentError, NoSuchModuleError, SQLAlchemyError

from tuner.errors import StorageError

ALLOWED = "sqlite:///PATH.db or postgresql+psycopg://USER:PASSWORD@HOST:PORT/DB"


def safe_url(url: str) -> str:
    """The URL with its password hidden: what may appear in a message or a log."""
    try:
        return make_url(url).render_as_string(hide_password=True)
    except Exception:
        return "<unparsable URL>"


def make_engine(url: str, *, check: bool = True) -> Engine:
    """An engine for `url`; with `check`, also one round trip so a wrong host or password fails here, clearly."""
    try:
        parsed = make_url(url)
    except ArgumentError:
        raise StorageError(f"storage URL {safe_url(url)!r} is not a database URL; use {ALLOWED}") from None
    # A pooled connection the database dropped (a restart, a failover) is found and replaced before use.
    kwargs: dict[str, Any] = {"pool_pre_ping": True}
    if parsed.get_backend_name() == "sqlite":
        # Optuna's storage and ours share the file: wait for the other's write rather than fail at once.
        kwargs["connect_args"] = {"timeout": 60}
    try:
        engine = sa.create_engine(parsed, **kwargs)
    except NoSuchModuleError:
        raise StorageError(
            f"storage URL {safe_url(url)!r}: unknown database kind {parsed.drivername!r}; use {ALLOWED}"
        ) from None
    except (ArgumentError, ImportError) as e:
        raise StorageError(f"storage URL {safe_url(url)!r}: {e}; use {ALLOWED}") from None
    if check:
        try:
            with engine.connect() as conn:
                conn.execute(sa.text("SELECT 1"))
        except SQLAlchemyError as e:
            engine.dispose()
            cause = str(getattr(e, "orig", None) or e).strip().splitlines()[0]
            raise StorageError(f"cannot open storage {safe_url(url)!r}: {cause}") from None
    return engine


__all__ = ["make_engine", "safe_url"]
