"""docker-compose.yml cannot run here (no Docker engine); keep it honest instead:
every service it declares runs a command that exists in this project."""

import re
from pathlib import Path

import yaml
from django.core.management import get_commands

ROOT = Path(__file__).resolve().parents[1]


def compose() -> dict:
    return yaml.safe_load((ROOT / "docker-compose.yml").read_text())


def test_compose_declares_every_part_of_the_relay():
    services = compose()["services"]
    assert set(services) >= {
        *("postgres", "redis", "migrate", "web", "smtp"),
        *("worker-control", "worker-delivery", "worker-webhooks", "beat"),
    }
    for name in (
        *("postgres", "redis", "web", "smtp"),
        *("worker-control", "worker-delivery", "worker-webhooks"),
    ):
        assert "healthcheck" in services[name], name
    assert services["migrate"]["restart"] == "no"
    assert "pgdata" in compose()["volumes"]


def test_compose_commands_are_real_commands_of_this_project():
    commands = get_commands()
    for name, service in compose()["services"].items():
        cmd = service.get("command")
        if not cmd or name in ("postgres", "redis"):
            continue
        if cmd[:2] == ["python", "manage.py"]:
            assert cmd[2] in commands, f"{name}: manage.py {cmd[2]} does not exist"
        elif cmd[0] == "celery":
            assert cmd[1:3] == ["-A", "mailrelay"] and cmd[3] in ("worker", "beat"), name
        elif cmd[0] == "gunicorn":
            assert cmd[1] == "mailrelay.wsgi", name
        else:
            raise AssertionError(f"{name}: unexpected command {cmd}")


def test_the_env_example_names_only_documented_settings():
    readme = (ROOT / "README.md").read_text()
    for line in (ROOT / ".env.example").read_text().splitlines():
        if line and not line.startswith("#"):
            name = line.split("=", 1)[0]
            assert f"`{name}`" in readme, f"{name} is not documented in README.md"


def _option(cmd: list[str], name: str) -> str:
    return cmd[cmd.index(name) + 1]


def test_compose_and_make_run_start_a_control_and_a_delivery_worker():
    """Routing and the sweep on their own queue and processes; deliveries on
    threads (tests/test_isolation.py shows why)."""
    from mailrelay.management.commands.runall import Command

    services = compose()["services"]
    run = Command()._commands()
    for cmd in (services["worker-control"]["command"], run["worker-control"]):
        assert _option(cmd, "-Q") == "control"
        assert "--pool" not in cmd  # prefork
    for cmd in (services["worker-delivery"]["command"], run["worker-delivery"]):
        assert _option(cmd, "-Q") == "delivery"
        assert _option(cmd, "--pool") == "threads"
    for cmd in (services["worker-webhooks"]["command"], run["worker-webhooks"]):
        assert _option(cmd, "-Q") == "webhooks"
        assert _option(cmd, "--pool") == "threads"
    assert "MAILRELAY_DELIVERY_CONCURRENCY" in _option(
        services["worker-delivery"]["command"], "--concurrency"
    )


def test_tasks_are_routed_to_the_queues_the_workers_consume():
    from mailrelay.celery import app

    queue_of = {
        name: app.amqp.router.route({}, name)["queue"].name
        for name in ("delivery.tasks.categorize", "delivery.tasks.sweep")
    }
    assert queue_of == {"delivery.tasks.categorize": "control", "delivery.tasks.sweep": "control"}
    assert app.amqp.router.route({}, "delivery.tasks.deliver_link")["queue"].name == "delivery"
    assert app.amqp.router.route({}, "tracking.tasks.send_webhooks")["queue"].name == "webhooks"
    # A worker started without -Q consumes them all (an old single-worker setup keeps working).
    assert {q.name for q in app.conf.task_queues} == {"control", "delivery", "webhooks"}


def test_beat_runs_every_periodic_task():
    """Every periodic task is in the beat schedule (a settings block that assigned
    CELERY_BEAT_SCHEDULE again once dropped the alerts and the deferral summary)."""
    from mailrelay.celery import app

    app.loader.import_default_modules()
    app.finalize()
    tasks = {entry["task"] for entry in app.conf.beat_schedule.values()}
    assert tasks >= {
        "delivery.tasks.sweep",
        "delivery.tasks.reclaim",
        "insight.tasks.refresh",
        "tracking.tasks.maintain",
        "tracking.tasks.webhook_sweep",
    }


def _pins() -> dict[str, str]:
    pins = {}
    for line in (ROOT / "constraints.txt").read_text().splitlines():
        if line and not line.startswith("#"):
            name, _, version = line.partition("==")
            pins[name.lower().replace("_", "-")] = version
    return pins


def test_every_dependency_is_pinned_and_installed_from_the_constraints():
    import tomllib

    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    wanted = [*project["dependencies"], *project["optional-dependencies"]["dev"]]
    names = {re.split(r"[\[<>=!~ ;]", req, maxsplit=1)[0].lower() for req in wanted}
    pins = _pins()
    assert not names - set(pins), "not pinned in constraints.txt"
    assert pins["celery"] != "5.7.0"  # dies on a Redis restart (test_broker_restart.py)
    assert "-c constraints.txt" in (ROOT / "Makefile").read_text()
    assert "-c constraints.txt" in (ROOT / "Dockerfile").read_text()
