#!/usr/bin/env bash
# Run the test suite as CI does: install what is needed, then pytest in parallel lanes.
#   scripts/test.sh            everything (CI runs exactly this)
#   scripts/test.sh --quick    the tests that start no engine and no server (the edit loop)
# Extra arguments go to pytest (e.g. scripts/test.sh tests/unit -x, or -p randomly
# --randomly-seed=N to repeat an order; each run prints its seed).
# LLM_BATCH_TEST_WORKERS: parallel pytest processes (default 2 for the whole suite: its CPU is
# mostly engine starts, and each process's home starts its own; 3 for the quick lane, which
# waits on nothing: docs/benchmarks.md, "The test suite").
set -euo pipefail
cd "$(dirname "$0")/.."
quick=false
if [[ ${1:-} == --quick ]]; then
  quick=true
  shift
fi
scripts/setup.sh
# Only the tests need it (the demo does not): the browser of tests/e2e/test_ui_page.py (Playwright drives it; its own download needs the internet).
# And Redis, the Celery broker of the production-shape tests (tests/shape/test_celery_shape.py),
# and Prometheus with promtool (tests/unit/test_monitoring.py, tests/e2e/test_prometheus.py).
missing=()
[[ -x /usr/bin/chromium ]] || missing+=(chromium)
[[ -x /usr/bin/redis-server ]] || missing+=(redis-server)
[[ -x /usr/bin/prometheus && -x /usr/bin/promtool ]] || missing+=(prometheus)
if [[ ${#missing[@]} -gt 0 ]]; then
  sudo=$([[ $(id -u) == 0 ]] || echo sudo)
  $sudo apt-get update -q && $sudo apt-get install -y -q --no-install-recommends "${missing[@]}"
fi
VENV=${LLM_BATCH_VENV:-.venv}
# The suite's processes keep what they compile (the tests' modules as pytest rewrites them,
# each in __pycache__, which git ignores) instead of compiling it again in each one.
unset PYTHONDONTWRITEBYTECODE
if $quick; then
  lane=(-n "${LLM_BATCH_TEST_WORKERS:-3}")
  # No engine, no server, no checkpoint build (tests/conftest.py also sets the markers from
  # the fixtures a test uses).
  lane+=(-m "not (engine or s3 or postgres or e2e or sdk or models)")
  # Every test of these folders starts one: not even collected (each process would import them).
  lane+=(--ignore=tests/engine --ignore=tests/e2e --ignore=tests/sdk --ignore=tests/shape)
  # Property tests draw a third of their examples here, all of them in the whole suite (tests/fuzzing.py).
  export LLM_BATCH_TEST_LANE=quick
else
  lane=(-n "${LLM_BATCH_TEST_WORKERS:-2}")
  # The SDK clients' own venvs (tests/sdk, tests/e2e/test_newest_clients.py), installed with
  # the rest rather than inside a test; up to date in ~0.1 s.
  scripts/sdk_venvs.sh >/dev/null
fi
set +e
"$VENV/bin/python" -m pytest "${lane[@]}" "$@"
rc=$?
set -e
if [[ $rc -eq 5 ]]; then
  echo "pytest collected no tests: that is a failure here" >&2
  exit 1
fi
exit $rc
