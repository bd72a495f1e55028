"""User values inside markdown that Airflow renders (a DAG run's note): shown as written, never
read as markup (an image link there would make a reader's browser fetch any URL). Escaping
every ASCII punctuation character, as CommonMark allows, stops every kind of markup alike.
"""

from __future__ import annotations

import re

MAX_CHARS = 1000
_PUNCTUATION = re.compile(r"""([!"#$%&'()*+,\-./:;<=>?@\[\\\]^_`{|}~])""")
_CONTROL = re.compile(r"[\x00-\x1f\x7f-\x9f]")


def escape(value: object, limit: int = MAX_CHARS) -> str:
    """`value` as literal markdown text on one line (no new block can start), at most `limit`
    characters of it, then an ellipsis."""
    text = str(value)
    if len(text) > limit:
        text = text[:limit] + "…"
    text = " ".join(_CONTROL.sub(" ", text).split())
    return _PUNCTUATION.sub(r"\\\1", text)
