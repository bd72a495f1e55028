"""Capture the exact JSON bodies llmengine's Completion.batch_create posts (the fixtures here).

Run with the client's own interpreter (scale-llm-engine 0.0.0b45 needs openai<2, so it lives
in a venv of its own), e.g.:

    python3.11 -m venv /tmp/scale45 && /tmp/scale45/bin/pip install scale-llm-engine==0.0.0b45
    LLM_ENGINE_DISABLE_VERSION_CHECK=true /tmp/scale45/bin/python capture.py v2 > b45-v2-batch-create.json

The client posts to a local HTTP server that records the body and answers like ours; the
file is {"client", "path", "body"}. Cases: v2 (use_v2=True, defaults only), v2-tuned (use_v2=True,
engine fields set), v1 (the v1 route; the only one of 0.0.0b36).
"""

import importlib.metadata
import json
import os
import sys
import threading
from http.server import BaseHTTPRequestHandler, HTTPServer

captured: dict = {}


class Recorder(BaseHTTPRequestHandler):
    def do_POST(self) -> None:  # noqa: N802 - http.server's name
        captured["path"] = self.path
        captured["body"] = json.loads(self.rfile.read(int(self.headers["content-length"])))
        now = "2026-01-01T00:00:00"
        reply = {"job_id": "job-x"} if "/v1/" in self.path else {
            "job_id": "job-x", "output_data_path": captured["body"]["output_data_path"],
            "model_config": captured["body"]["model_config"], "status": "queued",
            "created_at": now, "expires_at": now, "completed_at": None, "metadata": {}}
        data = json.dumps(reply).encode()
        self.send_response(200)
        self.send_header("content-type", "application/json")
        self.send_header("content-length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *args) -> None:
        pass


def main(case: str) -> None:
    server = HTTPServer(("127.0.0.1", 0), Recorder)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    # This script is its own process (not a test): the client reads its server and key from
    # the environment when llmengine is imported, and the server's port is known only now.
    os.environ["LLM_ENGINE_BASE_PATH"] = f"http://127.0.0.1:{server.server_port}/"
    os.environ["SCALE_API_KEY"] = "lbk_capture"
    from llmengine import Completion
    from llmengine.data_types import CreateBatchCompletionsModelConfig

    version = importlib.metadata.version("scale-llm-engine")
    tag = f"b{version.rsplit('b', 1)[1]}-{case}"
    if case.startswith("v2"):
        from llmengine.data_types import FilteredChatCompletionV2Request

        tuned = {
            "max_model_len": 512, "max_num_seqs": 8, "enforce_eager": True, "seed": 7,
            "dtype": "float32", "gpu_memory_utilization": 0.5, "max_num_batched_tokens": 1024,
            "enable_prefix_caching": False, "tokenizer_mode": "hf", "chat_template": "chatml",
            "response_role": "bot", "served_model_name": "my-model",
            "limit_mm_per_prompt": '{"image": 0}',
        } if case == "v2-tuned" else {}
        Completion.batch_create(
            output_data_path=f"out/{tag}.json",
            model_config=CreateBatchCompletionsModelConfig(model="smollm2-135m-instruct", **tuned),
            content=[FilteredChatCompletionV2Request(messages=[{"role": "user", "content": "Say hi."}], max_tokens=8)],
            use_v2=True,
        )
    else:
        from llmengine.data_types import CreateBatchCompletionsRequestContent

        Completion.batch_create(
            output_data_path=f"out/{tag}.json",
            model_config=CreateBatchCompletionsModelConfig(model="smollm2-135m-instruct", labels={}),
            content=CreateBatchCompletionsRequestContent(prompts=["Say hi."], max_new_tokens=8, temperature=0.0),
        )
    print(json.dumps({"client": f"scale-llm-engine=={version}", "path": captured["path"], "body": captured["body"]},
                     indent=2, sort_keys=True))


if __name__ == "__main__":
    main(sys.argv[1])
