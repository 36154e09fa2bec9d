"""Exim's retry rules: the language, its parser and rule matching.

This module is pure: no ORM, no settings, no clock. Every function that needs
"now" takes it as an argument, and the randomised H algorithm takes an
``rng``, so a five-day schedule is computed (and tested) in microseconds.
The only I/O is :func:`load_rules`, which reads the file it is given.

The language is Exim's retry configuration (``seeds/exim-retry-configuration.txt``,
"§n" below refers to its sections)::

    # pattern                  error       [senders=list]  parameter sets
    wonderland.fict.example    *           F,1h,15m; G,2d,1h,2
    *                          rcpt_4xx    senders=:       F,1h,30m
    *                          *           F,2h,15m; G,16h,1h,1.5; F,4d,6h

The pieces:

* :func:`parse_rules` / :func:`load_rules` turn text into :class:`RetryRules`,
  raising :class:`RetryRuleError` (with the line number) on any mistake.
* :meth:`RetryRules.find` picks the rule for an address (or host), an error and
  a sender, searching in order as Exim does (§2-§6).
* ``delivery.smtp.retryschedule`` evaluates a rule: the next retry time
  (§7), the whole schedule, and the retry data kept per host/IP or per
  address+sender (§9-§11).
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from datetime import timedelta
from fractions import Fraction
from pathlib import Path
from typing import Literal

from queues.lib import (
    DomainError,
    domain_key,
    format_duration,
    normalise_sender,
    parse_duration,
)

__all__ = [
    "DEFAULT_OPTIONS",
    "DEFAULT_RULES_TEXT",
    "RETRY_INTERVAL_MAX_LIMIT",
    "ErrorName",
    "ParamSet",
    "RetryOptions",
    "RetryRuleError",
    "RetryRules",
    "Rule",
    "load_rules",
    "load_rules_or_default",
    "parse_error_name",
    "parse_rules",
]

#: The rule set used when no rule file is configured (``MAILRELAY_RETRY_RULES`` empty).
DEFAULT_RULES_TEXT = "* * F,2d,15m\n"

#: §7: "retry_interval_max ... cannot be set greater than 24h, which is its default value."
RETRY_INTERVAL_MAX_LIMIT = timedelta(hours=24)

_ZERO = timedelta(0)


class RetryRuleError(ValueError):
    """A retry rule (or option) is wrong. ``str()`` names the source and line."""

    def __init__(self, message: str, *, line: int | None = None, source: str = "") -> None:
        self.message = message
        self.line = line
        self.source = source
        where = source or "retry rules"
        if line is not None:
            where = f"{where}, line {line}"
        super().__init__(f"{where}: {message}")


# --------------------------------------------------------------------------- options


@dataclass(frozen=True)
class RetryOptions:
    """Engine options that Exim keeps outside the retry section.

    ``retry_interval_max`` caps every computed interval (§7, at most 24h);
    ``retry_data_expire`` makes hints older than it be ignored (§9);
    ``delay_after_cutoff`` is the smtp transport option of §10.
    """

    retry_interval_max: timedelta = RETRY_INTERVAL_MAX_LIMIT
    retry_data_expire: timedelta = timedelta(days=7)
    delay_after_cutoff: bool = True

    def __post_init__(self) -> None:
        if self.retry_interval_max <= _ZERO:
            raise RetryRuleError("retry_interval_max must be positive")
        # Refused rather than silently capped: the seed says it *cannot be set*
        # greater than 24h, and a silently different value surprises operators.
        if self.retry_interval_max > RETRY_INTERVAL_MAX_LIMIT:
            raise RetryRuleError(
                f"retry_interval_max {format_duration(self.retry_interval_max)} "
                f"cannot be greater than {format_duration(RETRY_INTERVAL_MAX_LIMIT)}"
            )
        if self.retry_data_expire <= _ZERO:
            raise RetryRuleError("retry_data_expire must be positive")


DEFAULT_OPTIONS = RetryOptions()


# ----------------------------------------------------------------------- error names

ErrorKind = Literal[
    "*",
    "auth_failed",
    "rcpt_4xx",
    "mail_4xx",
    "data_4xx",
    "lost_connection",
    "lookup",
    "refused",
    "timeout",
    "tls_required",
    "quota",
]

_SIMPLE_ERRORS = ("auth_failed", "lost_connection", "lookup", "tls_required")
_SMTP_4XX = re.compile(r"^(rcpt|mail|data)_4([0-9x])([0-9x])$", re.IGNORECASE)
_REFUSED = re.compile(r"^refused(?:_(mx|a))?$", re.IGNORECASE)
_TIMEOUT = re.compile(r"^timeout(_connect)?(?:_(mx|a))?$", re.IGNORECASE)
_QUOTA = re.compile(r"^quota(?:_(.+))?$", re.IGNORECASE)
_PARAM_SET_LIKE = re.compile(r"^[FGH],", re.IGNORECASE)


@dataclass(frozen=True)
class ErrorName:
    """One error name, either in a rule (a pattern) or describing a failure.

    The same language serves both: a rule's ``rcpt_45x`` matches a failure
    described as ``rcpt_452``; a rule's ``timeout`` matches a failure described
    as ``timeout_connect_MX``; a rule's ``quota_5d`` matches a failure described
    as ``quota_6d`` (the mailbox has not been read for six days).

    ``code`` is the SMTP code pattern of the 4xx kinds (``4xx``, ``45x``,
    ``452``); ``origin`` is ``MX``/``A`` for refused/timeout (``None``: any or
    unknown); ``connect`` marks connect timeouts; ``idle`` is the quota time.
    """

    kind: ErrorKind
    code: str = ""
    origin: str | None = None
    connect: bool = False
    idle: timedelta | None = None
    text: str = ""

    def __str__(self) -> str:
        return self.text or self.kind

    def matches(self, failure: ErrorName) -> bool:
        """Does this rule error name cover ``failure``? (Exim's retry_find_config.)"""
        if self.kind == "*":
            return True
        if failure.kind != self.kind:
            return False
        if self.kind in ("rcpt_4xx", "mail_4xx", "data_4xx"):
            if self.code == "4xx":
                return True
            if self.code.endswith("x"):  # 4dx: the decade must match
                return failure.code[:2] == self.code[:2] and failure.code != "4xx"
            return failure.code == self.code
        if self.kind == "refused":
            return self.origin is None or self.origin == failure.origin
        if self.kind == "timeout":
            # timeout_connect* needs a connect timeout; timeout_MX/_A cover both
            # connect and in-session timeouts to that kind of host.
            if self.connect and not failure.connect:
                return False
            return self.origin is None or self.origin == failure.origin
        if self.kind == "quota":
            # §5: quota_<time> applies when the mailbox has not been read for
            # at least <time>; when that time is unknown the rule never matches.
            return self.idle is None or (failure.idle is not None and failure.idle >= self.idle)
        return True


_ANY_ERROR = ErrorName("*", text="*")


def parse_error_name(text: str) -> ErrorName:
    """Parse an error name (``rcpt_452``, ``timeout_connect_MX``, ``quota_4d``...).

    Raises ``ValueError`` with a readable reason. Names are case-insensitive
    (as Exim compares them); the canonical spelling is kept in ``text``.
    """
    name = text.strip()
    lowered = name.lower()
    if name == "*":
        return _ANY_ERROR
    if lowered in _SIMPLE_ERRORS:
        return ErrorName(lowered, text=lowered)  # type: ignore[arg-type]
    match = _SMTP_4XX.match(name)
    if match:
        verb, first, second = match.group(1).lower(), match.group(2), match.group(3)
        # §5: "either the first or both of the x's can be given as specific digits".
        if first == "x" and second != "x":
            raise ValueError(
                f"bad error name {name!r}: {verb}_4 must be followed by xx, dx or dd "
                "(x literally, d a digit)"
            )
        code = f"4{first}{second}".lower()
        return ErrorName(f"{verb}_4xx", code=code, text=f"{verb}_{code}")  # type: ignore[arg-type]
    if lowered.startswith(("rcpt_", "mail_", "data_")):
        raise ValueError(
            f"unknown error name {name!r}: {lowered[:4]}_ must be followed by 4xx, 4dx or 4dd"
        )
    match = _REFUSED.match(name)
    if match:
        origin = match.group(1).upper() if match.group(1) else None
        return ErrorName(
            "refused", origin=origin, text="refused" + (f"_{origin}" if origin else "")
        )
    match = _TIMEOUT.match(name)
    if match:
        connect = match.group(1) is not None
        origin = match.group(2).upper() if match.group(2) else None
        canonical = "timeout" + ("_connect" if connect else "") + (f"_{origin}" if origin else "")
        return ErrorName("timeout", origin=origin, connect=connect, text=canonical)
    match = _QUOTA.match(name)
    if match:
        if match.group(1) is None:
            return ErrorName("quota", text="quota")
        try:
            idle = parse_duration(match.group(1))
        except ValueError:
            raise ValueError(
                f"bad time in {name!r}: quota_ must be followed by a time such as 4d"
            ) from None
        return ErrorName("quota", idle=idle, text=f"quota_{format_duration(idle)}")
    hint = " (is the error name missing?)" if _PARAM_SET_LIKE.match(name) else ""
    raise ValueError(f"unknown error name {name!r}{hint}")


# --------------------------------------------------------------- address-list items


@dataclass(frozen=True)
class _Item:
    """One item of an Exim address list (§2 "any single item ... in an address list")."""

    text: str
    negated: bool
    regex: re.Pattern[str] | None = None  # ^... against the whole address
    local: str | None = None  # local-part pattern (None: domain-only item)
    domain: str = ""  # domain pattern: name, *, *suffix
    domain_regex: re.Pattern[str] | None = None  # local@^regex

    def hits(self, address: str) -> bool:
        """Positive match of the item itself, negation not applied."""
        if self.regex is not None:
            return self.regex.search(address) is not None
        if self.local is None and self.domain == "" and self.domain_regex is None:
            return address == ""  # the empty item: the null sender (senders=:)
        local, at, domain = address.rpartition("@")
        if not at:
            return False
        if self.local is not None and not _match_local(self.local, local):
            return False
        if self.domain_regex is not None:
            return self.domain_regex.search(domain) is not None
        return _match_domain(self.domain, domain)


def _match_local(pattern: str, local: str) -> bool:
    if pattern == "*":
        return True
    if pattern.startswith("*"):
        return local.lower().endswith(pattern[1:].lower())
    return local.lower() == pattern.lower()


def _domain_form(domain: str) -> str:
    """The one form of a domain (queues.lib), so a rule written with a
    U-label or full-width letters matches the A-label the relay routes by."""
    try:
        return domain_key(domain)
    except DomainError:
        return domain.lower().rstrip(".")


def _pattern_form(pattern: str) -> str:
    if pattern == "*":
        return pattern
    if pattern.startswith("*."):
        return "*." + _domain_form(pattern[2:])
    if pattern.startswith("*"):
        return pattern.lower()
    return _domain_form(pattern)


def _match_domain(pattern: str, domain: str) -> bool:
    domain = _domain_form(domain)
    if pattern == "*":
        return True
    if pattern.startswith("*"):
        # Exim: "*.example.com" matches any domain ending in ".example.com"
        # (not example.com itself); "*example.com" also matches "myexample.com".
        return domain.endswith(pattern[1:])
    return domain == pattern


def _compile_regex(text: str) -> re.Pattern[str]:
    try:
        # Address lists are matched caselessly in Exim.
        return re.compile(text, re.IGNORECASE)
    except re.error as exc:
        raise ValueError(f"bad regular expression {text!r}: {exc}") from None


def _compile_item(raw: str) -> _Item:
    """Compile one address-list item; ``ValueError`` for what we do not support."""
    text = raw.strip()
    negated = False
    if text.startswith("!"):
        negated = True
        text = text[1:].strip()
        if not text:
            raise ValueError("'!' must be followed by a pattern")
    # \N...\N protects text from Exim's string expansion; we do not expand, so
    # the markers are dropped (the seed's example regex uses them).
    text = text.replace("\\N", "")
    if text.startswith("^"):
        return _Item(raw.strip(), negated, regex=_compile_regex(text))
    if text.startswith("+"):
        raise ValueError(f"named lists are not supported ({text!r})")
    if ";" in text:
        raise ValueError(f"lookups are not supported ({text!r})")
    if text == "":
        return _Item(raw.strip(), negated)
    local: str | None = None
    domain = text
    if "@" in text:
        local, _, domain = text.rpartition("@")
        if local == "":
            raise ValueError(f"{text!r}: @-forms (@, @[], @mx_any ...) are not supported")
    if domain == "":
        raise ValueError(f"{text!r} has no domain")
    if domain.startswith("^"):
        return _Item(raw.strip(), negated, local=local, domain_regex=_compile_regex(domain))
    if domain.startswith("@") or "@" in domain:
        raise ValueError(f"{text!r}: @-forms (@, @[], @mx_any ...) are not supported")
    # A plain domain is treated as if preceded by "*@" (§2).
    return _Item(raw.strip(), negated, local=local, domain=_pattern_form(domain))


def _match_list(items: tuple[_Item, ...], address: str) -> bool:
    """Exim list semantics: first item that hits decides (a negated hit means
    no match); at the end, a list whose last item is negated matches."""
    for item in items:
        if item.hits(address):
            return not item.negated
    return bool(items) and items[-1].negated


def _split_list(text: str) -> list[str]:
    """Split an Exim colon-separated list; ``::`` is a literal colon.

    ``senders=:`` is the list holding one empty item, i.e. the null sender.
    """
    items: list[str] = []
    current: list[str] = []
    i = 0
    while i < len(text):
        char = text[i]
        if char == ":":
            if text[i + 1 : i + 2] == ":":
                current.append(":")
                i += 2
                continue
            items.append("".join(current).strip())
            current = []
        else:
            current.append(char)
        i += 1
    items.append("".join(current).strip())
    if len(items) > 1 and items[-1] == "":
        items.pop()  # a trailing separator ends the list, it is not an empty item
    if items == [""] and text.strip() == "":
        return []  # an empty list matches nothing
    return items


# ------------------------------------------------------------------------- the rules


@dataclass(frozen=True)
class ParamSet:
    """One retry parameter set: ``F,cutoff,interval`` or ``G|H,cutoff,start,multiplier``.

    ``cutoff`` is measured from the first failure; the set applies while the
    destination has been failing for no longer than ``cutoff`` (§7: the time
    "beyond which this algorithm no longer applies").
    """

    algorithm: Literal["F", "G", "H"]
    cutoff: timedelta
    interval: timedelta  # F: the interval; G/H: the starting (and minimum) interval
    multiplier: Fraction = Fraction(1)
    text: str = ""

    def __str__(self) -> str:
        return self.text


@dataclass(frozen=True)
class Rule:
    """One retry rule as written on ``line`` of the rule file."""

    line: int
    text: str
    pattern: str
    error: ErrorName
    senders: str | None
    params: tuple[ParamSet, ...]
    _pattern_items: tuple[_Item, ...] = field(repr=False, compare=False, default=())
    _sender_items: tuple[_Item, ...] | None = field(repr=False, compare=False, default=None)

    @property
    def final_cutoff(self) -> timedelta | None:
        """The last parameter set's cutoff: how long a destination may fail in
        total. ``None`` when the rule has no parameter sets (fail at once)."""
        return self.params[-1].cutoff if self.params else None

    @property
    def params_text(self) -> str:
        return "; ".join(p.text for p in self.params)

    def matches_error(self, failure: ErrorName | None) -> bool:
        # Without an error (exim -brt without one) only '*' rules apply.
        if failure is None:
            return self.error.kind == "*"
        return self.error.matches(failure)

    def matches_sender(self, sender: str | None) -> bool:
        if self._sender_items is None:
            return True
        # §6: a rule with senders= never matches when the sender is unknown.
        if sender is None:
            return False
        return _match_list(self._sender_items, normalise_sender(sender))

    def matches_key(self, key: str) -> bool:
        return _match_list(self._pattern_items, key)


@dataclass(frozen=True)
class RetryRules:
    """An ordered rule set plus the engine options."""

    rules: tuple[Rule, ...]
    options: RetryOptions = DEFAULT_OPTIONS
    source: str = ""

    def __iter__(self) -> Iterator[Rule]:
        return iter(self.rules)

    def __len__(self) -> int:
        return len(self.rules)

    def find(
        self,
        address: str,
        host: str | None = None,
        error: str | ErrorName | None = None,
        sender: str | None = None,
    ) -> Rule | None:
        """The first rule whose pattern, error name and senders all match, or ``None``.

        Steps (Exim's ``retry_find_config``, §3-§6):

        1. Build the keys. For a host error (``host`` given) the keys are
           ``*@host`` and then ``*@domain`` of ``address`` (§4: the host name
           first, then the domain; ``host`` may be an IP literal). Otherwise
           the key is ``address`` itself when it has a local part (RCPT 4xx
           and local errors use the whole address, §3) or ``*@domain`` when
           ``address`` is a bare domain (routing errors use only the domain).
        2. Scan the rules in order; skip a rule whose error name does not
           cover ``error`` (no error: only ``*`` rules) or whose ``senders=``
           list does not match ``sender`` (unknown sender: never matches).
        3. The first rule whose pattern matches any key wins. ``None`` means
           no retries: temporary errors are treated as permanent.

        Raises ``ValueError`` for an unknown error name.
        """
        failure = parse_error_name(error) if isinstance(error, str) else error
        domain = address.rpartition("@")[2]
        if host:
            keys = [f"*@{host.strip().lower().rstrip('.')}", f"*@{domain}"]
        elif "@" in address:
            keys = [address]
        else:
            keys = [f"*@{address}"]
        for rule in self.rules:
            if not rule.matches_error(failure) or not rule.matches_sender(sender):
                continue
            if any(rule.matches_key(key) for key in keys):
                return rule
        return None


# --------------------------------------------------------------------------- parser


def _logical_lines(text: str) -> Iterable[tuple[int, str]]:
    """Yield ``(first line number, joined text)`` for each rule line.

    Exim's configuration syntax: ``#`` as the first non-blank character makes
    a comment line (``#`` later on a line is data: regexes may contain it);
    blank lines are ignored; a line ending in ``\\`` continues on the next
    line, whose leading white space is dropped; comment lines inside a
    continuation are skipped and a blank line ends it.
    """
    current: list[str] = []
    start = 0
    for number, raw in enumerate(text.splitlines(), start=1):
        stripped = raw.strip()
        if current:
            if stripped.startswith("#"):
                continue
            if stripped == "":
                yield start, " ".join(current)
                current = []
                continue
        elif stripped == "" or stripped.startswith("#"):
            continue
        else:
            start = number
        if stripped.endswith("\\"):
            current.append(stripped[:-1].strip())
            continue
        current.append(stripped)
        yield start, " ".join(part for part in current if part)
        current = []
    if current:
        yield start, " ".join(part for part in current if part)


def _take_field(line: str, pos: int) -> tuple[str, int]:
    """Read one white-space separated field, double quotes allowed (``\\"`` inside)."""
    while pos < len(line) and line[pos].isspace():
        pos += 1
    if pos < len(line) and line[pos] == '"':
        pos += 1
        out: list[str] = []
        while pos < len(line):
            char = line[pos]
            if char == "\\" and line[pos + 1 : pos + 2] in ('"', "\\"):
                out.append(line[pos + 1])
                pos += 2
                continue
            if char == '"':
                return "".join(out), pos + 1
            out.append(char)
            pos += 1
        raise ValueError("unterminated quoted string")
    end = pos
    while end < len(line) and not line[end].isspace():
        end += 1
    return line[pos:end], end


def _parse_param_sets(text: str) -> tuple[ParamSet, ...]:
    pieces = [piece.strip() for piece in text.split(";")]
    if pieces and pieces[-1] == "":
        pieces.pop()  # a trailing ';' is allowed (the seed's examples have one)
    sets: list[ParamSet] = []
    for index, piece in enumerate(pieces, start=1):
        if piece == "":
            raise ValueError(f"parameter set {index} is empty (two semicolons in a row?)")
        parts = [part.strip() for part in piece.split(",")]
        letter = parts[0].upper()
        shown = ",".join([letter, *parts[1:]])
        if letter not in ("F", "G", "H"):
            raise ValueError(f"unknown retry algorithm {parts[0]!r} in {piece!r} (use F, G or H)")
        wanted = 3 if letter == "F" else 4
        if len(parts) != wanted:
            form = (
                "F,<cutoff>,<interval>"
                if letter == "F"
                else (f"{letter},<cutoff>,<start>,<multiplier>")
            )
            raise ValueError(
                f"{piece!r} has {len(parts) - 1} argument(s), {letter} takes {wanted - 1}: "
                f"the form is {form}"
            )
        cutoff = _param_time(parts[1], "cutoff time", piece)
        interval = _param_time(parts[2], "interval" if letter == "F" else "start", piece)
        if interval <= _ZERO:
            raise ValueError(f"the interval in {piece!r} must be more than 0")
        multiplier = Fraction(1)
        if letter != "F":
            try:
                multiplier = Fraction(parts[3])
            except (ValueError, ZeroDivisionError):
                raise ValueError(f"bad multiplier {parts[3]!r} in {piece!r}") from None
            # Geometric means growing intervals; below 1 they would shrink to
            # the start value and the rule would silently act as F.
            if multiplier < 1:
                raise ValueError(f"the multiplier in {piece!r} must be at least 1")
        if sets and cutoff <= sets[-1].cutoff:
            raise ValueError(
                f"the cutoff of {piece!r} is not later than the cutoff of "
                f"{sets[-1].text!r}, so it would never be used"
            )
        sets.append(ParamSet(letter, cutoff, interval, multiplier, shown))  # type: ignore[arg-type]
    return tuple(sets)


def _param_time(text: str, what: str, piece: str) -> timedelta:
    try:
        value = parse_duration(text)
    except ValueError:
        raise ValueError(f"bad {what} {text!r} in {piece!r} (e.g. 15m, 2h, 4d)") from None
    if value < _ZERO:
        raise ValueError(f"the {what} in {piece!r} must not be negative")
    return value


def _parse_rule(number: int, line: str) -> Rule:
    pattern, pos = _take_field(line, 0)
    if pattern == "":
        raise ValueError("missing pattern")
    pattern_items = (_compile_item(pattern),)
    error_text, pos = _take_field(line, pos)
    if error_text == "":
        raise ValueError(f"missing error name after pattern {pattern!r} (use * for any error)")
    error = parse_error_name(error_text)
    rest = line[pos:].strip()
    senders: str | None = None
    sender_items: tuple[_Item, ...] | None = None
    if rest.lower().startswith("senders"):
        after = rest[len("senders") :].lstrip()
        if not after.startswith("="):
            raise ValueError("'=' expected after 'senders'")
        after = after[1:].lstrip()
        if after == "":
            raise ValueError("senders= needs an address list (senders=: for bounces)")
        senders, used = _take_field(after, 0)
        rest = after[used:].strip()
        sender_items = tuple(_compile_item(item) for item in _split_list(senders))
    params = _parse_param_sets(rest) if rest else ()
    return Rule(
        line=number,
        text=line,
        pattern=pattern,
        error=error,
        senders=senders,
        params=params,
        _pattern_items=pattern_items,
        _sender_items=sender_items,
    )


def parse_rules(
    text: str, *, source: str = "", options: RetryOptions = DEFAULT_OPTIONS
) -> RetryRules:
    """Parse a retry rules text; any mistake raises :class:`RetryRuleError`.

    One rule per (logical) line: ``pattern error [senders=list] [sets]``,
    fields separated by white space, pattern and sender list in double
    quotes if they contain white space, parameter sets separated by ``;``.
    A rule without parameter sets is valid: its errors fail at once (§8).
    An Exim ``begin retry`` line is accepted and ignored, so an Exim retry
    section can be pasted as it is.
    """
    rules: list[Rule] = []
    for number, line in _logical_lines(text):
        if line.lower() == "begin retry":
            continue
        try:
            rules.append(_parse_rule(number, line))
        except ValueError as exc:
            raise RetryRuleError(str(exc), line=number, source=source) from None
    return RetryRules(tuple(rules), options, source)


def load_rules(path: str | Path, *, options: RetryOptions = DEFAULT_OPTIONS) -> RetryRules:
    """Read and parse a rule file. An unreadable file is a :class:`RetryRuleError`."""
    try:
        text = Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise RetryRuleError(f"cannot read the rule file: {exc}", source=str(path)) from None
    return parse_rules(text, source=str(path), options=options)


def load_rules_or_default(
    path: str | Path | None, *, options: RetryOptions = DEFAULT_OPTIONS
) -> RetryRules:
    """:func:`load_rules` for a configured path, :data:`DEFAULT_RULES_TEXT` when empty."""
    if not path or not str(path).strip():
        return parse_rules(DEFAULT_RULES_TEXT, source="built-in default rules", options=options)
    return load_rules(str(path).strip(), options=options)
