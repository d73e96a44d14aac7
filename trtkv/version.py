"""trtkv's version, in a module of its own: importing it imports nothing else (``trtkv/__init__.py``'s lazy
``Engine`` re-export would tie any module that reads the version to the API layer)."""
__version__ = "0.1.0"
