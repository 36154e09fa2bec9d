"""mailrelay settings: everything comes from the environment (see README)."""

from __future__ import annotations

import socket
from datetime import timedelta
from pathlib import Path

from django.core.exceptions import ImproperlyConfigured
from kombu import Exchange, Queue

from queues.lib import domain_keys

from .dburl import parse_database_url
from .env import (
    env_bool,
    env_duration,
    env_int,
    env_list,
    env_networks,
    env_size,
    env_str,
    parse_duration,
)
from .secret_key import secret_key

BASE_DIR = Path(__file__).resolve().parent.parent
DATA_DIR = Path(env_str("MAILRELAY_DATA_DIR", str(BASE_DIR / "var")))

DEBUG = env_bool("DJANGO_DEBUG", False)
# --- security (README "Production"): no known key in production, HTTPS behind a proxy.
# A missing DJANGO_SECRET_KEY: DEBUG uses the development key; the embedded
# default (no DATABASE_URL, one machine, everything in var/) reads or creates
# var/secret-key.txt; else the web app does not start (mailrelay.secret_key).
SECRET_KEY = secret_key(
    env_str("DJANGO_SECRET_KEY", ""),
    debug=DEBUG,
    data_dir=DATA_DIR,
    embedded=not env_str("DATABASE_URL", ""),
)
# No key (empty SECRET_KEY): the web app refuses to start; runall stores one for make run.
MAILRELAY_SECRET_KEY_MISSING = not SECRET_KEY
ALLOWED_HOSTS = env_list("DJANGO_ALLOWED_HOSTS", "localhost,127.0.0.1,[::1]")
CSRF_TRUSTED_ORIGINS = env_list("DJANGO_CSRF_TRUSTED_ORIGINS", "")
if env_bool("DJANGO_SECURE_PROXY_SSL_HEADER", False):
    # The TLS proxy in front of us says the request came over HTTPS; only set
    # this when the proxy always sets (or strips) X-Forwarded-Proto.
    SECURE_PROXY_SSL_HEADER = ("HTTP_X_FORWARDED_PROTO", "https")
# Served over HTTPS: cookies only over HTTPS, plain HTTP redirected (health
# checks and Prometheus scrapes inside the network stay on HTTP).
MAILRELAY_HTTPS = env_bool("DJANGO_HTTPS", env_bool("DJANGO_SECURE_PROXY_SSL_HEADER", False))
SESSION_COOKIE_SECURE = CSRF_COOKIE_SECURE = SECURE_SSL_REDIRECT = MAILRELAY_HTTPS
SECURE_REDIRECT_EXEMPT = [r"^healthz$", r"^metrics$"]
SECURE_HSTS_SECONDS = int(env_duration("DJANGO_SECURE_HSTS_SECONDS", "0s").total_seconds())
SECURE_HSTS_INCLUDE_SUBDOMAINS = env_bool("DJANGO_SECURE_HSTS_INCLUDE_SUBDOMAINS", False)
SECURE_HSTS_PRELOAD = env_bool("DJANGO_SECURE_HSTS_PRELOAD", False)
# Joining the browsers' preload list is the domain owner's decision, not the relay's.
SILENCED_SYSTEM_CHECKS = ["security.W021"]
SESSION_COOKIE_AGE = int(env_duration("DJANGO_SESSION_COOKIE_AGE", "12h").total_seconds())
# Login throttling (queues.throttle): failures per user name and per client address.
MAILRELAY_LOGIN_FAILURE_LIMIT = env_int("MAILRELAY_LOGIN_FAILURE_LIMIT", 5)
MAILRELAY_LOGIN_FAILURE_WINDOW = env_duration("MAILRELAY_LOGIN_FAILURE_WINDOW", "15m")
MAILRELAY_LOGIN_LOCKOUT = env_duration("MAILRELAY_LOGIN_LOCKOUT", "15m")
# Proxies whose X-Forwarded-For names the client (login throttling, /metrics networks).
MAILRELAY_TRUSTED_PROXIES = env_networks("MAILRELAY_TRUSTED_PROXIES", "")
# /api/schema/ and /api/docs/ for anonymous users too (default: logged-in users only).
MAILRELAY_API_DOCS_PUBLIC = env_bool("MAILRELAY_API_DOCS_PUBLIC", False)
# /metrics without MAILRELAY_METRICS_TOKEN: only these clients (loopback and private ranges).
MAILRELAY_METRICS_ALLOWED_NETWORKS = env_networks(
    "MAILRELAY_METRICS_ALLOWED_NETWORKS",
    "127.0.0.0/8,::1/128,10.0.0.0/8,172.16.0.0/12,192.168.0.0/16,fc00::/7",
)
# The cache holds the login throttle's counters, shared by every web process:
# Redis when it is the broker, else files in the data folder (the embedded default).
if env_str("CELERY_BROKER_URL", "").startswith(("redis://", "rediss://")):
    CACHES = {
        "default": {
            "BACKEND": "django.core.cache.backends.redis.RedisCache",
            "LOCATION": env_str("CELERY_BROKER_URL", ""),
            "KEY_PREFIX": "mailrelay",
        }
    }
else:
    CACHES = {
        "default": {
            "BACKEND": "django.core.cache.backends.filebased.FileBasedCache",
            "LOCATION": str(DATA_DIR / "cache"),
        }
    }

INSTALLED_APPS = [
    "django.contrib.admin",
    "django.contrib.auth",
    "django.contrib.contenttypes",
    "django.contrib.sessions",
    "django.contrib.messages",
    "django.contrib.staticfiles",
    "rest_framework",
    "rest_framework.authtoken",
    "drf_spectacular",
    "drf_spectacular_sidecar",
    "queues",
    "delivery",
    "insight",
    "tracking",
    "mailrelay",  # its command runall: the process supervisor
]

MIDDLEWARE = [
    "mailrelay.secret_key.RequireSecretKey",  # the web app needs DJANGO_SECRET_KEY
    "django.middleware.security.SecurityMiddleware",
    "whitenoise.middleware.WhiteNoiseMiddleware",
    "mailrelay.api_errors.JsonApiErrors",  # /api/'s 404 and 405 are JSON too
    "django.contrib.sessions.middleware.SessionMiddleware",
    "django.middleware.common.CommonMiddleware",
    "django.middleware.csrf.CsrfViewMiddleware",
    "django.contrib.auth.middleware.AuthenticationMiddleware",
    "django.contrib.messages.middleware.MessageMiddleware",
    "django.middleware.clickjacking.XFrameOptionsMiddleware",
]

ROOT_URLCONF = "mailrelay.urls"
WSGI_APPLICATION = "mailrelay.wsgi.application"

TEMPLATES = [
    {
        "BACKEND": "django.template.backends.django.DjangoTemplates",
        "DIRS": [BASE_DIR / "templates"],
        "APP_DIRS": True,
        "OPTIONS": {
            "context_processors": [
                "django.template.context_processors.request",
                "django.contrib.auth.context_processors.auth",
                "django.contrib.messages.context_processors.messages",
                "insight.context.alerts",
            ],
        },
    },
]

# --- Database: PostgreSQL from DATABASE_URL, else the embedded SQLite default.
DATABASE_URL = env_str("DATABASE_URL", "")
if DATABASE_URL:
    # Persistent connections, checked before reuse: a worker or ingress thread
    # keeps one connection instead of opening one per task. libpq's multi-host
    # forms (h1:5432,h2:5432 / host=h1,h2) follow the primary (mailrelay.dburl).
    DATABASES = {"default": parse_database_url(DATABASE_URL)}
else:
    DATABASES = {
        "default": {
            "ENGINE": "django.db.backends.sqlite3",
            "NAME": str(DATA_DIR / "mailrelay.sqlite3"),
            # Several processes (SMTP, worker, web) share the file: wait for locks.
            "OPTIONS": {
                "timeout": 30,
                "transaction_mode": "IMMEDIATE",
                "init_command": "PRAGMA journal_mode=WAL;",
            },
        }
    }
# A host cut off from PostgreSQL (a partition, a frozen VM) may leave its session
# idle inside a transaction, holding row locks that other hosts' reclaim needs:
# PostgreSQL ends such a session after this long (0s: never), and probes idle
# TCP connections both ways (keepalives) so a vanished peer is noticed in ~25 s.
MAILRELAY_DB_IDLE_IN_TRANSACTION_TIMEOUT = env_duration(
    "MAILRELAY_DB_IDLE_IN_TRANSACTION_TIMEOUT", "15s"
)
# PostgreSQL: the hot paths' batch inserts prepared on each connection (parsed
# and planned once, queues.database.prepared_cursor); off for a pooler in
# transaction mode that does not keep prepared statements (PgBouncer before 1.21).
MAILRELAY_DB_PREPARE = env_bool("MAILRELAY_DB_PREPARE", True)
if DATABASES["default"]["ENGINE"].endswith("postgresql"):
    _db_options = DATABASES["default"].setdefault("OPTIONS", {})
    _idle_ms = int(MAILRELAY_DB_IDLE_IN_TRANSACTION_TIMEOUT.total_seconds() * 1000)
    if _idle_ms:  # 0: no startup options at all (a pooler such as PgBouncer refuses them)
        _db_options["options"] = " ".join(
            part
            for part in (
                _db_options.get("options", ""),
                f"-c idle_in_transaction_session_timeout={_idle_ms}",
                "-c tcp_keepalives_idle=10 -c tcp_keepalives_interval=5 -c tcp_keepalives_count=3",
            )
            if part
        )
    if MAILRELAY_DB_PREPARE:
        # psycopg prepares nothing while this is None (Django's default); Django's
        # own cursors bind on the client and never prepare: only the batch
        # inserts are (prepared_cursor, the ingress's insert at its 5th run).
        _db_options.setdefault("prepare_threshold", 5)
    for _key, _value in (
        ("keepalives", 1),
        ("keepalives_idle", 10),
        ("keepalives_interval", 5),
        ("keepalives_count", 3),
    ):
        _db_options.setdefault(_key, _value)
if env_str("MAILRELAY_TEST_DATABASE"):
    DATABASES["default"].setdefault("TEST", {})["NAME"] = env_str("MAILRELAY_TEST_DATABASE")
DEFAULT_AUTO_FIELD = "django.db.models.BigAutoField"

AUTH_PASSWORD_VALIDATORS = [
    {"NAME": "django.contrib.auth.password_validation.MinimumLengthValidator"},
]
LANGUAGE_CODE = "en-us"
TIME_ZONE = "UTC"
USE_I18N = False
USE_TZ = True

STATIC_URL = "static/"
STATIC_ROOT = DATA_DIR / "static"
STATICFILES_DIRS = [BASE_DIR / "static"]

LOGGING = {
    "version": 1,
    "disable_existing_loggers": False,
    "formatters": {"plain": {"format": "%(asctime)s %(levelname)s %(name)s: %(message)s"}},
    "handlers": {"console": {"class": "logging.StreamHandler", "formatter": "plain"}},
    "root": {"handlers": ["console"], "level": env_str("MAILRELAY_LOG_LEVEL", "INFO")},
    "loggers": {"mail.log": {"level": "WARNING"}},
}

REST_FRAMEWORK = {
    "DEFAULT_AUTHENTICATION_CLASSES": [
        "rest_framework.authentication.TokenAuthentication",
        "rest_framework.authentication.SessionAuthentication",
    ],
    "DEFAULT_PERMISSION_CLASSES": ["rest_framework.permissions.IsAuthenticated"],
    "DEFAULT_SCHEMA_CLASS": "drf_spectacular.openapi.AutoSchema",
}
SPECTACULAR_SETTINGS = {
    "TITLE": "mailrelay API",
    "DESCRIPTION": "Queues, links, messages and operator actions of the mailrelay queue store.",
    "VERSION": "1",
    # Swagger UI served from our own static files: no CDN (relays often run offline).
    "SWAGGER_UI_DIST": "SIDECAR",
    "SWAGGER_UI_FAVICON_HREF": "SIDECAR",
    "REDOC_DIST": "SIDECAR",
    # Three models have a "state": name each enum (else W001 in manage.py check).
    "ENUM_NAME_OVERRIDES": {
        "LinkStateEnum": "queues.states.LinkState",
        "MessageStateEnum": "queues.states.MessageState",
        "RecipientStateEnum": "queues.states.RecipientState",
    },
}
LOGIN_URL = "/accounts/login/"
LOGIN_REDIRECT_URL = "/"

# --- Celery: Redis from CELERY_BROKER_URL, else kombu's filesystem transport.
CELERY_BROKER_URL = env_str("CELERY_BROKER_URL", "")
if not CELERY_BROKER_URL:
    # With a host: kombu warns "No hostname was supplied" on every connection of
    # a URL without one (each worker, beat, the ingress: a dozen lines at start).
    CELERY_BROKER_URL = "filesystem://localhost/"
    _broker_dir = DATA_DIR / "broker"
    CELERY_BROKER_TRANSPORT_OPTIONS = {
        "data_folder_in": str(_broker_dir),
        "data_folder_out": str(_broker_dir),
        "processed_folder": str(_broker_dir / "processed"),
        "control_folder": str(_broker_dir / "control"),
        "store_processed": False,
    }
elif CELERY_BROKER_URL.startswith("sentinel://"):
    # Redis Sentinel (docs/high-availability.md): CELERY_BROKER_URL lists the
    # sentinels (sentinel://s1:26379;sentinel://s2:26379); they name the master.
    CELERY_BROKER_TRANSPORT_OPTIONS = {
        "master_name": env_str("MAILRELAY_BROKER_SENTINEL_MASTER", "mymaster")
    }
CELERY_TASK_IGNORE_RESULT = True
CELERY_TASK_ACKS_LATE = True
CELERY_TASK_REJECT_ON_WORKER_LOST = True
CELERY_WORKER_PREFETCH_MULTIPLIER = 1
CELERY_BROKER_CONNECTION_RETRY_ON_STARTUP = True
# Celery's Django fixup closes the database connection after every task unless
# told to reuse it; a broken connection is still replaced (the task_prerun hook in
# delivery/qmgr/tasks.py).
CELERY_DB_REUSE_MAX = 100_000
# Two queues, so routing and the sweep never wait behind deliveries (a silent
# next hop holds a delivery for its connect and greeting timeouts): `control`
# (categorize, sweep) is served by a prefork worker, `delivery` (deliver_link)
# by a worker with a pool of threads, as `make run` and docker-compose start
# them. A worker started without `-Q` consumes them all.
CELERY_TASK_DEFAULT_QUEUE = "control"
CELERY_TASK_QUEUES = tuple(
    Queue(q, Exchange(q), routing_key=q) for q in ("control", "delivery", "webhooks")
)
CELERY_TASK_ROUTES = {
    "delivery.tasks.categorize": {"queue": "control"},
    "delivery.tasks.sweep": {"queue": "control"},
    "delivery.tasks.deliver_link": {"queue": "delivery"},
    # Webhooks go out from a worker of their own (tracking.sender): a slow or
    # dead endpoint never holds routing or delivery.
    "tracking.tasks.send_webhooks": {"queue": "webhooks"},
    "tracking.tasks.webhook_sweep": {"queue": "control"},
    "tracking.tasks.maintain": {"queue": "control"},
    "insight.tasks.refresh": {"queue": "control"},
}

# --- mailrelay (every setting is documented in README.md)
MAILRELAY_HOSTNAME = env_str("MAILRELAY_HOSTNAME", "") or socket.getfqdn()
MAILRELAY_SMTP_LISTEN = env_list("MAILRELAY_SMTP_LISTEN", "127.0.0.1:2525")
# In their one form (IDNA 2008 + UTS #46, A-labels), as recipient domains are at accept.
MAILRELAY_ACCEPTED_DOMAINS = domain_keys(
    "MAILRELAY_ACCEPTED_DOMAINS", env_list("MAILRELAY_ACCEPTED_DOMAINS")
)
MAILRELAY_RELAY_NETWORKS = env_networks("MAILRELAY_RELAY_NETWORKS", "127.0.0.0/8,::1/128")
MAILRELAY_MAX_MESSAGE_SIZE = env_size("MAILRELAY_MAX_MESSAGE_SIZE", "35MB")
MAILRELAY_MAX_RECIPIENTS = env_int("MAILRELAY_MAX_RECIPIENTS", 1000)
MAILRELAY_SMTP_SERVER_TIMEOUT = env_duration("MAILRELAY_SMTP_SERVER_TIMEOUT", "5m")
MAILRELAY_TLS_CERT_FILE = env_str("MAILRELAY_TLS_CERT_FILE", "")
MAILRELAY_TLS_KEY_FILE = env_str("MAILRELAY_TLS_KEY_FILE", "")
# Submission with AUTH (README "Submission and AUTH"): comma lists of host:port, "" = off.
# 587-style: STARTTLS required before AUTH and MAIL; 465-style: implicit TLS (RFC 8314).
MAILRELAY_SUBMISSION_LISTEN = env_list("MAILRELAY_SUBMISSION_LISTEN", "")
MAILRELAY_SUBMISSIONS_LISTEN = env_list("MAILRELAY_SUBMISSIONS_LISTEN", "")
# AUTH failures from one client address within 15 minutes before it gets 421 4.7.0,
# and for one username from any address before it gets 454 4.7.0 (counted in the cache).
MAILRELAY_AUTH_MAX_FAILURES = env_int("MAILRELAY_AUTH_MAX_FAILURES", 5)
MAILRELAY_AUTH_MAX_FAILURES_PER_USER = env_int("MAILRELAY_AUTH_MAX_FAILURES_PER_USER", 10)
# Inbound limits (Postfix's anvil and smtpd_* limits; README "Inbound policy").
MAILRELAY_SMTP_MAX_CONNECTIONS = env_int("MAILRELAY_SMTP_MAX_CONNECTIONS", 1000)
MAILRELAY_SMTP_MAX_CONNECTIONS_PER_CLIENT = env_int("MAILRELAY_SMTP_MAX_CONNECTIONS_PER_CLIENT", 50)
MAILRELAY_SMTP_MAX_SESSION_TIME = env_duration("MAILRELAY_SMTP_MAX_SESSION_TIME", "1h")
MAILRELAY_SMTP_JUNK_COMMAND_LIMIT = env_int("MAILRELAY_SMTP_JUNK_COMMAND_LIMIT", 100)
MAILRELAY_SMTP_MIN_DATA_RATE = env_int("MAILRELAY_SMTP_MIN_DATA_RATE", 500)
# The message header at DATA (Postfix's header_size_limit; a count of fields): 552 5.3.4.
MAILRELAY_SMTP_MAX_HEADER_FIELDS = env_int("MAILRELAY_SMTP_MAX_HEADER_FIELDS", 1000)
MAILRELAY_SMTP_MAX_HEADER_SIZE = env_size("MAILRELAY_SMTP_MAX_HEADER_SIZE", "100KB")  # per field
# runsmtp processes sharing the listening ports (SO_REUSEPORT); 0 = one per two cores.
MAILRELAY_SMTP_PROCESSES = env_int("MAILRELAY_SMTP_PROCESSES", 0)

MAILRELAY_TRANSPORTS = env_str("MAILRELAY_TRANSPORTS", "")
MAILRELAY_SMART_HOST = env_str("MAILRELAY_SMART_HOST", "")
MAILRELAY_DNS_NAMESERVERS = env_list("MAILRELAY_DNS_NAMESERVERS", "")
MAILRELAY_DNS_TIMEOUT = env_duration("MAILRELAY_DNS_TIMEOUT", "10s")
MAILRELAY_REMOTE_SMTP_PORT = env_int("MAILRELAY_REMOTE_SMTP_PORT", 25)

# At most; a round spreads its messages over the connections, at least 5 each
# (delivery.smtp.client.group_size).
MAILRELAY_MAX_MESSAGES_PER_CONNECTION = env_int("MAILRELAY_MAX_MESSAGES_PER_CONNECTION", 20)
# 20: the default of Postfix (default_destination_concurrency_limit) and of
# Exchange (MaxPerDomainOutboundConnections); bench/README.md "Session 8".
MAILRELAY_MAX_CONNECTIONS_PER_DESTINATION = env_int("MAILRELAY_MAX_CONNECTIONS_PER_DESTINATION", 20)
MAILRELAY_SMTP_CONNECT_TIMEOUT = env_duration("MAILRELAY_SMTP_CONNECT_TIMEOUT", "30s")
MAILRELAY_SMTP_CLIENT_TIMEOUT = env_duration("MAILRELAY_SMTP_CLIENT_TIMEOUT", "5m")
MAILRELAY_SMTP_DATA_TIMEOUT = env_duration("MAILRELAY_SMTP_DATA_TIMEOUT", "10m")
# Traffic shaping per destination (docs/shaping.md): a YAML or TOML file, "" = off
# (then the two limits above apply to each next hop, with no shared counters).
MAILRELAY_SHAPING = env_str("MAILRELAY_SHAPING", "")

MAILRELAY_SWEEP_INTERVAL = env_duration("MAILRELAY_SWEEP_INTERVAL", "30s")
# Queue counts are recounted for each read (exact) while the queues hold at most
# this many messages; above it they are the sweep's, shown with their age
# (queues.services.counts.current_counts). 0: always the sweep's.
MAILRELAY_LIVE_COUNTS_UP_TO = env_int("MAILRELAY_LIVE_COUNTS_UP_TO", 20000)
MAILRELAY_MESSAGE_EXPIRATION_TIMEOUT = env_duration("MAILRELAY_MESSAGE_EXPIRATION_TIMEOUT", "2d")
MAILRELAY_CATEGORIZER_RETRY_INTERVAL = env_duration("MAILRELAY_CATEGORIZER_RETRY_INTERVAL", "5m")
MAILRELAY_COMPLETED_RETENTION = env_duration("MAILRELAY_COMPLETED_RETENTION", "1d")
MAILRELAY_POISON_THRESHOLD = env_int("MAILRELAY_POISON_THRESHOLD", 2)
MAILRELAY_CATEGORIZER_BATCH = env_int("MAILRELAY_CATEGORIZER_BATCH", 500)
# Between two batches of a categorize task whose last batch was not full, the
# task waits this long so the next batch gathers more (0: no wait; bench/README.md).
MAILRELAY_CATEGORIZER_BATCH_WAIT = env_duration("MAILRELAY_CATEGORIZER_BATCH_WAIT", "0.05s")
# Claims (delivery rounds, links, categorizer batches) are leases that their
# live owner renews every third of this (queues.transitions.flow.Claim); a dead owner's
# claims are taken back by the sweep's reclaim once it runs out.
MAILRELAY_DELIVERY_LEASE = env_duration("MAILRELAY_DELIVERY_LEASE", "30s")
# An owner acts on a claim only while the time since the start of its last
# successful renewal is below the lease less this margin (clock drift between
# hosts, the time a send takes); at most a third of the lease is used.
MAILRELAY_DELIVERY_LEASE_MARGIN = env_duration("MAILRELAY_DELIVERY_LEASE_MARGIN", "5s")
# A delivery round claims at most this many bytes of messages (at least one message).
MAILRELAY_DELIVERY_ROUND_BYTES = env_size("MAILRELAY_DELIVERY_ROUND_BYTES", "100MB")
# Between two rounds of a link whose last round held fewer recipients than
# MAILRELAY_MAX_CONNECTIONS_PER_DESTINATION, its delivery task waits this long
# so the next round gathers more; after a larger round it does not wait (the
# link is busy). 0: no wait; bench/README.md.
MAILRELAY_DELIVERY_ROUND_WAIT = env_duration("MAILRELAY_DELIVERY_ROUND_WAIT", "0.05s")
MAILRELAY_WEB_LISTEN = env_str("MAILRELAY_WEB_LISTEN", "127.0.0.1:8000")
# Processes of the control worker (categorize, sweep) and threads of the
# delivery worker (one per delivery task, mostly waiting on peers) that
# `make run` starts; docker-compose passes the same numbers.
MAILRELAY_WORKER_CONCURRENCY = env_int("MAILRELAY_WORKER_CONCURRENCY", 2)
MAILRELAY_DELIVERY_CONCURRENCY = env_int("MAILRELAY_DELIVERY_CONCURRENCY", 32)

# --- retry, expiration and notifications (Exchange's names and defaults)
MAILRELAY_QUEUE_GLITCH_RETRY_COUNT = env_int("MAILRELAY_QUEUE_GLITCH_RETRY_COUNT", 4)
MAILRELAY_QUEUE_GLITCH_RETRY_INTERVAL = env_duration("MAILRELAY_QUEUE_GLITCH_RETRY_INTERVAL", "1m")
MAILRELAY_TRANSIENT_FAILURE_RETRY_COUNT = env_int("MAILRELAY_TRANSIENT_FAILURE_RETRY_COUNT", 6)
MAILRELAY_TRANSIENT_FAILURE_RETRY_INTERVAL = env_duration(
    "MAILRELAY_TRANSIENT_FAILURE_RETRY_INTERVAL", "5m"
)
MAILRELAY_OUTBOUND_CONNECTION_FAILURE_RETRY_INTERVAL = env_duration(
    "MAILRELAY_OUTBOUND_CONNECTION_FAILURE_RETRY_INTERVAL", "10m"
)
MAILRELAY_PER_MESSAGE_FAILURES_BEFORE_PROBLEM = env_int(
    "MAILRELAY_PER_MESSAGE_FAILURES_BEFORE_PROBLEM", 2
)
MAILRELAY_MESSAGE_RETRY_INTERVAL = env_duration("MAILRELAY_MESSAGE_RETRY_INTERVAL", "15m")
MAILRELAY_DELAY_NOTIFICATION_TIMEOUT = env_duration("MAILRELAY_DELAY_NOTIFICATION_TIMEOUT", "4h")
MAILRELAY_MAX_IDLE_TIME_BEFORE_RESUBMIT = env_duration(
    "MAILRELAY_MAX_IDLE_TIME_BEFORE_RESUBMIT", "12h"
)
MAILRELAY_MAX_DSN_SIZE = env_size("MAILRELAY_MAX_DSN_SIZE", "10MB")
MAILRELAY_DEAD_LETTER_RETENTION = env_duration("MAILRELAY_DEAD_LETTER_RETENTION", "30d")
MAILRELAY_POSTMASTER = env_str("MAILRELAY_POSTMASTER", "")
# Exim retry rules (a file); they are searched before the rules compiled from
# the Exchange settings above, so they override them for what they match.
MAILRELAY_RETRY_RULES = env_str("MAILRELAY_RETRY_RULES", "")
MAILRELAY_RETRY_INTERVAL_MAX = env_duration("MAILRELAY_RETRY_INTERVAL_MAX", "24h")
MAILRELAY_RETRY_DATA_EXPIRE = env_duration("MAILRELAY_RETRY_DATA_EXPIRE", "7d")
MAILRELAY_DELAY_AFTER_CUTOFF = env_bool("MAILRELAY_DELAY_AFTER_CUTOFF", True)

# --- operator insight (insight/: explain, incidents, age alerts; docs/insight.md)
# A queue whose oldest waiting message is older than this raises a warning
# (amber), twice as old a critical alert (red); per-queue overrides as
# "queue-name=4h,other.example=30m" (0 = no age alert for that queue).
MAILRELAY_ALERT_OLDEST_AGE = env_duration("MAILRELAY_ALERT_OLDEST_AGE", "1h")
MAILRELAY_ALERT_OLDEST_AGE_QUEUES: dict[str, timedelta] = {}
for _item in env_list("MAILRELAY_ALERT_OLDEST_AGE_QUEUES"):
    _name, _sep, _age = _item.partition("=")
    try:
        if not _sep or not _name.strip():
            raise ValueError(_item)
        MAILRELAY_ALERT_OLDEST_AGE_QUEUES[_name.strip().lower()] = parse_duration(_age.strip())
    except ValueError:
        raise ImproperlyConfigured(
            f"MAILRELAY_ALERT_OLDEST_AGE_QUEUES: {_item!r} is not queue-name=duration"
        ) from None
# How often the alerts are evaluated and the deferral summary refreshed (beat).
MAILRELAY_INSIGHT_REFRESH_INTERVAL = env_duration("MAILRELAY_INSIGHT_REFRESH_INTERVAL", "30s")
# At or above this many deferred recipients /deferrals/, /api/v1/errors/ and the
# incidents read the refreshed summary instead of grouping live.
MAILRELAY_INSIGHT_LIVE_LIMIT = env_int("MAILRELAY_INSIGHT_LIVE_LIMIT", 20000)
CELERY_BEAT_SCHEDULE = {
    "insight: evaluate alerts, refresh the deferral summary": {
        "task": "insight.tasks.refresh",
        "schedule": MAILRELAY_INSIGHT_REFRESH_INTERVAL.total_seconds(),
    },
}

# --- pickup and replay folders: Exchange's Pickup and Replay directories (docs/pickup-replay.md)
MAILRELAY_PICKUP_DIR = env_str("MAILRELAY_PICKUP_DIR", "")  # "" = off
MAILRELAY_REPLAY_DIR = env_str("MAILRELAY_REPLAY_DIR", "")  # "" = off
MAILRELAY_PICKUP_POLL_INTERVAL = env_duration("MAILRELAY_PICKUP_POLL_INTERVAL", "5s")
MAILRELAY_PICKUP_MAX_MESSAGES_PER_MINUTE = env_int("MAILRELAY_PICKUP_MAX_MESSAGES_PER_MINUTE", 100)
MAILRELAY_PICKUP_MAX_HEADER_SIZE = env_size("MAILRELAY_PICKUP_MAX_HEADER_SIZE", "64KB")
MAILRELAY_PICKUP_MAX_RECIPIENTS_PER_MESSAGE = env_int(
    "MAILRELAY_PICKUP_MAX_RECIPIENTS_PER_MESSAGE", 100
)
# --- DKIM signing at accept (README "DKIM"; queues/dkim.py)
MAILRELAY_DKIM_KEYS_DIR = env_str("MAILRELAY_DKIM_KEYS_DIR", "")  # <domain>.<selector>.key
# "" = the From domain's key only; else in its one form (a bad name stops start-up).
MAILRELAY_DKIM_SIGNING_DOMAIN = "".join(
    domain_keys("MAILRELAY_DKIM_SIGNING_DOMAIN", env_list("MAILRELAY_DKIM_SIGNING_DOMAIN"))[:1]
)
MAILRELAY_DKIM_HEADERS = env_list("MAILRELAY_DKIM_HEADERS", "")  # "" = RFC 6376's usual set
MAILRELAY_DKIM_KEY_REFRESH = env_duration("MAILRELAY_DKIM_KEY_REFRESH", "1m")
# --- metrics (docs/metrics.md); PROMETHEUS_MULTIPROC_DIR is read by prometheus_client itself
MAILRELAY_METRICS_TOKEN = env_str("MAILRELAY_METRICS_TOKEN", "")

# --- back pressure (Exchange's resource monitor; README "Back pressure")
MAILRELAY_NODE_NAME = env_str("MAILRELAY_NODE_NAME", "")  # default: hostname:pid
MAILRELAY_BP_ENABLED = env_bool("MAILRELAY_BP_ENABLED", True)
MAILRELAY_BP_MONITORING_INTERVAL = env_duration("MAILRELAY_BP_MONITORING_INTERVAL", "2s")
MAILRELAY_BP_DATABASE_PATH = env_str("MAILRELAY_BP_DATABASE_PATH", "")
MAILRELAY_BP_LOG_PATH = env_str("MAILRELAY_BP_LOG_PATH", "")
MAILRELAY_BP_TARPIT_START = env_duration("MAILRELAY_BP_TARPIT_START", "10s")
MAILRELAY_BP_TARPIT_STEP = env_duration("MAILRELAY_BP_TARPIT_STEP", "5s")
MAILRELAY_BP_TARPIT_MAX = env_duration("MAILRELAY_BP_TARPIT_MAX", "55s")
# Thresholds normal / medium / high (a percentage of 0 = Exchange's formula), history depth.
MAILRELAY_BP_DATABASE_DISK_SPACE_NORMAL = env_int("MAILRELAY_BP_DATABASE_DISK_SPACE_NORMAL", 0)
MAILRELAY_BP_DATABASE_DISK_SPACE_MEDIUM = env_int("MAILRELAY_BP_DATABASE_DISK_SPACE_MEDIUM", 0)
MAILRELAY_BP_DATABASE_DISK_SPACE_HIGH = env_int("MAILRELAY_BP_DATABASE_DISK_SPACE_HIGH", 0)
MAILRELAY_BP_LOG_DISK_SPACE_NORMAL = env_int("MAILRELAY_BP_LOG_DISK_SPACE_NORMAL", 0)
MAILRELAY_BP_LOG_DISK_SPACE_MEDIUM = env_int("MAILRELAY_BP_LOG_DISK_SPACE_MEDIUM", 0)
MAILRELAY_BP_LOG_DISK_SPACE_HIGH = env_int("MAILRELAY_BP_LOG_DISK_SPACE_HIGH", 0)
MAILRELAY_BP_VERSION_BUCKETS_NORMAL = env_int("MAILRELAY_BP_VERSION_BUCKETS_NORMAL", 80)
MAILRELAY_BP_VERSION_BUCKETS_MEDIUM = env_int("MAILRELAY_BP_VERSION_BUCKETS_MEDIUM", 120)
MAILRELAY_BP_VERSION_BUCKETS_HIGH = env_int("MAILRELAY_BP_VERSION_BUCKETS_HIGH", 200)
MAILRELAY_BP_VERSION_BUCKETS_HISTORY_DEPTH = env_int(
    "MAILRELAY_BP_VERSION_BUCKETS_HISTORY_DEPTH", 10
)
MAILRELAY_BP_BATCH_POINTS_NORMAL = env_int("MAILRELAY_BP_BATCH_POINTS_NORMAL", 1000)
MAILRELAY_BP_BATCH_POINTS_MEDIUM = env_int("MAILRELAY_BP_BATCH_POINTS_MEDIUM", 2000)
MAILRELAY_BP_BATCH_POINTS_HIGH = env_int("MAILRELAY_BP_BATCH_POINTS_HIGH", 4000)
MAILRELAY_BP_BATCH_POINTS_HISTORY_DEPTH = env_int("MAILRELAY_BP_BATCH_POINTS_HISTORY_DEPTH", 300)
MAILRELAY_BP_PRIVATE_BYTES_NORMAL = env_int("MAILRELAY_BP_PRIVATE_BYTES_NORMAL", 0)
MAILRELAY_BP_PRIVATE_BYTES_MEDIUM = env_int("MAILRELAY_BP_PRIVATE_BYTES_MEDIUM", 0)
MAILRELAY_BP_PRIVATE_BYTES_HIGH = env_int("MAILRELAY_BP_PRIVATE_BYTES_HIGH", 0)
MAILRELAY_BP_PRIVATE_BYTES_HISTORY_DEPTH = env_int("MAILRELAY_BP_PRIVATE_BYTES_HISTORY_DEPTH", 30)
MAILRELAY_BP_PHYSICAL_MEMORY_NORMAL = env_int("MAILRELAY_BP_PHYSICAL_MEMORY_NORMAL", 0)
MAILRELAY_BP_PHYSICAL_MEMORY_MEDIUM = env_int("MAILRELAY_BP_PHYSICAL_MEMORY_MEDIUM", 0)
MAILRELAY_BP_PHYSICAL_MEMORY_HIGH = env_int("MAILRELAY_BP_PHYSICAL_MEMORY_HIGH", 94)
MAILRELAY_BP_SUBMISSION_QUEUE_NORMAL = env_int("MAILRELAY_BP_SUBMISSION_QUEUE_NORMAL", 2000)
MAILRELAY_BP_SUBMISSION_QUEUE_MEDIUM = env_int("MAILRELAY_BP_SUBMISSION_QUEUE_MEDIUM", 4000)
MAILRELAY_BP_SUBMISSION_QUEUE_HIGH = env_int("MAILRELAY_BP_SUBMISSION_QUEUE_HIGH", 10000)
MAILRELAY_BP_SUBMISSION_QUEUE_HISTORY_DEPTH = env_int(
    "MAILRELAY_BP_SUBMISSION_QUEUE_HISTORY_DEPTH", 300
)

# Outbound TLS policy and AUTH to next hops (README "TLS policy").
# A Postfix smtp_tls_policy_maps-like file: "destination level" lines.
MAILRELAY_TLS_POLICY = env_str("MAILRELAY_TLS_POLICY", "")
MAILRELAY_TLS_DEFAULT_LEVEL = env_str("MAILRELAY_TLS_DEFAULT_LEVEL", "may")
# CA bundle for verify/secure and MTA-STS (certificates and policy fetch); "" = system store.
MAILRELAY_TLS_CA_FILE = env_str("MAILRELAY_TLS_CA_FILE", "")
MAILRELAY_MTA_STS = env_bool("MAILRELAY_MTA_STS", True)
# One deadline for the whole policy fetch (address, connect, TLS, headers, body).
MAILRELAY_MTA_STS_FETCH_TIMEOUT = env_duration("MAILRELAY_MTA_STS_FETCH_TIMEOUT", "10s")
# Fetch policies from non-public addresses (loopback, private, link-local, ...) too.
MAILRELAY_MTA_STS_ALLOW_PRIVATE = env_bool("MAILRELAY_MTA_STS_ALLOW_PRIVATE", False)
# Test-only: the HTTPS port of mta-sts.<domain> (RFC 8461 says 443).
MAILRELAY_MTA_STS_PORT = env_int("MAILRELAY_MTA_STS_PORT", 443)
# The path of a file of "next-hop username:password [allow-cleartext]" lines;
# with MAILRELAY_SMTP_AUTH_FILE (a mounted secret) the value is those lines.
MAILRELAY_SMTP_AUTH = env_str("MAILRELAY_SMTP_AUTH", "")
# Send those credentials over TLS whose certificate was not verified (policy may/encrypt)?
MAILRELAY_SMTP_AUTH_ALLOW_UNVERIFIED_TLS = env_bool(
    "MAILRELAY_SMTP_AUTH_ALLOW_UNVERIFIED_TLS", False
)

# --- message tracking and webhooks (README "Message tracking and webhooks")
MAILRELAY_TRACKING_RETENTION = env_duration("MAILRELAY_TRACKING_RETENTION", "30d")
MAILRELAY_EVENT_LOG = env_str("MAILRELAY_EVENT_LOG", "")  # a path, "-" (stdout) or "" (off)
MAILRELAY_WEBHOOK_TIMEOUT = env_duration("MAILRELAY_WEBHOOK_TIMEOUT", "5s")
MAILRELAY_WEBHOOK_RETRY_FOR = env_duration("MAILRELAY_WEBHOOK_RETRY_FOR", "24h")
MAILRELAY_WEBHOOK_CONCURRENCY = env_int("MAILRELAY_WEBHOOK_CONCURRENCY", 4)
# false: webhook URLs to loopback, private or link-local addresses are refused
# (at save and, after DNS resolution, at send time); docs/webhooks.md.
MAILRELAY_WEBHOOK_ALLOW_PRIVATE = env_bool("MAILRELAY_WEBHOOK_ALLOW_PRIVATE", True)
# Beat: tracking partitions and retention hourly; a ring for due webhooks (a lost ring).
# Added to the schedule above (insight), never assigned again: one assignment
# would drop the other's tasks (tests/test_deployment.py checks them all).
CELERY_BEAT_SCHEDULE |= {
    "tracking partitions and retention": {"task": "tracking.tasks.maintain", "schedule": 3600.0},
    "ring for due webhooks": {"task": "tracking.tasks.webhook_sweep", "schedule": 30.0},
}
