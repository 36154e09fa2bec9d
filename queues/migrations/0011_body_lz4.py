"""A message's bytes compressed with LZ4 instead of pglz (issue #24).

PostgreSQL compresses a value that does not fit in a row's first 2 kB; with
its default, pglz, that was 24–31 µs of the server's CPU a 2 kB message
(0.3 s for a 30 MB one), with LZ4 6–8 µs and a smaller result
(bench/README.md "Session 18"). Only new values are compressed so: those
already stored stay as they are, and PostgreSQL reads both. A server built
without LZ4 (``default_toast_compression`` does not offer it) keeps pglz.
"""

from django.db import migrations

COLUMNS = ("data", "signature")


def _has_lz4(schema_editor) -> bool:
    with schema_editor.connection.cursor() as cur:
        cur.execute(
            "SELECT 'lz4' = ANY(enumvals) FROM pg_settings "
            "WHERE name = 'default_toast_compression'"
        )
        row = cur.fetchone()
    return bool(row and row[0])


def _set(schema_editor, method: str) -> None:
    if schema_editor.connection.vendor != "postgresql" or not _has_lz4(schema_editor):
        return
    changes = ", ".join(f"ALTER COLUMN {column} SET COMPRESSION {method}" for column in COLUMNS)
    schema_editor.execute(f"ALTER TABLE queues_message {changes}")


def to_lz4(apps, schema_editor):
    _set(schema_editor, "lz4")


def to_default(apps, schema_editor):
    _set(schema_editor, "DEFAULT")


class Migration(migrations.Migration):
    dependencies = [
        ("queues", "0010_fewer_indexes"),
    ]

    operations = [migrations.RunPython(to_lz4, to_default)]
