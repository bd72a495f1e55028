"""schemathesis against /batch/openapi.json on the live app: no 5xx for any generated input
(authenticated as a normal user, so the generated bodies reach the handlers)."""

from __future__ import annotations

import pytest
import schemathesis
from hypothesis import HealthCheck, settings
from schemathesis.checks import not_a_server_error

from tests.fuzzing import examples

pytestmark = pytest.mark.airflow


@pytest.fixture(scope="session")
def batch_openapi(live_server):
    return schemathesis.openapi.from_url(f"{live_server}/batch/openapi.json")


def test_openapi_is_served_with_docs(live_server):
    import httpx

    spec = httpx.get(f"{live_server}/batch/openapi.json").json()
    assert "/v1/batches" in spec["paths"] and "/v2/batch-completions" in spec["paths"]
    assert httpx.get(f"{live_server}/batch/docs").status_code == 200


def test_no_server_errors(batch_openapi, creds, live_server):
    """Every operation, 20 generated cases each (hypothesis drives schemathesis' strategies
    directly: its pytest loader does not run under this pytest)."""
    from hypothesis import given

    operations = [result.ok() for result in batch_openapi.get_all_operations()]
    assert len(operations) >= 13
    calls = []
    for operation in operations:

        @given(case=operation.as_strategy())
        @settings(max_examples=examples(20), deadline=None, suppress_health_check=list(HealthCheck), database=None)
        def no_5xx(case):
            response = case.call_and_validate(
                base_url=f"{live_server}/batch", headers=creds.key("alice"), checks=[not_a_server_error]
            )
            calls.append((operation.label, response.status_code))

        no_5xx()
    assert len({label for label, _ in calls}) == len(operations)
    assert any(200 <= status < 300 for _, status in calls)  # some generated inputs got through
