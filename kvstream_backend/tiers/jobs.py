"""The jobs a tier worker runs: one read, one copy written, one copy re-made. A job is created
by the completion loop, owned by the tier's worker (and its file and verify threads, one at a
time) until it is delivered back, then by the loop again; it carries its outcome (``errno``,
``reason``, ``moved``) and never a lock.
"""

from __future__ import annotations

from .. import format as fmt
from ..handles import Buffer, ReadHandle, Segment
from ..io.memory import AlignedBuffer


class ReadJob:
    """One read of one chunk copy from one tier (a primary read or a hedge)."""

    __slots__ = ("tier", "rid", "handle", "buf", "primary", "hdr", "errno", "reason", "moved",
                 "t_start", "bounce", "payload_xxh")

    def __init__(self, tier: int, rid: int, handle: ReadHandle, buf: Buffer, primary: bool,
                 hdr: tuple[int, memoryview], t_start: float) -> None:
        self.tier = tier
        self.rid = rid
        self.handle = handle
        self.buf = buf
        self.primary = primary  # ``buf`` is the handle's own buffer (else a hedge's)
        self.hdr = hdr  # a header slot owned by the loop's slab pool
        self.errno = 0
        self.reason = ""  # a corruption tag ("bad-payload-checksum", ...) if the copy is bad
        self.moved = 0
        self.t_start = t_start
        self.bounce: AlignedBuffer | None = None  # read here, then copied into ``buf``
        self.payload_xxh: int | None = None  # the payload's checksum, taken as it was read

    @property
    def ok(self) -> bool:
        return not self.errno and not self.reason


class WriteJob:
    """One tier's copy of one staged chunk: reserve, write a temp file, publish it."""

    __slots__ = ("tier", "chunk", "digest", "hdr_addr", "segs", "size", "header",
                 "errno", "reason", "moved", "published", "bounce")

    def __init__(self, tier: int, chunk: object, digest: bytes, hdr_addr: int,
                 segs: list[Segment], header: fmt.Header) -> None:
        self.tier = tier
        self.chunk = chunk  # the writer's per-chunk record
        self.digest = digest
        self.hdr_addr = hdr_addr
        self.segs = segs  # the payload's memory (padded when the buffer allows)
        self.size = fmt.file_size(header.payload_len)
        self.header = header
        self.errno = 0
        self.reason = ""  # "capacity" when the tier could not make room
        self.moved = 0
        self.published = False  # this call published the file (False: another writer won)
        self.bounce: AlignedBuffer | None = None  # an aligned copy of the payload, if needed

    @property
    def ok(self) -> bool:
        return not self.errno and not self.reason


class RepairJob:
    """Copy a published chunk file from another tier to this one (re-replication)."""

    __slots__ = ("tier", "digest", "src_path", "errno", "reason", "moved")

    def __init__(self, tier: int, digest: bytes, src_path: str) -> None:
        self.tier = tier
        self.digest = digest
        self.src_path = src_path
        self.errno = 0
        self.reason = ""  # "capacity", or "source-gone" when the source copy vanished
        self.moved = 0

    @property
    def ok(self) -> bool:
        return not self.errno and not self.reason


Job = ReadJob | WriteJob | RepairJob
