"""``RAGInputs``: the ``{"context": ..., "question": ...}`` step, with batches planned jointly.

In the usual chain ``{"context": retriever | format_documents, "question": RunnablePassthrough()}``
the map is a ``RunnableParallel``, whose ``batch`` runs ``invoke`` once per input: each request
is then planned on its own, against what the index already holds (ContextPilot's online mode).
``RAGInputs(retriever=...)`` produces the same dict, but its ``batch``/``abatch`` call the
retriever's ``batch``, so that :meth:`ContextPilotRetriever.batch` plans the whole batch jointly
and marks the schedule, which :func:`~.plan_fields.with_plan_fields` then follows::

    chain = RAGInputs(retriever=retriever) | CONTEXTPILOT_PROMPT | with_plan_fields(llm)
    answers = chain.batch(questions, config={"max_concurrency": 4})  # input order
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from langchain_core.callbacks import AsyncCallbackManagerForChainRun, CallbackManagerForChainRun
from langchain_core.runnables import Runnable, RunnableConfig, RunnableSerializable
from langchain_core.runnables.config import patch_config
from pydantic import ConfigDict, Field

from contextpilot_integrations.langchain.prompts import format_documents

__all__ = ["RAGInputs"]


class RAGInputs(RunnableSerializable[Any, dict[str, Any]]):
    """Question in, ``{"context": RenderedContext, "question": str}`` out.

    Args:
        retriever: the retriever (a :class:`~.retriever.ContextPilotRetriever`).
        formatter: documents -> context (default :data:`~.prompts.format_documents`).
        question_key: the question's key in a dict input and in the output.
        context_key: the context's key in the output.

    The input is the question (``str``) or a dict holding it under ``question_key``; other
    keys of a dict input (for example a chat history) are passed through.

    Raises:
        TypeError: an input that is neither a ``str`` nor a dict with a ``str`` question.
    """

    model_config = ConfigDict(arbitrary_types_allowed=True)

    retriever: Runnable[str, Any]
    formatter: Runnable[Any, Any] = Field(default_factory=lambda: format_documents)
    question_key: str = "question"
    context_key: str = "context"

    @classmethod
    def is_lc_serializable(cls) -> bool:
        return False

    def invoke(
        self, input: Any, config: RunnableConfig | None = None, **kwargs: Any
    ) -> dict[str, Any]:
        return self._call_with_config(self._invoke, input, config, **kwargs)

    async def ainvoke(
        self, input: Any, config: RunnableConfig | None = None, **kwargs: Any
    ) -> dict[str, Any]:
        return await self._acall_with_config(self._ainvoke, input, config, **kwargs)

    def batch(
        self,
        inputs: list[Any],
        config: RunnableConfig | list[RunnableConfig] | None = None,
        *,
        return_exceptions: bool = False,
        **kwargs: Any,
    ) -> list[dict[str, Any]]:
        if not inputs:
            return []
        return self._batch_with_config(
            self._batch, inputs, config, return_exceptions=return_exceptions, **kwargs
        )

    async def abatch(
        self,
        inputs: list[Any],
        config: RunnableConfig | list[RunnableConfig] | None = None,
        *,
        return_exceptions: bool = False,
        **kwargs: Any,
    ) -> list[dict[str, Any]]:
        if not inputs:
            return []
        return await self._abatch_with_config(
            self._abatch, inputs, config, return_exceptions=return_exceptions, **kwargs
        )

    # ------------------------------------------------------------------ internals
    def _question(self, input: Any) -> str:
        question = input.get(self.question_key) if isinstance(input, Mapping) else input
        if not isinstance(question, str):
            raise TypeError(
                f"input must be a question str or a dict with a str {self.question_key!r}, "
                f"got {type(input).__name__}: {input!r:.80}"
            )
        return question

    def _output(self, input: Any, question: str, context: Any) -> dict[str, Any]:
        passed = dict(input) if isinstance(input, Mapping) else {}
        return {**passed, self.question_key: question, self.context_key: context}

    def _invoke(
        self, input: Any, run_manager: CallbackManagerForChainRun, config: RunnableConfig
    ) -> dict[str, Any]:
        question = self._question(input)
        documents = self.retriever.invoke(
            question, patch_config(config, callbacks=run_manager.get_child("retriever"))
        )
        context = self.formatter.invoke(
            documents, patch_config(config, callbacks=run_manager.get_child("formatter"))
        )
        return self._output(input, question, context)

    async def _ainvoke(
        self, input: Any, run_manager: AsyncCallbackManagerForChainRun, config: RunnableConfig
    ) -> dict[str, Any]:
        question = self._question(input)
        documents = await self.retriever.ainvoke(
            question, patch_config(config, callbacks=run_manager.get_child("retriever"))
        )
        context = await self.formatter.ainvoke(
            documents, patch_config(config, callbacks=run_manager.get_child("formatter"))
        )
        return self._output(input, question, context)

    def _batch(
        self,
        inputs: list[Any],
        run_manager: list[CallbackManagerForChainRun],
        config: list[RunnableConfig],
    ) -> list[Any]:
        run_managers, configs = run_manager, config  # one per input (names set by LangChain)
        questions, valid = self._questions(inputs)
        documents = self.retriever.batch(
            [questions[i] for i in valid],
            [_child(configs[i], run_managers[i], "retriever") for i in valid],
            return_exceptions=True,
        )
        return self._finish_batch(inputs, questions, valid, documents, run_managers, configs)

    async def _abatch(
        self,
        inputs: list[Any],
        run_manager: list[AsyncCallbackManagerForChainRun],
        config: list[RunnableConfig],
    ) -> list[Any]:
        run_managers, configs = run_manager, config  # one per input (names set by LangChain)
        questions, valid = self._questions(inputs)
        documents = await self.retriever.abatch(
            [questions[i] for i in valid],
            [_child(configs[i], run_managers[i], "retriever") for i in valid],
            return_exceptions=True,
        )
        outputs: list[Any] = list(questions)
        for i, docs in zip(valid, documents):
            if isinstance(docs, BaseException):
                outputs[i] = docs
                continue
            try:
                context = await self.formatter.ainvoke(
                    docs, _child(configs[i], run_managers[i], "formatter")
                )
            except Exception as exc:
                outputs[i] = exc
                continue
            outputs[i] = self._output(inputs[i], questions[i], context)
        return outputs

    def _questions(self, inputs: list[Any]) -> tuple[list[Any], list[int]]:
        """Per input its question (or the TypeError), and the indices of valid inputs."""
        questions: list[Any] = []
        for input in inputs:
            try:
                questions.append(self._question(input))
            except TypeError as exc:
                questions.append(exc)
        return questions, [i for i, q in enumerate(questions) if isinstance(q, str)]

    def _finish_batch(
        self,
        inputs: list[Any],
        questions: list[Any],
        valid: list[int],
        documents: list[Any],
        run_managers: list[Any],
        configs: list[RunnableConfig],
    ) -> list[Any]:
        outputs: list[Any] = list(questions)
        for i, docs in zip(valid, documents):
            if isinstance(docs, BaseException):
                outputs[i] = docs
                continue
            try:
                context = self.formatter.invoke(
                    docs, _child(configs[i], run_managers[i], "formatter")
                )
            except Exception as exc:
                outputs[i] = exc
                continue
            outputs[i] = self._output(inputs[i], questions[i], context)
        return outputs


def _child(config: RunnableConfig, run_manager: Any, tag: str) -> RunnableConfig:
    return patch_config(config, callbacks=run_manager.get_child(tag))
