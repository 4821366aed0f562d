"""A retriever as an agent tool whose result shows labelled documents and keeps them as the
tool's artifact.

``langchain_core.tools.create_retriever_tool`` renders only each document's ``page_content``,
joined by blank lines: the model cannot cite a document, and the order annotation a
:class:`~.retriever.ContextPilotRetriever` adds when it reorders documents is lost.
:func:`retriever_tool` renders the documents with the core renderer
(:func:`~.prompts.render_context`, :class:`~contextpilot_integrations.core.rendering.PromptLayout`):
``[Doc 1]``, its text and the separator line for each shown document, then the plan's context
tail (location hints, and the order annotation when the pilot reordered them: docs/DESIGN.md,
"Prompt layout"), so the labels are the ones the plan gave. Documents of any other retriever
are labelled in the order returned, with no annotation.

The tool's ``response_format`` is ``"content_and_artifact"``: the ``ToolMessage`` carries the
rendered text as its content and the documents (with their ``metadata["contextpilot"]``
entries) as its ``artifact``, for the app's citations; the model sees only the content.
"""

from __future__ import annotations

from langchain_core.callbacks import Callbacks  # noqa: TC002 (read at runtime by StructuredTool)
from langchain_core.documents import Document
from langchain_core.retrievers import BaseRetriever
from langchain_core.tools import StructuredTool
from langchain_core.tools.retriever import RetrieverInput

from contextpilot_integrations.core.rendering import PromptLayout
from contextpilot_integrations.langchain.prompts import render_context

__all__ = ["retriever_tool"]


def retriever_tool(
    retriever: BaseRetriever,
    name: str,
    description: str,
    *,
    layout: PromptLayout | None = None,
) -> StructuredTool:
    """A tool that runs ``retriever`` on the model's ``query`` (sync and async).

    Args:
        retriever: any LangChain retriever; a ``ContextPilotRetriever``'s documents are
            rendered with its plan's labels and context tail.
        name: the tool's name, as the model calls it.
        description: what the model is told the tool does.
        layout: the labels and block template (default: the retriever's pilot's ``layout``
            when it has a pilot, else :class:`PromptLayout`). Give the pilot's layout when
            the retriever wraps one further down.

    Returns:
        A ``StructuredTool`` taking ``{"query": str}`` whose result is
        ``(rendered documents, documents)``.

    Raises:
        TypeError: ``retriever`` is not a ``BaseRetriever``, or ``name`` or ``description``
            is not a non-empty str.
    """
    if not isinstance(retriever, BaseRetriever):
        raise TypeError(f"retriever must be a BaseRetriever, got {type(retriever).__name__}")
    for field, value in (("name", name), ("description", description)):
        if not isinstance(value, str) or not value:
            raise TypeError(f"{field} must be a non-empty str, got {value!r:.80}")

    def content(documents: list[Document]) -> tuple[str, list[Document]]:
        return str(render_context(documents, layout or _layout_of(retriever))), documents

    def run(query: str, callbacks: Callbacks = None) -> tuple[str, list[Document]]:
        return content(retriever.invoke(query, config={"callbacks": callbacks}))

    async def arun(query: str, callbacks: Callbacks = None) -> tuple[str, list[Document]]:
        return content(await retriever.ainvoke(query, config={"callbacks": callbacks}))

    return StructuredTool(
        name=name,
        description=description,
        func=run,
        coroutine=arun,
        args_schema=RetrieverInput,
        response_format="content_and_artifact",
    )


def _layout_of(retriever: BaseRetriever) -> PromptLayout | None:
    """The layout of the retriever's pilot, if it has one (``None``: the default)."""
    pilot = getattr(retriever, "pilot", None)
    layout = getattr(pilot, "layout", None) if pilot is not None else None
    return layout if isinstance(layout, PromptLayout) else None
