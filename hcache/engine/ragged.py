"""How a ragged batch maps rows to sequences; shared by engines (which produce rows) and the saver."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Segment:
    """Rows ``[row, row + length)`` of a ragged batch are tokens ``[start, start + length)`` of sequence ``uid``."""

    uid: int
    start: int
    length: int
    row: int
