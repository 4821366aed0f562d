"""The service's snapshot file: every pilot's state, written atomically, checked on the way in.

File format (JSON, UTF-8)::

    {"format": "contextpilot-service-snapshot", "version": 2,
     "saved_at": <unix seconds>, "cache_model": "<kv-events|capacity|ttl|none>",
     "final": <bool>, "isolation": "<open|single|partitioned|shared>",
     "partitions": [{"tenant": <str, or null for the one pilot of the open and single
                     modes>, "rid_tags": [<hex>, ...], "pilot": <ContextPilot.snapshot()>}]}

``saved_at`` lets the TTL model tell how long the service was down; ``final`` says the save
was taken with planning stopped: only then does the conversation store come back whole
(:mod:`contextpilot_integrations.core.conversations.conversation`). A version 1 file (the
index alone) is read too.

Writing (:func:`write_snapshot`): a temporary file beside the target (``.<name>.<random>.tmp``;
a symlinked path is followed, the link kept), flushed, fsynced, renamed over the target and
the directory fsynced, so a crash leaves the old snapshot or the new one, never a torn file.
The encoding is done in pieces of bounded size with a pause between them, so a save in a
background thread does not hold the GIL for long (:func:`yield_to_planners`). Temporary files
a killed save left behind are removed at start (:func:`remove_temporary_files`).

Reading (:func:`read_snapshot`) checks the whole document before anything is restored; a file
that fails (bad JSON, nesting too deep, wrong types) raises :class:`SnapshotError`, and the
service sets it aside (:func:`set_aside`) and starts empty: never a crash loop.
"""

from __future__ import annotations

import json
import logging
import math
import os
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import msgspec

from contextpilot_integrations.service.tenants import is_rid_tag

__all__ = [
    "SERVICE_SNAPSHOT_VERSION",
    "SNAPSHOT_FORMAT",
    "SnapshotError",
    "read_snapshot",
    "remove_temporary_files",
    "resolved",
    "set_aside",
    "write_snapshot",
    "yield_to_planners",
]

logger = logging.getLogger(__name__)

SNAPSHOT_FORMAT = "contextpilot-service-snapshot"
SERVICE_SNAPSHOT_VERSION = 2
_READABLE_VERSIONS = (1, 2)
_TEMPORARY_SUFFIX = ".tmp"
_PIECE_LEAVES = 20_000
"""Most scalar values one encoder call encodes (well under a millisecond)."""
_SLICE_S = 0.001
_PAUSE_S = 0.0005


class SnapshotError(ValueError):
    """A snapshot file that cannot be restored (the message names the path and the fault)."""


# --------------------------------------------------------------------------------------------
# Paths
# --------------------------------------------------------------------------------------------


def resolved(path: str | os.PathLike[str]) -> Path:
    """The file a snapshot path stands for: symlinks followed (also a dangling one)."""
    return Path(os.path.realpath(path))


def set_aside(path: str | os.PathLike[str]) -> Path | None:
    """Rename an unreadable snapshot to ``<name>.unreadable-<UTC time>`` beside it (the next
    save must not overwrite it, the operator may want it); returns the new path, or None when
    there was nothing to move or it could not be moved (logged)."""
    target = resolved(path)
    if not target.exists():
        return None
    stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
    aside = target.with_name(f"{target.name}.unreadable-{stamp}")
    number = 1
    while aside.exists():
        number += 1
        aside = target.with_name(f"{target.name}.unreadable-{stamp}-{number}")
    try:
        target.rename(aside)
    except OSError as exc:
        logger.warning("cannot move the unreadable snapshot %s aside: %s", target, exc)
        return None
    logger.info("moved the unreadable snapshot %s to %s", target, aside)
    return aside


def remove_temporary_files(path: str | os.PathLike[str]) -> int:
    """Remove the temporary files that killed saves of this snapshot left; returns how many."""
    target = resolved(path)
    removed = 0
    try:
        leftovers = list(target.parent.glob(f".{target.name}.*{_TEMPORARY_SUFFIX}"))
    except OSError:
        return 0
    for leftover in leftovers:
        try:
            leftover.unlink()
            removed += 1
        except OSError as exc:
            logger.warning("cannot remove the stale temporary snapshot %s: %s", leftover, exc)
    if removed:
        logger.info("removed %d temporary snapshot files of interrupted saves", removed)
    return removed


# --------------------------------------------------------------------------------------------
# Writing
# --------------------------------------------------------------------------------------------


def yield_to_planners() -> None:
    """Sleep a moment: called between encoded pieces once a millisecond's worth is done, so
    that threads waiting for the GIL (plans) take it now rather than at the next switch
    interval."""
    time.sleep(_PAUSE_S)


def write_snapshot(
    path: str | os.PathLike[str],
    document: dict[str, Any],
    *,
    pause: Callable[[], None] | None = None,
    release: bool = False,
) -> int:
    """Write ``document`` as JSON to ``path`` atomically and durably; returns the bytes written.

    Args:
        path: the snapshot path (a symlink is followed: its target is replaced).
        document: JSON-serialisable (the format of the module docstring).
        pause: called between pieces of the encoding, about every millisecond of work
            (default :func:`yield_to_planners`).
        release: empty ``document`` in place once written, a slice at a time with pauses:
            freeing a large document in one go holds the GIL for as long as it takes (a
            quarter of a second for 100,000 requests), which every plan would wait for.

    Raises:
        OSError: the directory is not writable, the disk is full, ...
        TypeError / ValueError: ``document`` is not JSON-serialisable.
    """
    pause = pause or yield_to_planners
    target = resolved(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, temporary = tempfile.mkstemp(
        prefix=f".{target.name}.", suffix=_TEMPORARY_SUFFIX, dir=target.parent
    )
    size = 0
    try:
        with os.fdopen(fd, "wb", buffering=1 << 20) as handle:
            slice_started = time.perf_counter()
            for piece in _json_pieces(document):
                handle.write(piece)
                size += len(piece)
                if time.perf_counter() - slice_started > _SLICE_S:
                    pause()
                    slice_started = time.perf_counter()
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(temporary, target)
    except BaseException:
        Path(temporary).unlink(missing_ok=True)
        raise
    finally:
        if release:
            _release(document, pause)
    _fsync_directory(target.parent)
    return size


def _release(value: dict[str, Any] | list[Any], pause: Callable[[], None]) -> None:
    """Empty a large document in slices, pausing about every millisecond of freeing."""
    slice_started = [time.perf_counter()]

    def paced() -> None:
        if time.perf_counter() - slice_started[0] > _SLICE_S:
            pause()
            slice_started[0] = time.perf_counter()

    def empty(container: dict[str, Any] | list[Any]) -> None:
        if isinstance(container, dict):
            for item in container.values():
                if isinstance(item, (dict, list)) and _leaves(item, _PIECE_LEAVES) > _PIECE_LEAVES:
                    empty(item)
            container.clear()
            return
        while container:
            piece, leaves = 0, 0
            while piece < len(container) and leaves <= _PIECE_LEAVES:
                piece += 1
                leaves += _leaves(container[-piece], _PIECE_LEAVES)
            for item in container[-piece:]:
                if isinstance(item, (dict, list)) and _leaves(item, _PIECE_LEAVES) > _PIECE_LEAVES:
                    empty(item)
            del container[-piece:]
            paced()

    empty(value)


def _fsync_directory(directory: Path) -> None:
    """Make the rename durable (on POSIX, a rename is on disk once its directory is)."""
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return  # e.g. a platform without directory file descriptors
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


_encode = msgspec.json.Encoder().encode  # compact JSON, UTF-8; faster than json.dumps


def _json_pieces(value: Any) -> Iterator[bytes]:
    """``value`` as compact JSON, in pieces of at most about ``_PIECE_LEAVES`` scalars each."""
    if _leaves(value, _PIECE_LEAVES) <= _PIECE_LEAVES:
        yield _encode(value)
    elif isinstance(value, dict):
        yield b"{"
        for number, (key, item) in enumerate(value.items()):
            yield (b"," if number else b"") + _encode(str(key)) + b":"
            yield from _json_pieces(item)
        yield b"}"
    else:  # a list or tuple
        yield b"["
        run: list[Any] = []
        run_leaves = 0
        first = True
        for item in value:
            leaves = _leaves(item, _PIECE_LEAVES)
            if run and (leaves > _PIECE_LEAVES or run_leaves + leaves > _PIECE_LEAVES):
                yield (b"" if first else b",") + _encode(run)[1:-1]
                first, run, run_leaves = False, [], 0
            if leaves > _PIECE_LEAVES:
                yield b"" if first else b","
                yield from _json_pieces(item)
                first = False
            else:
                run.append(item)
                run_leaves += leaves
        if run:
            yield (b"" if first else b",") + _encode(run)[1:-1]
        yield b"]"


def _leaves(value: Any, limit: int) -> int:
    """Scalars in ``value`` (counting stops past ``limit``). A list whose first and last items
    are scalars counts as a list of scalars (cheap: the snapshot's lists are uniform)."""
    if isinstance(value, dict):
        items: Any = value.values()
    elif isinstance(value, (list, tuple)):
        if not value:
            return 1
        if not isinstance(value[0], (dict, list, tuple)) and not isinstance(
            value[-1], (dict, list, tuple)
        ):
            return len(value)
        items = value
    else:
        return 1
    total = 1
    for item in items:
        total += _leaves(item, limit - total) if isinstance(item, (dict, list, tuple)) else 1
        if total > limit:
            break
    return total


# --------------------------------------------------------------------------------------------
# Reading
# --------------------------------------------------------------------------------------------


def read_snapshot(path: str | os.PathLike[str]) -> dict[str, Any] | None:
    """The checked document of a snapshot file (a version 1 file as ``{"version": 1,
    "saved_at", "cache_model", "index"}``); None when there is no file.

    Checks the envelope (format, version, ``saved_at``, ``cache_model``, ``final``,
    ``isolation``, each partition's ``tenant``, ``rid_tags`` and ``pilot`` types); the pilots'
    states are checked by ``ContextPilot.restore``.

    Raises:
        SnapshotError: the file cannot be read or is not a snapshot of a readable version.
    """
    target = resolved(path)
    where = f"snapshot {str(target)!r}"
    try:
        raw = target.read_bytes()
    except FileNotFoundError:
        return None
    except OSError as exc:
        raise SnapshotError(f"{where} cannot be read: {exc}") from None
    try:
        data = json.loads(raw)
    except RecursionError:
        raise SnapshotError(f"{where} is nested too deeply to be a snapshot") from None
    except (UnicodeDecodeError, ValueError) as exc:
        raise SnapshotError(f"{where} is not valid JSON: {exc}") from None
    if not isinstance(data, dict) or data.get("format") != SNAPSHOT_FORMAT:
        raise SnapshotError(f"{where} has no format {SNAPSHOT_FORMAT!r}")
    version = data.get("version")
    if isinstance(version, bool) or version not in _READABLE_VERSIONS:
        raise SnapshotError(
            f"{where} has version {version!r:.40}, this service reads {list(_READABLE_VERSIONS)}"
        )
    saved_at = data.get("saved_at")
    if (
        isinstance(saved_at, bool)
        or not isinstance(saved_at, (int, float))
        or not math.isfinite(saved_at)
        or saved_at < 0
    ):
        raise SnapshotError(f"{where}: saved_at must be a unix time, got {saved_at!r:.40}")
    cache_model = data.get("cache_model", "")
    if not isinstance(cache_model, str):
        raise SnapshotError(f"{where}: cache_model must be a str")
    if version == 1:
        if not isinstance(data.get("index"), dict):
            raise SnapshotError(f"{where}: a version 1 snapshot needs an index object")
        return {
            "version": 1,
            "saved_at": float(saved_at),
            "cache_model": cache_model,
            "index": data["index"],
        }
    final, isolation, partitions = data.get("final"), data.get("isolation"), data.get("partitions")
    if not isinstance(final, bool) or not isinstance(isolation, str):
        raise SnapshotError(f"{where}: final must be a bool and isolation a str")
    if not isinstance(partitions, list):
        raise SnapshotError(f"{where}: partitions must be a list, got {type(partitions).__name__}")
    tenants = set()
    for i, partition in enumerate(partitions):
        if not isinstance(partition, dict) or set(partition) != {"tenant", "rid_tags", "pilot"}:
            raise SnapshotError(f"{where}: partitions[{i}] needs tenant, rid_tags and pilot")
        tenant, tags = partition["tenant"], partition["rid_tags"]
        if tenant is not None and not isinstance(tenant, str):
            raise SnapshotError(f"{where}: partitions[{i}].tenant must be a str or null")
        if tenant in tenants:
            raise SnapshotError(f"{where}: partitions[{i}] repeats tenant {tenant!r:.80}")
        tenants.add(tenant)
        if not isinstance(tags, list) or not all(is_rid_tag(tag) for tag in tags):
            raise SnapshotError(f"{where}: partitions[{i}].rid_tags must be a list of rid tags")
        if not isinstance(partition["pilot"], dict):
            raise SnapshotError(f"{where}: partitions[{i}].pilot must be an object")
    return {
        "version": 2,
        "saved_at": float(saved_at),
        "cache_model": cache_model,
        "final": final,
        "isolation": isolation,
        "partitions": partitions,
    }
