"""A model of TensorFlow's BFC allocator: where a step's held bytes exceed its requested ones.

:func:`tf_remat.plan.simulate` counts the bytes a plan's values take, and what a rewritten
step's kernels request matches it within about 1.5% (``benchmarks/results/rewrite.md``).
TensorFlow's measured peak (``get_memory_info``) counts the allocator's chunks instead, and its
best-fit-with-coalescing (BFC) allocator hands a request a whole free chunk when that chunk is
less than twice the request: a 5 MiB value that lands in a freed 8 MiB chunk holds 8 MiB.
:class:`BFCModel` places allocations by the same policy (256-byte rounding, power-of-two bins
searched from the request's own upward, best fit by size then address, the split rule above,
neighbours merged on free, regions that double as the pool grows), and :func:`replay` runs a
step's recorded allocations through it.

What it is for: telling apart the two causes of a held peak over the requested one. Replayed
in an empty pool, a step's own allocations show what its allocation pattern costs; the rest of
TensorFlow's figure comes from what earlier allocations left in the pool, which no model of the
step alone can know. On bn_cnn at batch 64 and 70% of its peak (``rewrite.md``, 2026-11-27)
the plan simulated 40.6 MiB, its kernels requested 40.6, the empty-pool replay held 44.7, the
profiled run held 44.7, and three measurements in the same process after it gave 45.9, 58.0
and 55.4 MiB: the step's own pattern costs 10%, the pool's history up to 30% more, and the
history changes from call to call. That is why ``optimize`` verifies a plan by measuring it in
several allocator layouts rather than predicting its held peak. (A replay of a plan's nodes,
one request per node, was tried as a predictor and missed the profiled held peak by -8% and
+11% on two bn_cnn plans: TensorFlow makes several requests per node, outputs and scratch.
A replay of each node's buffers ranks plans by their measured peak no better than the simulated
peak does, and one plan's measured peak moves by up to 35% with the history alone:
``benchmarks/results/allocator.md``, ``tools/bench_allocator.py``.)

Example:
    >>> m = BFCModel()
    >>> a = m.allocate(8 << 20); m.free(a)
    >>> b = m.allocate(5 << 20)      # the freed 8 MiB chunk, less than twice 5 MiB: held whole
    >>> m.in_use == 8 << 20, m.requested == 5 << 20
    (True, True)
"""

from __future__ import annotations

import bisect
from typing import Iterable

__all__ = ["BFCModel", "replay"]

MIN_ALLOCATION = 256
NUM_BINS = 21


def _rounded(n: int) -> int:
    return max(MIN_ALLOCATION, -(-int(n) // MIN_ALLOCATION) * MIN_ALLOCATION)


def _bin(size: int) -> int:
    return min(NUM_BINS - 1, (max(size, MIN_ALLOCATION) >> 8).bit_length() - 1)


class BFCModel:
    """TensorFlow's BFC allocator's placement policy, with addresses but no memory behind them.

    Args:
        initial_region: the first region's size; TensorFlow's CPU allocator (``allow_growth``)
            starts at 2 MiB and doubles the next region each time it grows.
        max_internal_fragmentation: a chunk more than this over the request is always split
            (TensorFlow's default, 128 MiB).

    ``in_use`` is what TensorFlow's ``get_memory_info`` calls ``current`` (chunk sizes),
    ``requested`` what the allocations asked for; ``peak_in_use`` / ``peak_requested`` their
    maxima since :meth:`reset_peak`.
    """

    def __init__(self, *, initial_region: int = 2 << 20,
                 max_internal_fragmentation: int = 128 << 20):
        self._next_region = _rounded(initial_region)
        self._max_frag = int(max_internal_fragmentation)
        self._base = 0  # regions get addresses far apart, so they never merge
        # addr -> [size, in use, prev addr or None, next addr or None, bytes requested]
        self._chunks: dict = {}
        self._bins = [[] for _ in range(NUM_BINS)]  # sorted (size, addr) of free chunks
        self.in_use = self.requested = 0
        self.peak_in_use = self.peak_requested = 0
        self.pool_bytes = 0

    # ------------------------------------------------------------------ public
    def allocate(self, nbytes: int) -> int:
        """Place a request; returns its chunk's address (the handle :meth:`free` takes)."""
        nbytes = int(nbytes)
        if nbytes <= 0:  # TensorFlow's allocator returns no memory for these either
            raise ValueError(f"cannot allocate {nbytes} bytes; give a positive size")
        size = _rounded(nbytes)
        addr = self._find(size)
        if addr is None:
            self._extend(size)
            addr = self._find(size)
        chunk = self._chunks[addr]
        chunk[1], chunk[4] = True, nbytes
        self.in_use += chunk[0]
        self.requested += nbytes
        self.peak_in_use = max(self.peak_in_use, self.in_use)
        self.peak_requested = max(self.peak_requested, self.requested)
        return addr

    def free(self, addr: int) -> None:
        chunk = self._chunks.get(addr)
        if chunk is None or not chunk[1]:
            raise ValueError(f"no allocation at {addr}")
        self.in_use -= chunk[0]
        self.requested -= chunk[4]
        chunk[1], chunk[4] = False, 0
        # merge with free neighbours in the same region, as the allocator does on free
        nxt = chunk[3]
        if nxt is not None and not self._chunks[nxt][1]:
            self._unbin(nxt)
            self._merge(addr, nxt)
        prev = chunk[2]
        if prev is not None and not self._chunks[prev][1]:
            self._unbin(prev)
            self._merge(prev, addr)
            addr = prev
        self._bin_insert(addr)

    def reset_peak(self) -> None:
        self.peak_in_use, self.peak_requested = self.in_use, self.requested

    # ------------------------------------------------------------------ policy
    def _find(self, size: int):
        for b in range(_bin(size), NUM_BINS):
            free = self._bins[b]
            i = bisect.bisect_left(free, (size, -1))
            if i == len(free):
                continue
            csize, addr = free.pop(i)
            # split only into two reasonably large pieces; otherwise the request holds it all
            if csize >= 2 * size or csize - size >= self._max_frag:
                self._split(addr, size)
            return addr
        return None

    def _extend(self, size: int) -> None:
        grew = False
        while size > self._next_region:
            self._next_region *= 2
            grew = True
        region = self._next_region
        if not grew:
            self._next_region *= 2
        addr = self._base
        self._base += region + (1 << 40)
        self._chunks[addr] = [region, False, None, None, 0]
        self.pool_bytes += region
        self._bin_insert(addr)

    def _split(self, addr: int, size: int) -> None:
        chunk = self._chunks[addr]
        rest = addr + size
        self._chunks[rest] = [chunk[0] - size, False, addr, chunk[3], 0]
        if chunk[3] is not None:
            self._chunks[chunk[3]][2] = rest
        chunk[0], chunk[3] = size, rest
        self._bin_insert(rest)

    def _merge(self, addr: int, nxt: int) -> None:
        chunk, other = self._chunks[addr], self._chunks.pop(nxt)
        chunk[0] += other[0]
        chunk[3] = other[3]
        if other[3] is not None:
            self._chunks[other[3]][2] = addr

    def _bin_insert(self, addr: int) -> None:
        bisect.insort(self._bins[_bin(self._chunks[addr][0])], (self._chunks[addr][0], addr))

    def _unbin(self, addr: int) -> None:
        free = self._bins[_bin(self._chunks[addr][0])]
        free.pop(bisect.bisect_left(free, (self._chunks[addr][0], addr)))


def replay(events: Iterable, *, warm_runs: int = 1, model: BFCModel | None = None) -> dict:
    """Replay one step's allocations through :class:`BFCModel`; the peaks it would hold.

    ``events`` is the step's allocations and frees in order: ``(True, key, nbytes)`` allocates,
    ``(False, key, _)`` frees what ``key`` allocated (a free of a key the step did not allocate
    is ignored: memory from before the step). What the step still holds at its end is freed
    before the next run. The step runs ``warm_runs`` times before the one measured, as a step
    is measured after its first call, whose freed chunks are where the measured run's values
    land.

    Returns ``{"requested_peak_bytes", "held_peak_bytes"}`` of the measured run. With a fresh
    model this is what the step's own allocation pattern costs in an otherwise empty pool;
    TensorFlow's measured figure is higher by what earlier allocations left in the pool
    (``tools/bench_rewrite.py`` prints both).
    """
    m = model if model is not None else BFCModel()
    events = list(events)
    out = {}
    for _ in range(warm_runs + 1):
        live = {}
        base_use, base_req = m.in_use, m.requested
        m.reset_peak()
        for alloc, key, nbytes in events:
            if alloc:
                if key in live:  # its free was not recorded: keep the books straight
                    m.free(live.pop(key))
                if nbytes > 0:
                    live[key] = m.allocate(nbytes)
            elif key in live:
                m.free(live.pop(key))
        out = {"requested_peak_bytes": int(m.peak_requested - base_req),
               "held_peak_bytes": int(m.peak_in_use - base_use)}
        for addr in live.values():
            m.free(addr)
    return out
