"""Migrations only add, and schema.py never drifts from what the migrations build.

Why: `sandgate migrate` runs before new instances start while old ones keep serving
(DESIGN.md, "migrations only add"). Every migration must leave the previous release
working, so no migration may drop, rename or narrow anything, and no added column may
be NOT NULL without a server default (old code would fail to insert rows).

The rule is checked on the source of every file in `migrations/versions/`, upgrade
and downgrade alike (a destructive downgrade is one command away from data loss).
"""

from __future__ import annotations

import ast
import asyncio
import re
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from alembic.script import ScriptDirectory
from sqlalchemy import Connection, inspect, make_url, pool
from sqlalchemy.ext.asyncio import create_async_engine

from sandgate.store import schema
from sandgate.store.migrate import MIGRATIONS_DIR, alembic_config, async_url, head_revision, upgrade

VERSIONS_DIR = MIGRATIONS_DIR / "versions"
FORBIDDEN_PREFIXES = ("drop_", "rename_")
FORBIDDEN_ALTER_KWARGS = ("type_", "new_column_name")
DESTRUCTIVE_SQL = [
    re.compile(p)
    for p in (
        r"\bdrop\b",
        r"\brename\b",
        r"\btruncate\b",
        r"\bdelete\s+from\b",
        r"\bset\s+not\s+null\b",
        r"\balter\s+column\s+\S+\s+(set\s+data\s+)?type\b",
    )
]


def _call_name(node: ast.Call) -> str | None:
    if isinstance(node.func, ast.Attribute):
        return node.func.attr
    if isinstance(node.func, ast.Name):
        return node.func.id
    return None


def _kwarg(node: ast.Call, name: str) -> ast.expr | None:
    for kw in node.keywords:
        if kw.arg == name:
            return kw.value
    return None


def _is_true(node: ast.expr | None) -> bool:
    return isinstance(node, ast.Constant) and node.value is True


def violations(source: str, filename: str = "<migration>") -> list[str]:
    """Every way `source` breaks the only-add rule, as readable messages."""
    found: list[str] = []
    tree = ast.parse(source, filename=filename)
    for node in ast.walk(tree):
        if not isinstance(node, ast.Call):
            continue
        name = _call_name(node)
        if name is None:
            continue
        where = f"{filename}:{node.lineno}"
        # op.drop_table, op.drop_column, op.drop_index, op.drop_constraint,
        # op.rename_table, batch_op.drop_column, ... on any receiver
        if isinstance(node.func, ast.Attribute) and name.startswith(FORBIDDEN_PREFIXES):
            found.append(f"{where}: {name}() removes or renames something")
        if name == "alter_column":
            for kw in FORBIDDEN_ALTER_KWARGS:
                if _kwarg(node, kw) is not None:
                    found.append(f"{where}: alter_column({kw}=...) changes an existing column")
            nullable = _kwarg(node, "nullable")
            if nullable is not None and not _is_true(nullable):
                found.append(f"{where}: alter_column(nullable=...) may make a column NOT NULL")
        if name == "add_column":
            for arg in [*node.args, *(kw.value for kw in node.keywords)]:
                if isinstance(arg, ast.Call) and _call_name(arg) == "Column":
                    nullable = _kwarg(arg, "nullable")
                    has_default = _kwarg(arg, "server_default") is not None
                    if nullable is not None and not _is_true(nullable) and not has_default:
                        found.append(f"{where}: added column is NOT NULL without a server_default")
        if name == "execute":
            for arg in node.args:
                if isinstance(arg, ast.Constant) and isinstance(arg.value, str):
                    sql = arg.value.lower()
                    if any(pattern.search(sql) for pattern in DESTRUCTIVE_SQL):
                        found.append(f"{where}: raw SQL looks destructive: {arg.value!r}")
    return found


def migration_files() -> list[Path]:
    files = sorted(p for p in VERSIONS_DIR.glob("*.py") if p.name != "__init__.py")
    assert files, f"no migrations in {VERSIONS_DIR}"
    return files


@pytest.mark.parametrize("path", migration_files(), ids=lambda p: p.name)
def test_migration_only_adds(path: Path) -> None:
    assert violations(path.read_text(encoding="utf-8"), path.name) == []


@pytest.mark.parametrize(
    "source",
    [
        "op.drop_table('sandboxes')",
        "op.drop_column('sandboxes', 'env')",
        "op.drop_index('ix_jobs_sandbox_name', table_name='jobs')",
        "op.drop_constraint('uq_tenants_name', 'tenants')",
        "op.rename_table('jobs', 'tasks')",
        "with op.batch_alter_table('jobs') as b:\n    b.drop_column('error')",
        "op.alter_column('jobs', 'error', type_=sa.String(10))",
        "op.alter_column('jobs', 'error', new_column_name='err')",
        "op.alter_column('jobs', 'error', nullable=False)",
        "op.add_column('jobs', sa.Column('x', sa.Text(), nullable=False))",
        "op.execute('DROP TABLE jobs')",
        "op.execute('ALTER TABLE jobs ALTER COLUMN error TYPE varchar(3)')",
    ],
)
def test_checker_catches_destructive_operations(source: str) -> None:
    assert violations(source) != []


@pytest.mark.parametrize(
    "source",
    [
        "op.create_table('t', sa.Column('id', sa.Text(), nullable=False))",
        "op.add_column('jobs', sa.Column('x', sa.Text(), nullable=True))",
        "op.add_column('jobs', sa.Column('n', sa.Integer(), nullable=False,"
        " server_default=sa.text('0')))",
        "op.create_index('ix_jobs_x', 'jobs', ['x'])",
        "op.alter_column('jobs', 'error', nullable=True)",
        "op.alter_column('jobs', 'error', comment='why it failed')",
        "op.execute('CREATE TYPE mood AS ENUM (1)')",
        "op.execute('CREATE INDEX CONCURRENTLY ix ON jobs (dropped_at)')",
    ],
)
def test_checker_allows_additive_operations(source: str) -> None:
    assert violations(source) == []


def test_revisions_form_one_line_ending_at_head() -> None:
    script = ScriptDirectory.from_config(alembic_config())
    heads = script.get_heads()
    assert heads == [head_revision()]
    revisions = list(script.walk_revisions())
    assert len(revisions) == len(migration_files())
    assert revisions[-1].revision == "0001"
    assert revisions[-1].down_revision is None
    for rev in revisions:
        assert isinstance(rev.down_revision, str | None), "no merges or branches"


# ----------------------------------------------------------------------- drift


def _describe(connection: Connection) -> dict[str, Any]:
    """Everything about the schema that must match, in a comparable form."""
    insp = inspect(connection)
    dialect = connection.dialect
    tables: dict[str, Any] = {}
    for table in sorted(insp.get_table_names()):
        if table == "alembic_version":
            continue
        columns = [
            (
                col["name"],
                col["type"].compile(dialect=dialect),
                col["nullable"],
                None if col.get("default") is None else str(col["default"]).strip("()'\""),
            )
            for col in insp.get_columns(table)
        ]
        pk = insp.get_pk_constraint(table)
        tables[table] = {
            "columns": columns,
            "pk": (pk.get("name"), tuple(pk["constrained_columns"])),
            "indexes": sorted(
                (ix["name"], tuple(ix["column_names"]), bool(ix["unique"]))
                for ix in insp.get_indexes(table)
                if not ix.get("duplicates_constraint")
            ),
            "unique": sorted(
                (uq["name"], tuple(uq["column_names"])) for uq in insp.get_unique_constraints(table)
            ),
            "foreign_keys": sorted(
                (
                    fk["name"],
                    tuple(fk["constrained_columns"]),
                    fk["referred_table"],
                    tuple(fk["referred_columns"]),
                )
                for fk in insp.get_foreign_keys(table)
            ),
        }
    return tables


async def _describe_migrated(url: str) -> dict[str, Any]:
    await upgrade(url)
    engine = create_async_engine(async_url(url), poolclass=pool.NullPool)
    try:
        async with engine.connect() as conn:
            return await conn.run_sync(_describe)
    finally:
        await engine.dispose()


async def _describe_create_all(url: str) -> dict[str, Any]:
    engine = create_async_engine(async_url(url), poolclass=pool.NullPool)
    try:
        async with engine.begin() as conn:
            await conn.run_sync(schema.metadata.create_all)
        async with engine.connect() as conn:
            return await conn.run_sync(_describe)
    finally:
        await engine.dispose()


def _assert_same_schema(migrated: dict[str, Any], declared: dict[str, Any]) -> None:
    assert set(migrated) == set(schema.metadata.tables)
    assert set(migrated) == set(declared)
    for table in declared:
        assert migrated[table] == declared[table], f"table {table} drifted"


def test_sqlite_migrations_build_exactly_schema_py(tmp_path: Path) -> None:
    migrated = asyncio.run(_describe_migrated(f"sqlite:///{tmp_path / 'migrated.db'}"))
    declared = asyncio.run(_describe_create_all(f"sqlite:///{tmp_path / 'declared.db'}"))
    _assert_same_schema(migrated, declared)


@pytest.fixture
def two_pg_databases(pg_dsn: str) -> Iterator[tuple[str, str]]:
    import asyncpg  # type: ignore[import-untyped]

    admin = make_url(pg_dsn).set(drivername="postgresql")
    names = [f"sandgate_drift_{uuid.uuid4().hex[:10]}" for _ in range(2)]

    async def run(*statements: str) -> None:
        conn = await asyncpg.connect(admin.render_as_string(hide_password=False))
        try:
            for statement in statements:
                await conn.execute(statement)
        finally:
            await conn.close()

    asyncio.run(run(*(f'CREATE DATABASE "{n}"' for n in names)))
    try:
        urls = [admin.set(database=n).render_as_string(hide_password=False) for n in names]
        yield urls[0], urls[1]
    finally:
        asyncio.run(run(*(f'DROP DATABASE IF EXISTS "{n}" WITH (FORCE)' for n in names)))


@pytest.mark.postgres
def test_postgres_migrations_build_exactly_schema_py(two_pg_databases: tuple[str, str]) -> None:
    migrated_url, declared_url = two_pg_databases
    migrated = asyncio.run(_describe_migrated(migrated_url))
    declared = asyncio.run(_describe_create_all(declared_url))
    _assert_same_schema(migrated, declared)
