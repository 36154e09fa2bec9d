"""``retrytest``: which retry rule applies, and its schedule (Exim's ``-brt``).

    python manage.py retrytest user@example.com --error rcpt_452 --sender ''
    python manage.py retrytest example.com --host mx1.example.com --error timeout_connect_MX

Rules come from ``--rules FILE``; without it, the active rule list: the file
named by ``MAILRELAY_RETRY_RULES`` followed by the rules compiled from the
Exchange retry settings (delivery.smtp.retry). The schedule is shown relative to
the first failure, so it needs no clock, up to ``--until`` (default: the
message expiration timeout, when Exchange's expiry ends every schedule).
"""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from itertools import groupby

from django.conf import settings
from django.core.management.base import BaseCommand, CommandError, CommandParser

# The engine options from settings, as the active rules use them (a --rules file too).
from delivery.smtp.retry import options as settings_options
from delivery.smtp.retry import rules as active_rules
from delivery.smtp.retryrules import (
    RetryRuleError,
    RetryRules,
    Rule,
    load_rules_or_default,
    parse_error_name,
)
from delivery.smtp.retryschedule import ScheduledTry, projected_schedule
from queues.lib import format_duration, parse_duration

# A final cutoff this long is "never" (delivery.smtp.retry.FOREVER): project to expiry.
NEVER_ENDS = timedelta(days=365)
# Any fixed instant will do: only offsets from it are printed.
_EPOCH = datetime(2000, 1, 1, tzinfo=UTC)


def _offset(at: datetime) -> str:
    return "+" + format_duration(at - _EPOCH)


class Command(BaseCommand):
    help = (
        "Show which retry rule applies to an address (or host) and error, and the "
        "retry schedule it gives (like exim -brt)."
    )

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("address", help="an address (local@domain) or a domain")
        parser.add_argument(
            "--error",
            default=None,
            help="the error, e.g. rcpt_452, timeout_connect_MX, refused_A, quota_5d "
            "(without it only rules with error * apply)",
        )
        parser.add_argument(
            "--sender",
            default=None,
            help="the envelope sender ('' or '<>' for bounces); without it rules "
            "with senders= never apply",
        )
        parser.add_argument(
            "--host",
            default=None,
            help="for a host error: the host name (or IP), matched before the domain",
        )
        parser.add_argument(
            "--rules",
            default=None,
            help="rule file (default: MAILRELAY_RETRY_RULES + the Exchange settings' rules)",
        )
        parser.add_argument(
            "--until",
            default=None,
            help="how far to project the schedule (default: MAILRELAY_MESSAGE_EXPIRATION_TIMEOUT)",
        )

    def handle(self, *args, **options) -> None:
        path = options["rules"]
        try:
            # Options from settings are validated here too (retry_interval_max <= 24h).
            if path is None:
                rules = active_rules()
            else:
                rules = load_rules_or_default(path, options=settings_options())
        except RetryRuleError as exc:
            raise CommandError(f"bad retry rules: {exc}") from None
        try:
            self.until = parse_duration(options["until"]) if options["until"] else None
        except ValueError as exc:
            raise CommandError(f"--until: {exc}") from None

        error = None
        if options["error"] is not None:
            try:
                error = parse_error_name(options["error"])
            except ValueError as exc:
                raise CommandError(f"--error: {exc}") from None

        address, host, sender = options["address"], options["host"], options["sender"]
        rule = rules.find(address, host=host, error=error, sender=sender)
        self._header(rules, address, host, error, sender)
        if rule is None:
            self.stdout.write(
                "No retry rule applies: a temporary error is treated as permanent "
                "(the address fails at once)."
            )
            return
        self.stdout.write(f"Retry rule: line {rule.line}: {rule.text}")
        self._schedule(rules, rule, int(options.get("verbosity", 1)))

    def _header(self, rules: RetryRules, address, host, error, sender) -> None:
        self.stdout.write(f"Rules: {rules.source}")
        self.stdout.write(f"Address: {address}")
        if host:
            self.stdout.write(f"Host: {host} (matched first, then the domain)")
        self.stdout.write(f"Error: {error if error is not None else '(none: only * rules)'}")
        if sender is None:
            self.stdout.write("Sender: (none: rules with senders= do not apply)")
        else:
            self.stdout.write(f"Sender: <{sender.strip('<>')}>")

    def _schedule(self, rules: RetryRules, rule: Rule, verbosity: int) -> None:
        if not rule.params:
            self.stdout.write("No retries: a temporary error fails the address at once.")
            return
        limit = 10_000
        until = self.until
        expiration = settings.MAILRELAY_MESSAGE_EXPIRATION_TIMEOUT
        if until is None and (rule.final_cutoff is None or rule.final_cutoff >= NEVER_ENDS):
            # A rule that never ends (Exchange's compiled rules): expiry ends the tries.
            until = expiration
        tries = projected_schedule(
            rule, _EPOCH, _EPOCH + until if until else None, options=rules.options, limit=limit
        )
        if until:
            self.stdout.write(
                f"(projected for {format_duration(until)} after the first failure; messages "
                f"expire {format_duration(expiration)} after arrival)"
            )
        cutoff = format_duration(rule.final_cutoff or timedelta(0))
        self.stdout.write(
            f"Schedule after a first failure at +0s (retry_interval_max "
            f"{format_duration(rules.options.retry_interval_max)}, final cutoff {cutoff}):"
        )
        if verbosity >= 2:
            for number, item in enumerate(tries, start=1):
                self.stdout.write(
                    f"  retry {number}: {_offset(item.at)} (after "
                    f"{format_duration(item.interval)}, {item.param_set})"
                )
        else:
            self._grouped(tries)
        if any(p.algorithm == "H" for p in rule.params):
            self.stdout.write("  (H intervals are random; shown at the top of their range)")
        if tries and tries[-1].final:
            self.stdout.write(
                f"Final attempt: retry {len(tries)} at {_offset(tries[-1].at)}; if it fails "
                "the address times out and bounces."
            )
        elif len(tries) >= limit:
            self.stdout.write(f"(schedule truncated after {limit} retries)")
        self.stdout.write(
            f"A message queued for longer than {cutoff} is tried once at the next queue "
            "run and bounces if that fails."
        )

    def _grouped(self, tries: list[ScheduledTry]) -> None:
        """One line per run of equal intervals from the same parameter set."""
        number = 1
        for (param_set, interval), run in groupby(tries, key=lambda t: (t.param_set, t.interval)):
            items = list(run)
            first, last = number, number + len(items) - 1
            if len(items) == 1:
                line = (
                    f"  retry {first}: {_offset(items[0].at)} "
                    f"(after {format_duration(interval)}, {param_set})"
                )
            else:
                line = (
                    f"  retries {first}-{last}: every {format_duration(interval)}, "
                    f"{_offset(items[0].at)} to {_offset(items[-1].at)} ({param_set})"
                )
            self.stdout.write(line)
            number = last + 1
