#!/usr/bin/env bash
# One virtual environment per SDK client release that the batch API is tested against
# (tests/sdk/, docs/api.md "SDK matrix"), under .cache/sdk-venvs/<name>. Idempotent: a
# stamp in each venv holds what it was built from (python + requirements), so a second run
# does nothing (~0.1 s); a changed line below rebuilds only that venv.
#
# Usage: scripts/sdk_venvs.sh [NAME...]   build (all, or the named ones) and print "NAME<TAB>PYTHON" per venv
#        scripts/sdk_venvs.sh --list      print the matrix ("NAME<TAB>REQUIREMENTS"), build nothing
# Env:   LLM_BATCH_SDK_VENVS (default .cache/sdk-venvs), PYTHON (default python3.11)
#
# Bumping a client: `pip index versions openai` (add --pre for scale-llm-engine), change the
# pin below and the venv's name with it, run tests/sdk, update docs/api.md "SDK matrix".
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=${LLM_BATCH_SDK_VENVS:-.cache/sdk-venvs}
PY=${PYTHON:-python3.11}

# NAME (= <pip package>-<version>; the tests take the dialect from the package) and its exact
# requirements. Newest releases resolved with `pip index versions` on 2026-12-01 (see docs).
MATRIX=(
  "openai-3.57.0              openai==3.57.0"
  # Oldest 1.x with client.batches (create/retrieve/cancel; batches.list came in 1.22.0) and
  # files.content. openai<1.55.3 passes proxies= to httpx, which httpx 0.28 removed.
  "openai-1.18.0              openai==1.18.0 httpx==0.27.2"
  "mistralai-3.7.0            mistralai==3.7.0"
  # Oldest with batch jobs (input files only; inline `requests` came in 1.x later); 1.x
  # imports `from mistralai import Mistral`, 2.0 on `from mistralai.client import Mistral`.
  "mistralai-1.2.0            mistralai==1.2.0"
  # Newest: Completion.batch_create(use_v2=True) and the v2 get/update/cancel calls; needs openai<2.
  "scale-llm-engine-0.0.0b45  scale-llm-engine==0.0.0b45"
  # What pip resolved beside openai 3.x in the main venv: batch_create on the v1 route only.
  "scale-llm-engine-0.0.0b36  scale-llm-engine==0.0.0b36"
)

if [[ ${1:-} == --list ]]; then
  for entry in "${MATRIX[@]}"; do
    read -r name reqs <<<"$entry"
    printf '%s\t%s\n' "$name" "$reqs"
  done
  exit 0
fi

selected() { [[ ${#wanted[@]} -eq 0 || " ${wanted[*]} " == *" $1 "* ]]; }
wanted=("$@")
for name in "${wanted[@]}"; do
  printf '%s\n' "${MATRIX[@]}" | grep -q "^$name " || { echo "sdk_venvs: no venv named $name (see --list)" >&2; exit 2; }
done
mkdir -p "$ROOT"
ROOT=$(cd "$ROOT" && pwd)
exec 9>"$ROOT/.lock"
flock 9  # one builder at a time (two test sessions, or a test session and a shell)

build() {  # stamp name requirements...: a fresh venv, then the stamp last (a half-built venv has none)
  local stamp=$1 name=$2 dir=$ROOT/$2
  shift 2
  rm -rf "$dir"
  "$PY" -m venv "$dir"
  "$dir/bin/python" -m pip install -q --disable-pip-version-check "$@"
  "$dir/bin/python" -m pip freeze --disable-pip-version-check >"$dir/freeze.txt"
  echo "$stamp" >"$dir/.sdk-stamp"
}

pyversion=$("$PY" -c 'import sys; print(sys.version.split()[0])')
pids=() names=()
for entry in "${MATRIX[@]}"; do
  read -r name reqs <<<"$entry"
  selected "$name" || continue
  want="python $pyversion: $reqs"
  if [[ $(cat "$ROOT/$name/.sdk-stamp" 2>/dev/null) != "$want" ]]; then
    echo "sdk_venvs: building $name ($reqs), log in $ROOT/$name.log" >&2
    # shellcheck disable=SC2086  # reqs is a list of words
    build "$want" "$name" $reqs >"$ROOT/$name.log" 2>&1 &
    pids+=($!) names+=("$name")
  fi
done
failed=0
for i in "${!pids[@]}"; do
  if ! wait "${pids[$i]}"; then
    echo "sdk_venvs: building ${names[$i]} failed:" >&2
    tail -20 "$ROOT/${names[$i]}.log" >&2
    failed=1
  fi
done
[[ $failed -eq 0 ]] || exit 1
for entry in "${MATRIX[@]}"; do
  read -r name _ <<<"$entry"
  if selected "$name"; then printf '%s\t%s\n' "$name" "$ROOT/$name/bin/python"; fi
done
