"""No input gives a 500: every list endpoint of the OpenAPI schema (and the
Queue Viewer's lists) driven with generated query parameters (hypothesis).

The parameters come from the schema itself, so a new filter is fuzzed the day
it is declared. Values mix random text and numbers with the shapes that broke
things before (huge durations and sizes, impossible dates, NUL, regular
expression bombs). The examples are derandomized and bounded, so the test is
the same every run and takes seconds. The test runs inside one transaction:
a query PostgreSQL refuses would poison the ones after it, so a value that
reaches the database unchecked fails this test even if the view maps it to a 400.
"""

from __future__ import annotations

import base64
import json

import pytest
from django.test import Client
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from queues.filters import MESSAGE_FILTERS, QUEUE_FILTERS
from tests.support.operator_factories import api_client, make_message, make_queue, make_user
from tracking.search import PARAMETERS as TRACKING_PARAMETERS

pytestmark = pytest.mark.django_db

NASTY = [
    "",
    " ",
    "-1",
    "0",
    "1.5h",
    "99999999999w",
    "99999999999999d",
    "1e309",
    "nan",
    "9" * 25,
    "99999999999999999999GB",
    "2026-02-30T00:00:00Z",
    "0001-01-01T00:00:00+05:00",
    "9999-12-31T23:59:59-05:00",
    "2026-01-01T00:00:00+25:00",
    "2026-01-01T00:00:00",
    "\x00",
    "a\x00b",
    "%",
    "_",
    "\\",
    "[",
    "(",
    "#" * 200,
    "# " * 100,
    "<>",
    "１２",
    "²",
    "٣",
    ",",
    "ready,,retry",
    "-received",
    "-",
    "--size",
    "AAAA",
    "eyJ4IjoxfQ",  # base64 of a JSON that is not a cursor
    "WyIyMDI2LTAxLTAxIiwxZTMwLCJuIl0",  # ["2026-01-01",1e30,"n"]
    "WzEsOTk5OTk5OTk5OTk5OTk5OTk5OTk5LCJuIl0",  # [1,999999999999999999999,"n"]
    "x" * 1200,
]
VALUES = st.one_of(
    st.sampled_from(NASTY),
    st.text(st.characters(blacklist_categories=("Cs",)), max_size=40),
    st.integers(min_value=-(2**70), max_value=2**70).map(str),
)
UI_LISTS = {
    "/messages/": [p.name for p in MESSAGE_FILTERS] + ["sort", "cursor", "limit"],
    "/queues/": [p.name for p in QUEUE_FILTERS] + ["sort", "cursor"],
    "/audit/": ["action", "actor", "target_type", "via", "since", "cursor"],
    "/deferrals/": ["queue"],
    "/live.json": ["queues", "messages"],
    "/tracking/": [*TRACKING_PARAMETERS, "limit", "cursor"],
}
KINDS = {p.name: p.kind for p in (*MESSAGE_FILTERS, *QUEUE_FILTERS)} | {
    "since": "when",
    "until": "when",
    "limit": "int",
    "top": "int",
    "cursor": "cursor",
}


def _cursor(items: list) -> str:
    raw = json.dumps(items).encode()
    return base64.urlsafe_b64encode(raw).decode().rstrip("=")


# Numbers at the edges (hypothesis alone starts small): a day count past
# timedelta's, bigint's limits, more digits than anything holds.
EDGES = [0, 1, 59, 10**6, 10**9, 10**11, 10**13, 10**15, 10**20, 2**63 - 1, 2**63, 10**30]
NUMBERS = st.one_of(st.sampled_from(EDGES), st.integers(0, 10**20))
# Values shaped like what each kind of parameter parses, out of range as often as not.
BY_KIND = {
    "when": st.one_of(
        st.builds("{}{}".format, NUMBERS, st.sampled_from("wdhms")),
        st.builds(
            "{:04d}-{:02d}-{:02d}T{:02d}:00:00{}".format,
            st.integers(0, 10000),
            st.integers(0, 13),
            st.integers(0, 32),
            st.integers(0, 25),
            st.sampled_from(["Z", "+05:00", "-14:00", "+25:00", ""]),
        ),
    ),
    "size": st.builds("{}{}".format, NUMBERS, st.sampled_from(["", "K", "MB", "GB", "X"])),
    "int": st.one_of(NUMBERS, st.integers(-(2**70), 2**70)).map(str),
    "cursor": st.builds(
        _cursor,
        st.lists(
            st.one_of(
                NUMBERS,
                st.integers(-(2**80), 2**80),
                st.text(max_size=30),
                st.none(),
                st.sampled_from(["n", "p", "2026-01-01T00:00:00+00:00", "0001-01-01"]),
            ),
            max_size=4,
        ),
    ),
}


def _values(name: str):
    kind = BY_KIND.get(KINDS.get(name, ""))
    return VALUES if kind is None else st.one_of(kind, kind, VALUES)


def _list_endpoints(client) -> dict[str, list[str]]:
    """Every GET path of the schema without a path parameter, and its query parameters."""
    schema = client.get("/api/schema/", HTTP_ACCEPT="application/vnd.oai.openapi+json").json()
    out = {}
    for path, operations in schema["paths"].items():
        if "{" in path or "get" not in operations or path == "/api/schema/":
            continue
        names = [p["name"] for p in operations["get"].get("parameters", []) if p["in"] == "query"]
        out[path] = names
    return out


# Every parameter of every list gets each of these (not left to sampling): the
# values that broke a list before (NUL in a query, a duration past timedelta,
# a number past bigint); dates and long text come through NASTY and BY_KIND.
HOSTILE = ["a\x00b", "99999999999999d", "9" * 25]


def _targets() -> tuple[dict, list[tuple[str, str, list[str]]]]:
    """The clients by edge and role, and every list (edge, path, its parameters)."""
    queue = make_queue()
    make_message("u@example.net", queue=queue, last_text="greylisted 4.7.1 try later")
    roles = {role: make_user(role, f"fuzz-{role}") for role in ("viewer", "operator")}
    api = {role: api_client(user) for role, user in roles.items()}
    ui = {}
    for role, user in roles.items():
        ui[role] = Client()
        ui[role].force_login(user)
    endpoints = _list_endpoints(api["operator"])
    assert "/api/v1/messages/" in endpoints and "older_than" in endpoints["/api/v1/messages/"]
    assert {"since", "until", "message_id"} <= set(endpoints["/api/v1/tracking/"])
    assert len(endpoints) >= 7
    targets = [("api", path, names) for path, names in sorted(endpoints.items())]
    targets += [("ui", path, names) for path, names in sorted(UI_LISTS.items())]
    return {"api": api, "ui": ui}, targets


def test_no_list_parameter_answers_5xx_to_a_hostile_value():
    """Each parameter of each list (API and Queue Viewer, tracking search included),
    with each HOSTILE value: a 200, or a 4xx (the API's a JSON 400 naming it)."""
    clients, targets = _targets()
    checked = 0
    for edge, path, names in targets:
        # The operator sees every parameter (a viewer is refused message_id: 403).
        client = clients[edge]["operator"]
        for name in names:
            for value in HOSTILE:
                response = client.get(path, {name: value})
                assert response.status_code < 500, (path, name, value[:30])
                if edge == "api" and response.status_code == 400:
                    assert response.json()["detail"], (path, name, value[:30])
                checked += 1
    assert checked > 200


def test_no_list_endpoint_answers_5xx_to_generated_parameters():
    """Each query parameter of each list, with values of its kind, alone or with another."""
    clients, targets = _targets()
    api, ui = clients["api"], clients["ui"]
    checked = 0
    for edge, path, names in targets:
        for name in names or ["x"]:
            _fuzz(api if edge == "api" else ui, edge, path, name, names)
            checked += 1
    assert checked > 50


def _fuzz(clients, edge: str, path: str, name: str, names: list[str]) -> None:
    @settings(
        max_examples=6,
        deadline=None,
        derandomize=True,
        database=None,
        suppress_health_check=[HealthCheck.too_slow],
    )
    @given(
        role=st.sampled_from(sorted(clients)),
        value=_values(name),
        other=st.dictionaries(st.sampled_from(names or ["x"]), VALUES, max_size=1),
    )
    def run(role, value, other):
        params = {**other, name: value}
        response = clients[role].get(path, params)
        assert response.status_code < 500, (path, params, response.status_code)
        if edge == "api" and response.status_code == 400:
            assert response.json()["detail"]  # a clear message, naming the parameter

    run()
