"""User-facing errors: one line saying what was wrong and what to do. The CLI prints them without a traceback."""


class TrtkvError(Exception):
    """Bad input or an unusable artifact. ``str(e)`` is the one-line message shown to the user."""


class OutOfKVMemory(TrtkvError):
    """The KV pools have no free page for a request that must grow (admission should prevent this)."""
