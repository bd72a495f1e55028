"""User values inside markdown that Airflow renders (a DAG run's note): shown as written,
never read as markup (an image link there would make a reader's browser fetch any URL with
their cookies).

CommonMark lets every ASCII punctuation character be backslash-escaped; escaping all of them
(rather than a list of the dangerous ones) stops links, images, raw HTML, autolinks, code
spans, emphasis, headings and entity references alike.
"""

from __future__ import annotations

import re

MAX_CHARS = 1000
_PUNCTUATION = re.compile(r"""([!"#$%&'()*+,\-./:;<=>?@\[\\\]^_`{|}~])""")
_CONTROL = re.compile(r"[\x00-\x1f\x7f-\x9f]")


def escape(value: object, limit: int = MAX_CHARS) -> str:
    """`value` as literal markdown text on one line, at most `limit` characters of it
    (then an ellipsis): line breaks and control characters become spaces (no new block can
    start), every ASCII punctuation character is escaped."""
    text = str(value)
    if len(text) > limit:
        text = text[:limit] + "…"
    text = " ".join(_CONTROL.sub(" ", text).split())
    return _PUNCTUATION.sub(r"\\\1", text)
