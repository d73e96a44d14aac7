"""Loaded engines out of the cyclic garbage collector's full passes while a process serves them.

A full (generation 2) collection walks every tracked object: with an engine loaded that is ~200k of them
(modules, weights' wrappers, the tokenizer, registries), ~90 ms at 32 layers x 256 requests, once every ~100
decode steps on a Zen 4 core - 0.9 ms a step on average and one 90-ms stall in the tail. ``gc.freeze`` moves
what is alive now to the permanent generation, which collections skip (vLLM and SGLang freeze after loading
too); objects made afterwards (requests, pages' lists, a bench run's cores) are collected as before.
"""
from __future__ import annotations

import contextlib
import gc
from collections.abc import Iterator


@contextlib.contextmanager
def frozen_gc() -> Iterator[None]:
    """Freeze every object alive now (after a collection, so no garbage is frozen) for the block; unfreeze after,
    so that an engine dropped later, in the same process, is collected (the tests run many commands in one)."""
    gc.collect()
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()
