"""``python manage.py message explain <queue-id>``: explain as text (or JSON)."""

from __future__ import annotations

import json

from insight.explain import explain_message
from queues.lib import clock
from queues.models import Message


def explain_text(message: Message, as_json: bool = False) -> str:
    result = explain_message(message, clock.now())
    if as_json:
        return json.dumps(result.as_dict(), indent=2)
    lines = [f"{result.qid} ({result.state}): {result.summary}"]
    for x in result.recipients:
        queue = x.queue["name"] if x.queue else "-"
        lines.append("")
        lines.append(f"{x.address}  [{x.state}, queue {queue}]  reason: {x.reason}")
        for r in x.reasons:
            lines.append(f"  - {r.code}: {r.text}")
        if x.rule:
            where = (
                f"line {x.rule['line']} of {x.rule['source']}"
                if x.rule["line"]
                else x.rule["source"]
            )
            lines.append(f"  rule: {x.rule['text']}  ({where})")
        if x.last_reply:
            lr = x.last_reply
            code = " ".join(str(p) for p in (lr["code"], lr["enhanced"]) if p)
            lines.append(f"  last reply: {code} {lr['text']}".rstrip())
        for s in x.schedule:
            lines.append(f"  {s['at'].isoformat()}  {s['kind']}")
        for a in x.actions:
            lines.append(f"  can do: {a.label}  (POST {a.api})")
    return "\n".join(lines)
