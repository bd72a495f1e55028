"""`llm-batch api-key create|list|revoke` against the job store the API reads."""

from __future__ import annotations

import pytest

from llm_batch.cli.main import main

pytestmark = pytest.mark.airflow


def _key_ids(listing: str) -> set[str]:
    return {word for word in listing.split() if word.startswith("key_")}


def test_create_list_revoke_round_trip(client, capsys):
    # The store is the session's: dora may hold keys of earlier tests; the new one is the new id.
    assert main(["api-key", "list", "--owner", "dora"]) == 0
    before = _key_ids(capsys.readouterr().out)
    assert main(["api-key", "create", "dora", "--name", "cli test"]) == 0
    key = capsys.readouterr().out.strip()
    assert key.startswith("lbk_")
    assert client.get("/v1/batch/jobs", headers={"x-api-key": key}).status_code == 200

    assert main(["api-key", "list", "--owner", "dora"]) == 0
    listing = capsys.readouterr().out
    assert "cli test" in listing and key not in listing  # secrets are never listed
    (key_id,) = _key_ids(listing) - before

    assert main(["api-key", "revoke", key_id]) == 0
    assert client.get("/v1/batch/jobs", headers={"x-api-key": key}).status_code == 401
    assert main(["api-key", "revoke", "key_nope"]) == 1
