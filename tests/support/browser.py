"""A real browser for the Queue Viewer tests: Playwright driving Debian's Chromium.

No browser is downloaded (``playwright install`` is never run): Playwright
starts the system's ``/usr/bin/chromium`` (``MAILRELAY_CHROMIUM`` overrides
the path), headless, against pytest-django's ``live_server``.

Fixtures:

- ``browser`` (per module): one Chromium for the module's tests;
- ``page``: a fresh browser context (no cookies) at 1280×800 whose relative
  URLs resolve against the live server, downloads allowed; a JavaScript
  error on any page fails the test.

Helpers:

- ``make_user(name, role)``: a user in the role's group (viewer, operator,
  admin), password ``PASSWORD``;
- ``login(page, name)``: sign in through the login form;
- ``off_loop(fn, *args)``: call ``fn`` in a thread of its own (see below).

Playwright's synchronous API keeps an asyncio event loop running in the test's
thread. Two consequences, handled here: Django refuses ORM calls from a thread
with a running loop unless ``DJANGO_ALLOW_ASYNC_UNSAFE`` is set (it is, while
the browser runs: the loop is Playwright's, no ORM call happens inside it), and
``asyncio.run`` (the engine's outbound SMTP client) cannot start there, so the
engine is driven through ``off_loop``.
"""

from __future__ import annotations

import os
import shutil
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, TypeVar

import pytest
from django.contrib.auth.models import Group, User
from django.db import connections

CHROMIUM = os.environ.get("MAILRELAY_CHROMIUM", "/usr/bin/chromium")
CHROMIUM_ARGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]
VIEWPORT = {"width": 1280, "height": 800}
PASSWORD = "correct horse battery staple"
TIMEOUT_MS = 10_000

T = TypeVar("T")


def make_user(name: str, role: str | None) -> User:
    """A user with ``role`` (a Queue Viewer group) or none; password ``PASSWORD``."""
    user = User.objects.create_user(name, f"{name}@example.org", PASSWORD)
    if role is not None:
        # Transactional tests flush the groups the migration made: make them again.
        group, _ = Group.objects.get_or_create(name=role)
        user.groups.add(group)
    return user


def off_loop(fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
    """Run ``fn`` in a new thread (no event loop there) and return its result.

    The thread's database connection is closed before it ends, so no
    connection outlives the test.
    """
    result: dict[str, Any] = {}

    def run() -> None:
        try:
            result["value"] = fn(*args, **kwargs)
        except BaseException as e:  # noqa: BLE001 - re-raised in the caller
            result["error"] = e
        finally:
            connections.close_all()

    thread = threading.Thread(target=run, name=f"off-loop-{getattr(fn, '__name__', 'fn')}")
    thread.start()
    thread.join()
    if "error" in result:
        raise result["error"]
    return result["value"]


def login(page: Any, name: str, password: str = PASSWORD) -> None:
    page.goto("/accounts/login/")
    page.get_by_label("User name").fill(name)
    page.get_by_label("Password").fill(password)
    page.get_by_role("button", name="Log in").click()
    page.wait_for_url("**/queues/")


@pytest.fixture(scope="module")
def browser() -> Iterator[Any]:
    if not (Path(CHROMIUM).exists() or shutil.which(CHROMIUM)):
        # Not a skip: the browser tests are part of the suite (.ci/run installs it).
        pytest.fail(f"no Chromium at {CHROMIUM}: run `apt-get install chromium`")
    from playwright import sync_api

    previous = os.environ.get("DJANGO_ALLOW_ASYNC_UNSAFE")
    os.environ["DJANGO_ALLOW_ASYNC_UNSAFE"] = "true"
    try:
        with sync_api.sync_playwright() as playwright:
            chromium = playwright.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
            try:
                yield chromium
            finally:
                chromium.close()
    finally:
        if previous is None:
            os.environ.pop("DJANGO_ALLOW_ASYNC_UNSAFE", None)
        else:
            os.environ["DJANGO_ALLOW_ASYNC_UNSAFE"] = previous


@pytest.fixture
def page(browser: Any, live_server: Any) -> Iterator[Any]:
    context = browser.new_context(
        viewport=VIEWPORT, base_url=live_server.url, accept_downloads=True
    )
    context.set_default_timeout(TIMEOUT_MS)
    tab = context.new_page()
    errors: list[str] = []
    tab.on("pageerror", lambda error: errors.append(str(error)))
    try:
        yield tab
    finally:
        context.close()
    assert not errors, f"JavaScript errors: {errors}"
