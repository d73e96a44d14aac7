"""trtkv: build, run, measure and serve reasoning LLMs with compressed KV caches."""
from trtkv.version import __version__ as __version__


def __getattr__(name):  # lazy: importing trtkv must not import torch
    if name in ("Engine", "SamplingParams", "GenerationResult", "StreamEvent"):
        from trtkv import api

        return getattr(api, name)
    raise AttributeError(name)
