"""``PageChanges`` under drawn histories (hypothesis): what ``since`` reports equals a plain per-row model of the
last changes, and its page-boundary shortcut equals reading the whole ring."""
from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from trtkv.cache.page_changes import CHANGE_MAX, DEPTH, PageChanges

L, R = 2, 4

_rows = st.lists(st.integers(0, R - 1), min_size=1, max_size=R, unique=True)
_op = st.one_of(
    st.tuples(st.just("append"), st.integers(0, L - 1), _rows, st.integers(1, CHANGE_MAX + 1), st.booleans(),
              st.integers(0, 5)),
    st.tuples(st.just("remove"), st.integers(0, L - 1), _rows, st.integers(1, CHANGE_MAX + 1), st.integers(0, 5)),
    st.tuples(st.just("touch"), st.integers(0, L - 1), _rows),
    st.tuples(st.just("clear"), st.integers(0, R - 1)),
    st.tuples(st.just("read"), st.integers(0, L - 1), _rows),
    st.tuples(st.just("read_all"),),
)


def _expected(history: list, seen: int) -> tuple[bool, list]:
    """The changes a row read at stamp ``seen`` applies: those from the kept change made right after that read, when
    every one since is recorded."""
    kept = history[-DEPTH:]
    for j, (before, _, _, _) in enumerate(kept):
        if before == seen and all(rec for _, rec, _, _ in kept[j:]):
            return True, [(fid, pages, removed) for _, _, (fid, pages), removed in kept[j:]]
    return False, []


def _reported(covered: np.ndarray, changes: list, i: int) -> tuple[bool, list]:
    out = []
    for mask, fids, pages, removed in changes:
        if mask[i]:
            out.append((int(fids[i]), tuple(p for p in pages[i].tolist() if p >= 0), bool(removed[i])))
    return bool(covered[i]), out


@settings(max_examples=300, deadline=None)
@given(st.lists(_op, min_size=1, max_size=40))
def test_since_reports_each_rows_recorded_changes_after_its_read(ops):
    pc = PageChanges(L, R)
    history = {(layer, row): [] for layer in range(L) for row in range(R)}  # (before, recorded, (fid, pages), removed)
    seen = np.zeros((L, R), np.int64)
    next_page = 0
    for op in ops:
        kind = op[0]
        if kind == "append":
            _, layer, rows, m, at_end, fid = op
            pages = np.arange(next_page, next_page + len(rows) * m).reshape(len(rows), m)
            next_page += pages.size
            at = np.array([at_end or r % 2 == 0 for r in rows])
            before = pc.stamps(layer, np.array(rows)).tolist()
            pc.append_rows(layer, np.array(rows), fid, pages[:, 0] if m == 1 else pages, at)
            for r, b, p, ok in zip(rows, before, pages.tolist(), at.tolist()):
                history[layer, r].append((b, ok and m <= CHANGE_MAX, (fid, tuple(p)), False))
        elif kind == "remove":
            _, layer, rows, m, fid = op
            counts = np.array([1 + (m + r) % m for r in rows])
            pages = np.arange(next_page, next_page + counts.sum())
            next_page += len(pages)
            before = pc.stamps(layer, np.array(rows)).tolist()
            pc.remove_rows(layer, np.array(rows), fid, pages, counts)
            start = 0
            for r, b, n in zip(rows, before, counts.tolist()):
                history[layer, r].append((b, n <= CHANGE_MAX, (fid, tuple(pages[start:start + n].tolist())), True))
                start += n
        elif kind == "touch":
            _, layer, rows = op
            pc.touch_rows(layer, np.array(rows))
            for r in rows:
                history[layer, r] = [(None, False, None, None)]
        elif kind == "clear":
            pc.clear_row(op[1])
            for layer in range(L):
                history[layer, op[1]] = [(None, False, None, None)]
        else:
            layers, rows = (np.repeat(np.arange(L), R), np.tile(np.arange(R), L)) if kind == "read_all" else \
                (np.full(len(op[2]), op[1]), np.array(op[2]))
            stale = pc.stamps_layers(np.arange(R))[layers, rows] != seen[layers, rows]
            layers, rows = layers[stale], rows[stale]
            if not len(rows):
                continue
            got = pc.since(layers, rows, seen[layers, rows])
            whole = pc.since_in_ring(layers, rows, seen[layers, rows])
            for i, (layer, r) in enumerate(zip(layers.tolist(), rows.tolist())):
                assert _reported(*got, i) == _reported(*whole, i) == _expected(history[layer, r], seen[layer, r])
            seen[layers, rows] = pc.stamps_layers(np.arange(R))[layers, rows]
