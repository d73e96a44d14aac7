"""``ByteAccount``: the running total of KV bytes one request holds, and its peak."""
from __future__ import annotations

from collections.abc import Iterable
from numbers import Integral


class ByteAccount:
    """Charged by the request's block tables (pages), its key-scale groups and its residual buffer."""

    __slots__ = ("bytes", "peak")

    def __init__(self, start: int = 0) -> None:
        self.bytes = self.peak = start

    def add(self, n: int) -> None:
        self.bytes += n
        if self.bytes > self.peak:
            self.peak = self.bytes

    @staticmethod
    def add_each(accounts: Iterable[ByteAccount], amounts: Integral | Iterable[int]) -> None:
        """``add`` of ``amounts`` (one int for all, or one each) to each of ``accounts`` in one loop: a batch's
        charges without a method call a request."""
        if isinstance(amounts, Integral):
            amounts = int(amounts)
            for a in accounts:
                a.bytes += amounts
                if a.bytes > a.peak:
                    a.peak = a.bytes
            return
        for a, n in zip(accounts, amounts):
            a.bytes += n
            if a.bytes > a.peak:
                a.peak = a.bytes

    def start_at(self, n: int) -> None:
        """Begin from ``n`` bytes (a fork holds its parent's pages from the start)."""
        self.bytes = self.peak = n
