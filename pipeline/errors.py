"""The bottom floor every part of the pipeline stands on: the driver's logger and its error.

`log` is what the driver tells the user; `smpipe` (pipeline/cli/) sends it to the console.
Job output streams separately, through the backend's `echo`.
"""

from __future__ import annotations

import logging
import os

log = logging.getLogger("smpipe")
# A line that says what a run produced (its summary, its report, its registered version): `extra`
# of log calls that --quiet still shows.
RESULT = {"result": True}


class PipelineError(RuntimeError):
    """A step failed or a run cannot start; the message is one paragraph for the user."""


class Refused(PipelineError):
    """What was asked cannot be done as asked (a --resume of a run that cannot go on), said
    before anything runs: `smpipe` exits 2, as for wrong settings."""


def counted(number: int, noun: str) -> str:
    """'1 file', '3 files': a count said to the user as a sentence says it."""
    return f"{number:,} {noun}{'' if number == 1 else 's'}"


NOT_UTF8 = (
    "holds bytes that are not UTF-8, and a run's records, S3 keys and SageMaker's requests "
    "are UTF-8: rename it (or the folder it is in)"
)


def not_utf8(text: str) -> bool:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return True
    return False


def as_bytes(path: str) -> str:
    """A path as its bytes read, each that is not UTF-8 escaped: /tmp/caf\\xe9."""
    return os.fsencode(path).decode("utf-8", "backslashreplace")
