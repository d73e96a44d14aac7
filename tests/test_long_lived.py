"""``frozen_gc`` (trtkv/runtime/long_lived.py): what is alive when a command starts serving is out of the full
collections for the command, and collectable again after it."""
from __future__ import annotations

import gc
import weakref

from trtkv.runtime.long_lived import frozen_gc


class _Node:
    pass


def test_frozen_for_the_block_then_collected():
    node = _Node()
    node.me = node  # a reference cycle: only the cyclic collector frees it
    ref = weakref.ref(node)
    with frozen_gc():
        assert gc.get_freeze_count() > 0
        del node
        gc.collect()
        assert ref() is not None  # frozen: collections skip it
    assert gc.get_freeze_count() == 0
    gc.collect()
    assert ref() is None
