"""User-facing errors: one line saying what was wrong and what to do. The CLI prints them without a traceback."""


class TrtkvError(Exception):
    """Bad input or an unusable artifact. ``str(e)`` is the one-line message shown to the user."""


class OutOfKVMemory(TrtkvError):
    """A request does not fit the KV pools: raised at admission when it never can, and by a full pool if a
    running request outgrows what admission reserved for it (then ``seq_id`` names that request's sequence,
    so the scheduler fails it alone)."""

    def __init__(self, message: str, seq_id: int | None = None):
        super().__init__(message)
        self.seq_id = seq_id
