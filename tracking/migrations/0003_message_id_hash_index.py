"""Message-ID searched by an index of its MD5 (PostgreSQL): a btree entry holds
at most 2,704 bytes and a Message-ID of 998 UTF-8 characters is up to about
4,000, so one such message made the INSERT of its whole batch of tracking rows
fail (issue #20). SQLite keeps its index on the text (no entry size limit)."""

from django.db import migrations


def forwards(apps, schema_editor) -> None:
    from tracking import partitions

    schema_editor.execute("DROP INDEX IF EXISTS tracking_event_msgid")
    for statement in partitions.create_indexes(schema_editor.connection.vendor):
        schema_editor.execute(statement)


def backwards(apps, schema_editor) -> None:
    from tracking import partitions

    schema_editor.execute("DROP INDEX IF EXISTS tracking_event_msgid_md5")
    schema_editor.execute(
        f"CREATE INDEX IF NOT EXISTS tracking_event_msgid ON {partitions.TABLE} "
        "(message_id, at) WHERE message_id <> ''"
    )


class Migration(migrations.Migration):
    dependencies = [("tracking", "0002_search_indexes_webhook_age")]

    operations = [migrations.RunPython(forwards, backwards)]
