"""One canonical job: its input and options are a typed model (core.job_spec.JobInput), and
the layers under the API (core, pipeline, runtime) never ask which dialect made a job."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
from pydantic import ValidationError
from sqlalchemy import create_engine, text

from llm_batch.core.job_request import DIALECTS
from llm_batch.core.job_spec import JobInput, ModerationShape, OutputFormat
from llm_batch.infra.jobstore import JobStore, upgrade_to_head

PACKAGE = Path(__file__).resolve().parents[2] / "src" / "llm_batch"
DIALECT_FREE = ("core", "pipeline", "runtime")


def _strings(node: ast.AST) -> set[str]:
    """The string constants of an operand (one, or the items of a tuple/list/set)."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return {node.value}
    if isinstance(node, ast.Tuple | ast.List | ast.Set):
        return {s for item in node.elts for s in _strings(item)}
    return set()


def _names(node: ast.AST) -> set[str]:
    return {n.attr if isinstance(n, ast.Attribute) else n.id
            for n in ast.walk(node) if isinstance(n, ast.Attribute | ast.Name)}


def _dialect_branches(source: str, name: str) -> list[str]:
    """Where a module compares something with a dialect's name, or compares a dialect."""
    found = []
    for node in ast.walk(ast.parse(source, name)):
        if isinstance(node, ast.Compare):
            operands = [node.left, *node.comparators]
            if any(_strings(o) & set(DIALECTS) for o in operands) or "dialect" in set().union(*map(_names, operands)):
                found.append(f"{name}:{node.lineno}: {ast.unparse(node)}")
        elif isinstance(node, ast.MatchValue) and _strings(node.value) & set(DIALECTS):
            found.append(f"{name}:{node.lineno}: case {ast.unparse(node)}")
    return found


def test_core_pipeline_and_runtime_never_branch_on_a_dialect():
    files = [p for layer in DIALECT_FREE for p in sorted((PACKAGE / layer).rglob("*.py"))]
    assert len(files) > 20
    hits = [hit for path in files for hit in _dialect_branches(path.read_text(), str(path.relative_to(PACKAGE)))]
    assert hits == []


def test_the_scan_sees_a_dialect_branch():
    source = ("a = job.dialect == 'scale'\nb = kind in ('openai', 'other')\nc = fmt == 'jsonl'\n"
              "match kind:\n    case 'mistral':\n        pass\n")
    assert [hit.split(":")[1] for hit in _dialect_branches(source, "probe.py")] == ["1", "2", "5"]


def test_pipeline_and_runtime_never_read_the_jobs_dialect():
    """Below the API a job's dialect is only recorded (core.job_request creates the row)."""
    files = [p for layer in ("pipeline", "runtime") for p in sorted((PACKAGE / layer).rglob("*.py"))]
    hits = [f"{p.relative_to(PACKAGE)}:{n.lineno}" for p in files for n in ast.walk(ast.parse(p.read_text()))
            if (isinstance(n, ast.Attribute) and n.attr == "dialect")
            or (isinstance(n, ast.keyword | ast.arg) and n.arg == "dialect")]
    assert hits == []


# -- the typed input ----------------------------------------------------------------------


def test_a_writers_unknown_key_is_refused():
    with pytest.raises(ValidationError, match="output_expires_after_seconds"):
        JobInput(file_ids=["file_a"], output_expires_after_seconds=3600)
    with pytest.raises(ValidationError):
        JobInput.model_validate({"uri": "s3://b/in.jsonl", "dialect": "scale"})
    with pytest.raises(ValidationError):
        JobInput(output_format="csv")
    with pytest.raises(ValidationError):
        JobInput(output_expires_after_s=0)


def test_a_stored_rows_unknown_key_is_dropped_when_read():
    read = JobInput.from_stored({"uri": "s3://b/in.jsonl", "inline": True, "from_a_later_version": 1})
    assert read == JobInput(uri="s3://b/in.jsonl", inline=True)
    assert JobInput.from_stored(None) == JobInput() == JobInput.from_stored({})


def test_stored_keeps_only_what_differs_from_the_defaults():
    assert JobInput(file_ids=["f"]).stored() == {"file_ids": ["f"]}  # the same JSON rows had before
    given = JobInput(uri="/u", path="in.json", output_format=OutputFormat.JSON_ARRAY,
                     moderation_shape=ModerationShape.FLAGGED, output_expires_after_s=3600)
    assert given.stored() == {"uri": "/u", "path": "in.json", "output_format": "json_array",
                              "moderation_shape": "flagged", "output_expires_after_s": 3600}
    assert JobInput.from_stored(given.stored()) == given


def test_the_store_hands_back_a_typed_input(sqlite_store_url):
    store = JobStore(sqlite_store_url)
    try:
        given = JobInput(uri="/in.json", inline=True, inline_file_id="file_x", output_format=OutputFormat.JSON_ARRAY)
        job = store.create_job(dialect="scale", endpoint="/v1/completions", model="m", owner="o", input=given.stored())
        assert store.get_job(job.id).input == job.input == given
        bare = store.create_job(dialect="openai", endpoint="/v1/completions", model="m", owner="o")
        assert store.get_job(bare.id).input == JobInput()
    finally:
        store.close()


def test_migration_0008_writes_what_the_dialect_of_an_older_row_implied(tmp_path):
    from alembic import command
    from alembic.config import Config

    from llm_batch.infra.jobstore import database

    url = f"sqlite:///{tmp_path / 'jobs.db'}"
    engine = create_engine(url)
    try:
        with engine.begin() as connection:
            config = Config(str(database._ALEMBIC_INI))
            config.attributes["connection"] = connection
            command.upgrade(config, "0007")
            for job_id, dialect, given in [("job_s", "scale", '{"uri": "/in.json", "path": "in.json"}'),
                                           ("job_o", "openai", '{"file_ids": ["f"], "output_expires_after_s": 7200}'),
                                           ("job_m", "mistral", '{"file_ids": ["g"]}')]:
                connection.execute(text(
                    "INSERT INTO jobs (id, dialect, endpoint, model, model_config, input, metadata, labels, priority,"
                    " data_parallelism, resources, status, created_at, updated_at, total, completed, succeeded,"
                    " failed, errors, owner) VALUES (:id, :dialect, '/v1/moderations', 'm', '{}', :input, '{}',"
                    " '{}', 0, 1, '{}', 'RUNNING', CURRENT_TIMESTAMP, CURRENT_TIMESTAMP, 0, 0, 0, 0, '[]', 'alice')"),
                    {"id": job_id, "dialect": dialect, "input": given})
        upgrade_to_head(engine)
        store = JobStore(url)
        try:
            assert store.get_job("job_s").input == JobInput(uri="/in.json", path="in.json",
                                                            output_format=OutputFormat.JSON_ARRAY)
            assert store.get_job("job_o").input == JobInput(file_ids=["f"], output_expires_after_s=7200,
                                                            moderation_shape=ModerationShape.FLAGGED)
            assert store.get_job("job_m").input == JobInput(file_ids=["g"])
        finally:
            store.close()
        with engine.begin() as connection:
            config = Config(str(database._ALEMBIC_INI))
            config.attributes["connection"] = connection
            command.downgrade(config, "0007")
            rows = dict(connection.execute(text("SELECT id, input FROM jobs")).all())
        assert "output_format" not in rows["job_s"] and "moderation_shape" not in rows["job_o"]
    finally:
        engine.dispose()
