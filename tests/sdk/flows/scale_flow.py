"""Scale batch completions as llmengine's docs show them (`Completion.batch_create`, and from
the release that has them `use_v2=True`, `get_batch_completion`, `cancel_batch_completion`),
one step per call of the test; see _flow.py for the protocol. The client reads
LLM_ENGINE_BASE_PATH and SCALE_API_KEY from the environment (the test sets both). The output
file's items are parsed with the client's own types (`parse_output`)."""

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
    logprobs = Completion.batch_create(
        output_data_path=f"{output_path}.logprobs.json", model_config=config,
        content=CreateBatchCompletionsRequestContent(prompts=prompts, max_new_tokens=4, temperature=0.0,
                                                     return_token_log_probs=True))
    observed = {"inline": inline.job_id, "from_file": from_file.job_id, "logprobs": logprobs.job_id,
                "has_v2": has_v2(), "status": status_of(inline.job_id)}
    if hasattr(Completion, "cancel_batch_completion"):
        observed["cancel"] = Completion.cancel_batch_completion(job_id=from_file.job_id)
    observed["refused"] = {
        "unknown_model": refusal(lambda: Completion.batch_create(
            output_data_path="out/never.json", model_config=CreateBatchCompletionsModelConfig(model="no-such-model", labels=labels),
            content=content)),
        "foreign_path": refusal(lambda: Completion.batch_create(output_data_path=foreign_path, model_config=config, content=content)),
    }
    return observed


def create_v2(base, key, model, labels, messages, prompts, output_path, input_path, file_output_path):
    """`use_v2=True` as the client's docstring shows it (chat requests inline), and from a file;
    inline completion requests (with logprobs), and v1 prompts content on the v2 route."""
    if not has_v2():
        return {"v2": None}
    from llmengine.data_types import FilteredChatCompletionV2Request, FilteredCompletionV2Request

    config = CreateBatchCompletionsModelConfig(model=model)
    job = Completion.batch_create(output_data_path=output_path, model_config=config,
                                  content=[FilteredChatCompletionV2Request(messages=m, max_tokens=4) for m in messages],
                                  use_v2=True, labels=labels)
    completions = Completion.batch_create(
        output_data_path=f"{output_path}.completions.json", model_config=config, use_v2=True,
        content=[FilteredCompletionV2Request(prompt=p, max_tokens=4, logprobs=1) for p in prompts])
    v1_content = Completion.batch_create(
        output_data_path=f"{output_path}.v1-content.json", model_config=config, use_v2=True,
        content=CreateBatchCompletionsRequestContent(prompts=prompts, max_new_tokens=4, temperature=0.0))
    from_file = Completion.batch_create(input_data_path=input_path, output_data_path=file_output_path, model_config=config,
                                        use_v2=True, priority="high")
    got = Completion.get_batch_completion(job_id=job.job_id)["job"]
    return {
        "v2": {"id": job.job_id, "status": str(job.status.value), "output_data_path": job.output_data_path, "labels": labels},
        "got": {"status": got["status"], "metadata": got.get("metadata"), "priority": got.get("priority")},
        "from_file": {"id": from_file.job_id, "priority": from_file.priority},
        "completions": {"id": completions.job_id, "output_data_path": completions.output_data_path},
        "v1_content": {"id": v1_content.job_id, "output_data_path": v1_content.output_data_path},
        "cancel": Completion.cancel_batch_completion(job_id=from_file.job_id),
        "cancelled_status": status_of(from_file.job_id),
        "refused": {"unknown_model": refusal(lambda: Completion.batch_create(
            output_data_path="out/never.json", model_config=CreateBatchCompletionsModelConfig(model="no-such-model"),
            content=[FilteredChatCompletionV2Request(messages=messages[0])], use_v2=True))},
    }


def create_adapter(base, key, model, unknown_model, prompts, messages, output_path):
    """model_config.model naming a LoRA adapter: on the default route (v1 prompts) and, where
    the release has it, on the v2 route (chat requests, the job read back with
    get_batch_completion); and an adapter nobody has, on each route."""
    config = CreateBatchCompletionsModelConfig(model=model, labels={})  # labels: required in 0.0.0b36
    content = CreateBatchCompletionsRequestContent(prompts=prompts, max_new_tokens=4, temperature=0.0)
    v1 = Completion.batch_create(output_data_path=output_path, model_config=config, content=content)
    observed = {"v1": {"id": v1.job_id}, "has_v2": has_v2(), "v2": None, "refused": {
        "unknown_v1": refusal(lambda: Completion.batch_create(
            output_data_path="out/never.json", model_config=CreateBatchCompletionsModelConfig(model=unknown_model, labels={}),
            content=content))}}
    if has_v2():
        from llmengine.data_types import FilteredChatCompletionV2Request

        requests = [FilteredChatCompletionV2Request(messages=m, max_tokens=4) for m in messages]
        job = Completion.batch_create(output_data_path=f"{output_path}.v2.json", model_config=config, content=requests,
                                      use_v2=True)
        got = Completion.get_batch_completion(job_id=job.job_id)["job"]
        observed["v2"] = {"id": job.job_id, "status": str(job.status.value), "model": job.model_config.model,
                          "output_data_path": job.output_data_path,
                          "got": {"status": got["status"], "model": got["model_config"]["model"]}}
        observed["refused"]["unknown_v2"] = refusal(lambda: Completion.batch_create(
            output_data_path="out/never.json", model_config=CreateBatchCompletionsModelConfig(model=unknown_model, labels={}),
            content=requests, use_v2=True))
    return observed


# The client's type of an output item, by what the job's content was: Scale's v1 prompts give
# CompletionOutput items, v2 completion and chat requests their v2 response bodies.
OUTPUT_TYPES = {"v1": "CompletionOutput", "completion": "CompletionV2Response", "chat": "ChatCompletionV2Response"}


def parse_output(array, shape):
    """Every item parsed by the client's own type for the job's content: what the parses
    refused (`invalid`: the field's path, list positions as `*`, and pydantic's error type), the item
    fields the type does not know, and per v1 item its counts and token outputs."""
    from llmengine import data_types

    model = getattr(data_types, OUTPUT_TYPES[shape])
    parsed, invalid = [], set()
    for item in array:
        try:
            parsed.append(model.parse_obj(item))
        except ValueError as exc:  # pydantic's ValidationError
            invalid.update((".".join("*" if isinstance(part, int) else str(part) for part in error["loc"]), error["type"])
                           for error in exc.errors())
    observed = {"type": model.__name__, "fields": sorted(model.__fields__), "parsed": len(parsed),
                "invalid": sorted(invalid), "unknown": sorted({key for item in array for key in item} - set(model.__fields__))}
    if shape == "v1":
        observed["items"] = [{"num_completion_tokens": p.num_completion_tokens, "num_prompt_tokens": p.num_prompt_tokens,
                              "tokens": len(p.tokens or []),
                              "spelled": "".join(t.token for t in p.tokens) == p.text if p.tokens else None}
                             for p in parsed]
    else:
        observed["objects"] = sorted({item.get("object") for item in array})
    return observed


def results(base, key, job_id, local_path, shape):
    """The job's status (where the client can ask) and the JSON array written at its output
    path, each item parsed as the job's `shape` (v1, completion, chat) says."""
    with open(local_path) as f:
        array = json.load(f)
    return {"status": status_of(job_id), "results": len(array), "parsed": parse_output(array, shape)}


def foreign(base, key, job_id):
    """Another user's job, as this key sees it (releases with get/cancel calls)."""
    if not hasattr(Completion, "get_batch_completion"):
        return {"refused": None}
    return {"refused": {
        "get": refusal(lambda: Completion.get_batch_completion(job_id=job_id)),
        "cancel": refusal(lambda: Completion.cancel_batch_completion(job_id=job_id)),
    }}


if __name__ == "__main__":
    run("scale-llm-engine", {"create_v1": create_v1, "create_adapter": create_adapter, "create_v2": create_v2, "results": results, "foreign": foreign})
