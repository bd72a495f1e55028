"""``/batch/docs`` explains itself: every property of every schema in the served OpenAPI
document (``/batch/openapi.json``) has a description, and so has every schema.

A property that is only a reference (``$ref``, or ``anyOf``/``oneOf``/``allOf`` of references
and ``null``) counts as described by its own description or by the referenced schemas'.
"""

from __future__ import annotations

from typing import Any

import pytest

pytestmark = pytest.mark.airflow

_REF = "#/components/schemas/"

# Schemas FastAPI itself adds to every app (the default 422 body); not ours to describe.
FASTAPI_SCHEMAS = {
    "HTTPValidationError": "FastAPI's default 422 body (fastapi.openapi.utils)",
    "ValidationError": "FastAPI's item of HTTPValidationError.detail (fastapi.openapi.utils)",
}
# Schemas that come from other libraries: none today. Add one only with the reason.
LIBRARY_SCHEMAS: dict[str, str] = {}
SKIPPED = FASTAPI_SCHEMAS | LIBRARY_SCHEMAS

# FastAPI names a route's multipart/form body ``Body_<route>`` and gives it no description
# (its fields are the route's File/Form parameters, which carry theirs): only the schema-level
# check skips these.
_FORM_BODY_PREFIX = "Body_"


def _has_text(schema: dict[str, Any]) -> bool:
    description = schema.get("description")
    return isinstance(description, str) and bool(description.strip())


def _described(schema: dict[str, Any], schemas: dict[str, Any], seen: frozenset[str] = frozenset()) -> bool:
    """A property schema with its own description, or one that only points at described
    schemas: a ``$ref``, or ``anyOf``/``oneOf``/``allOf`` whose branches are such (``null``
    branches need none)."""
    if _has_text(schema):
        return True
    if ref := schema.get("$ref"):
        name = ref.removeprefix(_REF)
        if name in seen or name not in schemas:
            return False
        return _described(schemas[name], schemas, seen | {name})
    for combinator in ("anyOf", "oneOf", "allOf"):
        if branches := schema.get(combinator):
            meaningful = [b for b in branches if b != {"type": "null"}]
            return bool(meaningful) and all(_described(b, schemas, seen) for b in meaningful)
    return False


def undescribed_properties(document: dict[str, Any]) -> list[str]:
    """Every ``Schema.property`` of components.schemas without a description (skipped
    schemas left out), sorted."""
    schemas = document.get("components", {}).get("schemas", {})
    return sorted(
        f"{name}.{prop}"
        for name, schema in schemas.items()
        if name not in SKIPPED
        for prop, spec in (schema.get("properties") or {}).items()
        if not _described(spec, schemas)
    )


def undescribed_schemas(document: dict[str, Any]) -> list[str]:
    schemas = document.get("components", {}).get("schemas", {})
    return sorted(
        name
        for name, schema in schemas.items()
        if name not in SKIPPED and not name.startswith(_FORM_BODY_PREFIX) and not _has_text(schema)
    )


# -- the served document ----------------------------------------------------------------------


@pytest.fixture(scope="module")
def document(batch_app) -> dict[str, Any]:
    from fastapi.testclient import TestClient

    with TestClient(batch_app, base_url="http://testserver/batch") as client:
        response = client.get("/openapi.json")
    assert response.status_code == 200, response.text
    return response.json()


def test_every_property_has_a_description(document):
    schemas = document["components"]["schemas"]
    assert len(schemas) >= 20, sorted(schemas)  # the walk saw the whole document
    missing = undescribed_properties(document)
    assert not missing, f"{len(missing)} properties have no description:\n" + "\n".join(missing)


def test_every_schema_has_a_description(document):
    missing = undescribed_schemas(document)
    assert not missing, f"{len(missing)} schemas have no description (a model docstring):\n" + "\n".join(missing)


def test_skipped_schemas_are_in_the_document(document):
    """A skip entry for a schema that is gone would hide nothing; drop it instead."""
    gone = sorted(set(SKIPPED) - set(document["components"]["schemas"]))
    assert not gone, gone


# -- the walk itself ----------------------------------------------------------------------------


def test_the_walk_follows_references_and_reports_each_property():
    document = {
        "components": {
            "schemas": {
                "Described": {"description": "a thing", "properties": {"x": {"type": "string", "description": "x"}}},
                "Bare": {"properties": {}},
                "Model": {
                    "description": "m",
                    "properties": {
                        "own": {"type": "integer", "description": "has its own"},
                        "ref": {"$ref": _REF + "Described"},
                        "ref_with_own": {"$ref": _REF + "Bare", "description": "says it itself"},
                        "optional_ref": {"anyOf": [{"$ref": _REF + "Described"}, {"type": "null"}]},
                        "all_of": {"allOf": [{"$ref": _REF + "Described"}]},
                        "no_text": {"type": "string"},
                        "blank": {"type": "string", "description": "  "},
                        "ref_to_bare": {"$ref": _REF + "Bare"},
                        "optional_plain": {"anyOf": [{"type": "string"}, {"type": "null"}]},
                        "only_null": {"anyOf": [{"type": "null"}]},
                        "dangling": {"$ref": _REF + "Missing"},
                        "array_of_described": {"type": "array", "items": {"$ref": _REF + "Described"}},
                    },
                },
                "HTTPValidationError": {"properties": {"detail": {"type": "array"}}},
            }
        }
    }
    assert undescribed_properties(document) == [
        f"Model.{name}"
        for name in sorted(
            ["no_text", "blank", "ref_to_bare", "optional_plain", "only_null", "dangling", "array_of_described"]
        )
    ]
    assert undescribed_schemas(document) == ["Bare"]
