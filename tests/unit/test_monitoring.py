"""The shipped alert rules load (promtool check rules) and fire on their conditions and only
then (promtool test rules deploy/monitoring/alerts_test.yml): Debian's promtool, which
scripts/test.sh installs."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

MONITORING = Path(__file__).resolve().parents[2] / "deploy" / "monitoring"


def _promtool() -> str:
    found = shutil.which("promtool")
    if not found:
        pytest.fail("promtool is missing: scripts/test.sh installs it (apt-get install prometheus)")
    return found


def test_the_rules_load():
    done = subprocess.run([_promtool(), "check", "rules", "alerts.yml"], cwd=MONITORING, capture_output=True, text=True)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "SUCCESS: 6 rules found" in done.stdout


def test_each_alert_fires_on_its_condition_and_only_then():
    done = subprocess.run([_promtool(), "test", "rules", "alerts_test.yml"], cwd=MONITORING, capture_output=True, text=True)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "SUCCESS" in done.stdout
