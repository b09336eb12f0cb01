"""The real-service mechanism itself: a PostgreSQL round-trip through SQLAlchemy."""

from __future__ import annotations

import sqlalchemy as sa


def test_postgres_round_trip(postgres_url: str) -> None:
    engine = sa.create_engine(postgres_url)
    meta = sa.MetaData()
    table = sa.Table("probe", meta, sa.Column("id", sa.Integer, primary_key=True), sa.Column("note", sa.Text))
    meta.create_all(engine)
    with engine.begin() as conn:
        conn.execute(table.insert(), [{"id": 1, "note": "kv"}, {"id": 2, "note": "cache"}])
    with engine.connect() as conn:
        rows = conn.execute(sa.select(table.c.note).order_by(table.c.id)).scalars().all()
        version = conn.execute(sa.text("SHOW server_version")).scalar_one()
    engine.dispose()
    assert rows == ["kv", "cache"]
    assert int(str(version).split(".")[0]) >= 12
