"""The service's snapshot file: the context index, saved atomically, read back on start.

File format (JSON, UTF-8)::

    {"format": "contextpilot-service-snapshot", "version": 1,
     "saved_at": <unix seconds>, "cache_model": "<kv-events|capacity|ttl|none>",
     "index": <ContextIndex.snapshot()>}

``saved_at`` lets the TTL model tell how long the service was down; ``cache_model`` is kept
for the operator's information. A save writes a temporary file in the same directory, flushes
it to disk and renames it over the old one (POSIX ``rename`` is atomic), so a crash during a
save leaves the previous snapshot intact.
"""

from __future__ import annotations

import json
import os
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

SNAPSHOT_FORMAT = "contextpilot-service-snapshot"
SNAPSHOT_VERSION = 1


@dataclass(frozen=True)
class ServiceSnapshot:
    """What a snapshot file holds.

    Attributes:
        saved_at: unix time of the save, in seconds.
        cache_model: the cache-state source the saving service used.
        index: :meth:`ContextIndex.snapshot` output.
    """

    saved_at: float
    cache_model: str
    index: dict[str, Any]


def save_snapshot(path: str | os.PathLike[str], snapshot: ServiceSnapshot) -> int:
    """Write ``snapshot`` to ``path`` atomically; returns the bytes written.

    Raises:
        OSError: the directory is not writable.
    """
    target = Path(path)
    payload = json.dumps(
        {
            "format": SNAPSHOT_FORMAT,
            "version": SNAPSHOT_VERSION,
            "saved_at": snapshot.saved_at,
            "cache_model": snapshot.cache_model,
            "index": snapshot.index,
        },
        separators=(",", ":"),
    ).encode("utf-8")
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, temporary = tempfile.mkstemp(prefix=f".{target.name}.", dir=target.parent)
    try:
        with os.fdopen(fd, "wb") as handle:
            handle.write(payload)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(temporary, target)
    except BaseException:
        Path(temporary).unlink(missing_ok=True)
        raise
    return len(payload)


def load_snapshot(path: str | os.PathLike[str]) -> ServiceSnapshot | None:
    """Read a snapshot; None when ``path`` does not exist.

    Raises:
        ValueError: the file is not a snapshot of this format and version (the message names
            the path and what is wrong).
        OSError: the file exists but cannot be read.
    """
    target = Path(path)
    try:
        raw = target.read_bytes()
    except FileNotFoundError:
        return None
    try:
        data = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ValueError(f"snapshot {str(target)!r} is not valid JSON: {exc}") from exc
    if not isinstance(data, dict) or data.get("format") != SNAPSHOT_FORMAT:
        raise ValueError(f"snapshot {str(target)!r} has no format {SNAPSHOT_FORMAT!r}")
    if data.get("version") != SNAPSHOT_VERSION:
        raise ValueError(
            f"snapshot {str(target)!r} has version {data.get('version')!r}, "
            f"this service reads {SNAPSHOT_VERSION}"
        )
    saved_at = data.get("saved_at")
    index = data.get("index")
    if not isinstance(saved_at, (int, float)) or not isinstance(index, dict):
        raise ValueError(f"snapshot {str(target)!r} lacks a numeric saved_at or an index object")
    return ServiceSnapshot(float(saved_at), str(data.get("cache_model", "")), index)
