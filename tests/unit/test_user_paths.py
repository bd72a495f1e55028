"""llm_batch.infra.user_paths: the gate for paths users name, tried as an attacker would.

A home with the real layout (job database and its -wal/-shm files, the admin key, Airflow's
home, work, files and model areas) and two owners, alice and bob, each with files in their
own folder of the user root. Every protected target, in every spelling, must be refused.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from llm_batch.core.config import Settings
from llm_batch.infra import user_paths
from llm_batch.infra.user_paths import PathRefused, PathUnavailable


@pytest.fixture
def home(tmp_path: Path) -> Path:
    home = tmp_path / "home"
    for name in ("jobs.db", "jobs.db-wal", "jobs.db-shm", "jobs.db-journal", "api-key",
                 "airflow/airflow.db", "airflow/passwords.json", "airflow/logs/x.log", "airflow/run/api.pid",
                 "work/job_1/output.jsonl", "files/file-1", "models/tiny/config.json",
                 "data/alice/in.json", "data/alice/out.json", "data/bob/in.json", "data/bob/out.json",
                 "stray-file"):
        path = home / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(b"[]")
    return home.resolve()


@pytest.fixture
def settings(home: Path) -> Settings:
    return Settings(home=home)


def protected_targets(home: Path) -> list[str]:
    """Everything under the home that is not alice's: internal state and bob's files."""
    return sorted(str(p) for p in home.rglob("*") if p.is_file() and not p.is_relative_to(home / "data" / "alice"))


def spellings(path: str) -> list[str]:
    """Ways to write one path that a naive check might not recognise."""
    parent, name = os.path.split(path)
    return [path, f"file://{path}", f"file://localhost{path}", path.upper(), f"{path}.", f"{path} ",
            f"{parent}/./{name}", f"{parent}//{name}", f"file://{parent}/%{ord(name[0]):02x}{name[1:]}"]


def test_the_default_user_root_holds_no_internal_state(settings: Settings, home: Path) -> None:
    assert settings.local_roots == [home / "data"]
    assert user_paths.check("in.json", "alice", settings).uri == str(home / "data" / "alice" / "in.json")
    assert user_paths.check(str(home / "data" / "alice" / "new" / "o.json"), "alice", settings).uri.endswith("new/o.json")


def test_every_protected_target_in_every_spelling_is_refused(settings: Settings, home: Path) -> None:
    checked = 0
    for target in protected_targets(home):
        for spelled in spellings(target):
            with pytest.raises((PathRefused, PathUnavailable)):
                user_paths.check(spelled, "alice", settings)
            checked += 1
    assert checked >= 15 * 9  # the list really was generated


def test_dotdot_and_home_relative_spellings_are_refused(settings: Settings, home: Path) -> None:
    for spelled in ("../bob/in.json", "../../jobs.db-wal", f"{home}/data/alice/../bob/in.json",
                    f"file://{home}/data/alice/%2e%2e/bob/in.json", "~/.llm-batch/jobs.db", "s3:/bucket/x"):
        with pytest.raises(PathRefused):
            user_paths.check(spelled, "alice", settings)


def test_symlinks_out_of_the_namespace_answer_like_a_missing_file(settings: Settings, home: Path) -> None:
    own = home / "data" / "alice"
    (own / "to-wal").symlink_to(home / "jobs.db-wal")
    (own / "to-bob").symlink_to(home / "data" / "bob" / "in.json")
    (own / "to-bob-dir").symlink_to(home / "data" / "bob")
    answers = set()
    for name in ("to-wal", "to-bob", "to-bob-dir/out.json"):
        with pytest.raises(PathUnavailable) as info:
            user_paths.check(str(own / name), "alice", settings)
        answers.add(str(info.value).split(":", 1)[1])
    assert len(answers) == 1  # one answer, whatever lies behind the link


def test_a_hard_link_to_someone_elses_file_is_refused(settings: Settings, home: Path) -> None:
    os.link(home / "data" / "bob" / "in.json", home / "data" / "alice" / "linked.json")
    with pytest.raises(PathUnavailable):
        user_paths.check(str(home / "data" / "alice" / "linked.json"), "alice", settings)


def test_a_name_that_is_not_an_owner_name_has_no_folder(settings: Settings, home: Path) -> None:
    for owner in ("..", ".", "a/b", "../bob", "bob/..", "", "x\0y", "Alice", "alice.", "alice "):
        with pytest.raises(PathRefused, match="not an owner name"):
            user_paths.check("f.json", owner, settings)
    assert user_paths.owner_dirname("alice") == "alice"


def test_the_namespace_is_compared_as_spelled(settings: Settings, home: Path) -> None:
    """alice3's folder is data/alice3 only: no spelling that folds to it (case, trailing
    dots or spaces) is hers, so none can be another owner's folder she reaches."""
    for folder in ("ALICE3", "Alice3", "alice3.", "alice3 ", "alice3.."):
        with pytest.raises(PathRefused, match="namespace"):
            user_paths.check(str(home / "data" / folder / "x.json"), "alice3", settings)
    assert user_paths.check(str(home / "data" / "alice3" / "x.json"), "alice3", settings)


def test_admins_may_name_any_user_folder_but_never_internal_state(settings: Settings, home: Path) -> None:
    assert user_paths.check(str(home / "data" / "bob" / "in.json"), "ops", settings, is_admin=True)
    for target in (home / "jobs.db-wal", home / "api-key", home / "airflow" / "airflow.db"):
        with pytest.raises((PathRefused, PathUnavailable)):
            user_paths.check(str(target), "ops", settings, is_admin=True)


def test_a_root_that_is_the_whole_home_still_protects_internal_state(home: Path) -> None:
    settings = Settings(home=home, local_roots=[home], owner_namespaces=False)
    assert user_paths.check(str(home / "data" / "bob" / "in.json"), "alice", settings)
    for target in ("jobs.db", "jobs.db-wal", "JOBS.DB-SHM", "jobs.db-journal", "api-key", "airflow/x",
                   "work/job_1/output.jsonl", "files/file-1", "models/tiny/config.json"):
        with pytest.raises((PathRefused, PathUnavailable)):
            user_paths.check(str(home / target), "alice", settings)


def test_s3_namespaces_and_internal_prefixes(home: Path) -> None:
    settings = Settings(home=home, allowed_buckets=["data", "llm"], work_uri="s3://llm/work", files_uri="s3://llm/files")
    assert user_paths.check("s3://data/alice/in.json", "alice", settings).uri == "s3://data/alice/in.json"
    assert user_paths.check("s3://llm/alice/in.json", "alice", settings)
    refused = ["s3://data/bob/in.json", "s3://data/in.json", "s3://llm/work/job_1/output.jsonl",
               "s3://llm/WORK/job_1/x", "s3://llm/files/file-1", "s3://other/alice/x",
               "s3://data/alice/../bob/in.json", "s3://data/alice//x", "s3://data/alice/./x",
               "s3://data/alice/a\\..\\b", "s3://Data/alice/x", "s3://data/alice/\x01"]
    for uri in refused:
        with pytest.raises(PathRefused):
            user_paths.check(uri, "alice", settings)
    with pytest.raises(PathRefused, match="own storage"):  # not even an admin
        user_paths.check("s3://llm/work/job_1/output.jsonl", "ops", settings, is_admin=True)
    with pytest.raises(PathRefused, match="no buckets"):
        user_paths.check("s3://data/alice/x", "alice", Settings(home=home))


def test_refuse_internal_is_the_merge_steps_last_check(settings: Settings, home: Path) -> None:
    user_paths.refuse_internal(str(home / "data" / "alice" / "out.json"), settings)
    with pytest.raises(PathRefused):
        user_paths.refuse_internal(str(home / "jobs.db-wal"), settings)
