"""The default models on the real engine: SmolLM2 chat with structured output, MiniLM
embeddings. Only shape and validity are asserted, never model text."""

from __future__ import annotations

import base64
import json

import numpy as np
import pytest
from openai.types import CreateEmbeddingResponse
from openai.types.chat import ChatCompletion

from llm_batch.core.endpoints import Endpoint
from llm_batch.core.records import BatchRequest
from llm_batch.runtime.engine.runner import EngineRunner

pytestmark = pytest.mark.engine


def _run(llm, endpoint, model, bodies):
    runner = EngineRunner(llm, endpoint, model)
    out = []
    requests = [BatchRequest(index=i, custom_id=f"c{i}", body=b) for i, b in enumerate(bodies)]
    assert runner.run(requests, lambda r, u: out.append(r)) is None
    assert [r.index for r in out] == list(range(len(bodies)))
    return out


def test_smollm2_chat_and_json_schema(smollm2_llm):
    schema = {
        "type": "object",
        # Bounded fields: a 135M model can loop forever on digits of an unbounded integer.
        "properties": {"city": {"type": "string", "maxLength": 40}, "is_capital": {"type": "boolean"}},
        "required": ["city", "is_capital"],
        "additionalProperties": False,
    }
    fmt = {"type": "json_schema", "json_schema": {"name": "city", "schema": schema, "strict": True}}
    ask = "Give the capital of France as JSON, and whether it is a capital."
    bodies = [
        {"messages": [{"role": "user", "content": "What is the capital of France?"}], "max_tokens": 32, "temperature": 0},
        *({"messages": [{"role": "user", "content": ask}], "max_tokens": 96, "temperature": 0, "response_format": fmt}
          for _ in range(2)),
    ]
    results = _run(smollm2_llm, Endpoint.CHAT_COMPLETIONS, "smollm2-135m-instruct", bodies)
    parsed = [ChatCompletion.model_validate(r.body) for r in results]
    assert parsed[0].choices[0].message.content.strip()
    for p in parsed[1:]:
        assert p.choices[0].finish_reason == "stop"
        value = json.loads(p.choices[0].message.content)
        assert set(value) == {"city", "is_capital"}
        assert isinstance(value["city"], str) and isinstance(value["is_capital"], bool)


def test_minilm_embeddings_match_llm_embed(minilm_llm):
    texts = ["The cat sits on the mat.", "A cat is sitting on a mat.", "Quarterly tax filing deadlines."]
    results = _run(minilm_llm, Endpoint.EMBEDDINGS, "all-minilm-l6-v2", [
        {"input": texts[0]},
        {"input": texts, "encoding_format": "float"},
        {"input": texts[:2], "encoding_format": "base64"},
    ])
    single, several, encoded = results
    assert CreateEmbeddingResponse.model_validate(single.body).data[0].index == 0
    response = CreateEmbeddingResponse.model_validate(several.body)
    assert [d.index for d in response.data] == [0, 1, 2]
    vectors = np.array([d.embedding for d in response.data])
    assert vectors.shape == (3, 384)
    assert response.usage.prompt_tokens == response.usage.total_tokens > 0
    reference = np.array([o.outputs.embedding for o in minilm_llm.embed(texts, use_tqdm=False)])
    assert np.allclose(vectors, reference, atol=1e-3)
    # Paraphrases are close, unrelated text is not (normalized vectors: dot = cosine).
    assert vectors[0] @ vectors[1] > 0.8 > vectors[0] @ vectors[2]
    decoded = [np.frombuffer(base64.b64decode(d["embedding"]), dtype="<f4") for d in encoded.body["data"]]
    assert np.allclose(np.array(decoded), vectors[:2], atol=1e-3)
