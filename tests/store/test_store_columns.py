"""A trial's detail is declared once, `TrialFields` (what a study writes), and a request once, `RequestRecord`:
the store's tables (`TrialRow`, `RequestRow`), the detail view (`TrialDetail`) and the Alembic migrations are held
to them here, names, types and nullability. Each check is itself tested on a made-up table where it fails."""

from __future__ import annotations

import dataclasses
import datetime as dt
import types
import typing
from collections.abc import Mapping
from typing import Any, TypedDict

import sqlalchemy as sa
from alembic.autogenerate import compare_metadata
from alembic.runtime.migration import MigrationContext

from tuner.load.results import RequestRecord
from tuner.store.migrate import VERSION_TABLE, upgrade
from tuner.store.models import Base, RequestRow, TrialRow
from tuner.store.store import TrialDetail, TrialFields

# The trial row's key and its timestamps: the store's, not what a study writes.
TRIAL_KEYS = {"study_name": str, "trial_number": int}
TIMESTAMPS = {"created_at": dt.datetime, "updated_at": dt.datetime}
# The request row's id and where it belongs (the trial, the capacity search's step).
REQUEST_KEYS = {"id": int, "study_name": str, "trial_number": int, "step": int}
# RequestRecord's fields no column holds, and why a re-score is exact without them.
NOT_STORED = {"turn": "a conversation's turn number: no score reads it"}


def _kind(hint: Any) -> tuple[str, bool]:
    """(the column kind a type needs, whether it may be None): a dict or list is JSON, the rest its Python type."""
    args = typing.get_args(hint)
    nullable = (
        type(None) in args if isinstance(hint, types.UnionType) or typing.get_origin(hint) is typing.Union else False
    )
    inner = next((a for a in args if a is not type(None)), hint) if nullable else hint
    base = typing.get_origin(inner) or inner
    if base in (dict, list):
        return "json", nullable
    if typing.get_origin(inner) is typing.Literal:
        return "str", nullable
    return getattr(base, "__name__", str(base)), nullable


def _column_kind(column: sa.Column[Any]) -> tuple[str, bool]:
    if isinstance(column.type, sa.JSON):
        return "json", bool(column.nullable)
    return column.type.python_type.__name__, bool(column.nullable)


def column_mismatches(declared: Mapping[str, Any], table: sa.Table) -> list[str]:
    """Where `table`'s columns and the declared fields (name -> type) differ: a name on one side only, a column of
    another kind, a nullable column for a field that cannot be None or the other way round."""
    columns = {c.name: c for c in table.columns}
    out = [f"{table.name}: no column for {name}" for name in declared if name not in columns]
    out += [f"{table.name}.{name}: a column no field declares" for name in columns if name not in declared]
    for name, hint in declared.items():
        if name in columns and _kind(hint) != _column_kind(columns[name]):
            out.append(f"{table.name}.{name}: declared {_kind(hint)}, the column is {_column_kind(columns[name])}")
    return out


def migration_drift(metadata: sa.MetaData, url: str = "sqlite://") -> list[str]:
    """What the migrations, applied to an empty database (SQLite in memory unless `url` names one), leave different
    from `metadata`'s tables (a float and a double are one column type to SQLite and PostgreSQL alike)."""

    def compare_type(context: Any, inspected: Any, meta: Any, inspected_type: Any, meta_type: Any) -> bool | None:
        return False if isinstance(inspected_type, sa.Float) and isinstance(meta_type, sa.Float) else None

    engine = sa.create_engine(url)
    try:
        upgrade(engine)
        with engine.connect() as conn:
            opts = {"compare_type": compare_type, "version_table": VERSION_TABLE}
            return [repr(diff) for diff in compare_metadata(MigrationContext.configure(conn, opts=opts), metadata)]
    finally:
        engine.dispose()


def _hints(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)


def test_the_trial_row_holds_what_a_study_writes() -> None:
    declared = {**TRIAL_KEYS, **_hints(TrialFields), **TIMESTAMPS}
    assert column_mismatches(declared, TrialRow.__table__) == []  # type: ignore[arg-type]


def detail_mismatches(detail: Any, fields: type) -> list[str]:
    """Where a detail view (a dataclass) does not read what `fields` (a TypedDict) declares: its fields must be the
    key (study, number), every declared field in order with the same type, then the timestamps."""
    names = [f.name for f in dataclasses.fields(detail)]
    want = ["study", "number", *_hints(fields), *TIMESTAMPS]
    out = [f"{detail.__name__}: fields {names}, declared {want}"] if names != want else []
    hints = _hints(detail)
    out += [
        f"{detail.__name__}.{name}: {hints.get(name)} where {fields.__name__} declares {hint}"
        for name, hint in _hints(fields).items()
        if name in hints and hints[name] != hint
    ]
    return out


def test_the_trial_detail_reads_every_field_a_study_writes() -> None:
    assert detail_mismatches(TrialDetail, TrialFields) == []


def test_the_request_row_holds_a_request_record() -> None:
    fields = {name: hint for name, hint in _hints(RequestRecord).items() if name not in NOT_STORED}
    assert column_mismatches({**REQUEST_KEYS, **fields}, RequestRow.__table__) == []  # type: ignore[arg-type]


def test_the_migrations_build_the_tables_the_models_declare(storage_url: str) -> None:
    assert migration_drift(Base.metadata, storage_url) == []


class _Fields(TypedDict, total=False):
    outcome: str
    note: str | None


def test_the_column_check_fails_on_a_table_out_of_step() -> None:
    meta = sa.MetaData()
    table = sa.Table(
        "t",
        meta,
        sa.Column("outcome", sa.String(8), nullable=True),
        sa.Column("extra", sa.Integer),
        sa.Column("x", sa.JSON, nullable=False),
    )
    assert column_mismatches({**_hints(_Fields), "x": dict[str, Any]}, table) == [
        "t: no column for note",
        "t.extra: a column no field declares",
        "t.outcome: declared ('str', False), the column is ('str', True)",
    ]
    in_step = sa.Table("u", meta, sa.Column("outcome", sa.String(8), nullable=False), sa.Column("note", sa.Text))
    assert column_mismatches(_hints(_Fields), in_step) == []


def test_the_migration_check_fails_on_a_column_no_migration_adds() -> None:
    meta = sa.MetaData()
    for table in Base.metadata.tables.values():
        table.to_metadata(meta)
    sa.Table("tuner_trial", meta, sa.Column("new_figure", sa.Float, nullable=True), extend_existing=True)
    drift = migration_drift(meta)
    assert len(drift) == 1 and "add_column" in drift[0] and "new_figure" in drift[0], drift


@dataclasses.dataclass
class _Detail:
    study: str
    number: int
    outcome: int  # declared str
    created_at: dt.datetime
    updated_at: dt.datetime


def test_the_detail_check_fails_on_a_view_out_of_step() -> None:
    assert detail_mismatches(_Detail, _Fields) == [
        "_Detail: fields ['study', 'number', 'outcome', 'created_at', 'updated_at'], declared ['study', 'number', "
        "'outcome', 'note', 'created_at', 'updated_at']",
        "_Detail.outcome: <class 'int'> where _Fields declares <class 'str'>",
    ]
