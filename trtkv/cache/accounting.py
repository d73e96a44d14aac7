"""``ByteAccount``: the running total of KV bytes one request holds, and its peak."""
from __future__ import annotations


class ByteAccount:
    """Charged by the request's block tables (pages), its key-scale groups and its residual buffer."""

    __slots__ = ("bytes", "peak")

    def __init__(self, start: int = 0) -> None:
        self.bytes = self.peak = start

    def add(self, n: int) -> None:
        self.bytes += n
        if self.bytes > self.peak:
            self.peak = self.bytes

    def start_at(self, n: int) -> None:
        """Begin from ``n`` bytes (a fork holds its parent's pages from the start)."""
        self.bytes = self.peak = n
