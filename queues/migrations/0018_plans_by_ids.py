"""The hot path's statements that find a batch's rows by their ids reach them by
those ids, whatever the tables' statistics when their plan was made (issue #24).

A pinned function's plan is made at its first run on a connection: on a relay
just started, or on a database not yet analyzed, while the tables look empty.
Each statement below names a state in its WHERE (``m.state = 'queued'``), which
implies the predicate of a partial index (``message_live_expiry``: every
message not done), so the planner could take that index, read whole, for the
batch's short list, and it did: the categorizer's check for recipients sent
back read every message not done and every recipient once submitted at every
batch (2.5 ms a batch after 8,000 messages, a tenth of PostgreSQL's time in the
bench, and growing with the queue's past: a partial index keeps the entries of
the rows that left it until VACUUM). Written as a PL/pgSQL variable, a state
is a parameter of the generic plan, which implies no index's predicate: the
rows are reached by the ids (the primary key, or ``message_id``), the state
checked on each row found.

The same for the categorizer's fence (``MessageFlow.queue_owned``: it read
``message_categorizing_lease`` whole) and its placement
(``RecipientFlow.place_many``: ``recipient_submitted`` whole), until now
statements planned at each run and so pinned here as functions, and for a
round's record of its deliveries (``recipient_active_lease`` whole).
``tests/test_hot_paths.py`` fails on a pinned statement that reads an index
without an index condition.
"""

import importlib

from django.db import migrations

PINNED = importlib.import_module("queues.migrations.0014_pinned_plans")
DELIVERED = importlib.import_module("queues.migrations.0015_delivered_attempts_are_events")

RESUBMIT = "queues_resubmit_if_recipients_submitted(bigint[], timestamptz)"
RECORD = DELIVERED.SIGNATURE


def _states(*words: str) -> str:
    """The DECLARE of the state words a function checks, as variables (so
    parameters of the generic plan, above): ``v_queued varchar := 'queued';``."""
    lines = "".join(f"\n    v_{word} varchar := '{word}';" for word in words)
    return "DECLARE" + lines


def _edited(sql: str, edits: list[tuple[str, str]]) -> str:
    for old, new in edits:
        assert sql.count(old) == 1, old
        sql = sql.replace(old, new)
    return sql


def _resubmit() -> str:
    return _edited(
        PINNED.original(RESUBMIT),
        [
            ("DECLARE\n    n integer;", f"{_states('queued', 'submitted')}\n    n integer;"),
            ("m.state = 'queued'", "m.state = v_queued"),
            ("r.state = 'submitted')", "r.state = v_submitted)"),
        ],
    )


def _record() -> str:
    return _edited(
        DELIVERED._current(),
        [
            ("AS $fn$\nBEGIN", f"AS $fn$\n{_states('active', 'done')}\nBEGIN"),
            ("t.state = 'active' AND", "t.state = v_active AND"),
            ("m.state <> 'done' AND", "m.state <> v_done AND"),
        ],
    )


QUEUE_OWNED = "queues_queue_owned(bigint[], text)"
PLACE = "queues_place_recipients(bigint[], bigint[], bigint[], timestamptz)"

NEW = [
    (
        QUEUE_OWNED,
        f"""
CREATE OR REPLACE FUNCTION queues_queue_owned(p_ids bigint[], p_owner text)
RETURNS TABLE (o_id bigint)
LANGUAGE plpgsql {PINNED.PINNED} AS $fn$
{_states("categorizing")}
BEGIN
-- The categorizer's write fence: those of p_ids that p_owner still holds become
-- queued, locked until the transaction ends; returns their ids.
RETURN QUERY
UPDATE queues_message AS m SET state = 'queued', lease_owner = '', lease_until = NULL,
    crash_count = 0, isolate = false
WHERE m.id = ANY(p_ids) AND m.state = v_categorizing AND m.lease_owner = p_owner
RETURNING m.id;
END $fn$""",
    ),
    (
        PLACE,
        f"""
CREATE OR REPLACE FUNCTION queues_place_recipients(
    p_ids bigint[], p_queues bigint[], p_links bigint[], p_now timestamptz)
RETURNS TABLE (o_id bigint)
LANGUAGE plpgsql {PINNED.PINNED} AS $fn$
{_states("submitted")}
BEGIN
-- The submitted recipients of p_ids routed, each to its queue and link (the
-- same positions of the three arrays): waiting in their queue, due now, their
-- routing written; returns the ids placed (an expiry or an operator may have
-- finished some meanwhile).
RETURN QUERY
UPDATE queues_recipient AS r SET queue_id = v.queue_id, state = 'queued',
    next_attempt_at = p_now, routed_at = p_now, routed_queue_id = v.queue_id,
    routed_link_id = v.link_id
FROM unnest(p_ids, p_queues, p_links) AS v(id, queue_id, link_id)
WHERE r.id = v.id AND r.state = v_submitted
RETURNING r.id;
END $fn$""",
    ),
]


def create(apps, schema_editor) -> None:
    if schema_editor.connection.vendor != "postgresql":
        return
    schema_editor.execute(_resubmit())
    schema_editor.execute(_record())
    for _, sql in NEW:
        schema_editor.execute(sql)


def restore(apps, schema_editor) -> None:
    if schema_editor.connection.vendor != "postgresql":
        return
    schema_editor.execute(PINNED.original(RESUBMIT))
    schema_editor.execute(DELIVERED._current())
    for signature, _ in NEW:
        schema_editor.execute(f"DROP FUNCTION IF EXISTS {signature}")


class Migration(migrations.Migration):
    dependencies = [
        ("queues", "0017_routed_recipients_are_events"),
    ]

    operations = [migrations.RunPython(create, restore)]
