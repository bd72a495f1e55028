"""User values in markdown Airflow renders (a DAG run's note) are text, never markup."""

from __future__ import annotations

from types import SimpleNamespace

from hypothesis import given
from hypothesis import strategies as st

from llm_batch.core.jobs import JobStatus
from llm_batch.core.markdown import MAX_CHARS, escape

ATTACK = "![x](http://127.0.0.1:8081/steal.png) <img src=x onerror=alert(1)> `a` [l](javascript:x) &amp;\n# heading"


def _unescaped(text: str, char: str) -> bool:
    """Whether `char` occurs in `text` without a backslash escaping it."""
    i = 0
    while i < len(text):
        if text[i] == "\\":
            i += 2
            continue
        if text[i] == char:
            return True
        i += 1
    return False


@given(st.text())
def test_no_markup_character_survives_and_the_value_stays_one_bounded_line(value: str):
    escaped = escape(value)
    assert not any(_unescaped(escaped, c) for c in "![]()<>`*_#&|~\\")
    assert "\n" not in escaped and "\r" not in escaped
    assert len(escaped) <= 2 * (MAX_CHARS + 1)


def test_an_image_link_in_a_reason_is_text_in_the_run_note():
    from llm_batch.api.listeners import run_note

    job = SimpleNamespace(id="job_`x`)![i](http://evil/)", status=JobStatus.FAILED, succeeded=0, failed=1, total=1,
                          status_reason=ATTACK)
    note = run_note(job)
    body, link = note.rsplit("\n\n", 1)
    assert escape(job.id) in body and escape(ATTACK) in body  # text only (the property above)
    assert link.startswith("[job status](") and link.endswith("#job=job_%60x%60%29%21%5Bi%5D%28http%3A%2F%2Fevil%2F%29)")
    assert escape("a" * 5000).endswith("…") and len(escape("a" * 5000)) == MAX_CHARS + 1
