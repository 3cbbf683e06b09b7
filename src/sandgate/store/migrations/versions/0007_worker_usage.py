"""worker usage: what each worker's live sandboxes hold, kept by triggers

Revision ID: 0007
Revises: 0006
Create Date: 2026-12-05 00:00:00

Only adds: the `worker_usage` table (one row per worker that ever held a sandbox: how many
live sandboxes, pending or running, and the memory_mb and disk_mb they were granted),
triggers on `sandboxes` that keep it in the transaction of every insert, state move,
re-assignment and delete, and a backfill from the sandboxes already there.

Why: a create read the worker's usage twice (placement, then the insert's exact check) as
sums over every sandbox the worker holds, which grew with them (0.8 ms each at 1,000 on
SQLite). The triggers make both reads one row, whoever writes: an instance of the previous
release keeps the table exact too, since it is the database that keeps it.

A granted value that is not a JSON number counts 0, and a fractional one its integer part,
as `core.placement.usage` counts them; a JSON boolean counts 0 here where `usage` would count
`true` as 1 (the API never stores one: both are integers with a lower bound).
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0007"
down_revision = "0006"
branch_labels = None
depends_on = None

LIVE = "('pending', 'running')"  # store.sql.rows.LIVE_STATES, as of this revision
BUDGETED = ("memory_mb", "disk_mb")  # core.placement.BUDGETED, as of this revision


def _sqlite_granted(row: str, name: str) -> str:
    return (
        f"(CASE WHEN json_type({row}.resources, '$.{name}') IN ('integer', 'real') "
        f"THEN CAST(json_extract({row}.resources, '$.{name}') AS INTEGER) ELSE 0 END)"
    )


def _pg_granted(row: str, name: str) -> str:
    return (
        f"(CASE WHEN json_typeof({row}.resources -> '{name}') = 'number' "
        f"THEN trunc(({row}.resources ->> '{name}')::numeric)::bigint ELSE 0 END)"
    )


def _sqlite_triggers() -> list[str]:
    def add(row: str, where: str) -> str:
        granted = ", ".join(_sqlite_granted(row, n) for n in BUDGETED)
        return (
            f"INSERT INTO worker_usage (worker, live, {', '.join(BUDGETED)}) "
            f"SELECT {row}.worker, 1, {granted} WHERE {where} "
            "ON CONFLICT (worker) DO UPDATE SET live = live + 1, "
            + ", ".join(f"{n} = {n} + excluded.{n}" for n in BUDGETED)
            + ";"
        )

    def take(row: str) -> str:
        return (
            "UPDATE worker_usage SET live = live - 1, "
            + ", ".join(f"{n} = {n} - {_sqlite_granted(row, n)}" for n in BUDGETED)
            + f" WHERE worker = {row}.worker AND {row}.state IN {LIVE};"
        )

    new_live = f"NEW.worker IS NOT NULL AND NEW.state IN {LIVE}"
    old_live = f"OLD.worker IS NOT NULL AND OLD.state IN {LIVE}"
    # what the row adds changed (pending -> running on the same worker changes nothing)
    changed = (
        f"({old_live}) <> ({new_live}) OR OLD.worker IS NOT NEW.worker "
        "OR OLD.resources IS NOT NEW.resources"
    )
    return [
        "CREATE TRIGGER sandboxes_worker_usage_insert AFTER INSERT ON sandboxes "
        f"FOR EACH ROW WHEN {new_live} BEGIN {add('NEW', '1')} END",
        "CREATE TRIGGER sandboxes_worker_usage_update "
        "AFTER UPDATE OF state, worker, resources ON sandboxes "
        f"FOR EACH ROW WHEN ({old_live} OR {new_live}) AND ({changed}) "
        f"BEGIN {take('OLD')} {add('NEW', new_live)} END",
        "CREATE TRIGGER sandboxes_worker_usage_delete AFTER DELETE ON sandboxes "
        f"FOR EACH ROW WHEN {old_live} BEGIN {take('OLD')} END",
    ]


def _pg_triggers() -> list[str]:
    taken = ", ".join(f"{n} = {n} - {_pg_granted('OLD', n)}" for n in BUDGETED)
    added = ", ".join(_pg_granted("NEW", n) for n in BUDGETED)
    summed = ", ".join(f"{n} = u.{n} + excluded.{n}" for n in BUDGETED)
    columns = ", ".join(BUDGETED)
    # A sandbox moved between two workers (a pending one placed again) locks both rows:
    # always the smaller name first, so that two moves the opposite ways cannot deadlock.
    function = f"""
CREATE OR REPLACE FUNCTION sandgate_worker_usage() RETURNS trigger LANGUAGE plpgsql AS $$
DECLARE
    side text;
BEGIN
    FOREACH side IN ARRAY CASE
        WHEN TG_OP = 'UPDATE' AND NEW.worker < OLD.worker THEN ARRAY['new', 'old']
        ELSE ARRAY['old', 'new'] END
    LOOP
        IF side = 'old' AND TG_OP <> 'INSERT' THEN
            IF OLD.worker IS NOT NULL AND OLD.state IN {LIVE} THEN
                UPDATE worker_usage SET live = live - 1, {taken} WHERE worker = OLD.worker;
            END IF;
        ELSIF side = 'new' AND TG_OP <> 'DELETE' THEN
            IF NEW.worker IS NOT NULL AND NEW.state IN {LIVE} THEN
                INSERT INTO worker_usage AS u (worker, live, {columns})
                VALUES (NEW.worker, 1, {added})
                ON CONFLICT (worker) DO UPDATE SET live = u.live + 1, {summed};
            END IF;
        END IF;
    END LOOP;
    RETURN NULL;
END
$$"""
    old_live = f"OLD.worker IS NOT NULL AND OLD.state IN {LIVE}"
    new_live = f"NEW.worker IS NOT NULL AND NEW.state IN {LIVE}"
    changed = (
        f"({old_live}) <> ({new_live}) OR OLD.worker IS DISTINCT FROM NEW.worker "
        "OR OLD.resources::text IS DISTINCT FROM NEW.resources::text"
    )
    run = "FOR EACH ROW WHEN ({}) EXECUTE FUNCTION sandgate_worker_usage()"
    return [
        function,
        "CREATE TRIGGER sandboxes_worker_usage_insert AFTER INSERT ON sandboxes "
        + run.format(new_live),
        "CREATE TRIGGER sandboxes_worker_usage_update "
        "AFTER UPDATE OF state, worker, resources ON sandboxes " + run.format(changed),
        "CREATE TRIGGER sandboxes_worker_usage_delete AFTER DELETE ON sandboxes "
        + run.format(old_live),
    ]


def upgrade() -> None:
    op.create_table(
        "worker_usage",
        sa.Column("worker", sa.Text(), nullable=False),
        sa.Column("live", sa.BigInteger(), nullable=False, server_default=sa.text("0")),
        sa.Column("memory_mb", sa.BigInteger(), nullable=False, server_default=sa.text("0")),
        sa.Column("disk_mb", sa.BigInteger(), nullable=False, server_default=sa.text("0")),
        sa.PrimaryKeyConstraint("worker", name="pk_worker_usage"),
    )
    sqlite = op.get_context().dialect.name == "sqlite"
    # The triggers first: on PostgreSQL creating one locks `sandboxes` against writes until
    # this migration commits, so the backfill below sums exactly what the triggers then
    # keep (an instance still serving waits for it; on SQLite there is one writer anyway).
    for statement in _sqlite_triggers() if sqlite else _pg_triggers():
        op.execute(statement)
    granted = _sqlite_granted if sqlite else _pg_granted
    op.execute(
        f"INSERT INTO worker_usage (worker, live, {', '.join(BUDGETED)}) "
        "SELECT s.worker, count(*), "
        + ", ".join(f"coalesce(sum({granted('s', n)}), 0)" for n in BUDGETED)
        + f" FROM sandboxes AS s WHERE s.worker IS NOT NULL AND s.state IN {LIVE}"
        " GROUP BY s.worker"
    )


def downgrade() -> None:
    # Migrations only add (DESIGN.md): there is no downgrade that drops data.
    raise NotImplementedError("sandgate migrations only add; restore a backup instead")
