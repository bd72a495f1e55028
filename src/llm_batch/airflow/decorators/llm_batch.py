"""``@task.llm_batch``: a TaskFlow function that returns the batch's input (prompts, requests or
a dict naming one input), run as an ``LLMBatchOperator`` (docs/orchestration.md, "A batch as a
step of your DAG", shows an example)."""

from __future__ import annotations

from collections.abc import Callable, Collection, Mapping, Sequence
from typing import Any, ClassVar

from airflow.sdk.bases.decorator import DecoratedOperator, TaskDecorator, determine_kwargs, task_decorator_factory
from airflow.sdk.definitions._internal.types import SET_DURING_EXECUTION
from airflow.sdk.definitions.context import context_merge

from llm_batch.airflow.operators.batch_step import INPUTS, LLMBatchOperator


def input_of(returned: Any) -> dict[str, Any]:
    """The operator input the callable's value stands for (TypeError if it is none)."""
    if isinstance(returned, Mapping):
        given = [name for name in INPUTS if name in returned]
        if len(given) != 1 or len(returned) != 1:
            raise TypeError(f"a dict returned by an @task.llm_batch function names exactly one of {', '.join(INPUTS)}; "
                            f"got keys {sorted(returned)}")
        return dict(returned)
    if isinstance(returned, (str, bytes)) or not isinstance(returned, Sequence) or not returned:
        raise TypeError("an @task.llm_batch function returns a non-empty list of prompts or requests (or a dict "
                        f"naming one input), got {type(returned).__name__}")
    if all(isinstance(item, str) for item in returned):
        return {"prompts": list(returned)}
    return {"requests": list(returned)}


class _LLMBatchDecoratedOperator(DecoratedOperator, LLMBatchOperator):
    """Runs the callable for the batch's input, then is an ``LLMBatchOperator``.

    :param python_callable: returns the input (see the module's docstring).
    :param op_args: positional arguments of the callable (templated).
    :param op_kwargs: keyword arguments of the callable (templated).
    """

    template_fields: Sequence[str] = (*DecoratedOperator.template_fields, *LLMBatchOperator.template_fields)
    template_fields_renderers: ClassVar[dict[str, str]] = {
        **DecoratedOperator.template_fields_renderers,
        **LLMBatchOperator.template_fields_renderers,
    }
    custom_operator_name: str = "@task.llm_batch"

    def __init__(self, *, python_callable: Callable, op_args: Collection[Any] | None = None,
                 op_kwargs: Mapping[str, Any] | None = None, **kwargs: Any) -> None:
        # The input comes from the callable at run time.
        kwargs.setdefault("prompts", SET_DURING_EXECUTION)
        super().__init__(python_callable=python_callable, op_args=op_args, op_kwargs=op_kwargs, **kwargs)

    def execute(self, context: Any) -> Any:
        context_merge(context, self.op_kwargs)
        kwargs = determine_kwargs(self.python_callable, self.op_args, context)
        chosen = input_of(self.python_callable(*self.op_args, **kwargs))
        for name in INPUTS:
            setattr(self, name, chosen.get(name))
        return LLMBatchOperator.execute(self, context)


def llm_batch_task(python_callable: Callable | None = None, **kwargs: Any) -> TaskDecorator:
    """Wrap a function returning the batch's input into an ``LLMBatchOperator``.

    :param python_callable: the function.
    :param kwargs: ``LLMBatchOperator`` parameters (``model`` is required).
    """
    return task_decorator_factory(python_callable=python_callable, decorated_operator_class=_LLMBatchDecoratedOperator,
                                  **kwargs)
