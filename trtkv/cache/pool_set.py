"""``PoolSet``: every page pool of one cache — per layer, one ``PagePool`` per format — and the static
per-layer scales of each format.

Device pools are sized once from the budget (``trtkv/cache/budget.py``) and allocated all at once on first
use, so a cache that never runs costs nothing. Host pools (``growable``, the host tiers' storage) start at
``initial_pages`` and double when full; their bytes are capped elsewhere (``TierStore``).
"""
from __future__ import annotations

from collections.abc import Mapping

from plugins.formats import LayerScales, get_format
from trtkv.cache.budget import PoolPlan, plan_pools
from trtkv.cache.config import CacheConfig
from trtkv.cache.pool import PagePool
from trtkv.cache.pool_stack import SlotStack
from trtkv.errors import OutOfKVMemory, TrtkvError


class PoolSet:
    """``formats``: every format the cache will store (so ``kv_memory`` can be split among them);
    ``drops_tokens``: whether the policy may drop tokens (sizes the key-scale arenas); ``useful_pages``: the
    most pages a pool could ever hold (caps the default budget); ``kv_amax``: calibrated K/V amax per layer."""

    def __init__(self, cfg: CacheConfig, kv_amax: dict | None = None, formats=None, drops_tokens: bool = True,
                 useful_pages: int | None = None, growable: bool = False, pin: bool = False):
        self.cfg = cfg
        self.kv_amax = kv_amax  # {"k": [per layer], "v": [per layer]} from calibration, or None
        self.formats = tuple(sorted(formats)) if formats is not None else None
        self.drops_tokens = drops_tokens
        self.useful_pages = useful_pages
        self.growable, self.pin = growable, pin
        self._plan: PoolPlan | None = None
        self._scales: dict[tuple[int, str], LayerScales] = {}
        self._layers: list[dict[str, PagePool]] = [{} for _ in range(cfg.num_layers)]
        self._stacks: dict[str, SlotStack] = {}  # device pools: each format's slot state, every layer in one array

    def __getitem__(self, layer: int) -> dict[str, PagePool]:
        """The pools of one layer that exist so far, by format (read-only)."""
        return self._layers[layer]

    def __iter__(self):
        return iter(self._layers)

    def __len__(self) -> int:
        return len(self._layers)

    def all_pools(self):
        return (p for pools in self._layers for p in pools.values())

    @property
    def plan(self) -> PoolPlan:
        """The pools' sizes, decided once; nothing is allocated until a pool is first used."""
        if self._plan is None:
            self._plan = plan_pools(self.cfg, self.formats, self.drops_tokens, self.useful_pages)
        return self._plan

    def allocate(self) -> None:
        """Allocate every planned pool, all at once (the first write does this)."""
        plan = self.plan
        for layer, pools in enumerate(self._layers):
            for fmt in plan.formats or ():
                if fmt not in pools:
                    pools[fmt] = self._new_pool(fmt, layer)

    def pool(self, layer: int, fmt: str) -> PagePool:
        """The pool of ``fmt`` in ``layer``, allocating the planned pools on first use."""
        pools = self._layers[layer]
        if fmt not in pools:
            if self.growable:
                pools[fmt] = self._new_pool(fmt, layer)
                return pools[fmt]
            self.allocate()
            plan = self.plan
            if fmt not in pools:
                if plan.formats is not None:
                    raise TrtkvError(f"the KV cache has no {fmt} pool (its pools: {', '.join(plan.formats)}); "
                                     f"the policy must list every format it stores in pool_formats()")
                pools[fmt] = self._new_pool(fmt, layer)
        return pools[fmt]

    def stack(self, fmt: str) -> SlotStack | None:
        """The slot state of ``fmt``'s pools in every layer, when every layer's pool exists and is stacked."""
        st = self._stacks.get(fmt)
        return st if st is not None and st.complete else None

    def _new_pool(self, fmt: str, layer: int) -> PagePool:
        c = self.cfg
        if self.growable:
            return PagePool(get_format(fmt), c.num_kv_heads, c.head_dim, c.block_size, "cpu", c.initial_pages,
                            c.initial_pages, growable=True, pin=self.pin)
        plan = self.plan
        try:
            stack = self._stacks.get(fmt)
            if stack is None:
                stack = self._stacks[fmt] = SlotStack(c.num_layers, plan.pages, c.block_size)
            pool = PagePool(get_format(fmt), c.num_kv_heads, c.head_dim, c.block_size, c.device, plan.pages,
                            plan.groups(fmt, c), slot_state=stack.rows(layer))
            stack.attach(layer, pool)
            return pool
        except (RuntimeError, MemoryError) as e:  # torch.OutOfMemoryError is a RuntimeError
            raise OutOfKVMemory(f"could not allocate the {fmt} KV pools ({plan.pages} pages per layer) on "
                                f"{c.device}: {str(e).splitlines()[0] if str(e) else type(e).__name__}; lower "
                                f"--kv-memory or kv_memory_fraction") from None

    def capacity_pages(self, fmt: str) -> int:
        """Pages of one (layer, format) pool."""
        return self.plan.pages

    def capacity_groups(self, fmt: str) -> int:
        """Key-scale groups of one (layer, format) pool's arena."""
        return self.plan.groups(fmt, self.cfg)

    def layer_scales(self, layer: int, fmt: str) -> LayerScales:
        """Static second-level / tensor scales of a format in a layer, from the calibrated K/V amax
        (1.0 without calibration)."""
        key = (layer, fmt)
        if key not in self._scales:
            from plugins.formats.quantized import calibrate_layer_scales

            if self.kv_amax:
                self._scales[key] = calibrate_layer_scales(float(self.kv_amax["k"][layer]),
                                                           float(self.kv_amax["v"][layer]), get_format(fmt))
            else:
                self._scales[key] = LayerScales()
        return self._scales[key]

    def prepare(self, pages: Mapping[str, int], groups: Mapping[str, int]) -> None:
        """Make the first ``pages[fmt]`` pages and ``groups[fmt]`` key-scale groups (none without an entry: arenas
        admission does not reserve stay first-used, their entries are a few bytes) of every layer's ``fmt`` pool
        ready before they are handed out (``PagePool.prepare``). Host pools grow instead: nothing to do."""
        if self.growable:
            return
        for fmt, n in pages.items():
            if n > 0:
                for layer in range(len(self._layers)):
                    self.pool(layer, fmt).prepare(n, groups.get(fmt, 0))

    # --- bytes ---------------------------------------------------------------------------------------
    def pages_in_use(self) -> int:
        return sum(p.in_use for p in self.all_pools())

    def reserved_bytes(self) -> int:
        """Bytes the pools reserved (allocated once, used or not)."""
        return sum(p.allocated_bytes() for p in self.all_pools())

    def peak_bytes(self) -> int:
        """Bytes of the most pages and groups each pool had in use at once (what the runs needed)."""
        return sum(p.peak_bytes() for p in self.all_pools())
