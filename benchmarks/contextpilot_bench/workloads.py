"""Real benchmark workloads: a corpus of context blocks and a stream of retrieval requests.

A :class:`Workload` is what the benchmark replays: ``corpus`` (documents, each in one retrieval
*scope*) and ``requests`` (queries in arrival order, each retrieving only among the documents of
its own scope). Loaders read the third-party data files from a data directory
(:func:`resolve_data_dir`; without one, the files are fetched from their upstreams,
:mod:`~contextpilot_bench.datasets`) and never modify them. Built-in workloads (files,
upstreams and licences: docs/DESIGN.md, "Datasets"):

``multihop-rag``
    The 500-question MultiHop-RAG sample. Corpus: one document per distinct evidence article
    (keyed by title): the title, then the article's evidence facts, one per line, de-duplicated,
    in first-seen order over the questions in file order. Requests: the questions, one scope.
``locomo``
    LoCoMo: each question retrieves among the dialog turns of its own conversation (scope =
    conversation), rendered ``"speaker (session date): text"`` plus ``" [shares an image:
    caption]"`` when the turn shares one (the image is part of what was said).
``mtrag``
    MTRAG-UN: every user turn of every conversation (conversations in file order, turns in order)
    retrieves among the reference passages of its collection: the union of the ``contexts`` of
    all tasks of that ``Collection``, de-duplicated by ``document_id`` (scope = collection). Each
    request carries the time its user turn was written (``metadata.created_at``, Unix seconds)
    as ``Request.arrived_at``; the other workloads record no request times.
``mtrag-conversations``
    The same, each request also carrying the agent's recorded answer (``Request.answer``;
    ``None`` for a conversation's last turn), for :mod:`~contextpilot_bench.multiturn`.

Other workloads are added with :func:`register_workload`.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from contextpilot_bench.datasets import fetch_files

__all__ = [
    "AGENT_WORKLOADS",
    "DATA_DIR_ENV",
    "Document",
    "Request",
    "Workload",
    "WorkloadSpec",
    "load_workload",
    "register_workload",
    "resolve_data_dir",
    "workload_names",
]

logger = logging.getLogger(__name__)

DATA_DIR_ENV = "CONTEXTPILOT_DATA_DIR"

AGENT_WORKLOADS = ("agentic-multihop-rag", "agentic-mtrag", "agentic-file-edits")
"""The agent workloads: two built on these datasets (:mod:`~contextpilot_bench.agent_sessions`)
and one over the package's own source files (:mod:`~contextpilot_bench.agent_file_sessions`);
named here so the command line lists them without importing the agent frameworks."""
"""Environment variable naming the data directory when ``--data-dir`` is not given."""


@dataclass(frozen=True, slots=True)
class Document:
    """One corpus document (a context block once retrieved).

    Attributes:
        id: the dataset's own id (article title, ``dia_id``, ``document_id``); unique within
            its scope, kept for reporting.
        text: the block text exactly as it will be rendered into prompts (non-empty).
        scope: the retrieval scope the document belongs to ("" when the workload has one).
    """

    id: str
    text: str
    scope: str = ""


@dataclass(frozen=True, slots=True)
class Request:
    """One request of the workload, in arrival order.

    Attributes:
        id: a stable id, unique within the workload (a base for the engine's rid).
        query: the text used for retrieval and as the question in the prompt (non-empty).
        conversation_id: the conversation (or tenant) the request belongs to, or ``None``.
        scope: the retrieval scope; the request retrieves only documents of this scope.
        answer: the reply the data records for this request, or ``None``; a multi-turn replay
            shows it in the conversation history of the next turn.
        arrived_at: when the data records the request was made (Unix seconds), or ``None``;
            ``contextpilot-bench --arrival replay`` replays the gaps between them.
    """

    id: str
    query: str
    conversation_id: str | None = None
    scope: str = ""
    answer: str | None = None
    arrived_at: float | None = None


@dataclass(frozen=True)
class Workload:
    """A corpus and a request stream.

    Attributes:
        name: the workload name (as given to :func:`load_workload`).
        corpus: all documents, every scope, each ``(scope, id)`` once.
        requests: requests in arrival order; every request's scope has documents.

    Raises:
        ValueError: on construction, an empty corpus or request list, a repeated
            ``(scope, id)`` or request id, an empty text or query, or a request whose scope
            has no document.
    """

    name: str
    corpus: tuple[Document, ...]
    requests: tuple[Request, ...]
    _scopes: dict[str, tuple[Document, ...]] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if not self.corpus:
            raise ValueError(f"workload {self.name!r}: corpus is empty")
        if not self.requests:
            raise ValueError(f"workload {self.name!r}: requests is empty")
        scopes: dict[str, list[Document]] = {}
        seen: set[tuple[str, str]] = set()
        for doc in self.corpus:
            if not doc.text.strip():
                raise ValueError(f"workload {self.name!r}: document {doc.id!r} has empty text")
            if (doc.scope, doc.id) in seen:
                raise ValueError(
                    f"workload {self.name!r}: document id {doc.id!r} repeated in scope "
                    f"{doc.scope!r}"
                )
            seen.add((doc.scope, doc.id))
            scopes.setdefault(doc.scope, []).append(doc)
        rids: set[str] = set()
        for req in self.requests:
            if req.id in rids:
                raise ValueError(f"workload {self.name!r}: request id {req.id!r} repeated")
            rids.add(req.id)
            if not req.query.strip():
                raise ValueError(f"workload {self.name!r}: request {req.id!r} has an empty query")
            if req.scope not in scopes:
                raise ValueError(
                    f"workload {self.name!r}: request {req.id!r} has scope {req.scope!r} "
                    "with no document"
                )
        object.__setattr__(self, "_scopes", {s: tuple(d) for s, d in scopes.items()})

    def scope_corpus(self, scope: str) -> tuple[Document, ...]:
        """The documents of one scope, in corpus order.

        Raises:
            KeyError: ``scope`` has no document.
        """
        return self._scopes[scope]

    @property
    def scopes(self) -> list[str]:
        """Scope names in first-seen corpus order."""
        return list(self._scopes)

    def head(self, n: int | None) -> Workload:
        """The same workload with only the first ``n`` requests (all of them when ``None``).

        The corpus is kept whole, so retrieval results for the kept requests do not change.

        Raises:
            ValueError: ``n`` is not a positive integer.
        """
        if n is None:
            return self
        if isinstance(n, bool) or not isinstance(n, int) or n <= 0:
            raise ValueError(f"limit must be a positive integer, got {n!r}")
        return Workload(self.name, self.corpus, self.requests[:n])


Loader = Callable[[Path], Workload]


@dataclass(frozen=True)
class WorkloadSpec:
    """How to load one workload.

    Attributes:
        name: the workload name (``--workload``).
        loader: ``data_dir -> Workload``; called after ``files`` were found.
        files: paths relative to the data directory that the loader reads.
        upstream: where a user gets the files (repository, commit or page, path).
    """

    name: str
    loader: Loader
    files: tuple[str, ...]
    upstream: str


_REGISTRY: dict[str, WorkloadSpec] = {}


def register_workload(spec: WorkloadSpec) -> None:
    """Add a workload to :func:`load_workload` and the CLI's ``--workload`` choices.

    Raises:
        ValueError: a workload of that name is already registered.
    """
    if spec.name in _REGISTRY:
        raise ValueError(f"workload {spec.name!r} is already registered")
    _REGISTRY[spec.name] = spec


def workload_names() -> list[str]:
    """Registered workload names, in registration order."""
    return list(_REGISTRY)


def resolve_data_dir(
    data_dir: str | os.PathLike[str] | None = None, *, files: Iterable[str] | None = None
) -> Path:
    """Find the data directory.

    Order: ``data_dir`` when given, else the environment variable ``CONTEXTPILOT_DATA_DIR``,
    else the fetch cache of :mod:`~contextpilot_bench.datasets`, into which ``files`` are first
    downloaded from their upstreams where missing.

    Args:
        data_dir: ``--data-dir``.
        files: the data-directory paths the caller reads, fetched when the cache is used
            (default: every file of :data:`~contextpilot_bench.datasets.DATASETS`; ``()``:
            none).

    Raises:
        FileNotFoundError: the chosen directory does not exist (the message says where it was
            chosen from), or a file could not be downloaded
            (:class:`~contextpilot_bench.datasets.DatasetUnavailableError`).
        ValueError: a downloaded file's checksum is not the pinned one.
    """
    if data_dir is not None:
        path, origin = Path(data_dir), "--data-dir"
    elif os.environ.get(DATA_DIR_ENV):
        path, origin = Path(os.environ[DATA_DIR_ENV]), f"${DATA_DIR_ENV}"
    else:
        return fetch_files(files)
    if not path.is_dir():
        raise FileNotFoundError(f"data directory {path} (from {origin}) does not exist")
    return path


def load_workload(name: str, data_dir: str | os.PathLike[str] | None = None) -> Workload:
    """Load a registered workload from the data directory.

    Raises:
        ValueError: unknown workload name.
        FileNotFoundError: the data directory or one of the workload's files is missing; the
            message names the file and where it comes from upstream.
    """
    spec = _REGISTRY.get(name)
    if spec is None:
        raise ValueError(f"unknown workload {name!r}; known: {', '.join(_REGISTRY)}")
    root = resolve_data_dir(data_dir, files=spec.files)
    for rel in spec.files:
        if not (root / rel).is_file():
            raise FileNotFoundError(
                f"workload {name!r} needs {root / rel}, which is missing. Get it from "
                f"{spec.upstream} and place it at <data dir>/{rel}."
            )
    workload = spec.loader(root)
    logger.info(
        "loaded workload %s: %d documents in %d scopes, %d requests",
        name,
        len(workload.corpus),
        len(workload.scopes),
        len(workload.requests),
    )
    return workload


def _read_json(path: Path) -> object:
    with path.open(encoding="utf-8") as f:
        return json.load(f)


def _dedup(items: Iterable[str]) -> list[str]:
    return list(dict.fromkeys(items))


# --- multihop-rag -------------------------------------------------------------------------------

_MULTIHOP_FILES = (
    "multihop_rag_sample500/queries.json",
    "multihop_rag_sample500/ground_truth.json",
)


def _load_multihop_rag(root: Path) -> Workload:
    queries = _read_json(root / _MULTIHOP_FILES[0])
    truth = _read_json(root / _MULTIHOP_FILES[1])
    if not isinstance(queries, dict) or not isinstance(truth, dict):
        raise ValueError("multihop-rag: queries.json and ground_truth.json must be JSON objects")
    facts: dict[str, list[str]] = {}
    requests: list[Request] = []
    for entry in queries["queries"]:
        qid = str(entry["id"])
        for evidence in truth[qid]["evidence_list"]:
            facts.setdefault(evidence["title"].strip(), []).append(evidence["fact"].strip())
        requests.append(Request(id=f"multihop-{qid}", query=entry["question"]))
    corpus = tuple(
        Document(id=title, text="\n".join([title, *_dedup(f for f in article if f)]))
        for title, article in facts.items()
    )
    return Workload("multihop-rag", corpus, tuple(requests))


register_workload(
    WorkloadSpec(
        name="multihop-rag",
        loader=_load_multihop_rag,
        files=_MULTIHOP_FILES,
        upstream=(
            "github.com/zc277584121/search-datasets@ad6f7c0222686b2b53642f80aaa6b7ab31a4dcc1, "
            "files multihop_rag/queries.json and multihop_rag/ground_truth.json (a 500-question "
            "sample of yixuantt/MultiHop-RAG, ODC-BY)"
        ),
    )
)


# --- locomo -------------------------------------------------------------------------------------

_LOCOMO_FILE = "locomo/locomo10.json"


def _session_keys(conversation: dict[str, object]) -> list[str]:
    keys = [k for k in conversation if k.startswith("session_") and k[8:].isdigit()]
    return sorted(keys, key=lambda k: int(k[8:]))


def _render_turn(turn: dict[str, str], date: str) -> str:
    text = f"{turn['speaker']} ({date}): {turn['text'].strip()}"
    caption = turn.get("blip_caption")
    if caption:
        text += f" [shares an image: {caption.strip()}]"
    return text


def _load_locomo(root: Path) -> Workload:
    samples = _read_json(root / _LOCOMO_FILE)
    if not isinstance(samples, list):
        raise ValueError(f"locomo: {_LOCOMO_FILE} must be a JSON list of conversations")
    corpus: list[Document] = []
    requests: list[Request] = []
    for sample in samples:
        conv_id = str(sample["sample_id"])
        conversation = sample["conversation"]
        for key in _session_keys(conversation):
            date = str(conversation.get(f"{key}_date_time", "")).strip() or "undated"
            corpus.extend(
                Document(id=turn["dia_id"], text=_render_turn(turn, date), scope=conv_id)
                for turn in conversation[key]
            )
        requests.extend(
            Request(
                id=f"{conv_id}-q{i}", query=qa["question"], conversation_id=conv_id, scope=conv_id
            )
            for i, qa in enumerate(sample["qa"])
        )
    return Workload("locomo", tuple(corpus), tuple(requests))


register_workload(
    WorkloadSpec(
        name="locomo",
        loader=_load_locomo,
        files=(_LOCOMO_FILE,),
        upstream=(
            "github.com/snap-research/LoCoMo@3eb6f2c585f5e1699204e3c3bdf7adc5c28cb376, "
            "path data/locomo10.json (CC BY-NC 4.0)"
        ),
    )
)


# --- mtrag (MTRAG-UN) ---------------------------------------------------------------------------

_MTRAG_FILE = "mtrag/mtragun-human/generation_tasks/reference.jsonl"


def _read_jsonl(path: Path) -> list[dict[str, Any]]:
    with path.open(encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def _mtrag_collections(tasks: Sequence[dict[str, Any]]) -> dict[str, dict[str, str]]:
    """Collection -> {document_id: text}, the union of the tasks' reference passages."""
    collections: dict[str, dict[str, str]] = {}
    for task in tasks:
        passages = collections.setdefault(str(task["Collection"]), {})
        for context in task["contexts"]:
            passages.setdefault(str(context["document_id"]), context["text"].strip())
    return collections


def _created_at(message: dict[str, Any]) -> float | None:
    created = (message.get("metadata") or {}).get("created_at")
    return float(created) if isinstance(created, (int, float)) else None


def _load_mtrag(root: Path, *, name: str = "mtrag", answers: bool = False) -> Workload:
    tasks = _read_jsonl(root / _MTRAG_FILE)
    corpus = tuple(
        Document(id=doc_id, text=text, scope=collection)
        for collection, passages in _mtrag_collections(tasks).items()
        for doc_id, text in passages.items()
    )
    requests: list[Request] = []
    for task in tasks:
        conv_id = str(task["conversation_id"])
        messages = task["input"]
        number = 0
        for position, message in enumerate(messages):
            if message["speaker"] != "user":
                continue
            number += 1
            reply = messages[position + 1] if position + 1 < len(messages) else None
            answer = None
            if answers and reply is not None and reply["speaker"] == "agent":
                answer = str(reply["text"])
            requests.append(
                Request(
                    id=f"{conv_id}::{number}",
                    query=message["text"],
                    conversation_id=conv_id,
                    scope=str(task["Collection"]),
                    answer=answer,
                    arrived_at=_created_at(message),
                )
            )
    return Workload(name, corpus, tuple(requests))


def _load_mtrag_conversations(root: Path) -> Workload:
    return _load_mtrag(root, name="mtrag-conversations", answers=True)


register_workload(
    WorkloadSpec(
        name="mtrag",
        loader=_load_mtrag,
        files=(_MTRAG_FILE,),
        upstream=(
            "github.com/IBM/mt-rag-benchmark@cc5b1d481b391181b89f7ced860308482e785463, "
            "path mtragun-human/generation_tasks/reference.jsonl (Apache-2.0)"
        ),
    )
)


register_workload(
    WorkloadSpec(
        name="mtrag-conversations",
        loader=_load_mtrag_conversations,
        files=(_MTRAG_FILE,),
        upstream=(
            "github.com/IBM/mt-rag-benchmark@cc5b1d481b391181b89f7ced860308482e785463, "
            "path mtragun-human/generation_tasks/reference.jsonl (Apache-2.0)"
        ),
    )
)
