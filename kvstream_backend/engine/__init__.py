"""The engine: one completion loop (:mod:`.loop`) that drives the read pool (:mod:`.readpool`)
and the writer (:mod:`.writer`) over the tiers' workers (:mod:`kvstream_backend.tiers`), with the
lookup table (:mod:`.lookups`) as the one owner of pins. Adapters use :class:`Engine` and the
contract in :mod:`kvstream_backend.handles`, nothing else of this package."""

from .core import Alloc, Buffer, ChunkInfo, Engine, ReadHandle, ReadRequest, payload_view

__all__ = ["Alloc", "Buffer", "ChunkInfo", "Engine", "ReadHandle", "ReadRequest", "payload_view"]
