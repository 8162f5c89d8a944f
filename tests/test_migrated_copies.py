"""The migrated PostgreSQL schemas the fixtures hand out are replays of one real migration
(testing.stores.migrate_pg_schema): a replayed schema must be what ``schema.upgrade`` makes of an empty one,
object for object, down to the functions' bodies and the rows the migrations write.
"""

from __future__ import annotations

from typing import Any

import sqlalchemy as sa

from fencing.engines import make_engine
from reservations import schema
from testing.stores import own_pg_schema, schema_of

# What the catalog says about a schema's objects; the schema's own name is replaced by a placeholder, so
# that two schemas compare by content.
_CATALOG = {
    "relations": """
        SELECT c.relname, c.relkind, c.relpersistence, obj_description(c.oid, 'pg_class')
        FROM pg_class c WHERE c.relnamespace = :ns ORDER BY 1""",
    "columns": """
        SELECT c.relname, a.attnum, a.attname, format_type(a.atttypid, a.atttypmod), a.attnotnull,
               pg_get_expr(d.adbin, d.adrelid), a.attidentity, a.attgenerated,
               col_description(c.oid, a.attnum)
        FROM pg_attribute a JOIN pg_class c ON c.oid = a.attrelid
        LEFT JOIN pg_attrdef d ON d.adrelid = a.attrelid AND d.adnum = a.attnum
        WHERE c.relnamespace = :ns AND a.attnum > 0 AND NOT a.attisdropped ORDER BY 1, 2""",
    "constraints": """
        SELECT c.relname, k.conname, k.contype, pg_get_constraintdef(k.oid)
        FROM pg_constraint k JOIN pg_class c ON c.oid = k.conrelid
        WHERE k.connamespace = :ns ORDER BY 1, 2""",
    "indexes": """
        SELECT i.relname, pg_get_indexdef(x.indexrelid)
        FROM pg_index x JOIN pg_class i ON i.oid = x.indexrelid
        WHERE i.relnamespace = :ns ORDER BY 1""",
    "triggers": """
        SELECT c.relname, t.tgname, t.tgenabled, pg_get_triggerdef(t.oid)
        FROM pg_trigger t JOIN pg_class c ON c.oid = t.tgrelid
        WHERE c.relnamespace = :ns AND NOT t.tgisinternal ORDER BY 1, 2""",
    "functions": """
        SELECT p.proname, pg_get_function_identity_arguments(p.oid), pg_get_functiondef(p.oid)
        FROM pg_proc p WHERE p.pronamespace = :ns ORDER BY 1, 2""",
    "sequences": """
        SELECT c.relname, s.seqtypid::regtype::text, s.seqstart, s.seqincrement, s.seqmax, s.seqmin,
               s.seqcache, s.seqcycle
        FROM pg_sequence s JOIN pg_class c ON c.oid = s.seqrelid
        WHERE c.relnamespace = :ns ORDER BY 1""",
    "views": "SELECT viewname, definition FROM pg_views WHERE schemaname = :name ORDER BY 1",
    "types": """
        SELECT t.typname, t.typtype FROM pg_type t
        WHERE t.typnamespace = :ns AND t.typtype NOT IN ('c', 'b') ORDER BY 1""",
}
_ROWS = {
    "alembic_version": "SELECT version_num FROM alembic_version ORDER BY 1",
    "schema_compatibility": "SELECT revision, oldest_code FROM schema_compatibility ORDER BY 1",
}


def _catalog(url: str) -> dict[str, list[tuple[Any, ...]]]:
    name = schema_of(url)
    engine = make_engine(url)
    try:
        with engine.connect() as conn:
            ns = conn.execute(
                sa.text("SELECT oid FROM pg_namespace WHERE nspname = :n"), {"n": name}
            ).scalar()
            found = {
                part: [
                    tuple(str(v).replace(name, "<schema>") if isinstance(v, str) else v for v in row)
                    for row in conn.execute(sa.text(query), {"ns": ns, "name": name})
                ]
                for part, query in _CATALOG.items()
            }
            for table, query in _ROWS.items():
                found[table] = [tuple(row) for row in conn.execute(sa.text(query))]
            # Each relation's row count: the migrations leave no data but the rows above.
            for relname, relkind, *_ in found["relations"]:
                if relkind == "r":
                    count = conn.execute(sa.text(f'SELECT count(*) FROM "{relname}"')).scalar()  # noqa: S608
                    found.setdefault("row_counts", []).append((relname, count))
            return found
    finally:
        engine.dispose()


def test_a_replayed_schema_is_the_migrated_schema() -> None:
    with own_pg_schema() as migrated, own_pg_schema(migrated=True) as replayed:
        schema.upgrade(migrated)
        expected, copied = _catalog(migrated), _catalog(replayed)
        assert schema.fit(replayed).ok
    assert copied == expected
    # The comparison covered what matters: the triggers and their functions, and the revision rows.
    assert expected["alembic_version"] == [(schema.head(),)]
    assert expected["schema_compatibility"] and expected["triggers"] and expected["functions"]
    assert any("RAISE EXCEPTION '" in body and "%" in body for _, _, body in expected["functions"])


def test_a_fixture_migrated_schema_is_at_head_and_fit(inventory_url: str) -> None:
    assert schema.current(inventory_url) == schema.head()
    assert schema.fit(inventory_url).ok
