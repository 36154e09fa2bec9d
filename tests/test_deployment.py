"""docker-compose.yml cannot run here (no Docker engine); keep it honest instead:
every service it declares runs a command that exists in this project."""

from pathlib import Path

import yaml
from django.core.management import get_commands

ROOT = Path(__file__).resolve().parents[1]


def compose() -> dict:
    return yaml.safe_load((ROOT / "docker-compose.yml").read_text())


def test_compose_declares_every_part_of_the_relay():
    services = compose()["services"]
    assert set(services) >= {"postgres", "redis", "migrate", "web", "smtp", "worker", "beat"}
    for name in ("postgres", "redis", "web", "smtp", "worker"):
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
