"""Scale batch completions as llmengine's docs show them (`Completion.batch_create`, and from
the release that has them `use_v2=True`, `get_batch_completion`, `cancel_batch_completion`),
one step per call of the test; see _flow.py for the protocol. The client reads
LLM_ENGINE_BASE_PATH and SCALE_API_KEY from the environment (the test sets both)."""

from __future__ import annotations

import inspect
import json

from _flow import refusal, run
from llmengine import Completion
from llmengine.data_types import CreateBatchCompletionsModelConfig, CreateBatchCompletionsRequestContent


def has_v2() -> bool:
    return "use_v2" in inspect.signature(Completion.batch_create).parameters


def status_of(job_id: str) -> str | None:
    """The job's status through the client's own call (None: this release has none)."""
    if not hasattr(Completion, "get_batch_completion"):
        return None
    return Completion.get_batch_completion(job_id=job_id)["job"]["status"]


def create_v1(base, key, model, labels, prompts, output_path, input_path, file_output_path, foreign_path):
    """The default route (v1), from inline prompts and from a JSON file."""
    config = CreateBatchCompletionsModelConfig(model=model, labels=labels)
    content = CreateBatchCompletionsRequestContent(prompts=prompts, max_new_tokens=4, temperature=0.0)
    inline = Completion.batch_create(output_data_path=output_path, model_config=config, content=content)
    from_file = Completion.batch_create(input_data_path=input_path, output_data_path=file_output_path, model_config=config,
                                        data_parallelism=2)
    observed = {"inline": inline.job_id, "from_file": from_file.job_id, "has_v2": has_v2(),
                "status": status_of(inline.job_id)}
    if hasattr(Completion, "cancel_batch_completion"):
        observed["cancel"] = Completion.cancel_batch_completion(job_id=from_file.job_id)
    observed["refused"] = {
        "unknown_model": refusal(lambda: Completion.batch_create(
            output_data_path="out/never.json", model_config=CreateBatchCompletionsModelConfig(model="no-such-model", labels=labels),
            content=content)),
        "foreign_path": refusal(lambda: Completion.batch_create(output_data_path=foreign_path, model_config=config, content=content)),
    }
    return observed


def create_v2(base, key, model, labels, messages, output_path, input_path, file_output_path):
    """`use_v2=True` as the client's docstring shows it (chat requests inline), and from a file."""
    if not has_v2():
        return {"v2": None}
    from llmengine.data_types import FilteredChatCompletionV2Request

    config = CreateBatchCompletionsModelConfig(model=model)
    job = Completion.batch_create(output_data_path=output_path, model_config=config,
                                  content=[FilteredChatCompletionV2Request(messages=m, max_tokens=4) for m in messages],
                                  use_v2=True, labels=labels)
    from_file = Completion.batch_create(input_data_path=input_path, output_data_path=file_output_path, model_config=config,
                                        use_v2=True, priority="high")
    got = Completion.get_batch_completion(job_id=job.job_id)["job"]
    return {
        "v2": {"id": job.job_id, "status": str(job.status.value), "output_data_path": job.output_data_path, "labels": labels},
        "got": {"status": got["status"], "metadata": got.get("metadata"), "priority": got.get("priority")},
        "from_file": {"id": from_file.job_id, "priority": from_file.priority},
        "cancel": Completion.cancel_batch_completion(job_id=from_file.job_id),
        "cancelled_status": status_of(from_file.job_id),
        "refused": {"unknown_model": refusal(lambda: Completion.batch_create(
            output_data_path="out/never.json", model_config=CreateBatchCompletionsModelConfig(model="no-such-model"),
            content=[FilteredChatCompletionV2Request(messages=messages[0])], use_v2=True))},
    }


def results(base, key, job_id, local_path):
    """The job's status (where the client can ask) and the JSON array written at its output path."""
    with open(local_path) as f:
        array = json.load(f)
    return {"status": status_of(job_id), "results": len(array)}


def foreign(base, key, job_id):
    """Another user's job, as this key sees it (releases with get/cancel calls)."""
    if not hasattr(Completion, "get_batch_completion"):
        return {"refused": None}
    return {"refused": {
        "get": refusal(lambda: Completion.get_batch_completion(job_id=job_id)),
        "cancel": refusal(lambda: Completion.cancel_batch_completion(job_id=job_id)),
    }}


if __name__ == "__main__":
    run("scale-llm-engine", {"create_v1": create_v1, "create_v2": create_v2, "results": results, "foreign": foreign})
