"""Audit entries of webhook changes written before URLs were redacted in them
(issue #20): the userinfo password and the query values of each URL in their
``detail`` are masked, as tracking.redact does for new entries. Not reversible
(the masked text is gone): backwards does nothing."""

from django.db import migrations

BATCH = 1000


def forwards(apps, schema_editor) -> None:
    from tracking import redact

    audit = apps.get_model("queues", "AuditEntry")
    rows = audit.objects.filter(target_type="webhook", detail__icontains="://")
    changed = []
    for pk, detail in rows.values_list("pk", "detail").iterator(chunk_size=BATCH):
        masked = redact.text(detail)
        if masked != detail:
            changed.append(audit(pk=pk, detail=masked))
        if len(changed) >= BATCH:
            audit.objects.bulk_update(changed, ["detail"])
            changed = []
    if changed:
        audit.objects.bulk_update(changed, ["detail"])


class Migration(migrations.Migration):
    dependencies = [
        ("tracking", "0003_message_id_hash_index"),
        ("queues", "0009_reroute_from"),
    ]

    operations = [migrations.RunPython(forwards, migrations.RunPython.noop)]
