"""A check the cache tests share: a cache's batch block tables (``trtkv/cache/reads.py``) equal tables built anew."""
from __future__ import annotations

from trtkv.cache import reads
from trtkv.cache.manager import KVCacheManager


def check_block_tables(cache: KVCacheManager, batch: list | None = None) -> None:
    """The cached block tables (rows brought up to date as pages join and leave) equal tables built anew, for
    ``batch``, or (None) for every request of the cache and for batches sharing its rows."""
    if batch is None:
        seqs = [cache.seqs[s] for s in sorted(cache.seqs)]
        if len(seqs) < 2:
            return
        batches = [seqs, seqs[1::2], seqs[::-1]] if len(seqs) > 3 else [seqs]  # batches sharing rows, in any order
    else:
        batches = [batch]
    L = cache.cfg.num_layers
    for b in batches:
        for layer in range(L):
            got = [(p.fmt.name, bt.tolist()) for p, bt in cache.block_tables(layer, b)]
            want = [(p.fmt.name, bt.tolist()) for p, bt in reads.BlockTableCache(L).get(
                cache.pools[layer], layer, b, cache.columns, cache.rows(b))]
            assert got == want
