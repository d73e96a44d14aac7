"""``BlockTable``: one request's pages in one layer, and where each of its tokens lives.

A table owns, for its request and layer: the pages of every class (format, thought type) in allocation
order, the open page of each class (never-written tail slots), the reusable (evicted) slots, the
position map ``position -> (format, page, slot)``, the flat page arrays and cached block tables built from
the page lists (rebuilt whenever a page list changes), and the bytes its pages cost the request. Every
change goes through a verb here, so the rules of paging live in one place; the pools' own state (codes,
validity, fill) changes only through ``PagePool``'s verbs. The position map, live count, open pages and
reusable slots sit in the cache's ``TableColumns`` (this table's row there), so a decode step's write
updates them for the whole batch at once (``batch_alloc.py``, ``TableColumns.place_rows``, ``ReusableSlots``).
"""
from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from itertools import islice, repeat
from types import MappingProxyType

import numpy as np

from trtkv.cache.accounting import ByteAccount
from trtkv.cache.columns import Cls, PositionView, TableColumns, Where
from trtkv.cache.fresh_pages import group_waiting
from trtkv.cache.index_ops import add_at, sorted_runs, split_counts
from trtkv.cache.pool import PagePool
from trtkv.errors import OutOfKVMemory

__all__ = ["BlockTable", "Cls", "Where", "ENTRY_BYTES", "held_page_bytes"]
ENTRY_BYTES = 4  # one block-table entry (an int32 page id), charged with each page a request holds


def held_page_bytes(pool: PagePool) -> int:
    """What holding one page of ``pool`` costs a request: the page and its block-table entry."""
    return pool.page_bytes + ENTRY_BYTES


class BlockTable:
    """One request's pages in one layer. ``order`` numbers pages as they join the table (shared by the
    cache's tables, so "oldest page first" among reusable slots is the cache-wide allocation order)."""

    def __init__(self, seq_id: int, layer: int, account: ByteAccount, order: Iterator[int], cols: TableColumns,
                 row: int) -> None:
        self.seq_id, self.layer = seq_id, layer
        self._account = account
        self._order = order
        self._cols, self._row = cols, row  # position map, live count, open pages, reuse flags: this row
        self._page_lists: dict[Cls, list[int]] = {}  # (read through ``_pages``: a page boundary's pages wait)
        self._flat: dict[str, np.ndarray] | None = None
        self._single_bt: list | None = None  # block tables of this request alone (attention at batch 1)

    # --- the page lists, with the pages a batch's page boundary left waiting (cache/fresh_pages.py) ---------------
    @property
    def _pages(self) -> dict[Cls, list[int]]:
        self._catch_up()
        return self._page_lists

    @_pages.setter
    def _pages(self, lists: dict[Cls, list[int]]) -> None:
        self._page_lists = lists

    def _catch_up(self) -> None:
        if self._cols.leaving.waiting(self.layer, self._row):  # (first: a page that left may be back as a fresh one)
            self._drop_leaving()
        if self._cols.fresh.waiting(self.layer, self._row):
            self._join_waiting(*self._cols.fresh.take(self.layer, self._row))

    def _drop_leaving(self) -> None:
        """The pages an event released from this table leave its lists (their bytes went when they were released,
        and the batch's block tables dropped them then)."""
        fids, classes, pages = self._cols.leaving.take(self.layer, self._row)
        names = self._cols.fmt_names
        keys = list(zip(fids, classes))
        for f, c in dict.fromkeys(keys):
            self._remove_listed((names[f], c), [p for p, key in zip(pages, keys) if key == (f, c)])

    def take_waiting_pages(self) -> None:
        """The pages waiting for this table join its lists (their bytes were charged and the batch's block
        tables took them when they were given), after the pages waiting to leave them have left."""
        self._catch_up()

    @staticmethod
    def catch_up_each(tables: list[BlockTable]) -> None:
        """``take_waiting_pages`` of every table (distinct, of one layer) with pages waiting, read in one pass; a
        table whose waiting pages are all of one class (the common case) extends that list with them."""
        if not tables:
            return
        cols, layer = tables[0]._cols, tables[0].layer  # noqa: SLF001 (tables of one cache and layer)
        rows = np.fromiter((t._row for t in tables), np.int64, len(tables))  # noqa: SLF001
        for i in np.flatnonzero(cols.leaving.waiting_rows(layer, rows)).tolist():
            tables[i]._drop_leaving()  # noqa: SLF001
        at = np.flatnonzero(cols.fresh.waiting_rows(layer, rows))
        if not len(at):
            return
        n, fids, classes, pages = cols.fresh.take_rows(layer, rows[at])
        past = np.arange(fids.shape[1]) >= n[:, None]
        one = ((fids == fids[:, :1]) & (classes == classes[:, :1]) | past).all(1)
        names = cols.fmt_names
        dropped = ((pages < 0) & ~past).any(1)  # (pages released while waiting: FreshPages.drop)
        for i, k, f, c, ps, d in zip(at[one].tolist(), n[one].tolist(), fids[one, 0].tolist(),
                                     classes[one, 0].tolist(), pages[one].tolist(), dropped[one].tolist()):
            t = tables[i]
            t._page_lists.setdefault((names[f], c), []).extend([p for p in ps[:k] if p >= 0] if d else ps[:k])  # noqa: SLF001
            t._flat = t._single_bt = None  # noqa: SLF001
        if not one.all():
            BlockTable._join_waiting_each([tables[i] for i in at[~one].tolist()], n[~one], fids[~one],
                                          classes[~one], pages[~one])

    @staticmethod
    def _join_waiting_each(tables: list[BlockTable], n: np.ndarray, fids: np.ndarray, classes: np.ndarray,
                           pages: np.ndarray) -> None:
        """``_join_waiting`` of each of ``tables`` (row ``i``'s first ``n[i]`` entries its pages): the pages grouped by
        (table, format, class) with array operations, each group's list extended once, the classes of a table in
        the order their first page waited (a class new to the table is listed in that order)."""
        bounds, t_at, g_fids, g_classes, flat_pages = group_waiting(n, fids, classes, pages)
        names = tables[0]._cols.fmt_names  # noqa: SLF001
        dropped = -1 in flat_pages  # (pages released while waiting: FreshPages.drop)
        for a, b, i, f, c in zip(bounds[:-1], bounds[1:], t_at, g_fids, g_classes):
            tables[i]._page_lists.setdefault((names[f], c), []).extend(  # noqa: SLF001
                [p for p in flat_pages[a:b] if p >= 0] if dropped else flat_pages[a:b])
        for t in tables:
            t._flat = t._single_bt = None  # noqa: SLF001

    def _join_waiting(self, fids: list[int], classes: list[int], pages: list[int]) -> None:
        names = self._cols.fmt_names
        keys = list(zip(fids, classes))
        for f, c in dict.fromkeys(keys):
            self._page_lists.setdefault((names[f], c), []).extend(
                [p for p, key in zip(pages, keys) if key == (f, c) and p >= 0])
        self._flat = self._single_bt = None

    def _list(self, cls: Cls) -> None:
        """``cls`` joins this table's classes (FreshPages keeps their order, which block tables follow)."""
        self._cols.fresh.list_class(self.layer, self._row, self._cols.fmt_id(cls[0]), cls[1])

    # --- what the table holds (read-only views) ------------------------------------------------------
    @property
    def live(self) -> int:
        return self._cols.live(self.layer, self._row)

    @property
    def loc(self) -> PositionView:
        """``position -> (format, page, slot)`` of every paged token, ascending positions."""
        return PositionView(self._cols, self.layer, self._row)

    @property
    def pages(self) -> MappingProxyType:
        """``class -> [page, ...]`` in table order."""
        return MappingProxyType(self._pages)

    @property
    def reusable(self) -> dict[Cls, list[tuple[int, int, int]]]:
        """``class -> [(page order, page, slot), ...]``: the reusable slots of each class, in the order writes take
        them (a copy)."""
        return self._cols.reuse.entries(self.layer, self._row)

    @property
    def open_page(self) -> dict[Cls, int]:
        """``class -> page`` of each class's open page (a copy)."""
        return self._cols.open_pages_of(self.layer, self._row)

    @property
    def page_seq(self) -> dict[tuple[str, int], int]:
        """``(format, page) -> order number`` of every held page (a copy)."""
        out = {}
        for (fmt, _), pages in self._pages.items():
            if pages:
                out.update(zip(zip(repeat(fmt), pages), self._cols.reuse.orders_of(self.layer, fmt, pages).tolist()))
        return out

    @property
    def holes(self) -> bool:
        return self._cols.holes(self.layer, self._row)

    def __contains__(self, pos: int) -> bool:
        return self._cols.code(self.layer, self._row, int(pos)) >= 0

    def locate(self, pos: int) -> Where | None:
        return self._cols.locate(self.layer, self._row, int(pos))

    def positions(self) -> np.ndarray:
        """Held positions, ascending."""
        return self._cols.positions(self.layer, self._row)

    def holds_page(self, fmt: str, p: int) -> bool:
        return any(p in pages for (f, _), pages in self._pages.items() if f == fmt)

    def num_pages(self) -> int:
        return sum(len(p) for p in self._pages.values())

    def pages_of_format(self) -> dict[str, np.ndarray]:
        """Pages per format in table order, as int32 arrays (a batch's block table is copied from them every
        layer of every step); rebuilt only when a page list changes."""
        self._catch_up()
        if self._flat is None and len(self._pages) == 1:  # one class (most tables): no merging
            ((fmt, _), pages), = self._pages.items()
            self._flat = {fmt: np.asarray(pages, np.int32)}
        if self._flat is None:
            flat: dict[str, list[int]] = {}
            for (fmt, _), pages in self._pages.items():
                flat.setdefault(fmt, []).extend(pages)
            self._flat = {f: np.asarray(p, np.int32) for f, p in flat.items()}
        return self._flat

    def page_lists_of(self, fmt: str) -> list[list[int]]:
        """The page lists of ``fmt``'s classes in table order (the lists themselves: read, never changed), so a
        batch's block tables are filled from every table's lists in one pass (``BlockTableCache``)."""
        self._catch_up()
        return [pages for (f, _), pages in self._page_lists.items() if f == fmt]

    def single_block_tables(self, build: Callable[[dict[str, np.ndarray]], list]) -> list:
        """This request's block tables built by ``build(pages_of_format())``, cached until a page list changes."""
        self._catch_up()
        if self._single_bt is None:
            self._single_bt = build(self.pages_of_format())
        return self._single_bt

    def dense_run(self) -> tuple[int, int] | None:
        """``(first page, live tokens)`` when the tokens fill one ascending run of pages from the first slot
        with no hole (attention can then read a view of the pool instead of a gather)."""
        if self.holes or len(self._pages) != 1:
            return None
        (pages,) = self._pages.values()
        if not pages or pages[-1] - pages[0] != len(pages) - 1 or any(b - a != 1 for a, b in zip(pages, pages[1:])):
            return None
        return pages[0], self.live

    # --- slots ---------------------------------------------------------------------------------------
    def _open_of(self, cls: Cls) -> int | None:
        p = self._cols.open_page(self.layer, self._row, cls)
        return None if p < 0 else p

    def _close(self, cls: Cls) -> None:
        self._cols.set_open(self.layer, self._row, cls, -1)

    def alloc_slots(self, pool: PagePool, cls: Cls, n: int) -> tuple[np.ndarray, np.ndarray]:
        """Slots for ``n`` tokens of ``cls``: reusable (evicted) slots first (oldest page, lowest slot), then
        the open page's tail, and only then new pages."""
        pages, slots = self._cols.reuse.take(self.layer, self._row, cls, n, pool.slots_free)
        while len(pages) < n:
            p = self._open_of(cls)
            if p is None:
                p = self.new_page(pool, cls)
            start, take = pool.take_tail(p, n - len(pages))
            pages.extend([p] * take)
            slots.extend(range(start, start + take))
            if pool.tail_full(p):
                self._close(cls)
        return np.asarray(pages, np.int64), np.asarray(slots, np.int64)

    def needs_fresh_pages(self, cls: Cls) -> bool:
        """No reusable slot and no open page of ``cls``: a write of whole pages takes fresh pages."""
        return self._cols.reuse.count(self.layer, self._row, cls) == 0 and self._open_of(cls) is None

    def new_page(self, pool: PagePool, cls: Cls) -> int:
        """A page of ``cls`` from ``pool`` becomes the open page (a full pool names this request)."""
        try:
            p = pool.alloc_page(cls[1])
        except OutOfKVMemory as e:
            raise e.at(self.seq_id, self.layer, cls[0]) from None
        self._adopt_open_page(pool, cls, p)
        return p

    def _adopt_open_page(self, pool: PagePool, cls: Cls, p: int) -> None:
        """Page ``p``, just taken from ``pool``, joins the table as the open page of ``cls``."""
        self._number(cls, p)
        self._join(cls, [p])
        self._cols.set_open(self.layer, self._row, cls, p)
        self._pages_changed()
        self._account.add(held_page_bytes(pool))

    def hold_fresh(self, cls: Cls, pages: list[int], cost: int) -> bool:
        """Pages just taken from the pool join ``cls``'s list (``cost``: their bytes); True when they end their
        format's list (the batch's block tables can append them)."""
        orders = list(islice(self._order, len(pages)))
        if pages:
            self._cols.reuse.note_orders(self.layer, cls[0], np.asarray(pages, np.int64),
                                         np.asarray(orders, np.int64))
        return self.hold_numbered(cls, pages, cost)

    def hold_numbered(self, cls: Cls, pages: list[int], cost: int) -> bool:
        """``hold_fresh`` of pages the caller numbered (from this table's page numbering, noted with the reusable
        slots): a batch's flush numbers every table's pages at once."""
        self._join(cls, pages)
        return self._held_fresh(cls, cost)

    def _number(self, cls: Cls, p: int) -> None:
        """Page ``p`` of ``cls`` takes the next order number of the cache's page numbering."""
        self._cols.reuse.note_orders(self.layer, cls[0], p, next(self._order))

    def _join(self, cls: Cls, pages: list[int]) -> None:
        """``pages`` join the end of ``cls``'s list; a class new to the table is listed after the others."""
        held = self._pages.get(cls)
        if held is None:
            self._list(cls)
            self._pages[cls] = list(pages)
        else:
            held.extend(pages)

    def _held_fresh(self, cls: Cls, cost: int) -> bool:
        """After fresh pages joined ``cls``'s list: cached views dropped, ``cost`` charged; whether that list ends
        its format's pages."""
        self._flat = self._single_bt = None
        self._account.add(cost)
        return len(self._pages) == 1 or [c for c in self._pages if c[0] == cls[0]][-1] == cls

    # --- the position map ----------------------------------------------------------------------------
    def place(self, fmt: str, pages: Iterable[int], slots: Iterable[int], positions: Iterable[int]) -> None:
        """The tokens at ``positions`` (distinct) now live in ``(fmt, page, slot)``."""
        arrays = [x if isinstance(x, np.ndarray) else list(x) for x in (pages, slots, positions)]
        self._cols.place(self.layer, self._row, fmt, *arrays)

    def place_one(self, fmt: str, p: int, s: int, pos: int) -> None:
        """``place`` of one token."""
        self._cols.place_one(self.layer, self._row, fmt, int(p), int(s), int(pos))

    def forget(self, positions: Iterable[int]) -> list[Where]:
        """Drop ``positions`` from the map (evicted or moved away); returns where the held ones were."""
        self._cols.set_holes(self.layer, self._row)
        return self._cols.forget(self.layer, self._row, positions)

    # --- freed slots and pages -----------------------------------------------------------------------
    def free_slot(self, pool: PagePool, cls: Cls, p: int, s: int) -> None:
        """Slot ``s`` of page ``p`` (just evicted) becomes reusable; the page goes back to the pool when it is left
        empty and is not the open page."""
        if pool.live[p] == 0 and self._open_of(cls) != p:
            self.release_page(pool, cls, p)  # (its reusable slots go with it)
        else:
            self._cols.reuse.push(self.layer, np.array([self._row]), cls, np.array([p]), np.array([s]))

    def _release_empty(self, pool: PagePool, fmt: str, pages: list[int], classes: list[int]) -> None:
        for p, c, live in zip(pages, classes, pool.live[pages].tolist()):
            if live == 0 and self._open_of((fmt, c)) != p:
                self.release_page(pool, (fmt, c), p)

    def release_page(self, pool: PagePool, cls: Cls, p: int) -> None:
        """Return empty page ``p`` to ``pool``."""
        self.drop_page(pool, cls, p)
        pool.release_page(p)

    @staticmethod
    def release_each(pool: PagePool, table_of: Callable[[int], BlockTable], owners: np.ndarray, rows: np.ndarray,
                     classes: np.ndarray, pages: np.ndarray, counts: np.ndarray,
                     freed: np.ndarray | None = None) -> None:
        """``release_page`` of ``counts[j]`` of ``pages`` (job by job) for each job ``j``: the emptied pages of class
        ``(pool's format, classes[j])`` of request ``owners[j]``'s table ``table_of(owners[j])`` (row ``rows[j]``;
        tables of one layer, no (table, class) twice): an event's emptied pages, the pool, reusable slots, stamps and
        each request's bytes updated once, with no Python work a job. ``freed`` (indexed by owner): the bytes the
        requests give back are added there instead, for the caller to return once for several layers."""
        if not len(owners):
            return
        first = table_of(int(owners[0]))
        cols, layer, fmt = first._cols, first.layer, pool.fmt.name  # noqa: SLF001 (tables of one cache and layer)
        cost = held_page_bytes(pool)
        fid = cols.fmt_id(fmt)
        # pages still waiting to join their tables' lists leave the waiting entries; the others wait to leave the
        # lists (LeavingPages), where their rows have room, else leave them now
        waiting = cols.fresh.drop(layer, np.repeat(rows, counts), fid, pages)
        job = np.repeat(np.arange(len(owners)), counts)
        listed = np.bincount(job[~waiting], minlength=len(owners))
        fits = cols.leaving.fits(layer, rows, listed)
        later = ~waiting & fits[job]
        cols.leaving.add(layer, rows[job[later]], fid, classes[job[later]], pages[later])
        if not fits.all():
            now = np.flatnonzero(~fits & (listed > 0))
            mine = split_counts(pages[~waiting & ~fits[job]].tolist(), listed[now])
            for j, gone in zip(now.tolist(), mine):
                table = table_of(int(owners[j]))
                table._catch_up()  # noqa: SLF001
                table._remove_listed((fmt, int(classes[j])), gone)  # noqa: SLF001
        if freed is not None:
            add_at(freed, owners, counts * cost)
        else:
            if len(owners) < 2 or (owners[1:] > owners[:-1]).all():  # (distinct already: a job a request)
                u, back = owners, counts
            else:
                u, inv = np.unique(owners, return_inverse=True)  # each request's bytes once
                back = np.bincount(inv, weights=counts).astype(np.int64)
            ByteAccount.add_each([table_of(i)._account for i in u.tolist()],  # noqa: SLF001
                                 (-cost * np.asarray(back, np.int64)).tolist())
        one = classes.min() == classes.max()
        for c in [int(classes[0])] if one else np.unique(classes).tolist():
            mine = pages if one else pages[np.repeat(classes == c, counts)]
            at = np.flatnonzero(classes == c)
            cols.reuse.drop_pages_each(layer, rows[at], (fmt, c), mine, counts[at])
        pool.release_pages(pages)
        # each row's emptied pages, recorded so the batch's block tables drop them in place
        row_of_page = np.repeat(rows, counts)
        order = np.argsort(row_of_page, kind="stable")
        changed, per_row = sorted_runs(row_of_page[order])
        cols.changes.remove_rows(layer, changed, fid, pages[order], per_row)

    def _unlist(self, cls: Cls, pages: list[int], cost: int) -> int:
        """Pages of ``cls`` leave the list (``cost`` each goes); returns this table's row."""
        self._catch_up()
        self._remove_listed(cls, pages)
        self._account.add(-cost * len(pages))
        return self._row

    def _remove_listed(self, cls: Cls, pages: list[int]) -> None:
        """``pages`` (in ``cls``'s list) leave it; no bytes change."""
        held = self._page_lists[cls]
        if len(pages) <= 8:  # (a few: one C-level scan each beats a set and a rebuilt list)
            for p in pages:
                held.remove(p)
        else:
            gone = set(pages)
            held[:] = [p for p in held if p not in gone]
        self._flat = self._single_bt = None

    def drop_page(self, pool: PagePool, cls: Cls, p: int) -> None:
        """Stop holding page ``p`` (its pool page stays with whoever else holds it)."""
        self._unlist(cls, [p], held_page_bytes(pool))
        self._cols.reuse.drop_page(self.layer, self._row, cls, p)  # its reusable slots go with it
        self._pages_changed()

    # --- shared pages (cache/forks.py) ---------------------------------------------------------------
    def seal(self) -> None:
        """No more writes into the current pages; the tokens are no longer one dense run (a sealed, partly
        filled page leaves unwritten slots), so attention must not take the dense-view fast path."""
        self._cols.close_all(self.layer, self._row)
        self._cols.reuse.clear(self.layer, self._row)
        self._cols.set_holes(self.layer, self._row)

    def copy_from(self, parent: BlockTable) -> None:
        """Hold exactly ``parent``'s pages and tokens, by reference (a fork; the bytes are charged by the
        caller, once for all layers)."""
        self._pages = {cls: list(pages) for cls, pages in parent.pages.items()}
        for cls in self._page_lists:
            self._list(cls)
        self._cols.copy_row(self.layer, parent._row, self._row)  # noqa: SLF001
        self._cols.set_holes(self.layer, self._row)
        self._pages_changed()

    def replace_page(self, cls: Cls, old: int, new: int, slot_positions: np.ndarray) -> None:
        """Copy-on-write: private copy ``new`` takes shared page ``old``'s place (a fresh order number) and
        its tokens (``slot_positions``: the position in each slot of the copy, -1 free)."""
        pages = self._pages[cls]
        pages[pages.index(old)] = new
        self._cols.reuse.drop_page(self.layer, self._row, cls, old)
        self._number(cls, new)
        for s, pos in enumerate(slot_positions.tolist()):
            if pos >= 0 and self.locate(pos) == (cls[0], old, s):
                self.place_one(cls[0], new, s, pos)
        self._pages_changed()

    def add_shared_page(self, pool: PagePool, cls: Cls, p: int) -> bool:
        """Hold page ``p`` of another table (its order number is the page's, shared); False when already held."""
        if self.holds_page(cls[0], p):
            return False
        self._join(cls, [p])
        self._pages_changed()
        self._account.add(held_page_bytes(pool))
        return True

    # --- compaction (cache/compaction.py) ------------------------------------------------------------
    @staticmethod
    def compacted_each(pool: PagePool, fmt: str, jobs: list[tuple[BlockTable, Cls]], positions: np.ndarray,
                       pages: np.ndarray, slots: np.ndarray, counts: np.ndarray) -> None:
        """After ``pool.compact_pages_many`` moved the live tokens of each job's (one layer's table, class of
        ``fmt``; distinct) pages to its first pages: job ``j``'s ``counts[j]`` tokens (``positions, pages, slots``
        concatenated job by job) take their places, pages past them go back to the pool, reusable slots are
        forgotten and a last kept page with tail slots stays open - ``compacted`` of each job in turn, by array
        operations where they are the batch's."""
        if not jobs:
            return
        cols, layer = jobs[0][0]._cols, jobs[0][0].layer  # noqa: SLF001 (tables of one cache and layer)
        cost = held_page_bytes(pool)
        cut = [table._cut(cls, -(-n // pool.B), cost) for (table, cls), n in zip(jobs, counts.tolist())]  # noqa: SLF001
        rows = np.fromiter((row for row, _, _ in cut), np.int64, len(cut))
        lasts = np.fromiter((last for _, last, _ in cut), np.int64, len(cut))
        gone = [p for _, _, drop in cut for p in drop]
        cols.place_each(layer, np.repeat(rows, counts), fmt, pages, slots, positions)
        pool.release_pages(np.asarray(gone, np.int64))
        kept = lasts >= 0
        lasts[kept] = np.where(pool.hwm[lasts[kept]] < pool.B, lasts[kept], -1)  # (a full last page closes)
        for cls, at in _by_class([cls for _, cls in jobs]):
            cols.reuse.clear(layer, rows[at], cls)
            cols.set_opens(layer, rows[at], cls, lasts[at])
        # the batch's block tables: each list kept its first pages in order, so the cut ones leave them in place
        cuts = np.fromiter((len(drop) for _, _, drop in cut), np.int64, len(cut))
        changed = rows[cuts > 0]
        if len(np.unique(changed)) == len(changed):
            cols.changes.remove_rows(layer, changed, cols.fmt_id(fmt), np.asarray(gone, np.int64), cuts[cuts > 0])
        else:  # (a table with several classes of the format)
            _touch(cols, layer, changed)

    def _cut(self, cls: Cls, keep: int, cost: int) -> tuple[int, int, list[int]]:
        """``cls`` keeps its first ``keep`` pages (the rest's ``cost`` each goes; the caller releases them): ``(row,
        last kept page or -1, the pages cut)``."""
        held = self._pages[cls]
        drop = held[keep:]
        if drop:
            self._account.add(-cost * len(drop))
            self._page_lists[cls] = held = held[:keep]
        self._flat = self._single_bt = None
        return self._row, (held[-1] if held else -1), drop

    @staticmethod
    def forget_reusable_each(tables: list[BlockTable]) -> None:
        """No slot of any class of these tables (of one layer) is reusable any more (a compaction gathered every
        class's tokens)."""
        if tables:
            cols, layer = tables[0]._cols, tables[0].layer  # noqa: SLF001 (tables of one cache and layer)
            cols.reuse.clear(layer, np.fromiter((t._row for t in tables), np.int64, len(tables)))  # noqa: SLF001

    def _pages_changed(self) -> None:
        self._flat = self._single_bt = None
        self._cols.changes.touch(self.layer, self._row)


def _by_class(classes: list[Cls]) -> Iterator[tuple[Cls, np.ndarray]]:
    """Each class of a batch's jobs with the indices of its jobs, classes in first-seen order."""
    for cls in dict.fromkeys(classes):
        yield cls, np.flatnonzero(np.fromiter((c == cls for c in classes), bool, len(classes)))


def _touch(cols: TableColumns, layer: int, rows: np.ndarray) -> None:
    """A batch verb changed the page lists of ``rows`` (repeats allowed): each row's stamp moves once."""
    cols.changes.touch_rows(layer, np.asarray(list(dict.fromkeys(rows.tolist())), np.int64))
