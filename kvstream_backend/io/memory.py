"""Page-aligned memory for O_DIRECT, addressed as ``(address, length)`` segments.

The ``liburing`` binding (2026.3.30) takes a buffer export from every object placed in an
``Iovec`` and never releases it, so each op would leak its exporter and pin its memory. We
therefore hand the binding only non-owning exporters (ctypes arrays over an address), cached per
``(address, length)``: the set of distinct segments is bounded by the buffer slots in use
(LMCache's pool, our header slabs), so the binding's leak is bounded too.
"""

from __future__ import annotations

import ctypes
import mmap

from ..format import ALIGN

Segment = tuple[int, int]  # (address, length)

_EXPORTERS: dict[Segment, memoryview] = {}
_EXPORTER_CAP = 1 << 16


def exporter(seg: Segment) -> memoryview:
    """A writable memoryview over ``seg`` that does not own the memory (see module doc)."""
    mv = _EXPORTERS.get(seg)
    if mv is None:
        if len(_EXPORTERS) >= _EXPORTER_CAP:
            _EXPORTERS.clear()
        mv = memoryview((ctypes.c_ubyte * seg[1]).from_address(seg[0])).cast("B")
        _EXPORTERS[seg] = mv
    return mv


def address_of(buf: mmap.mmap) -> int:
    """Base address of an mmap (the temporary ctypes export is dropped immediately)."""
    return ctypes.addressof(ctypes.c_char.from_buffer(buf))


class AlignedBuffer:
    """A page-aligned, zero-initialised buffer of at least ``size`` bytes.

    This is the buffer type used outside LMCache (tests, bench): ``addr``/``capacity`` for the
    I/O layer, ``view`` for Python access. Valid until :meth:`release`.
    """

    __slots__ = ("_map", "view", "addr", "capacity", "size")

    def __init__(self, size: int) -> None:
        self.size = size
        self.capacity = max(ALIGN, (size + ALIGN - 1) & ~(ALIGN - 1))
        self._map = mmap.mmap(-1, self.capacity)
        self.addr = address_of(self._map)
        self.view = memoryview(self._map)

    def release(self) -> None:
        self.view.release()
        self._map.close()


class SlabPool:
    """A free list of ``ALIGN``-byte aligned slots carved from large mmaps (chunk headers).

    Slots are ``(address, view)``; the pool keeps its mmaps for its whole life, so addresses
    repeat and the exporter cache stays small. Not thread-safe: owned by the completion loop.
    """

    def __init__(self, slots_per_slab: int = 64) -> None:
        self._per = slots_per_slab
        self._maps: list[mmap.mmap] = []
        self._free: list[tuple[int, memoryview]] = []

    def get(self) -> tuple[int, memoryview]:
        if not self._free:
            m = mmap.mmap(-1, self._per * ALIGN)
            self._maps.append(m)
            base, mv = address_of(m), memoryview(m)
            self._free.extend(
                (base + i * ALIGN, mv[i * ALIGN : (i + 1) * ALIGN]) for i in range(self._per)
            )
        return self._free.pop()

    def put(self, slot: tuple[int, memoryview]) -> None:
        self._free.append(slot)
