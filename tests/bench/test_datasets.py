"""The dataset fetcher against a local HTTP server laid out like a data directory
(``$CONTEXTPILOT_DATA_URL``): the download and its notice, the refusal of a file whose checksum
is not the pinned one, the cache reused without a second download, and the message when the
server cannot be reached."""

from __future__ import annotations

import http.server
import shutil
import socket
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from contextpilot_bench.cli import main
from contextpilot_bench.datasets import (
    CACHE_ENV,
    DATA_URL_ENV,
    DATASETS,
    DatasetUnavailableError,
    fetch_files,
    file_url,
)
from contextpilot_bench.workloads import DATA_DIR_ENV, load_workload, resolve_data_dir

MULTIHOP = ("multihop_rag_sample500/queries.json", "multihop_rag_sample500/ground_truth.json")


@dataclass
class Mirror:
    """A running server: its base URL, the directory it serves and the paths asked for."""

    url: str
    root: Path
    requested: list[str] = field(default_factory=list)


@pytest.fixture
def mirror(tmp_path: Path) -> Iterator[Mirror]:
    root = tmp_path / "served"
    root.mkdir()
    requested: list[str] = []

    class Handler(http.server.SimpleHTTPRequestHandler):
        def __init__(self, *args, **kwargs) -> None:  # type: ignore[no-untyped-def]
            super().__init__(*args, directory=str(root), **kwargs)

        def do_GET(self) -> None:
            requested.append(self.path)
            super().do_GET()

        def log_message(self, format: str, *args: object) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield Mirror(f"http://127.0.0.1:{server.server_address[1]}", root, requested)
    finally:
        server.shutdown()
        server.server_close()
        thread.join(timeout=10)


@pytest.fixture
def cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """An empty fetch cache, no data directory configured."""
    monkeypatch.delenv(DATA_DIR_ENV, raising=False)
    monkeypatch.setenv(CACHE_ENV, str(tmp_path / "cache"))
    return tmp_path / "cache"


def _serve(mirror: Mirror, data_dir: Path, *paths: str) -> None:
    for path in paths:
        (mirror.root / path).parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(data_dir / path, mirror.root / path)


def test_every_file_is_pinned_to_a_commit_and_a_checksum() -> None:
    for dataset in DATASETS:
        assert len(dataset.commit) == 40 and dataset.licence
        for file in dataset.files:
            assert len(file.sha256) == 64
            assert dataset.url(file) == (
                f"https://raw.githubusercontent.com/{dataset.repository}/{dataset.commit}/"
                f"{file.upstream_path}"
            )
    assert file_url("locomo/locomo10.json").endswith(
        "/snap-research/LoCoMo/3eb6f2c585f5e1699204e3c3bdf7adc5c28cb376/data/locomo10.json"
    )


def test_download_then_the_cache_is_reused(
    mirror: Mirror,
    cache: Path,
    data_dir: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    _serve(mirror, data_dir, *MULTIHOP)
    monkeypatch.setenv(DATA_URL_ENV, mirror.url + "/")
    assert file_url(MULTIHOP[0]) == f"{mirror.url}/{MULTIHOP[0]}"
    workload = load_workload("multihop-rag")
    assert len(workload.requests) == 500
    assert sorted(mirror.requested) == sorted(f"/{p}" for p in MULTIHOP)
    for path in MULTIHOP:
        assert (cache / path).read_bytes() == (data_dir / path).read_bytes()
    notice = capsys.readouterr().err
    assert notice.count("fetched MultiHop-RAG") == 1 and "ODC-BY" in notice
    assert str(cache / "multihop_rag_sample500") in notice
    # Again: the cache answers, nothing is downloaded and nothing is said.
    assert resolve_data_dir(files=MULTIHOP) == cache
    load_workload("multihop-rag")
    assert len(mirror.requested) == 2
    assert capsys.readouterr().err == ""


def test_a_file_with_another_checksum_is_refused(
    mirror: Mirror, cache: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = "locomo/locomo10.json"
    (mirror.root / "locomo").mkdir()
    (mirror.root / path).write_text("[]\n", encoding="utf-8")
    monkeypatch.setenv(DATA_URL_ENV, mirror.url)
    with pytest.raises(ValueError, match="SHA-256") as refused:
        fetch_files([path])
    assert f"{mirror.url}/{path}" in str(refused.value)
    assert "--data-dir" in str(refused.value)
    assert not (cache / path).exists()


def test_offline_names_the_url_and_the_flag(
    cache: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    with socket.socket() as probe:  # a port nothing listens on
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    monkeypatch.setenv(DATA_URL_ENV, f"http://127.0.0.1:{port}")
    url = f"http://127.0.0.1:{port}/mtrag/mtragun-human/generation_tasks/reference.jsonl"
    with pytest.raises(DatasetUnavailableError) as offline:
        load_workload("mtrag")
    message = str(offline.value)
    assert url in message and "--data-dir" in message and DATA_DIR_ENV in message
    assert main(["--workload", "mtrag", "--no-plot"]) == 2
    err = capsys.readouterr().err
    assert url in err and "--data-dir" in err


def test_a_data_dir_comes_before_the_cache(
    tmp_path: Path, cache: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(DATA_URL_ENV, "http://127.0.0.1:9")  # never asked
    assert resolve_data_dir(tmp_path) == tmp_path
    monkeypatch.setenv(DATA_DIR_ENV, str(tmp_path))
    assert resolve_data_dir() == tmp_path
    monkeypatch.delenv(DATA_DIR_ENV)
    assert resolve_data_dir(files=()) == cache
