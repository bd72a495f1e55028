"""Owner names (llm_batch.core.owners): one spelling per owner, so names that fold together
(``Alice3``, ``alice3.``, ``alice3 ``) never become two owners sharing a folder.

Tried as an attacker would: every spelling hypothesis finds that folds to an owner is
refused a key, and no owner reaches a folder spelled like another's.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from llm_batch.cli.main import main
from llm_batch.core import owners
from llm_batch.core.config import Settings
from llm_batch.core.owners import OwnerNameRefused
from llm_batch.infra import user_paths
from llm_batch.infra.jobstore import JobStore
from llm_batch.infra.user_paths import PathRefused
from tests.fuzzing import examples

canonical_names = st.from_regex(owners.OWNER_NAME, fullmatch=True)


@st.composite
def folding_twins(draw) -> tuple[str, str]:
    """(an owner name, another spelling that folds to it: case changed, dots or spaces after)."""
    name = draw(canonical_names)
    cased = "".join(c.upper() if draw(st.booleans()) else c for c in name)
    twin = cased + draw(st.text(alphabet=". ", max_size=3))
    assume(twin != name)
    return name, twin


@pytest.fixture
def store(sqlite_store_url: str):
    store = JobStore(sqlite_store_url)
    yield store
    store.close()


def test_the_names_in_use_are_owner_names():
    for name in ("alice", "bob", "ops", "root", "admin", "airflow", "dag_test", "user0", "o", "a.b-c_d",
                 "erin@example.com"):
        assert owners.check(name) == name
    for name in ("", "Alice", "alice.", "alice ", " alice", ".alice", "-alice", "al/ice", "..", "a" * 65,
                 "ålice", "alice\n", "Anonymous", None, 3):
        with pytest.raises(OwnerNameRefused, match="not an owner name"):
            owners.check(name)


@given(canonical_names, canonical_names)
def test_no_two_owner_names_fold_together(a: str, b: str):
    assert (owners.fold(a) == owners.fold(b)) == (a == b)
    assert len(a) <= 64 and not a.endswith(".")


@settings(max_examples=examples(60), suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(folding_twins())
def test_a_spelling_that_folds_to_an_owner_gets_no_key(store: JobStore, twins: tuple[str, str]):
    name, twin = twins
    store.create_api_key(name, "the owner")
    with pytest.raises(OwnerNameRefused):
        store.create_api_key(twin, "a twin")
    assert twin not in store.owner_names()


def test_a_new_name_folding_to_an_owner_recorded_before_is_refused(store: JobStore):
    """Owners recorded before names were checked (jobs, files, keys) keep theirs alone."""
    store.create_file(owner="Alice3", purpose="batch", filename="in.jsonl", bytes=1, uri="/x/in.jsonl")
    with pytest.raises(OwnerNameRefused, match="existing owner 'Alice3'"):
        store.create_api_key("alice3", "a twin")
    store.create_api_key("alice4", "a name of its own")


def test_the_cli_refuses_a_name_that_is_not_an_owner_name(tmp_path: Path, capsys):
    url = f"sqlite:///{tmp_path / 'cli.db'}"
    assert main(["api-key", "--database-url", url, "create", "Alice3"]) == 1
    assert "not an owner name" in capsys.readouterr().err
    assert main(["api-key", "--database-url", url, "create", "alice3"]) == 0


@settings(max_examples=examples(60))
@given(folding_twins())
def test_no_owner_reaches_a_folder_spelled_like_another(twins: tuple[str, str]):
    name, twin = twins
    settings_ = Settings(home=Path("/srv/llm-batch"))
    root = settings_.local_roots[0]
    assert user_paths.check(f"{root}/{name}/in.jsonl", name, settings_)
    with pytest.raises(PathRefused):  # the twin's folder is not the owner's
        user_paths.check(f"{root}/{twin}/in.jsonl", name, settings_)
    with pytest.raises(PathRefused):  # and the twin has none: it is no owner
        user_paths.check("in.jsonl", twin, settings_)
