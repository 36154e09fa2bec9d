"""The hot path's statements that find rows, as PL/pgSQL functions whose plan is
made once per connection and pinned to the indexes (issue #24).

PostgreSQL planned each of them at every run: a delivery round's record of its
deliveries (about 0.5 ms of planning a statement, 0.04 ms a message: the
recipients' and messages' many partial indexes are each weighed against the
statement), a round's lease of the recipients it claimed, the categorizer's
claim, its read of the batch and its check for recipients sent back
meanwhile. A prepared statement plans once, but its generic plan, made while a
table is small, may scan the table after it has grown (until the next
ANALYZE). A function's own settings pin the plan instead: ``plan_cache_mode =
force_generic_plan`` (PL/pgSQL keeps the plan of each statement for the
connection's life, remade only when a table's definition or statistics
change), ``enable_seqscan = off`` and, where a batch is taken in order,
``enable_bitmapscan = off`` (the ordered index scan, never a sort of every due
row). Each statement reaches its rows by an index: by primary key, by
``message_id``, or by the partial index of the due Submission messages. (A
round's search for the due recipients of a link is left to be planned at each
run: its best join order depends on how many queues the link has and how
full they are, which a plan made once cannot know.)

The statements are the store's transitions (``queues.transitions.flow``:
``MessageFlow.claim_for_categorizer``, ``resubmit_if_recipients_submitted``,
``RecipientFlow.claim_on_link``, ``record_delivered``;
``delivery.qmgr.tasks._to_route``); their text lives here, and a change of a
table they write needs a migration that replaces the function. PostgreSQL
only (SQLite runs the ORM's statements).
"""

from django.db import migrations

PINNED = "SET plan_cache_mode = force_generic_plan SET enable_seqscan = off"

FUNCTIONS = [
    (
        "queues_claim_for_categorizer(timestamptz, integer, text, timestamptz)",
        f"""
CREATE OR REPLACE FUNCTION queues_claim_for_categorizer(
    p_now timestamptz, p_limit integer, p_owner text, p_until timestamptz)
RETURNS TABLE (o_id bigint, o_crash_count integer)
LANGUAGE plpgsql {PINNED} SET enable_bitmapscan = off AS $fn$
BEGIN
-- A message to be tried alone first, else a batch, locked with SKIP LOCKED and
-- leased to the owner; a claim of one counts the try in crash_count.
RETURN QUERY
WITH iso AS (
    SELECT id FROM queues_message
    WHERE state = 'submission' AND next_attempt_at <= p_now AND NOT suspended AND isolate
    ORDER BY next_attempt_at, id LIMIT 1 FOR UPDATE SKIP LOCKED
), batch AS (
    SELECT id FROM queues_message
    WHERE state = 'submission' AND next_attempt_at <= p_now AND NOT suspended
        AND NOT isolate AND NOT EXISTS (SELECT 1 FROM iso)
    ORDER BY next_attempt_at, id LIMIT p_limit FOR UPDATE SKIP LOCKED
), picked AS (
    SELECT id FROM iso UNION ALL SELECT id FROM batch
), n AS (
    SELECT count(*) = 1 AS alone FROM picked
), claimed AS (
    UPDATE queues_message AS m
    SET state = 'categorizing', lease_owner = p_owner, lease_until = p_until,
        crash_count = m.crash_count + CASE WHEN n.alone THEN 1 ELSE 0 END, isolate = n.alone
    FROM n
    WHERE m.id IN (SELECT id FROM picked)
    RETURNING m.id, m.crash_count
)
SELECT claimed.id, claimed.crash_count FROM claimed;
END $fn$""",
    ),
    (
        "queues_to_route(bigint[])",
        f"""
CREATE OR REPLACE FUNCTION queues_to_route(p_ids bigint[])
RETURNS TABLE (
    o_domain varchar, o_id bigint, o_address varchar, o_message_id bigint, o_qid varchar,
    o_mail_from varchar, o_header_id varchar, o_client_address inet, o_auth_account varchar,
    o_size bigint, o_received_at timestamptz, o_next_attempt_at timestamptz, o_source varchar)
LANGUAGE plpgsql {PINNED} AS $fn$
BEGIN
-- The submitted recipients of a claimed batch, with what their tracking rows need.
RETURN QUERY
SELECT r.domain, r.id, r.address, r.message_id, m.qid, m.mail_from, m.message_id,
    m.client_address, m.auth_account, m.size, m.received_at, m.next_attempt_at, m.source
FROM queues_recipient AS r JOIN queues_message AS m ON m.id = r.message_id
WHERE r.message_id = ANY(p_ids) AND r.state = 'submitted' ORDER BY r.id;
END $fn$""",
    ),
    (
        "queues_resubmit_if_recipients_submitted(bigint[], timestamptz)",
        f"""
CREATE OR REPLACE FUNCTION queues_resubmit_if_recipients_submitted(
    p_ids bigint[], p_now timestamptz)
RETURNS integer
LANGUAGE plpgsql {PINNED} AS $fn$
DECLARE
    n integer;
BEGIN
-- Queued messages of p_ids with a recipient sent back to Submission meanwhile:
-- back to Submission, due now.
UPDATE queues_message AS m SET state = 'submission', next_attempt_at = p_now
WHERE m.id = ANY(p_ids) AND m.state = 'queued' AND EXISTS (
    SELECT 1 FROM queues_recipient AS r WHERE r.message_id = m.id AND r.state = 'submitted');
GET DIAGNOSTICS n = ROW_COUNT;
RETURN n;
END $fn$""",
    ),
    (
        "queues_record_delivered(json, bigint[], text, timestamptz, varchar[])",
        f"""
CREATE OR REPLACE FUNCTION queues_record_delivered(
    p_rows json, p_ids bigint[], p_owner text, p_now timestamptz, p_final varchar[])
RETURNS TABLE (
    o_id bigint, o_message_id bigint, o_queue_id bigint, o_address varchar, o_done boolean)
LANGUAGE plpgsql {PINNED} AS $fn$
BEGIN
-- Deliveries of the rows p_owner holds: each recipient delivered, an attempt
-- row each, the messages with no other recipient left done; returns the
-- recipients written and whether their message is done.
RETURN QUERY
WITH v AS (SELECT * FROM json_to_recordset(p_rows) AS v(
    recipient_id bigint, message_id bigint, started_at timestamptz, duration_ms integer,
    host varchar(300), ip varchar(64), port integer, phase varchar(10), code smallint,
    enhanced varchar(16), text text, outcome varchar(10), tls_version varchar(16),
    tls_cipher varchar(100), tls_verified varchar(20), tls_policy varchar(20),
    auth_used varchar(20), last_host text)),
r AS (UPDATE queues_recipient AS t SET state = 'delivered',
    attempt_count = t.attempt_count + 1, last_attempt_at = v.started_at, last_code = v.code,
    last_enhanced = v.enhanced, last_text = v.text, last_host = v.last_host,
    lease_owner = '', lease_until = NULL, final_at = p_now
    FROM v WHERE t.id = ANY(p_ids) AND t.id = v.recipient_id
    AND t.state = 'active' AND t.lease_owner = p_owner
    RETURNING t.id, t.message_id, t.queue_id, t.address),
a AS (INSERT INTO queues_attempt (recipient_id, message_id, started_at, duration_ms, host, ip,
        port, phase, code, enhanced, text, outcome, tls_version, tls_cipher, tls_verified,
        tls_policy, auth_used, queue_id)
    SELECT v.recipient_id, v.message_id, v.started_at, v.duration_ms, v.host, v.ip, v.port,
        v.phase, v.code, v.enhanced, v.text, v.outcome, v.tls_version, v.tls_cipher,
        v.tls_verified, v.tls_policy, v.auth_used, t.queue_id
    FROM v JOIN queues_recipient AS t ON t.id = ANY(p_ids) AND t.id = v.recipient_id),
m AS (UPDATE queues_message AS m SET state = 'done', completed_at = p_now,
    lease_owner = '', lease_until = NULL
    WHERE m.id IN (SELECT r.message_id FROM r) AND m.state <> 'done' AND NOT EXISTS (
    SELECT 1 FROM queues_recipient AS x WHERE x.message_id = m.id
    AND x.state <> ALL(p_final) AND x.id NOT IN (SELECT r.id FROM r))
    RETURNING m.id)
SELECT r.id, r.message_id, r.queue_id, r.address, r.message_id IN (SELECT m.id FROM m)
FROM r;
END $fn$""",
    ),
    (
        "queues_lease_recipients(bigint[], text, timestamptz)",
        f"""
CREATE OR REPLACE FUNCTION queues_lease_recipients(
    p_ids bigint[], p_owner text, p_until timestamptz)
RETURNS integer
LANGUAGE plpgsql {PINNED} AS $fn$
DECLARE
    n integer;
BEGIN
UPDATE queues_recipient SET state = 'active', lease_owner = p_owner, lease_until = p_until
WHERE id = ANY(p_ids);
GET DIAGNOSTICS n = ROW_COUNT;
RETURN n;
END $fn$""",
    ),
]


def original(signature: str) -> str:
    """A function's text as this migration creates it (later ones edit it)."""
    return next(sql for name, sql in FUNCTIONS if name == signature)


def edited(signature: str, edits: list[tuple[str, str]]) -> str:
    """``original(signature)`` with each (old, new) text replaced; each old
    text must stand in it once."""
    sql = original(signature)
    for old, new in edits:
        assert sql.count(old) == 1, old
        sql = sql.replace(old, new)
    return sql


def create(apps, schema_editor) -> None:
    if schema_editor.connection.vendor != "postgresql":
        return
    for _, sql in FUNCTIONS:
        schema_editor.execute(sql)


def drop(apps, schema_editor) -> None:
    if schema_editor.connection.vendor != "postgresql":
        return
    for signature, _ in FUNCTIONS:
        schema_editor.execute(f"DROP FUNCTION IF EXISTS {signature}")


class Migration(migrations.Migration):
    dependencies = [
        ("queues", "0013_hot_path_no_fk_checks"),
    ]

    operations = [migrations.RunPython(create, drop)]
