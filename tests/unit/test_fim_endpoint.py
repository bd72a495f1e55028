"""/v1/fim/completions: the endpoint and what a model needs to serve it (a registry `fim`
template), the template itself, and per-line validation of Mistral's FIM bodies (errors name
the field and the line), offline with `llm-batch validate` too."""

from __future__ import annotations

import io
import json
from pathlib import Path

import orjson
import pytest

from llm_batch.cli.main import main
from llm_batch.core.endpoints import SUPPORTED_ENDPOINTS, Endpoint, endpoints_served, parse_endpoint, serving_problem
from llm_batch.core.model_config import InvalidModelConfig
from llm_batch.infra.model_registry import FimTemplate, load_registry
from llm_batch.pipeline.validation import ValidationLimits, validate_batch

FIM = "/v1/fim/completions"
LIMITS = ValidationLimits(max_requests=1000, max_input_bytes=10**7, max_line_bytes=2**20, max_reported_errors=100)


def test_the_endpoint_is_served_by_generate_models_with_a_fim_template():
    assert parse_endpoint(FIM) is Endpoint.FIM_COMPLETIONS and FIM in SUPPORTED_ENDPOINTS
    assert Endpoint.FIM_COMPLETIONS in endpoints_served("generate", ["fim"])
    assert Endpoint.FIM_COMPLETIONS not in endpoints_served("generate")
    assert Endpoint.CHAT_COMPLETIONS in endpoints_served("generate", ["fim"])
    assert serving_problem(FIM, "m", "generate", ["fim"]) is None
    assert "has no 'fim' entry in the model registry" in serving_problem(FIM, "m", "generate", [])
    assert "(embed task) serves /v1/embeddings, not /v1/fim/completions" in serving_problem(FIM, "m", "embed")


def test_the_packaged_registry_knows_which_models_do_fim():
    registry = load_registry()
    assert registry.models["tiny-random-llama-fim"].features == ["fim"]
    assert registry.models["tiny-random-llama"].features == []
    assert registry.models["smollm2-135m-instruct"].fim is None


def test_fim_templates_render_in_their_order_and_are_checked(tmp_path: Path):
    psm = FimTemplate(prefix="<P>", suffix="<S>", middle="<M>")
    assert psm.render("def f(", "):") == "<P>def f(<S>):<M>"
    spm = FimTemplate(prefix="[PREFIX]", suffix="[SUFFIX]", order="spm")
    assert spm.render("def f(", "):") == "[SUFFIX]):[PREFIX]def f("
    assert spm.tokens == ["[PREFIX]", "[SUFFIX]"]
    with pytest.raises(ValueError, match="psm fim template needs a middle token"):
        FimTemplate(prefix="<P>", suffix="<S>")

    def registry_with(entry: str) -> Path:
        path = tmp_path / "models.yaml"
        path.write_text("default_chat_model: a\ndefault_embedding_model: a\nmodels:\n  a:\n"
                        f"    checkpoint: /m\n{entry}")
        return path

    with pytest.raises(InvalidModelConfig, match="fim is for generate models, not a embed model"):
        load_registry(registry_with("    task: embed\n    fim: {prefix: a, suffix: b, middle: c}\n"))
    with pytest.raises(InvalidModelConfig, match="fim.order"):
        load_registry(registry_with("    task: generate\n    fim: {prefix: a, suffix: b, middle: c, order: mps}\n"))


def _lines(*bodies) -> bytes:
    return b"".join(orjson.dumps({"custom_id": f"f{i}", "body": b}) + b"\n" for i, b in enumerate(bodies))


def test_fim_lines_are_checked_one_by_one_with_line_numbers():
    data = _lines(
        {"model": "codestral", "prompt": "def f(", "suffix": "):", "max_tokens": 16, "min_tokens": 1,
         "temperature": 0.2, "top_p": 0.9, "stop": ["\n\n"], "random_seed": 3, "stream": False,
         "metadata": {"k": 1}, "prompt_cache_key": "x"},
        {"prompt": ""},                                    # an empty prompt with no suffix is still a prompt: the template's tokens
        {"suffix": "only"},                                # 3: no prompt
        {"prompt": ["a list"]},                            # 4: FIM takes one string
        {"prompt": "p", "suffix": 5},                      # 5
        {"prompt": "p", "max_tokens": 0},                  # 6
        {"prompt": "p", "random_seed": "7"},               # 7
        {"prompt": "p", "min_tokens": 9, "max_tokens": 4},  # 8
        {"prompt": "p", "stream": True},                   # 9
        {"prompt": "p", "stop": [1]},                      # 10
    )
    valid, errors = io.BytesIO(), io.BytesIO()
    report = validate_batch(io.BytesIO(data), fmt="jsonl", endpoint=FIM, limits=LIMITS,
                            validated_out=valid, errors_out=errors)
    assert (report.total, report.valid, report.invalid) == (10, 2, 8)
    assert report.endpoint == FIM
    assert [json.loads(line)["custom_id"] for line in valid.getvalue().splitlines()] == ["f0", "f1"]
    found = {e.line: (e.code, e.message) for e in report.errors}
    assert sorted(found) == [3, 4, 5, 6, 7, 8, 9, 10]
    assert all(code == "invalid_body" for code, _ in found.values())
    assert found[3][1].startswith("body.prompt: field required")
    assert found[4][1].startswith("body.prompt: Input should be a valid string")
    assert found[5][1].startswith("body.suffix:")
    assert found[6][1].startswith("body.max_tokens:")
    assert found[7][1].startswith("body.random_seed:")
    assert "min_tokens (9) must not exceed max_tokens (4)" in found[8][1]
    assert found[9][1].startswith("body.stream:")
    assert found[10][1].startswith("body.stop:")


def test_llm_batch_validate_checks_fim_lines(capsys, tmp_path: Path):
    path = tmp_path / "fim.jsonl"
    path.write_bytes(_lines({"prompt": "def f(", "suffix": "):"}, {"prompt": 3}))
    status = main(["validate", str(path), "--endpoint", FIM, "--json"])
    printed = json.loads(capsys.readouterr().out)
    assert status == 1 and (printed["valid"], printed["invalid"]) == (1, 1)
    assert printed["errors"][0]["line"] == 2 and printed["errors"][0]["message"].startswith("body.prompt:")
