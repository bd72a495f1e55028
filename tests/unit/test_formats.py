"""The streaming readers: positions, line handling, Scale mappings, the custom_id set."""

from __future__ import annotations

import io
import json

import orjson
import pytest

from llm_batch.core.endpoints import Endpoint
from llm_batch.core.formats import (
    IdSet,
    InputUnreadable,
    RequestChecker,
    read_inline,
    read_jsonl,
    read_scale_v1,
    read_scale_v2,
    scale_v1_prompts,
    scale_v2_body,
    scan_scale_v1_params,
)
from llm_batch.core.records import BatchRequest, ErrorRecord

CHAT = Endpoint.CHAT_COMPLETIONS


def chat(custom_id: str, content: str = "Hello") -> bytes:
    return orjson.dumps({"custom_id": custom_id,
                         "body": {"messages": [{"role": "user", "content": content}]}})


def jsonl(data: bytes, endpoint=CHAT, max_line_bytes: int = 1024, **kw) -> list:
    return list(read_jsonl(io.BytesIO(data), RequestChecker(endpoint),
                           max_line_bytes=max_line_bytes, **kw))


def test_each_line_gives_exactly_one_item_with_index_and_line() -> None:
    items = jsonl(chat("a") + b"\n" + b"junk\n" + chat("b") + b"\n")
    assert [type(i) for i in items] == [BatchRequest, ErrorRecord, BatchRequest]
    assert [i.index for i in items] == [0, 1, 2]
    assert items[1].line == 2


def test_blank_lines_are_skipped_but_counted_as_lines() -> None:
    items = jsonl(b"\n" + chat("a") + b"\n  \n\n" + b"junk\n")
    assert [i.index for i in items] == [0, 1]
    assert items[1].line == 5


def test_crlf_and_a_last_line_without_newline() -> None:
    items = jsonl(chat("a") + b"\r\n" + chat("b"))
    assert [(i.custom_id, type(i)) for i in items] == [("a", BatchRequest), ("b", BatchRequest)]


def test_start_index_continues_a_previous_file() -> None:
    items = jsonl(chat("a") + b"\n", start_index=10, where="f2: ")
    assert items[0].index == 10


def test_long_line_is_skipped_without_losing_the_next_one() -> None:
    huge = chat("huge", "x" * 5000)
    items = jsonl(chat("a") + b"\n" + huge + b"\n" + chat("b") + b"\n", max_line_bytes=100)
    assert [type(i) for i in items] == [BatchRequest, ErrorRecord, BatchRequest]
    error = items[1]
    assert error.code == "line_too_long" and error.line == 2
    assert error.custom_id == "huge"  # read from the line's start, without parsing it all
    assert str(len(huge)) in error.message


def test_line_exactly_at_the_limit_is_accepted() -> None:
    line = chat("a", "x" * 50)
    items = jsonl(line + b"\n" + line.replace(b'"a"', b'"b"'), max_line_bytes=len(line))
    assert all(type(i) is BatchRequest for i in items)


def test_long_line_at_end_of_file_without_newline() -> None:
    items = jsonl(chat("a") + b"\n" + b"y" * 10_000, max_line_bytes=100)
    assert [i.code for i in items if isinstance(i, ErrorRecord)] == ["line_too_long"]


def test_invalid_utf8_says_where() -> None:
    (item,) = jsonl(b'{"custom_id": "a", "body": "\xc3("}\n')
    assert item.code == "invalid_utf8" and "byte 29" in item.message
    assert item.custom_id == "a"


def test_first_item_with_a_custom_id_owns_it_even_if_invalid() -> None:
    items = jsonl(b'{"custom_id": "a", "body": 5}\n' + chat("a") + b"\n")
    assert [i.code for i in items] == ["invalid_body", "duplicate_custom_id"]


def test_endpoint_unset_is_fixed_by_the_first_url() -> None:
    checker = RequestChecker(None)
    line = b'{"custom_id":"a","url":"/v1/completions","body":{"prompt":"hi"}}\n'
    items = list(read_jsonl(io.BytesIO(line + chat("b") + b"\n"), checker, max_line_bytes=1000))
    assert checker.endpoint == Endpoint.COMPLETIONS
    assert [type(i) for i in items] == [BatchRequest, ErrorRecord]


def test_inline_items_default_their_custom_id() -> None:
    items = list(read_inline([{"body": {"messages": [{"role": "user", "content": "x"}]}}] * 2,
                             RequestChecker(CHAT)))
    assert [i.custom_id for i in items] == ["0", "1"]


# -- Scale v2 ---------------------------------------------------------------------------------


def test_scale_v2_streams_an_array_with_index_ids() -> None:
    data = json.dumps([{"prompt": f"p{i}", "max_tokens": 4, "temperature": 0.5}
                       for i in range(5)]).encode()
    checker = RequestChecker(None)
    items = list(read_scale_v2(io.BytesIO(data), checker, start_index=3))
    assert checker.endpoint == Endpoint.COMPLETIONS
    assert [(i.index, i.custom_id) for i in items] == [(3, "3"), (4, "4"), (5, "5"), (6, "6"),
                                                      (7, "7")]
    assert items[0].body == {"prompt": "p0", "max_tokens": 4, "temperature": 0.5}
    assert type(items[0].body["temperature"]) is float  # not Decimal


def test_scale_v2_chat_items_fix_a_chat_job() -> None:
    data = [{"messages": [{"role": "user", "content": "x"}]}, {"prompt": "y"}]
    items = list(read_scale_v2(data, RequestChecker(None)))
    assert [type(i) for i in items] == [BatchRequest, ErrorRecord]
    assert items[1].code == "endpoint_mismatch"


def test_scale_v2_guided_fields_become_structured_outputs() -> None:
    body = scale_v2_body({"prompt": "x", "guided_json": {"type": "object"}, "guided_regex": None})
    assert body == {"prompt": "x", "structured_outputs": {"json": {"type": "object"}}}
    plain = {"prompt": "x", "max_tokens": 3}
    assert scale_v2_body(plain) is plain


@pytest.mark.parametrize("data", [b'[{"prompt": "a"}, {"prompt"', b'{"prompt": "a"}', b"",
                                  b'["\xff"]'])
def test_scale_v2_unreadable_arrays_raise(data: bytes) -> None:
    with pytest.raises(InputUnreadable):
        list(read_scale_v2(io.BytesIO(data), RequestChecker(None)))


# -- Scale v1 ---------------------------------------------------------------------------------

V1 = {"prompts": ["a", "b"], "max_new_tokens": 7, "temperature": 0.2,
      "stop_sequences": ["\n"], "return_token_log_probs": True, "presence_penalty": 0.5,
      "frequency_penalty": 0.1, "top_k": 5, "top_p": 0.9, "skip_special_tokens": False}


def test_scale_v1_maps_its_fields_to_completion_bodies() -> None:
    data = json.dumps(V1).encode()
    params = scan_scale_v1_params(io.BytesIO(data))
    items = list(read_scale_v1(params, scale_v1_prompts(io.BytesIO(data)), RequestChecker(None)))
    assert [i.custom_id for i in items] == ["0", "1"]
    assert items[1].body == {
        "prompt": "b", "max_tokens": 7, "temperature": 0.2, "stop": ["\n"], "logprobs": 1,
        "presence_penalty": 0.5, "frequency_penalty": 0.1, "top_k": 5, "top_p": 0.9,
        "skip_special_tokens": False,
    }


def test_scale_v1_params_after_the_prompts_are_found() -> None:
    data = b'{"prompts": ["a", {"nested": [1, 2]}], "stop_sequences": ["x", "y"], ' \
           b'"max_new_tokens": 3, "temperature": 0}'
    params = scan_scale_v1_params(io.BytesIO(data))
    assert params.max_new_tokens == 3 and params.stop_sequences == ["x", "y"]
    items = list(read_scale_v1(params, scale_v1_prompts(io.BytesIO(data)), RequestChecker(None)))
    assert [type(i) for i in items] == [BatchRequest, ErrorRecord]


def test_scale_v1_refuses_a_job_of_another_endpoint() -> None:
    params = scan_scale_v1_params(io.BytesIO(json.dumps(V1).encode()))
    with pytest.raises(InputUnreadable, match="/v1/completions"):
        list(read_scale_v1(params, ["a"], RequestChecker(CHAT)))


@pytest.mark.parametrize("content", [
    {"prompts": ["a"], "temperature": 0.5},                        # max_new_tokens missing
    {"prompts": ["a"], "max_new_tokens": 0, "temperature": 0.5},   # out of range
    {"prompts": "a", "max_new_tokens": 3, "temperature": 0.5},     # prompts not an array
    ["a"],                                                          # not an object
])
def test_scale_v1_bad_content_is_unreadable(content) -> None:
    with pytest.raises(InputUnreadable):
        scan_scale_v1_params(io.BytesIO(json.dumps(content).encode()))


# -- IdSet ------------------------------------------------------------------------------------


def test_id_set_finds_duplicates_across_growth() -> None:
    ids = IdSet(capacity=8)
    assert all(ids.add(f"request-{i}") for i in range(20_000))
    assert len(ids) == 20_000
    assert not any(ids.add(f"request-{i}") for i in range(0, 20_000, 997))
    assert ids.add("request-20000")


def test_a_utf8_bom_before_the_first_line_is_ignored() -> None:
    items = jsonl(b"\xef\xbb\xbf" + chat("a") + b"\n" + b"\xef\xbb\xbf" + chat("b") + b"\n")
    assert [type(i) for i in items] == [BatchRequest, ErrorRecord]  # only the file's start


def test_unsupported_url_with_no_endpoint_yet_names_the_supported_ones() -> None:
    (item,) = jsonl(b'{"custom_id": "a", "url": "/v1/conversations", "body": {}}\n', endpoint=None)
    assert item.code == "url_mismatch" and "/v1/embeddings" in item.message


# -- tried as a user: files as real tools write them --------------------------------------------

BOM = b"\xef\xbb\xbf"


def test_a_byte_order_mark_alone_or_before_a_blank_line_is_no_request() -> None:
    assert jsonl(BOM) == []
    assert jsonl(BOM + b"\r\n" + chat("a"))[0].line == 2


def test_crlf_is_not_counted_against_the_line_limit() -> None:
    line = chat("a", "x" * 100)
    limit = len(line)
    items = jsonl(line + b"\r\n" + chat("b", "x" * 101) + b"\r\n" + chat("c"), max_line_bytes=limit)
    assert [type(i) for i in items] == [BatchRequest, ErrorRecord, BatchRequest]
    assert items[1].code == "line_too_long" and items[1].custom_id == "b"
    assert f"line is {limit + 1} bytes" in items[1].message
    # the first line, with a byte-order mark, gets the same limit
    assert type(jsonl(BOM + line + b"\r\n", max_line_bytes=limit)[0]) is BatchRequest


def test_an_over_long_last_line_without_newline_is_reported_with_its_size() -> None:
    items = jsonl(chat("a") + b"\n" + chat("big", "x" * 5000), max_line_bytes=1024)
    assert [i.index for i in items] == [0, 1]
    assert items[1].code == "line_too_long" and items[1].custom_id == "big"
    assert f"line is {len(chat('big', 'x' * 5000))} bytes" in items[1].message


def test_scale_files_may_start_with_a_byte_order_mark() -> None:
    items = list(read_scale_v2(io.BytesIO(BOM + b'[{"prompt": "a"}]'), RequestChecker()))
    assert [type(i) for i in items] == [BatchRequest]
    content = BOM + b'{"prompts": ["a", "b"], "max_new_tokens": 3, "temperature": 0}'
    params = scan_scale_v1_params(io.BytesIO(content))
    prompts = scale_v1_prompts(io.BytesIO(content))
    assert len(list(read_scale_v1(params, prompts, RequestChecker()))) == 2


def test_scale_v2_number_overflow_names_the_problem_and_the_spot() -> None:
    data = b'[{"prompt": "a"}, {"prompt": "b", "seed": 99999999999999999999999}]'
    with pytest.raises(InputUnreadable) as caught:
        list(read_scale_v2(io.BytesIO(data), RequestChecker()))
    message = str(caught.value)
    assert "after element 1" in message and "64 bits" in message and "99999" in message


def test_scale_v1_with_prompts_twice_is_refused() -> None:
    content = b'{"prompts": ["a"], "max_new_tokens": 3, "temperature": 0, "prompts": ["b", "c"]}'
    with pytest.raises(InputUnreadable, match="'prompts' more than once"):
        scan_scale_v1_params(io.BytesIO(content))


# Inline content comes from the API as Python objects, which Python's JSON parser builds from
# text orjson would refuse: each must become an error record, not a crash when it is written.
NOT_JSON = [
    ({"messages": [{"role": "user", "content": "\ud800"}]}, "invalid_utf8",
     "body.messages[0].content: text is not valid UTF-8"),
    ({"messages": [{"role": "user", "content": "x"}], "seed": 2**70}, "invalid_json",
     "body.seed: the integer 1180591620717411303424 does not fit in 64 bits"),
    ({"messages": [{"role": "user", "content": "x"}], "extra": float("nan")}, "invalid_json",
     "body.extra: nan is not a JSON number"),
    ({"messages": [{"role": "user", "content": "x"}], "extra": {1: 2}}, "invalid_json",
     "body.extra: key 1 is not a string"),
]


@pytest.mark.parametrize("body, code, message", NOT_JSON)
def test_inline_values_json_cannot_hold_are_error_records(body: dict, code: str, message: str) -> None:
    items = list(read_inline([{"custom_id": "a", "body": body}, {"body": {"messages": [
        {"role": "user", "content": "ok"}]}}], RequestChecker(CHAT)))
    assert [type(i) for i in items] == [ErrorRecord, BatchRequest]
    assert items[0].code == code and items[0].custom_id == "a"
    assert items[0].message.startswith(f"request 1: {message}")
    assert orjson.dumps(items[0].model_dump())  # the error record itself can be written


def test_inline_scale_values_json_cannot_hold_are_error_records() -> None:
    items = list(read_scale_v2([{"prompt": "\ud800"}, {"prompt": "ok", "seed": -(2**64)}, {"prompt": "ok"}],
                               RequestChecker()))
    assert [i.code if type(i) is ErrorRecord else "ok" for i in items] == [
        "invalid_utf8", "invalid_json", "ok"]
    assert items[1].message.startswith("element 2: body.seed:")


def test_array_elements_over_the_line_limit_are_line_too_long() -> None:
    big = "x" * 2000
    data = orjson.dumps([{"prompt": "a"}, {"prompt": big}, {"prompt": "b"}])
    items = list(read_scale_v2(io.BytesIO(data), RequestChecker(), max_item_bytes=1024))
    assert [i.code if type(i) is ErrorRecord else "ok" for i in items] == ["ok", "line_too_long", "ok"]
    assert items[1].message.startswith("element 2 is 2013 bytes as JSON, over the limit of 1024")
    inline = list(read_inline([{"custom_id": "a", "body": {"input": big}}], RequestChecker(),
                              max_item_bytes=1024))
    assert inline[0].code == "line_too_long" and inline[0].custom_id == "a"
    params = scan_scale_v1_params(io.BytesIO(b'{"prompts": [], "max_new_tokens": 3, "temperature": 0}'))
    prompts = list(read_scale_v1(params, ["a", big], RequestChecker(), max_item_bytes=1024))
    assert [type(i) for i in prompts] == [BatchRequest, ErrorRecord]
    assert prompts[1].code == "line_too_long" and prompts[1].message.startswith("prompt 2 is")


@pytest.mark.parametrize("data, hint", [
    (b'[{"prompt": "a"}]\n', "is the scale-v2 format"),
    (b'[\n  {"prompt": "a"}\n]\n', "is the scale-v2 format"),
    (b'{\n  "custom_id": "a"\n}\n', "whole on one line"),
    ('{"custom_id": "a", "body": {}}\n'.encode("utf-16"), "looks like UTF-16"),
])
def test_a_file_that_is_not_jsonl_says_what_it_looks_like_on_line_1(data: bytes, hint: str) -> None:
    items = jsonl(data)
    assert hint in items[0].message
    assert all(hint not in i.message for i in items[1:] if type(i) is ErrorRecord)
