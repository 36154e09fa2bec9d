"""Pickup and replay folders (Exchange's Pickup and Replay directories).

- ``start_pickup(allowed=...)``: watch the configured folders on the running loop;
- ``replay_format(message, recipients)``: a message as a replay file (export);
- ``parse_pickup`` / ``parse_replay``: a file → envelope and stored bytes.

See docs/pickup-replay.md.
"""

from delivery.pickup.parse import BadFile, PickupLimits, Submission, parse_pickup, parse_replay
from delivery.pickup.watcher import (
    FolderConfig,
    FolderWatcher,
    Outcome,
    PickupService,
    configured_folders,
    start_pickup,
)
from queues.replay import replay_format

__all__ = [
    "BadFile",
    "FolderConfig",
    "FolderWatcher",
    "Outcome",
    "PickupLimits",
    "PickupService",
    "Submission",
    "configured_folders",
    "parse_pickup",
    "parse_replay",
    "replay_format",
    "start_pickup",
]
