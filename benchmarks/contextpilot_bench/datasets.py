"""The workloads' data files, fetched from their upstream repositories when no data directory is
given (docs/DESIGN.md, "Datasets").

Every file is pinned: a repository, a commit and a path, and the file's SHA-256. A file is
downloaded once into the fetch cache (:func:`cache_dir`: ``$CONTEXTPILOT_DATA_CACHE``, else
pooch's per-user cache, ``~/.cache/contextpilot-bench`` on Linux) under the relative path a
data directory holds it at, so the cache is itself a data directory; a file already there with
the right checksum is not downloaded again, and one whose download has another checksum is
refused and not kept. A dataset's first download into a cache prints one line to stderr saying
where it went and under which licence (LoCoMo's is non-commercial).

``$CONTEXTPILOT_DATA_URL`` replaces every upstream with one base URL laid out like a data
directory (``<base>/locomo/locomo10.json``): a mirror, or a local server in the tests. Offline,
:class:`DatasetUnavailableError` names the URL and how to point at a local copy
(``--data-dir`` or ``$CONTEXTPILOT_DATA_DIR``).
"""

from __future__ import annotations

import os
import sys
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

__all__ = [
    "CACHE_ENV",
    "DATASETS",
    "DATA_URL_ENV",
    "Dataset",
    "DatasetFile",
    "DatasetUnavailableError",
    "cache_dir",
    "fetch_files",
    "file_url",
]

CACHE_ENV = "CONTEXTPILOT_DATA_CACHE"
"""Environment variable naming the fetch cache (default: pooch's per-user cache)."""
DATA_URL_ENV = "CONTEXTPILOT_DATA_URL"
"""Environment variable naming one base URL laid out like a data directory, used instead of
every upstream (a mirror, or a local server)."""

_DATA_DIR_HINT = "--data-dir DIR or set CONTEXTPILOT_DATA_DIR=DIR"
_TIMEOUT_S = 60.0


@dataclass(frozen=True, slots=True)
class DatasetFile:
    """One pinned data file.

    Attributes:
        path: where a data directory holds it (``locomo/locomo10.json``).
        upstream_path: its path in the upstream repository at the pinned commit.
        sha256: the file's SHA-256, hex.
    """

    path: str
    upstream_path: str
    sha256: str


@dataclass(frozen=True, slots=True)
class Dataset:
    """A dataset's files, all from one GitHub repository at one commit.

    Attributes:
        name: what the notice calls it.
        repository: ``owner/name`` on GitHub.
        commit: the pinned commit, 40 hex digits.
        licence: the data's licence, as the notice states it.
        files: the files the workloads read.
    """

    name: str
    repository: str
    commit: str
    licence: str
    files: tuple[DatasetFile, ...]

    def url(self, file: DatasetFile) -> str:
        """The file's raw URL at the pinned commit."""
        return (
            f"https://raw.githubusercontent.com/{self.repository}/{self.commit}/"
            f"{file.upstream_path}"
        )


DATASETS = (
    Dataset(
        name="LoCoMo",
        repository="snap-research/LoCoMo",
        commit="3eb6f2c585f5e1699204e3c3bdf7adc5c28cb376",
        licence="CC BY-NC 4.0, non-commercial use only",
        files=(
            DatasetFile(
                "locomo/locomo10.json",
                "data/locomo10.json",
                "79fa87e90f04081343b8c8debecb80a9a6842b76a7aa537dc9fdf651ea698ff4",
            ),
        ),
    ),
    Dataset(
        name="MTRAG-UN",
        repository="IBM/mt-rag-benchmark",
        commit="cc5b1d481b391181b89f7ced860308482e785463",
        licence="Apache-2.0",
        files=(
            DatasetFile(
                "mtrag/mtragun-human/generation_tasks/reference.jsonl",
                "mtragun-human/generation_tasks/reference.jsonl",
                "68053f709c928570718fd2c88455eccf974746f5bfa2206d7fd39b969acb21d4",
            ),
        ),
    ),
    Dataset(
        name="MultiHop-RAG 500-query sample",
        repository="zc277584121/search-datasets",
        commit="ad6f7c0222686b2b53642f80aaa6b7ab31a4dcc1",
        licence="ODC-BY (upstream MultiHop-RAG; the sampling repository has no licence file)",
        files=(
            DatasetFile(
                "multihop_rag_sample500/queries.json",
                "multihop_rag/queries.json",
                "6bd845d129c82a0e7fb318f71f699fb8c32b2a60484cf9d1c0bf498e01a0e20f",
            ),
            DatasetFile(
                "multihop_rag_sample500/ground_truth.json",
                "multihop_rag/ground_truth.json",
                "11bd7e64d40efef514d4718e776d080aa954bcc39b26c91a96dfdd59e1de2426",
            ),
        ),
    ),
)
"""Every file the built-in workloads and their reference answers read."""

_BY_PATH = {file.path: (dataset, file) for dataset in DATASETS for file in dataset.files}
_announced: set[tuple[Path, str]] = set()  # (cache, dataset name) told of in this process


class DatasetUnavailableError(FileNotFoundError):
    """A data file is not in the cache and could not be downloaded (offline, refused, not
    found); the message names the URL and how to point at a local copy."""


def cache_dir() -> Path:
    """The fetch cache: ``$CONTEXTPILOT_DATA_CACHE``, else pooch's per-user cache."""
    import pooch

    configured = os.environ.get(CACHE_ENV)
    return Path(configured) if configured else Path(pooch.os_cache("contextpilot-bench"))


def file_url(path: str) -> str:
    """Where ``path`` (a data-directory path of :data:`DATASETS`) is downloaded from:
    ``$CONTEXTPILOT_DATA_URL/<path>`` when that is set, else its pinned upstream URL.

    Raises:
        KeyError: ``path`` is not a file of :data:`DATASETS`.
    """
    dataset, file = _BY_PATH[path]
    base = os.environ.get(DATA_URL_ENV)
    return f"{base.rstrip('/')}/{path}" if base else dataset.url(file)


def fetch_files(paths: Iterable[str] | None = None) -> Path:
    """Make sure the fetch cache holds ``paths`` and return the cache.

    Args:
        paths: data-directory paths (default: every file of :data:`DATASETS`); a path that is
            not one of them is skipped (a registered workload's own files are the caller's to
            check).

    Raises:
        DatasetUnavailableError: a missing file could not be downloaded.
        ValueError: a downloaded file's SHA-256 is not the pinned one (nothing is kept).
    """
    import pooch  # here, not at the top: only a fetch needs pooch and requests
    import requests

    root = cache_dir()
    wanted = list(_BY_PATH) if paths is None else [p for p in paths if p in _BY_PATH]
    for path in dict.fromkeys(wanted):
        dataset, file = _BY_PATH[path]
        target = root / path
        if target.is_file() and pooch.file_hash(str(target)) == file.sha256:
            continue
        url = file_url(path)
        logger = pooch.get_logger()
        level = logger.level
        logger.setLevel("WARNING")  # the notice below says where the file went
        try:
            pooch.retrieve(
                url,
                known_hash=f"sha256:{file.sha256}",
                fname=Path(path).name,
                path=target.parent,
                downloader=pooch.HTTPDownloader(timeout=_TIMEOUT_S),
            )
        except requests.RequestException as exc:
            raise DatasetUnavailableError(
                f"could not download {url} ({type(exc).__name__}: {exc}); to use a local copy "
                f"of {dataset.name}, pass {_DATA_DIR_HINT} (DIR holding {path})"
            ) from exc
        except ValueError as exc:
            raise ValueError(
                f"{url}: the downloaded file's SHA-256 is not the pinned {file.sha256} (a changed "
                f"or broken upstream or mirror), so it was not kept; to use a local copy, pass "
                f"{_DATA_DIR_HINT}"
            ) from exc
        finally:
            logger.setLevel(level)
        if (root, dataset.name) not in _announced:
            _announced.add((root, dataset.name))
            print(
                f"contextpilot-bench: fetched {dataset.name} ({dataset.licence}) from "
                f"{dataset.repository}@{dataset.commit[:12]} into {target.parent}",
                file=sys.stderr,
            )
    return root
