"""The project's own tables (SQLAlchemy + Alembic) beside the Optuna study: trial detail, per-request records.

store = open_store("sqlite:///study.db")
store.trial_detail("my-study", 3)      # -> TrialDetail | None
store.request_records("my-study", 3)   # -> list[RequestRecord]
"""

from tuner.store.engine import make_engine, safe_url
from tuner.store.migrate import MIGRATIONS_DIR, VERSION_TABLE, current_revision, head_revision, upgrade
from tuner.store.store import Store, TrialDetail, flag_key, open_store

__all__ = [
    "MIGRATIONS_DIR",
    "VERSION_TABLE",
    "Store",
    "TrialDetail",
    "current_revision",
    "flag_key",
    "head_revision",
    "make_engine",
    "open_store",
    "safe_url",
    "upgrade",
]
