#!/usr/bin/env bash
# Run the whole test suite as CI does: install what is needed, then pytest.
# Extra arguments go to pytest (e.g. scripts/test.sh tests/unit -x).
set -euo pipefail
cd "$(dirname "$0")/.."
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
set +e
"$VENV/bin/python" -m pytest "$@"
rc=$?
set -e
if [[ $rc -eq 5 ]]; then
  echo "pytest collected no tests: that is a failure here" >&2
  exit 1
fi
exit $rc
