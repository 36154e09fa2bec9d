"""The Queue Viewer's substring filters search ``queues_messagetext`` (issue #24).

Until now the pg_trgm GIN indexes of migration 0003 sat on ``queues_message``
(sender, Subject, Message-ID) and ``queues_recipient`` (address). Both rows
change state several times on a message's way (claimed, queued, delivered),
and no such change is a HOT update (the state is in the partial indexes'
predicates), so PostgreSQL wrote every field's trigrams again into its GIN
index at every change: about 460 index entries a one-recipient message. The
bench measured PostgreSQL's CPU a message a fifth lower without them.

``queues_messagetext`` holds the same text once per message. The database
writes it: a statement trigger on the recipients' INSERT (one row a message,
its addresses one a line), and row triggers when an operator corrects the
sender or a recipient (``queues.services.envelope_edits``). The filters join
it; nothing else reads or writes it. Existing messages are filled in here.
The error filter keeps its partial index on ``queues_recipient.last_text``
(only failing recipients carry one).
"""

import django.db.models.deletion
from django.db import migrations, models

OLD_TRIGRAM_INDEXES = [
    ("message_mail_from_trgm", "queues_message", "mail_from"),
    ("message_subject_trgm", "queues_message", "subject"),
    ("message_message_id_trgm", "queues_message", "message_id"),
    ("recipient_address_trgm", "queues_recipient", "address"),
]
TEXT_INDEXES = [
    ("messagetext_mail_from_trgm", "mail_from"),
    ("messagetext_subject_trgm", "subject"),
    ("messagetext_msgid_trgm", "msgid"),
    ("messagetext_recipients_trgm", "recipients"),
]

POSTGRESQL = [
    """
    CREATE FUNCTION queues_messagetext_add() RETURNS trigger LANGUAGE plpgsql AS $$
    BEGIN
        INSERT INTO queues_messagetext (message_id, mail_from, subject, msgid, recipients)
        SELECT m.id, m.mail_from, m.subject, m.message_id, r.addresses
        FROM (SELECT message_id, string_agg(address, E'\\n' ORDER BY id) AS addresses
              FROM new_rows GROUP BY message_id) AS r
        JOIN queues_message AS m ON m.id = r.message_id
        ON CONFLICT (message_id) DO UPDATE
            SET recipients = queues_messagetext.recipients || E'\\n' || EXCLUDED.recipients;
        RETURN NULL;
    END
    $$
    """,
    """
    CREATE TRIGGER queues_recipient_text AFTER INSERT ON queues_recipient
    REFERENCING NEW TABLE AS new_rows
    FOR EACH STATEMENT EXECUTE FUNCTION queues_messagetext_add()
    """,
    """
    CREATE FUNCTION queues_messagetext_recipients() RETURNS trigger LANGUAGE plpgsql AS $$
    BEGIN
        UPDATE queues_messagetext SET recipients = COALESCE(
            (SELECT string_agg(address, E'\\n' ORDER BY id) FROM queues_recipient
             WHERE message_id = NEW.message_id), '')
        WHERE message_id = NEW.message_id;
        RETURN NULL;
    END
    $$
    """,
    """
    CREATE TRIGGER queues_recipient_address_text AFTER UPDATE OF address ON queues_recipient
    FOR EACH ROW WHEN (OLD.address IS DISTINCT FROM NEW.address)
    EXECUTE FUNCTION queues_messagetext_recipients()
    """,
    """
    CREATE FUNCTION queues_messagetext_message() RETURNS trigger LANGUAGE plpgsql AS $$
    BEGIN
        UPDATE queues_messagetext
        SET mail_from = NEW.mail_from, subject = NEW.subject, msgid = NEW.message_id
        WHERE message_id = NEW.id;
        RETURN NULL;
    END
    $$
    """,
    """
    CREATE TRIGGER queues_message_text AFTER UPDATE OF mail_from, subject, message_id
    ON queues_message FOR EACH ROW
    WHEN (OLD.mail_from IS DISTINCT FROM NEW.mail_from
          OR OLD.subject IS DISTINCT FROM NEW.subject
          OR OLD.message_id IS DISTINCT FROM NEW.message_id)
    EXECUTE FUNCTION queues_messagetext_message()
    """,
]
POSTGRESQL_DROP = [
    "DROP TRIGGER IF EXISTS queues_recipient_text ON queues_recipient",
    "DROP TRIGGER IF EXISTS queues_recipient_address_text ON queues_recipient",
    "DROP TRIGGER IF EXISTS queues_message_text ON queues_message",
    "DROP FUNCTION IF EXISTS queues_messagetext_add()",
    "DROP FUNCTION IF EXISTS queues_messagetext_recipients()",
    "DROP FUNCTION IF EXISTS queues_messagetext_message()",
]

# SQLite (make run's embedded default): row triggers, the same rows.
SQLITE = [
    """
    CREATE TRIGGER queues_recipient_text AFTER INSERT ON queues_recipient BEGIN
        INSERT INTO queues_messagetext (message_id, mail_from, subject, msgid, recipients)
        SELECT id, mail_from, subject, message_id, NEW.address FROM queues_message
        WHERE id = NEW.message_id
        ON CONFLICT (message_id) DO UPDATE
            SET recipients = recipients || char(10) || excluded.recipients;
    END
    """,
    """
    CREATE TRIGGER queues_recipient_address_text AFTER UPDATE OF address ON queues_recipient
    WHEN OLD.address IS NOT NEW.address BEGIN
        UPDATE queues_messagetext SET recipients = COALESCE(
            (SELECT group_concat(address, char(10)) FROM
                (SELECT address FROM queues_recipient WHERE message_id = NEW.message_id
                 ORDER BY id)), '')
        WHERE message_id = NEW.message_id;
    END
    """,
    """
    CREATE TRIGGER queues_message_text AFTER UPDATE OF mail_from, subject, message_id
    ON queues_message
    WHEN OLD.mail_from IS NOT NEW.mail_from OR OLD.subject IS NOT NEW.subject
         OR OLD.message_id IS NOT NEW.message_id BEGIN
        UPDATE queues_messagetext
        SET mail_from = NEW.mail_from, subject = NEW.subject, msgid = NEW.message_id
        WHERE message_id = NEW.id;
    END
    """,
]
SQLITE_DROP = [
    "DROP TRIGGER IF EXISTS queues_recipient_text",
    "DROP TRIGGER IF EXISTS queues_recipient_address_text",
    "DROP TRIGGER IF EXISTS queues_message_text",
]

BACKFILL = {
    "postgresql": """
        INSERT INTO queues_messagetext (message_id, mail_from, subject, msgid, recipients)
        SELECT m.id, m.mail_from, m.subject, m.message_id, COALESCE(
            (SELECT string_agg(address, E'\\n' ORDER BY id) FROM queues_recipient r
             WHERE r.message_id = m.id), '')
        FROM queues_message m
    """,
    "sqlite": """
        INSERT INTO queues_messagetext (message_id, mail_from, subject, msgid, recipients)
        SELECT m.id, m.mail_from, m.subject, m.message_id, COALESCE(
            (SELECT group_concat(address, char(10)) FROM
                (SELECT address FROM queues_recipient r WHERE r.message_id = m.id
                 ORDER BY id)), '')
        FROM queues_message m
    """,
}


def _trigram(schema_editor) -> bool:
    """Whether pg_trgm is there (migration 0003 made it when it could)."""
    with schema_editor.connection.cursor() as cur:
        cur.execute("SELECT 1 FROM pg_extension WHERE extname = 'pg_trgm'")
        return cur.fetchone() is not None


def forwards(apps, schema_editor):
    vendor = schema_editor.connection.vendor
    if vendor == "postgresql":
        for statement in POSTGRESQL:
            schema_editor.execute(statement)
    elif vendor == "sqlite":
        for statement in SQLITE:
            schema_editor.execute(statement)
    else:
        raise RuntimeError(f"queues 0011: no triggers written for {vendor}")
    schema_editor.execute(BACKFILL[vendor])
    if vendor == "postgresql" and _trigram(schema_editor):
        for name, _table, _column in OLD_TRIGRAM_INDEXES:
            schema_editor.execute(f"DROP INDEX IF EXISTS {name}")
        for name, column in TEXT_INDEXES:
            schema_editor.execute(
                f"CREATE INDEX IF NOT EXISTS {name} ON queues_messagetext "
                f"USING gin ({column} gin_trgm_ops)"
            )


def backwards(apps, schema_editor):
    vendor = schema_editor.connection.vendor
    for statement in POSTGRESQL_DROP if vendor == "postgresql" else SQLITE_DROP:
        schema_editor.execute(statement)
    if vendor == "postgresql" and _trigram(schema_editor):
        for name, table, column in OLD_TRIGRAM_INDEXES:
            schema_editor.execute(
                f"CREATE INDEX IF NOT EXISTS {name} ON {table} USING gin ({column} gin_trgm_ops)"
            )


class Migration(migrations.Migration):
    dependencies = [
        ("queues", "0010_fewer_indexes"),
    ]

    operations = [
        migrations.CreateModel(
            name="MessageText",
            fields=[
                (
                    "message",
                    models.OneToOneField(
                        on_delete=django.db.models.deletion.CASCADE,
                        primary_key=True,
                        related_name="search_text",
                        serialize=False,
                        to="queues.message",
                    ),
                ),
                ("mail_from", models.CharField(blank=True, max_length=512)),
                ("subject", models.CharField(blank=True, max_length=998)),
                ("msgid", models.CharField(blank=True, max_length=998)),
                ("recipients", models.TextField(blank=True)),
            ],
        ),
        migrations.RunPython(forwards, backwards),
    ]
