"""The Queue Viewer's substring filters on the sender, the Subject and the
Message-ID search ``queues_messagetext`` (issue #24).

The pg_trgm GIN indexes of migration 0003 sat on ``queues_message``. A message's
row changes state three times (claimed, queued, done) and no such change is a
HOT update, so each wrote every trigram of the three texts again: measured on
a copy of the bench's table, a state change of a message's row cost 76 µs of
the server's time with them and 37 µs without, and a message's life (insert
and three changes) 274 µs against 181 µs with the text kept here instead
(bench/README.md, session 19).

``queues_messagetext`` holds the three texts once a message. The database
writes it: a row trigger on the message's INSERT (whoever inserts it: the
ingress, pickup, a DSN, the ORM), a row trigger when an operator corrects the
sender (only when the UPDATE sets one of the three columns and changes it),
and a trigger on DELETE (a statement trigger on PostgreSQL, per row on
SQLite) and, on PostgreSQL, on TRUNCATE. No foreign key: its check would cost
the accept a lookup and a row lock a message, and the delete trigger already
removes the row with its message. Existing messages are filled in here; the
three GIN indexes move to the new table (the recipients' address and error
indexes stay where they are: a recipient's row costs a few microseconds a
change).
"""

import django.db.models.deletion
from django.db import migrations, models

OLD_INDEXES = [
    ("message_mail_from_trgm", "mail_from"),
    ("message_subject_trgm", "subject"),
    ("message_message_id_trgm", "message_id"),
]
TEXT_INDEXES = [
    ("messagetext_mail_from_trgm", "mail_from"),
    ("messagetext_subject_trgm", "subject"),
    ("messagetext_msgid_trgm", "msgid"),
]

POSTGRESQL = [
    """
    CREATE FUNCTION queues_messagetext_insert() RETURNS trigger LANGUAGE plpgsql AS $$
    BEGIN
        INSERT INTO queues_messagetext (message_id, mail_from, subject, msgid)
        VALUES (NEW.id, NEW.mail_from, NEW.subject, NEW.message_id);
        RETURN NULL;
    END
    $$
    """,
    """
    CREATE TRIGGER queues_message_text_insert AFTER INSERT ON queues_message
    FOR EACH ROW EXECUTE FUNCTION queues_messagetext_insert()
    """,
    """
    CREATE FUNCTION queues_messagetext_update() RETURNS trigger LANGUAGE plpgsql AS $$
    BEGIN
        UPDATE queues_messagetext
        SET mail_from = NEW.mail_from, subject = NEW.subject, msgid = NEW.message_id
        WHERE message_id = NEW.id;
        RETURN NULL;
    END
    $$
    """,
    """
    CREATE TRIGGER queues_message_text_update
    AFTER UPDATE OF mail_from, subject, message_id ON queues_message FOR EACH ROW
    WHEN (OLD.mail_from IS DISTINCT FROM NEW.mail_from
          OR OLD.subject IS DISTINCT FROM NEW.subject
          OR OLD.message_id IS DISTINCT FROM NEW.message_id)
    EXECUTE FUNCTION queues_messagetext_update()
    """,
    """
    CREATE FUNCTION queues_messagetext_delete() RETURNS trigger LANGUAGE plpgsql AS $$
    BEGIN
        DELETE FROM queues_messagetext AS t USING gone WHERE t.message_id = gone.id;
        RETURN NULL;
    END
    $$
    """,
    """
    CREATE TRIGGER queues_message_text_delete AFTER DELETE ON queues_message
    REFERENCING OLD TABLE AS gone FOR EACH STATEMENT
    EXECUTE FUNCTION queues_messagetext_delete()
    """,
    # A TRUNCATE of the messages (by hand, RESTART IDENTITY: the ids start
    # again) empties the text too. DELETE, not TRUNCATE: a TRUNCATE naming both
    # tables (Django's flush) still has the text table open when this runs.
    """
    CREATE FUNCTION queues_messagetext_truncate() RETURNS trigger LANGUAGE plpgsql AS $$
    BEGIN
        DELETE FROM queues_messagetext;
        RETURN NULL;
    END
    $$
    """,
    """
    CREATE TRIGGER queues_message_text_truncate AFTER TRUNCATE ON queues_message
    FOR EACH STATEMENT EXECUTE FUNCTION queues_messagetext_truncate()
    """,
]
POSTGRESQL_DROP = [
    "DROP TRIGGER IF EXISTS queues_message_text_insert ON queues_message",
    "DROP TRIGGER IF EXISTS queues_message_text_update ON queues_message",
    "DROP TRIGGER IF EXISTS queues_message_text_delete ON queues_message",
    "DROP TRIGGER IF EXISTS queues_message_text_truncate ON queues_message",
    "DROP FUNCTION IF EXISTS queues_messagetext_insert()",
    "DROP FUNCTION IF EXISTS queues_messagetext_update()",
    "DROP FUNCTION IF EXISTS queues_messagetext_delete()",
    "DROP FUNCTION IF EXISTS queues_messagetext_truncate()",
]

# SQLite (make run's embedded default): the same rows, by row triggers.
SQLITE = [
    """
    CREATE TRIGGER queues_message_text_insert AFTER INSERT ON queues_message BEGIN
        INSERT INTO queues_messagetext (message_id, mail_from, subject, msgid)
        VALUES (NEW.id, NEW.mail_from, NEW.subject, NEW.message_id);
    END
    """,
    """
    CREATE TRIGGER queues_message_text_update
    AFTER UPDATE OF mail_from, subject, message_id ON queues_message
    WHEN OLD.mail_from IS NOT NEW.mail_from OR OLD.subject IS NOT NEW.subject
         OR OLD.message_id IS NOT NEW.message_id BEGIN
        UPDATE queues_messagetext
        SET mail_from = NEW.mail_from, subject = NEW.subject, msgid = NEW.message_id
        WHERE message_id = NEW.id;
    END
    """,
    """
    CREATE TRIGGER queues_message_text_delete AFTER DELETE ON queues_message BEGIN
        DELETE FROM queues_messagetext WHERE message_id = OLD.id;
    END
    """,
]
SQLITE_DROP = [
    "DROP TRIGGER IF EXISTS queues_message_text_insert",
    "DROP TRIGGER IF EXISTS queues_message_text_update",
    "DROP TRIGGER IF EXISTS queues_message_text_delete",
]

BACKFILL = """
    INSERT INTO queues_messagetext (message_id, mail_from, subject, msgid)
    SELECT id, mail_from, subject, message_id FROM queues_message
"""


def _trigram(schema_editor) -> bool:
    """Whether pg_trgm is there (migration 0003 made it when it could)."""
    with schema_editor.connection.cursor() as cur:
        cur.execute("SELECT 1 FROM pg_extension WHERE extname = 'pg_trgm'")
        return cur.fetchone() is not None


def forwards(apps, schema_editor):
    vendor = schema_editor.connection.vendor
    if vendor not in ("postgresql", "sqlite"):
        raise RuntimeError(f"queues 0012: no triggers written for {vendor}")
    for statement in POSTGRESQL if vendor == "postgresql" else SQLITE:
        schema_editor.execute(statement)
    schema_editor.execute(BACKFILL)
    if vendor == "postgresql" and _trigram(schema_editor):
        for name, _column in OLD_INDEXES:
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
        for name, column in OLD_INDEXES:
            schema_editor.execute(
                f"CREATE INDEX IF NOT EXISTS {name} ON queues_message "
                f"USING gin ({column} gin_trgm_ops)"
            )


class Migration(migrations.Migration):
    dependencies = [
        ("queues", "0011_body_lz4"),
    ]

    operations = [
        migrations.CreateModel(
            name="MessageText",
            fields=[
                (
                    "message",
                    models.OneToOneField(
                        db_constraint=False,
                        on_delete=django.db.models.deletion.DO_NOTHING,
                        primary_key=True,
                        related_name="search_text",
                        serialize=False,
                        to="queues.message",
                    ),
                ),
                ("mail_from", models.CharField(blank=True, max_length=512)),
                ("subject", models.CharField(blank=True, max_length=998)),
                ("msgid", models.CharField(blank=True, max_length=998)),
            ],
        ),
        migrations.RunPython(forwards, backwards),
    ]
