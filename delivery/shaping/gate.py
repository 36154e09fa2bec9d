"""What a delivery round asks the shaping policy (hooks in delivery.smtp.deliver).

``current`` is the policy in force, read again when its file changes. Per
round, with a ``MAILRELAY_SHAPING`` file (without one: ``open_round`` returns
at once, no Redis, the built-in limits as before):

1. ``open_round``: match the link to an entry, then one Redis script grants
   connection slots and message/connection sends from the shared counters
   (with the entry's adaptive factor applied); nothing granted: the round
   does not claim at all (nothing is attempted, nothing counted), the task
   lets the link go, and a wake-up is scheduled (a slot: when a holder
   releases one; a rate: a countdown doorbell at the time the window frees,
   one per scope; the sweep rings due links anyway, as a backstop);
2. ``ShapedRound.claimed``: the round claimed what it was granted or less;
   the rest goes back at once;
3. ``ShapedRound.observe`` / ``close``: the slots are released, a throttling
   reply cuts the factor, a delivering round after the cool-down raises it.

When Redis cannot be reached, the round goes on with the entry's limits for
this link alone (no shared counters), so mail neither stops nor loops.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from dataclasses import dataclass, replace

import redis

from delivery.shaping import adaptive, policy
from delivery.shaping import limiter as limiter_module
from delivery.shaping.limiter import Grant, Limiter, limiter, warn_unavailable
from delivery.shaping.policy import Entry, Policy
from delivery.smtp.clientconfig import ClientConfig
from delivery.smtp.config import round_settings
from delivery.smtp.types import BatchResult, OutboundMessage
from queues.config import store_settings
from queues.lib import clock
from queues.models import Link, Queue
from queues.signals import link_work

log = logging.getLogger(__name__)

# Recipient domains of a link (its queues' names), for `domain` entries:
# read once per link and process for this long.
DOMAINS_TTL = 60.0
_domains: dict[int, tuple[float, tuple[str, ...]]] = {}
# Rounds holding slots, by round owner, so the link's lease renewal renews them.
_open: dict[str, ShapedRound] = {}
_open_lock = threading.Lock()
MAX_COUNTDOWN = 3000.0


# --- the current policy, re-read when the file changes -------------------------------


@dataclass
class _State:
    stamp: tuple | None = None
    policy: Policy | None = None
    error: str = ""  # why the file on disk is not in force ("" when it is)


_state = _State()
_policy_lock = threading.Lock()


def _path() -> str:
    return round_settings().shaping


def current() -> Policy | None:
    """The policy in force: None without ``MAILRELAY_SHAPING`` (the built-in
    behaviour, no shared counters). The file is stat'ed on each call and read
    again when it changed; a file that cannot be used is refused (logged with
    its line and reason, ``last_error``) and the policy before stays."""
    path = _path()
    if not path:
        return None
    try:
        st = os.stat(path)
        stamp: tuple | None = (path, st.st_mtime_ns, st.st_size, st.st_ino)
    except OSError as exc:
        stamp = (path, "missing", str(exc))
    if stamp == _state.stamp:
        return _state.policy
    with _policy_lock:
        if stamp == _state.stamp:
            return _state.policy
        _state.stamp = stamp
        try:
            if stamp[1] == "missing":
                raise policy.PolicyError(None, f"cannot read the file: {stamp[2]}")
            fresh = policy.read(path)
        except (policy.PolicyError, OSError, UnicodeDecodeError) as exc:
            _state.error = f"MAILRELAY_SHAPING {path}: {exc}"
            if _state.policy is None:
                # Nothing read before: shape with the built-in default only.
                _state.policy = Policy((), policy.builtin_default(), path)
            log.error("%s; the policy read before stays in force", _state.error)
        else:
            if _state.policy is not None:
                log.warning("MAILRELAY_SHAPING %s re-read: %d entries", path, len(fresh.entries))
            _state.policy, _state.error = fresh, ""
        return _state.policy


def last_error() -> str:
    return _state.error


def reset() -> None:
    """Forget the policy read (tests)."""
    global _state
    with _policy_lock:
        _state = _State()


def scope_of(entry: Entry, link_id: int | None) -> str:
    """The counters' scope: the entry, or each next hop alone for the default entry."""
    return f"link:{link_id}" if entry.is_default else f"entry:{entry.name}"


def link_domains(link: Link) -> tuple[str, ...]:
    hit = _domains.get(link.pk)
    if hit and hit[0] > time.monotonic():
        return hit[1]
    names = tuple(Queue.objects.filter(link_id=link.pk).values_list("name", flat=True)[:100])
    _domains[link.pk] = (time.monotonic() + DOMAINS_TTL, names)
    return names


def destination(link_name: str, hosts: list[dict], domains: tuple[str, ...] = ()) -> dict:
    """What an entry can match for a link: domains, MX host names, next-hop names."""
    from delivery.route.routing import NextHop, hop_label

    hops = [NextHop.from_json(h) for h in hosts]
    mx = [h.host for h in hops if not h.literal]
    names = {link_name.lower()}
    for h in hops:
        names.add(hop_label(h).lower())
        names.add(f"[{h.host}]".lower() if h.literal else h.host.lower())
    return {"domains": domains, "mx_hosts": mx, "hops": names}


def entry_for(link: Link, pol: Policy) -> Entry:
    domains = link_domains(link) if pol.needs_domains else ()
    return pol.match(**destination(link.name, link.hosts, domains))


def speaking_hosts(entry: Entry, link: Link) -> frozenset[str] | None:
    """The hosts of ``link`` whose replies speak for ``entry`` (adaptive shaping).

    None (every host) when the whole link is the entry's: the default entry
    (it limits this link alone), an entry matched by a recipient domain (that
    domain's owner chose every host) or by the link's name. Else only the
    hosts that match the entry by themselves (an ``mx`` name, a ``next_hop``):
    a domain that lists its own host before a provider's MX name shares the
    provider's entry, but its host's 421s do not slow the provider down.
    Matched against the host each connection went to (its reply's ``host``).
    """
    from delivery.route.routing import NextHop, hop_label

    if entry.is_default or link.name.lower() in entry.next_hops:
        return None
    if entry.domains and entry.matches_domain(link_domains(link)):
        return None
    owned = set()
    for hop in (NextHop.from_json(h) for h in link.hosts):
        host = hop.host.lower().rstrip(".")
        names = (hop_label(hop).lower(), f"[{host}]" if hop.literal else host)
        if entry.owns_host("" if hop.literal else host, names):
            owned.add(host)
    return frozenset(owned)


def client_config(entry: Entry, config: ClientConfig) -> ClientConfig:
    """``config`` with the entry's per-connection settings."""
    return replace(
        config,
        max_connections=entry.max_connections,
        max_messages_per_connection=entry.max_messages_per_connection,
        connect_timeout=entry.connect_timeout,
        helo_name=entry.helo_name or config.helo_name,
        source_address=entry.source_address,
    )


@dataclass
class ShapedRound:
    link: Link
    entry: Entry
    scope: str
    owner: str
    config: ClientConfig
    limit: int  # recipients the round may claim
    grant: Grant | None  # None: no shared counters (Redis away)
    limiter: Limiter | None
    connections: int = 0  # slots held now
    throttled: str = ""
    delivered: bool = False
    settled: bool = False  # what the round did not claim was given back

    @property
    def refused(self) -> bool:
        return self.grant is not None and self.grant.connections == 0

    def claimed(self, messages: list[OutboundMessage]) -> ClientConfig:
        """Keep the slots and sends the claimed messages need, give back the rest."""
        mpc = self.config.max_messages_per_connection
        need = min(self.connections, -(-len(messages) // max(1, mpc)))
        self.settled = True
        if self.grant is not None and self.limiter is not None:
            try:
                self.limiter.refund(self.scope, self.owner, self.grant, need, len(messages))
            except (redis.RedisError, OSError) as exc:
                warn_unavailable(exc)
                need = self.connections  # the lease ends them anyway
        self.connections = need
        return replace(self.config, max_connections=max(1, need))

    def observe(self, batch: BatchResult) -> None:
        """What the round's replies say of the entry: only replies from the
        entry's own hosts count, for a cut and for a step back up."""
        hosts = speaking_hosts(self.entry, self.link)
        self.throttled = adaptive.throttle_reason(batch, self.entry.on_throttle, hosts)
        self.delivered = any(
            r.outcome == "delivered" and adaptive.speaks(r.host, hosts) for r in batch.results
        )
        if self.throttled:
            log.warning(
                "shaping %s: throttling reply from link %s: %s",
                self.scope,
                self.link.name,
                self.throttled,
            )

    def renew(self, until: float) -> None:
        if self.limiter is not None and self.connections:
            try:
                self.limiter.renew(self.scope, self.owner, self.connections, until)
            except (redis.RedisError, OSError) as exc:
                warn_unavailable(exc)

    def close(self) -> None:
        with _open_lock:
            _open.pop(self.owner, None)
        if self.limiter is None or self.grant is None:
            return
        t = self.entry.on_throttle
        try:
            if not self.settled:  # nothing was due after all: give everything back
                self.limiter.refund(self.scope, self.owner, self.grant, 0, 0)
            waiters = self.limiter.release(
                self.scope,
                self.owner,
                self.grant.connections,
                now=clock.now().timestamp(),
                throttled=self.throttled,
                delivered=self.delivered,
                step=t.factor,
                cooldown=t.cooldown,
                min_factor=t.min_factor,
            )
        except (redis.RedisError, OSError) as exc:
            warn_unavailable(exc)
            return
        for waiter in waiters:
            if waiter.isdigit() and int(waiter) != self.link.pk:
                _ring(int(waiter))


def _ring(link_id: int) -> None:
    link_work.send(sender=None, link_id=link_id)


def ring_later(link_id: int, seconds: float) -> None:
    """A countdown doorbell for a link refused by a rate (backed by the sweep,
    which rings links with due work every MAILRELAY_SWEEP_INTERVAL anyway).
    Capped below the Redis broker's visibility timeout (1 h), past which a
    waiting task would be handed out twice."""
    try:
        link_work.send(
            sender=None, link_id=link_id, countdown=min(max(0.1, seconds), MAX_COUNTDOWN)
        )
    except Exception:  # noqa: BLE001 - the sweep rings due links anyway
        log.warning("could not schedule the wake-up of link %s", link_id, exc_info=True)


def open_round(link: Link, config: ClientConfig, owner: str) -> ShapedRound | None:
    """The round's shaping, or None without a policy file (the built-in behaviour)."""
    pol = current()
    if pol is None:
        return None
    entry = entry_for(link, pol)
    cfg = client_config(entry, config)
    scope = scope_of(entry, link.pk)
    want = cfg.max_connections * cfg.max_messages_per_connection
    lim = limiter()
    shaped = ShapedRound(link, entry, scope, owner, cfg, want, None, lim, cfg.max_connections)
    if lim is None:
        return shaped
    lease = store_settings().lease.total_seconds()
    try:
        grant = lim.acquire(
            scope,
            now=clock.now().timestamp(),
            lease=lease,
            token=owner,
            max_connections=entry.max_connections,
            messages_per_connection=entry.max_messages_per_connection,
            want=want,
            message_rate=_pair(entry.max_message_rate),
            connection_rate=_pair(entry.max_connection_rate),
            waiter=str(link.pk),
        )
    except (redis.RedisError, OSError) as exc:
        warn_unavailable(exc)
        return shaped
    shaped.grant = grant
    if not grant.connections:
        log.info("shaping %s: link %s waits %.1fs (%s)", scope, link.name, grant.wait, grant.why)
        if grant.ring_later:
            ring_later(link.pk, grant.wait)
        return shaped
    shaped.connections = grant.connections
    shaped.limit = grant.messages
    shaped.config = replace(cfg, max_connections=grant.connections)
    with _open_lock:
        _open[owner] = shaped
    return shaped


def renew(owner: str | None, until: float) -> None:
    """The link's lease was renewed: renew the slots of its round too."""
    if owner is None or not _open:
        return
    shaped = _open.get(owner)
    if shaped is not None:
        shaped.renew(until)


def _pair(rate: policy.Rate | None) -> tuple[int, float] | None:
    return (rate.count, rate.period) if rate else None


# --- what the queue list shows ------------------------------------------------------

_shown: dict[str, tuple[float, limiter_module.Status | None]] = {}
SHOWN_TTL = 2.0


def effective_limits(link: Link | None) -> str:
    """The link's entry and its effective limits now and why ("" without a
    policy file), e.g. "1 conn, 20 msg/conn, 5/min messages (halved after
    421 4.7.0 slow down at 10:32 UTC)". One Redis read per scope every
    SHOWN_TTL seconds at most, so a page of queues costs a few."""
    pol = current()
    if pol is None or link is None:
        return ""
    entry = entry_for(link, pol)
    scope = scope_of(entry, link.pk)
    hit = _shown.get(scope)
    if hit is not None and hit[0] > time.monotonic():
        status = hit[1]
    else:
        status = None
        lim = limiter()
        if lim is not None:
            try:
                status = lim.adaptive_many([scope])[scope]
            except (redis.RedisError, OSError) as exc:
                warn_unavailable(exc)
        _shown[scope] = (time.monotonic() + SHOWN_TTL, status)
    return f"{entry.name}: {adaptive.describe(entry, status)}"
