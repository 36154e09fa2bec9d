"""The back-pressure engine: readings in, levels and MAIL FROM decisions out.

Pure code (no I/O, no Django models, no clock): the monitor feeds it one
``Sample`` per resource per interval, table tests feed it whatever they like.

Per resource and interval (``ResourceTracker.observe``):

1. resolve the thresholds (a percentage threshold of 0 means Exchange's
   formula, which may depend on the sample: disk size, physical memory);
2. compute the level with hysteresis (``next_level``): up as soon as the
   reading reaches medium or high, down only when it falls below the next
   lower threshold;
3. count the intervals the resource has been under pressure (not normal)
   without a break, and keep a short history of levels;
4. move the tarpit delay of a tarpit resource: ``start`` on the first
   interval under pressure, ``+ step`` each further one, capped at ``max``;
   back at normal it comes down by ``step`` per interval;
5. derive the action (``ResourceTracker.action``).

The actions (the seed's table, as the issue states it):

- high, any resource: refuse every MAIL FROM (trusted clients too);
- medium, disk and memory resources: refuse untrusted clients — for a
  resource with a history depth (private bytes) only once it has been under
  pressure for that many intervals;
- medium, tarpit resources (version buckets, batch points, submission
  queue): tarpit untrusted clients; once under pressure for the history
  depth, refuse them instead, until the resource is back to normal;
- a tarpit delay left over when the pressure ends keeps delaying untrusted
  clients while it comes down step by step.

Pickup and replay stop whenever an untrusted client would be refused.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from enum import StrEnum

MiB = 1024**2
GiB = 1024**3
TiB = 1024**4

# Exchange's constants behind the disk and memory formulas.
DATABASE_DISK_RESERVE = 500 * MiB  # free space kept for the queue database
CHECKPOINT_DEPTH_MAX = 384 * MiB  # DatabaseCheckPointDepthMax
LOG_DISK_RESERVE = min(5 * GiB, 3 * CHECKPOINT_DEPTH_MAX)
PRIVATE_BYTES_PERCENT = 75
PRIVATE_BYTES_LIMIT = 1 * TiB
PHYSICAL_MEMORY_PERCENT = 94  # PercentagePhysicalMemoryUsedLimit

RECENT_HISTORY = 20  # levels kept for display beyond a resource's history depth

# Exchange says "452 4.3.1 Insufficient system resources" (RFC 3463 4.3.1).
INSUFFICIENT_RESOURCES = "452 4.3.1 Insufficient system resources"


class Resource(StrEnum):
    DATABASE_DISK_SPACE = "database_disk_space"
    LOG_DISK_SPACE = "log_disk_space"
    VERSION_BUCKETS = "version_buckets"
    BATCH_POINTS = "batch_points"
    PRIVATE_BYTES = "private_bytes"
    PHYSICAL_MEMORY = "physical_memory"
    SUBMISSION_QUEUE = "submission_queue"

    @property
    def label(self) -> str:
        return _LABELS[self][0]

    @property
    def exchange_name(self) -> str:
        return _LABELS[self][1]

    @property
    def unit(self) -> str:
        return _LABELS[self][2]

    @property
    def setting_prefix(self) -> str:
        """``MAILRELAY_BP_SUBMISSION_QUEUE`` (then ``_NORMAL``, ``_HISTORY_DEPTH``, ...)."""
        return f"MAILRELAY_BP_{self.name}"


_LABELS = {
    Resource.DATABASE_DISK_SPACE: ("queue database disk space", "DatabaseUsedSpace", "%"),
    Resource.LOG_DISK_SPACE: ("transaction-log disk space", "UsedDiskSpace", "%"),
    Resource.VERSION_BUCKETS: ("version buckets", "UsedVersionBuckets", "messages"),
    Resource.BATCH_POINTS: ("batch points", "BatchPoint", "tasks"),
    Resource.PRIVATE_BYTES: ("private bytes", "PrivateBytes", "%"),
    Resource.PHYSICAL_MEMORY: ("physical memory", "SystemMemory", "%"),
    Resource.SUBMISSION_QUEUE: (
        "submission queue",
        "QueueLength[SubmissionQueue]",
        "messages",
    ),
}

# Resources whose thresholds are percentages where 0 means "use the formula".
PERCENT_RESOURCES = frozenset(
    {
        Resource.DATABASE_DISK_SPACE,
        Resource.LOG_DISK_SPACE,
        Resource.PRIVATE_BYTES,
        Resource.PHYSICAL_MEMORY,
    }
)
# Resources that tarpit before they refuse (the others refuse straight away).
TARPIT_RESOURCES = frozenset(
    {Resource.VERSION_BUCKETS, Resource.BATCH_POINTS, Resource.SUBMISSION_QUEUE}
)
# Up-transitions of these force a garbage collection (the seed's table).
GC_RESOURCES = frozenset(
    {Resource.PRIVATE_BYTES, Resource.PHYSICAL_MEMORY, Resource.SUBMISSION_QUEUE}
)


class Level(StrEnum):
    NORMAL = "normal"
    MEDIUM = "medium"
    HIGH = "high"

    @property
    def rank(self) -> int:
        return _RANK[self]

    @property
    def letter(self) -> str:
        return self.value[0]


_RANK = {Level.NORMAL: 0, Level.MEDIUM: 1, Level.HIGH: 2}
NOT_MONITORED = "not_monitored"
NOT_MONITORED_LETTER = "-"
LETTERS = {Level.NORMAL.letter: Level.NORMAL.value, Level.MEDIUM.letter: Level.MEDIUM.value}
LETTERS |= {Level.HIGH.letter: Level.HIGH.value, NOT_MONITORED_LETTER: NOT_MONITORED}


class Action(StrEnum):
    NONE = ""
    TARPIT = "tarpit"  # delay MAIL FROM of untrusted clients
    REFUSE_UNTRUSTED = "refuse untrusted"
    REFUSE_ALL = "refuse all"


# ----------------------------------------------------------------- thresholds


@dataclass(frozen=True)
class Thresholds:
    normal: float
    medium: float
    high: float


@dataclass(frozen=True)
class ResourceConfig:
    """One resource's settings as given: a percentage of 0 means the formula."""

    normal: int
    medium: int
    high: int
    history_depth: int | None = None


@dataclass(frozen=True)
class TarpitConfig:
    """The MAIL FROM delay in seconds (MAILRELAY_BP_TARPIT_START / _STEP / _MAX)."""

    start: float
    step: float
    max: float


def disk_high_percent(size: int, reserve: int) -> int:
    """Exchange: 100 * (size - reserve) / size, rounded down (never below 0)."""
    if size <= 0:
        return 0
    return max(0, math.floor(100 * (size - reserve) / size))


def private_bytes_high_percent(physical_memory: int) -> int:
    """75 % of physical memory or 1 TB, whichever is less, as a percentage."""
    if physical_memory <= 0:
        return PRIVATE_BYTES_PERCENT
    return min(PRIVATE_BYTES_PERCENT, math.floor(100 * PRIVATE_BYTES_LIMIT / physical_memory))


def formula_high(resource: Resource, total: int | None) -> int | None:
    """The default high threshold of a percentage resource, None if ``total`` is unknown."""
    if resource is Resource.PHYSICAL_MEMORY:
        return PHYSICAL_MEMORY_PERCENT
    if total is None:
        return None
    if resource is Resource.DATABASE_DISK_SPACE:
        return disk_high_percent(total, DATABASE_DISK_RESERVE)
    if resource is Resource.LOG_DISK_SPACE:
        return disk_high_percent(total, LOG_DISK_RESERVE)
    if resource is Resource.PRIVATE_BYTES:
        return private_bytes_high_percent(total)
    raise ValueError(f"{resource} has no formula")


def resolve_thresholds(
    resource: Resource, config: ResourceConfig, total: int | None = None
) -> Thresholds | None:
    """The thresholds in force; None when a formula needs a ``total`` we do not have.

    For a percentage: high 0 = the formula, medium 0 = 2 below high, normal
    0 = 2 below medium (Exchange's EdgeTransport.exe.config semantics).
    """
    if resource not in PERCENT_RESOURCES:
        return Thresholds(config.normal, config.medium, config.high)
    high = config.high
    if not high:
        computed = formula_high(resource, total)
        if computed is None:
            return None
        high = computed
    medium = config.medium or max(0, high - 2)
    normal = config.normal or max(0, medium - 2)
    return Thresholds(normal, medium, high)


def next_level(current: Level, reading: float, t: Thresholds) -> Level:
    """The level after ``reading``, with hysteresis.

    Up as soon as the reading reaches a threshold; down only below the next
    lower one: high stays high down to medium, medium stays medium down to
    normal (a high resource whose reading drops below normal goes straight
    to normal).
    """
    if reading >= t.high:
        return Level.HIGH
    if current is Level.HIGH and reading >= t.medium:
        return Level.HIGH
    if reading >= t.medium:
        return Level.MEDIUM
    if current is not Level.NORMAL and reading >= t.normal:
        return Level.MEDIUM
    return Level.NORMAL


# ----------------------------------------------------------------- samples and trackers


@dataclass(frozen=True)
class Sample:
    """One reading. ``value`` None: not monitored (``note`` says why).

    ``total`` is what a percentage formula needs: the volume's size for a
    disk, physical memory for the memory resources.
    """

    value: float | None
    total: int | None = None
    note: str = ""

    @classmethod
    def unreadable(cls, why: str) -> Sample:
        return cls(None, None, why)


@dataclass(frozen=True)
class Transition:
    """A level change: ``old``/``new`` are Level values or NOT_MONITORED."""

    resource: Resource
    old: str
    new: str
    reading: float | None
    thresholds: Thresholds | None
    note: str = ""

    @property
    def rising(self) -> bool:
        return _order(self.new) > _order(self.old)

    @property
    def falling(self) -> bool:
        return _order(self.new) < _order(self.old)


def _order(level: str) -> int:
    return -1 if level == NOT_MONITORED else Level(level).rank


@dataclass(frozen=True)
class ResourceStatus:
    """One resource after an interval, as shown by the API and the CLI."""

    resource: Resource
    reading: float | None
    level: Level | None  # None: not monitored
    thresholds: Thresholds | None
    history: str  # one letter per interval, oldest first: n, m, h, "-" (not monitored)
    history_depth: int | None
    pressure_intervals: int  # consecutive intervals not normal
    delay: float  # tarpit delay in seconds
    action: Action
    note: str = ""

    @property
    def level_name(self) -> str:
        return self.level.value if self.level is not None else NOT_MONITORED


class ResourceTracker:
    """The state of one resource across intervals."""

    def __init__(self, resource: Resource, config: ResourceConfig, tarpit: TarpitConfig) -> None:
        self.resource = resource
        self.config = config
        self.tarpit = tarpit
        self.level: Level | None = None
        self.started = False  # observed at least once
        self.reading: float | None = None
        self.thresholds: Thresholds | None = None
        self.pressure_intervals = 0
        self.delay = 0.0
        self.note = ""
        self.history: deque[str] = deque(maxlen=max(config.history_depth or 0, RECENT_HISTORY))

    @property
    def tarpits(self) -> bool:
        return self.resource in TARPIT_RESOURCES

    def observe(self, sample: Sample) -> Transition | None:
        """Take one interval's sample; returns the level change, if any."""
        # Before the first interval the resource counts as normal, so a first
        # reading of medium or high is a change, and a first "not monitored" is not.
        first = not self.started
        old = Level.NORMAL.value if first else self.level_name
        self.started = True
        self.note = sample.note
        thresholds = (
            resolve_thresholds(self.resource, self.config, sample.total)
            if sample.value is not None
            else None
        )
        if sample.value is None or thresholds is None:
            # Never guessed: no level, no action, and the pressure count starts over.
            self.level = None
            self.reading = sample.value
            self.thresholds = thresholds
            self.pressure_intervals = 0
            self.delay = 0.0
            self.history.append(NOT_MONITORED_LETTER)
        else:
            self.reading = sample.value
            self.thresholds = thresholds
            self.level = next_level(self.level or Level.NORMAL, sample.value, thresholds)
            under_pressure = self.level is not Level.NORMAL
            self.pressure_intervals = self.pressure_intervals + 1 if under_pressure else 0
            if self.tarpits:
                self.delay = self._next_delay(under_pressure)
            self.history.append(self.level.letter)
        new = self.level_name
        if new == old or (first and self.level is None):
            return None
        return Transition(self.resource, old, new, self.reading, self.thresholds, self.note)

    def _next_delay(self, under_pressure: bool) -> float:
        t = self.tarpit
        if under_pressure:
            if self.delay <= 0:
                return min(t.start, t.max)
            return min(t.max, max(t.start, self.delay + t.step))
        return max(0.0, self.delay - t.step)

    @property
    def level_name(self) -> str:
        return self.level.value if self.level is not None else NOT_MONITORED

    @property
    def history_exhausted(self) -> bool:
        """Under pressure for the whole history depth (or no depth: at once)."""
        depth = self.config.history_depth
        return not depth or self.pressure_intervals >= depth

    @property
    def action(self) -> Action:
        level = self.level
        if level is None:
            return Action.NONE
        if level is Level.HIGH:
            return Action.REFUSE_ALL
        if level is Level.MEDIUM:
            if self.history_exhausted:
                return Action.REFUSE_UNTRUSTED
            return Action.TARPIT if self.tarpits else Action.NONE
        return Action.TARPIT if self.delay > 0 else Action.NONE

    def status(self) -> ResourceStatus:
        return ResourceStatus(
            resource=self.resource,
            reading=self.reading,
            level=self.level,
            thresholds=self.thresholds,
            history="".join(self.history),
            history_depth=self.config.history_depth,
            pressure_intervals=self.pressure_intervals,
            delay=self.delay if self.action is Action.TARPIT else 0.0,
            action=self.action,
            note=self.note,
        )


# ----------------------------------------------------------------- decisions


@dataclass(frozen=True)
class Decision:
    """What to do with one MAIL FROM: wait ``delay_seconds``, then reply 250
    unless ``refuse_reply`` says otherwise (then reply that, at once)."""

    delay_seconds: float = 0.0
    refuse_reply: str | None = None


ACCEPT = Decision()


def refusal(resources: Iterable[Resource]) -> str:
    names = ", ".join(r.label for r in resources)
    return f"{INSUFFICIENT_RESOURCES} ({names}); try again later"


def decide(statuses: Iterable[ResourceStatus], *, trusted: bool) -> Decision:
    """Combine every resource's action into the decision for one kind of client."""
    refusing: list[Resource] = []
    delay = 0.0
    for status in statuses:
        if status.action is Action.REFUSE_ALL or (
            not trusted and status.action is Action.REFUSE_UNTRUSTED
        ):
            refusing.append(status.resource)
        elif not trusted and status.action is Action.TARPIT:
            delay = max(delay, status.delay)
    if refusing:
        return Decision(0.0, refusal(refusing))
    return Decision(delay, None) if delay > 0 else ACCEPT


@dataclass(frozen=True)
class Snapshot:
    """Every resource after one interval, and the decisions that follow from it."""

    statuses: Mapping[Resource, ResourceStatus] = field(default_factory=dict)
    trusted: Decision = ACCEPT
    untrusted: Decision = ACCEPT
    ticks: int = 0

    def level(self, resource: Resource) -> Level | None:
        status = self.statuses.get(resource)
        return status.level if status is not None else None

    def status(self, resource: Resource) -> ResourceStatus:
        return self.statuses[resource]


class PressureState:
    """Every resource's tracker; ``observe`` turns one interval's samples into a Snapshot."""

    def __init__(self, resources: Mapping[Resource, ResourceConfig], tarpit: TarpitConfig) -> None:
        self.trackers = {
            resource: ResourceTracker(resource, config, tarpit)
            for resource, config in resources.items()
        }
        self.ticks = 0
        self.snapshot = Snapshot()

    def observe(self, samples: Mapping[Resource, Sample]) -> tuple[Snapshot, list[Transition]]:
        transitions = []
        for resource, tracker in self.trackers.items():
            sample = samples.get(resource) or Sample.unreadable("no sampler")
            transition = tracker.observe(sample)
            if transition is not None:
                transitions.append(transition)
        self.ticks += 1
        statuses = {resource: t.status() for resource, t in self.trackers.items()}
        self.snapshot = Snapshot(
            statuses=statuses,
            trusted=decide(statuses.values(), trusted=True),
            untrusted=decide(statuses.values(), trusted=False),
            ticks=self.ticks,
        )
        return self.snapshot, transitions
