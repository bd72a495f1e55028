"""Strict JSON (llm_batch.core.strict_json): what Python's parser admits and the pipeline cannot
write again is refused at the edge, and a batch line nested too deep is that line's error
record, never a failure of the step that writes the valid lines again."""

from __future__ import annotations

import json
import math

import orjson
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from llm_batch.core import strict_json
from tests.fuzzing import examples
from tests.unit.test_validation import chat_line, run


def nest(depth: int) -> object:
    value: object = "x"
    for i in range(depth):
        value = [value] if i % 2 else {"d": value}
    return value


@pytest.mark.parametrize("text, said", [
    (b'{"a": "\\ud800"}', "a: text is not valid UTF-8 (a lone surrogate"),
    (b'{"a": ["x", "\\udfff"]}', "lone surrogate"),
    (b'{"a": NaN}', "a: nan is not a JSON number"),
    (b'{"a": -Infinity}', "a: -inf is not a JSON number"),
    (b'{"a": 123456789012345678901234567890}', "does not fit in 64 bits"),
    (json.dumps({"a": nest(70)}).encode(), "nested deeper than 64 levels"),
    (json.dumps({"a": nest(600)}).encode(), "nested deeper than 64 levels"),
])
def test_what_python_admits_and_strict_json_refuses(text, said):
    json.loads(text)  # Python's parser takes each
    with pytest.raises(strict_json.NotStrictJson) as refused:
        strict_json.check(text)
    assert said in str(refused.value) and not refused.value.syntax


def test_text_that_is_not_json_is_a_syntax_error_and_long_numbers_in_strings_are_fine():
    with pytest.raises(strict_json.NotStrictJson) as refused:
        strict_json.check(b'{"a": ')
    assert refused.value.syntax
    assert strict_json.check(b'{"id": "123456789012345678901234567890", "n": 18446744073709551615}') == {
        "id": "123456789012345678901234567890", "n": 18446744073709551615}
    assert strict_json.check(json.dumps({"a": nest(60)})) == {"a": nest(60)}


def test_the_depth_error_says_where_and_stays_short():
    with pytest.raises(strict_json.NotStrictJson) as refused:
        strict_json.check(json.dumps({"model_config": {"labels": nest(300)}}).encode())
    assert refused.value.where.startswith("...") and len(str(refused.value)) < 200


@pytest.mark.parametrize("value, said", [
    ({"a": ["\ud800"]}, "a[0]: text is not valid UTF-8 (a lone surrogate"),
    ({"\udfff": 1}, "(a key): text is not valid UTF-8"),
    ({1: 1}, "key 1 is not a string"),
    ({"a": 2**70}, "a: the integer 1180591620717411303424 does not fit in 64 bits"),
    ({"a": math.nan}, "a: nan is not a JSON number"),
    ({"a": {1, 2}}, "a: a set is not a JSON value"),
    ({"a": nest(65)}, "nested deeper than 64 levels"),
])
def test_a_parsed_value_such_as_a_conf_is_held_to_the_same_rules(value, said):
    assert said in str(strict_json.problem(value))


_json = st.recursive(st.none() | st.booleans() | st.integers(-(2**63), 2**64 - 1)
                     | st.floats(allow_nan=False, allow_infinity=False) | st.text(),
                     lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
                     max_leaves=20)


@settings(max_examples=examples(300), deadline=None)
@given(_json)
def test_whatever_strict_json_admits_orjson_writes_and_reads_back(value):
    text = orjson.dumps(value)
    assert strict_json.check(text) == orjson.loads(text)
    assert strict_json.problem(value) is None


def test_a_batch_line_nested_too_deep_is_its_own_error_and_the_others_go_on():
    # json writes what orjson would not (past 254 levels): what a user's file may hold.
    deep_body = json.dumps({"custom_id": "deep", "body": {"messages": [{"role": "user", "content": "hi"}],
                                                          "metadata": nest(300)}}).encode() + b"\n"
    deep_extra = json.dumps({"custom_id": "extra", "body": {"messages": [{"role": "user", "content": "hi"}]},
                             "x": nest(900)}).encode() + b"\n"
    report, valid, errors = run(chat_line("a") + deep_body + chat_line("b") + deep_extra)
    assert [v["custom_id"] for v in valid] == ["a", "b"]
    assert [(e["line"], e["custom_id"], e["code"]) for e in errors] == [(2, "deep", "invalid_json"),
                                                                       (4, "extra", "invalid_json")]
    assert all("nested deeper than 64 levels" in e["message"] for e in errors)
    assert (report.total, report.valid, report.invalid) == (4, 2, 2)


_any_json = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**80), 2**80) | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=4) | st.sampled_from(["\ud800", "a\udfffb"]),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=4), inner, max_size=3),
    max_leaves=12,
)


@settings(max_examples=examples(500), deadline=None)
@given(_any_json)
def test_the_fast_check_of_text_agrees_with_the_full_check_of_what_python_parses(value):
    """check() parses with orjson and walks only what orjson cannot have refused; problem()
    looks at every value Python's parser builds. Both must refuse the same texts."""
    text = json.dumps(value).encode()
    expected = strict_json.problem(json.loads(text))
    try:
        strict_json.check(text)
    except strict_json.NotStrictJson as refused:
        assert expected is not None, f"refused what is strict JSON: {refused}"
        assert refused.message == expected.what
    else:
        assert expected is None, f"admitted {expected}"
