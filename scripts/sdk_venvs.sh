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
# The newest release of each client is the one a user's pip installs today: asked of the
# package index (`pip index versions`, kept for 6 h in $ROOT/.newest), never a pin that goes
# stale (openai went 3.57 -> 3.60 in two days). Offline, the last release checked below stands.
# The older rows are pins: the oldest supported release of each client, and what the main
# venv resolves. Adding one: a line in MATRIX, run tests/sdk, update docs/api.md "SDK matrix".
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=${LLM_BATCH_SDK_VENVS:-.cache/sdk-venvs}
PY=${PYTHON:-python3.11}
mkdir -p "$ROOT"
ROOT=$(cd "$ROOT" && pwd)

# newest PACKAGE LAST_CHECKED [--pre]: the newest release on the index (cached), at least LAST_CHECKED.
newest() {
  local package=$1 fallback=$2 cache=$ROOT/.newest now found
  shift 2
  now=$(date +%s)
  found=$(awk -v p="$package" -v now="$now" '$1 == p && now - $3 < 6 * 3600 { print $2 }' "$cache" 2>/dev/null | tail -1) || true
  if [[ -z $found ]]; then
    found=$("$PY" -m pip index versions "$package" "$@" --disable-pip-version-check 2>/dev/null |
            sed -nE '1s/^[^ ]+ \(([0-9][0-9A-Za-z.+!-]*)\)$/\1/p') || true
    if [[ -n $found ]]; then
      # Never older than the release last checked: a machine's local wheel folder
      # (PIP_FIND_LINKS) can answer with an old one when the index is out of reach.
      found=$(printf '%s\n%s\n' "$found" "$fallback" | sort -V | tail -1)
      echo "$package $found $now" >>"$cache"
    else
      echo "sdk_venvs: the package index did not answer for $package: using $fallback" >&2
      found=$fallback
    fi
  fi
  echo "$found"
}
OPENAI=$(newest openai 3.60.0)
MISTRALAI=$(newest mistralai 3.7.0)
SCALE=$(newest scale-llm-engine 0.0.0b45 --pre)

# NAME (= <pip package>-<version>; the tests take the dialect and the version from it) and its
# exact requirements. The first row of each package is its newest release.
MATRIX=(
  "openai-$OPENAI              openai==$OPENAI"
  # Oldest 1.x with client.batches (create/retrieve/cancel; batches.list came in 1.22.0) and
  # files.content. openai<1.55.3 passes proxies= to httpx, which httpx 0.28 removed.
  "openai-1.18.0              openai==1.18.0 httpx==0.27.2"
  "mistralai-$MISTRALAI            mistralai==$MISTRALAI"
  # Oldest with batch jobs (input files only; inline `requests` came in 1.x later); 1.x
  # imports `from mistralai import Mistral`, 2.0 on `from mistralai.client import Mistral`.
  "mistralai-1.2.0            mistralai==1.2.0"
  # Newest (0.0.0b45 when checked): Completion.batch_create(use_v2=True) and the v2
  # get/update/cancel calls; needs openai<2.
  "scale-llm-engine-$SCALE  scale-llm-engine==$SCALE"
  # The release of a user's report (tests/api/test_scale_model_config.py): kept when newer come.
  "scale-llm-engine-0.0.0b45  scale-llm-engine==0.0.0b45"
  # What pip resolved beside openai 3.x in the main venv: batch_create on the v1 route only.
  "scale-llm-engine-0.0.0b36  scale-llm-engine==0.0.0b36"
)
# A pinned row that is also today's newest is listed once.
declare -A listed=()
rows=()
for entry in "${MATRIX[@]}"; do
  read -r name _ <<<"$entry"
  [[ -n ${listed[$name]:-} ]] || rows+=("$entry")
  listed[$name]=1
done
MATRIX=("${rows[@]}")

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
