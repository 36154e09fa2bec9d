"""Every URL pattern of the URL conf, walked with every kind of user, against the
README's "URLs and roles" table (parsed here, so the table and the code cannot drift).

Users: anonymous, signed in without a role, viewer, operator, admin. A user
below a URL's role must be refused (401/403, or a redirect to a login page
with ``next=``); a user at or above it must not be refused and must not get a
5xx (400, 404, 405 and 409 are answers about the request, not the role).
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from django.contrib.auth.models import User
from django.test import Client
from django.urls import URLPattern, URLResolver, get_resolver
from django.urls.resolvers import RegexPattern

from queues.models import AuditEntry
from tests.support.operator_factories import make_message, make_queue, make_user

pytestmark = pytest.mark.django_db

README = Path(__file__).resolve().parent.parent / "README.md"
USERS = ("anonymous", "no role", "viewer", "operator", "admin")
# The least user each role lets in (index into USERS); "nobody": refused for all.
LEAST = {"anyone": 0, "metrics": 0, "logged in": 1, "viewer": 2, "operator": 3, "admin": 4}
ROW = re.compile(
    r"^\| `(?P<url>/[^`]*)` \| (?P<method>GET|POST|PUT|PATCH|DELETE) \| (?P<role>[a-z ()-]+) \|$"
)


@dataclass(frozen=True)
class Row:
    template: str
    method: str
    role: str
    regex: re.Pattern[str]


def readme_table() -> list[Row]:
    """The rows of README's "URLs and roles" table, in order."""
    text = README.read_text()
    section = text.split("## URLs and roles", 1)[1].split("\n## ", 1)[0]
    rows = []
    for line in section.splitlines():
        match = ROW.match(line.strip())
        if not match:
            continue
        template = match["url"]
        pattern = re.escape(template).replace("…", ".*")
        pattern = re.sub(r"\\\{\w+\\\}", "[^/]+", pattern)
        role = match["role"].split(" (")[0]
        rows.append(Row(template, match["method"], role, re.compile(pattern + "$")))
    return rows


def row_for(url: str, rows: list[Row]) -> Row:
    path = url
    if url.startswith("/api/"):
        path = re.sub(r"\.json/?$", "", url)  # the API's format suffix
    for row in rows:
        if row.regex.match(path) or row.regex.match(path + "/"):
            return row
    raise AssertionError(f"{url} is not in README's URLs and roles table")


# --- every pattern of the URL conf, as a URL -------------------------------------------


def _patterns(resolver: URLResolver, prefix: str = "") -> Iterator[tuple[str, str]]:
    """(kind, pattern) of every endpoint: kind "route" or "regex", prefixes joined."""
    for entry in resolver.url_patterns:
        pattern = entry.pattern
        text = pattern.regex.pattern if isinstance(pattern, RegexPattern) else str(pattern)
        if isinstance(pattern, RegexPattern):
            text = text.lstrip("^")
        if isinstance(entry, URLResolver):
            yield from _patterns(entry, prefix + _sample(text, isinstance(pattern, RegexPattern)))
        elif isinstance(entry, URLPattern):
            yield prefix + _sample(text, isinstance(pattern, RegexPattern)), text


def _sample(text: str, regex: bool) -> str:
    """A concrete path for a pattern: every parameter replaced by a sample value."""
    if not regex:
        return re.sub(r"<(?:(\w+):)?(\w+)>", lambda m: _value(m[2], m[1] or "str"), text)
    text = re.sub(r"\(\?P<(\w+)>([^()]*)\)", lambda m: _value(m[1], "re", m[2]), text.rstrip("$"))
    return text.replace("/?", "/").replace("\\.", ".")


SAMPLES: dict[str, str] = {}
# URLs that answer 403 to anyone without these parameters (a request error, not a role).
QUERY = {"/admin/autocomplete/": "?app_label=queues&model_name=attempt&field_name=queue"}


def _value(name: str, converter: str, regex: str = "") -> str:
    if converter == "drf_format_suffix" or name == "format":
        return ".json" if converter == "drf_format_suffix" else "json"
    if name == "app_label":
        return "queues" if "queues" in regex else regex.split("|")[0]
    if name == "url":  # the admin's catch-all
        return "no-such-page/"
    if name == "action":
        return "suspend"
    return SAMPLES.get(name, SAMPLES["pk"])


# --- the walk ----------------------------------------------------------------------------


def _client(kind: str, users: dict[str, User]) -> Client:
    client = Client()
    if kind != "anonymous":
        client.force_login(users[kind])
    return client


def _refused(response) -> bool:
    if response.status_code in (401, 403):
        return True
    location = response.get("Location", "")
    return response.status_code == 302 and "login/" in location and "next=" in location


@pytest.fixture
def users() -> dict[str, User]:
    admin = make_user("superuser", "root")
    admin.is_staff = True
    admin.save()
    return {
        "no role": make_user(None, "nobody"),
        "viewer": make_user("viewer", "vera"),
        "operator": make_user("operator", "olga"),
        "admin": admin,
    }


def test_every_url_pattern_answers_each_user_as_the_readme_table_says(users, settings):
    settings.MAILRELAY_METRICS_TOKEN = ""
    settings.MAILRELAY_API_DOCS_PUBLIC = False
    queue = make_queue()
    message = make_message("u@example.net", queue=queue)
    AuditEntry.objects.create(created_at=message.received_at, actor_name="x", via="ui")
    SAMPLES.update(
        pk=str(queue.pk),
        id=str(queue.pk),
        object_id=str(queue.pk),
        content_type_id="1",
    )
    rows = readme_table()
    assert len(rows) > 40
    seen, problems = set(), []
    clients = {kind: _client(kind, users) for kind in USERS}
    for url, _ in _patterns(get_resolver()):
        url = "/" + url
        if url in seen:
            continue
        seen.add(url)
        row = row_for(url, rows)
        least = LEAST.get(row.role, len(USERS))  # "nobody": past every user
        for rank, kind in enumerate(USERS):
            client = clients[kind]
            send = client.post if row.method == "POST" else client.get
            response = send(url + QUERY.get(url, ""))
            if "logout" in url:  # that ended the client's session: a fresh one
                clients[kind] = _client(kind, users)
            refused = _refused(response)
            if response.status_code >= 500:
                problems.append(f"{row.method} {url} as {kind}: {response.status_code}")
            elif refused != (rank < least):
                want = "refused" if rank < least else "served"
                problems.append(
                    f"{row.method} {url} as {kind}: {response.status_code}, "
                    f"README ({row.template}: {row.role}) says {want}"
                )
    assert len(seen) > 80
    assert not problems, "\n".join(problems)


def test_every_row_of_the_table_is_a_url_of_the_url_conf():
    urls = {"/" + url for url, _ in _patterns(get_resolver())}
    SAMPLES.setdefault("pk", "1")
    for row in readme_table():
        assert any(row.regex.match(url) for url in urls), f"{row.template} matches no URL"


def _endpoints(resolver: URLResolver, prefix: str = "") -> Iterator[tuple[str, object]]:
    """(url, view callback) of every endpoint, as _patterns samples them."""
    for entry in resolver.url_patterns:
        pattern = entry.pattern
        regex = isinstance(pattern, RegexPattern)
        text = pattern.regex.pattern.lstrip("^") if regex else str(pattern)
        if isinstance(entry, URLResolver):
            yield from _endpoints(entry, prefix + _sample(text, regex))
        elif isinstance(entry, URLPattern):
            yield "/" + prefix + _sample(text, regex), entry.callback


def _api_methods(callback) -> set[str]:
    """The methods a REST framework view takes (a viewset: those its route maps)."""
    actions = getattr(callback, "actions", None)
    cls = getattr(callback, "cls", None)
    if actions:
        methods = set(actions)
    elif cls is not None:
        methods = {m for m in cls.http_method_names if hasattr(cls, m)}
    else:
        return set()
    return {m.upper() for m in methods - {"options", "head"}}


def test_every_method_of_every_api_url_has_a_row():
    """A URL that takes POST, PATCH or DELETE has a row for each, with its role."""
    SAMPLES.setdefault("pk", "1")
    rows = readme_table()
    missing = []
    for url, callback in _endpoints(get_resolver()):
        if not url.startswith("/api/") or ".json" in url:
            continue
        for method in sorted(_api_methods(callback)):
            path = url if url.endswith("/") else url + "/"
            if not any(r.method == method and r.regex.match(path) for r in rows):
                missing.append(f"{method} {url}")
    assert not missing, "README's URLs and roles table lacks:\n" + "\n".join(missing)
