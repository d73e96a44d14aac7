"""User-facing errors: one line saying what was wrong and what to do. The CLI prints them without a traceback."""


class TrtkvError(Exception):
    """Bad input or an unusable artifact. ``str(e)`` is the one-line message shown to the user."""


class OutOfKVMemory(TrtkvError):
    """A request does not fit the KV pools: raised at admission when it never can, and by a full pool if a
    running request outgrows what admission reserved for it (then ``seq_id``, ``layer`` and ``fmt`` name the
    sequence that asked and the full pool, so the scheduler can fail the one request over its reservation)."""

    def __init__(self, message: str, seq_id: int | None = None, layer: int | None = None, fmt: str | None = None):
        super().__init__(message)
        self.seq_id, self.layer, self.fmt = seq_id, layer, fmt

    def at(self, seq_id: int, layer: int, fmt: str) -> "OutOfKVMemory":
        """Name the sequence and pool (the cache knows them, the pool does not); returns self to re-raise."""
        self.seq_id, self.layer, self.fmt = seq_id, layer, fmt
        return self
