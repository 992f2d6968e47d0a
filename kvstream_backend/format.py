"""The on-disk chunk file format (version 1).

A chunk file is one aligned header block followed by the payload at offset ``HEADER_SIZE``::

    0   magic        8s   b"KVSTRM\\x00\\x01"
    8   version      u16  FORMAT_VERSION
    10  flags        u16  0 (reserved)
    12  meta_len     u32  length of the opaque metadata (dtype/shape/format, set by the adapter)
    16  key_digest   16s  xxh3-128 of the full key string
    32  payload_len  u64  payload bytes (the file is HEADER_SIZE + padded(payload_len) long)
    40  payload_xxh  u64  xxh3-64 of the payload
    48  header_xxh   u64  xxh3-64 of bytes [0, 48) and the metadata
    56  meta         meta_len bytes
    ... zero padding to HEADER_SIZE

Invariants: a header is accepted only if every field is consistent (magic, version, bounded
``meta_len``, its own checksum, the expected key digest, ``payload_len`` within the caller's
bound); the payload is accepted only if its checksum matches. Anything else raises
:class:`CorruptChunk`, which callers turn into a miss; no field is trusted before it is checked,
so a hostile header cannot make the reader allocate more than the caller's bound.
"""

from __future__ import annotations

import struct
from collections.abc import Sequence

import xxhash

HEADER_SIZE = 4096
ALIGN = 4096
MAGIC = b"KVSTRM\x00\x01"
FORMAT_VERSION = 1
_FIXED = struct.Struct("<8sHHI16sQQ")  # magic..payload_xxh: 48 bytes
_HXXH = struct.Struct("<Q")
MAX_META = HEADER_SIZE - _FIXED.size - _HXXH.size


class CorruptChunk(Exception):
    """A chunk file failed validation; ``reason`` is a short machine-friendly tag."""

    def __init__(self, reason: str, detail: str = "") -> None:
        super().__init__(f"{reason}: {detail}" if detail else reason)
        self.reason = reason


def key_digest(key: str) -> bytes:
    """The 16-byte digest that names a key on disk (xxh3-128 of its UTF-8 string)."""
    return xxhash.xxh3_128_digest(key.encode())


def padded(n: int) -> int:
    """``n`` rounded up to the O_DIRECT alignment."""
    return (n + ALIGN - 1) & ~(ALIGN - 1)


def file_size(payload_len: int) -> int:
    return HEADER_SIZE + padded(payload_len)


def payload_checksum(parts: Sequence[memoryview]) -> int:
    """xxh3-64 of the payload held by ``parts``, in order (one part, or a scattered buffer's
    pieces: the same digest as of their concatenation)."""
    if len(parts) == 1:
        return xxhash.xxh3_64_intdigest(parts[0])
    h = xxhash.xxh3_64()
    for part in parts:
        h.update(part)
    return h.intdigest()


def encode_header(
    out: memoryview, digest: bytes, payload_len: int, payload_xxh: int, meta: bytes
) -> None:
    """Write a complete header into ``out`` (``HEADER_SIZE`` writable bytes)."""
    if len(meta) > MAX_META:
        raise ValueError(f"chunk metadata too large ({len(meta)} > {MAX_META} bytes)")
    fixed = _FIXED.pack(MAGIC, FORMAT_VERSION, 0, len(meta), digest, payload_len, payload_xxh)
    hxxh = xxhash.xxh3_64_intdigest(fixed + meta)
    end = _FIXED.size + _HXXH.size + len(meta)
    out[: _FIXED.size] = fixed
    out[_FIXED.size : _FIXED.size + _HXXH.size] = _HXXH.pack(hxxh)
    out[_FIXED.size + _HXXH.size : end] = meta
    out[end:HEADER_SIZE] = bytes(HEADER_SIZE - end)


class Header:
    """A validated header. ``meta`` is the adapter's opaque metadata."""

    __slots__ = ("payload_len", "payload_xxh", "meta")

    def __init__(self, payload_len: int, payload_xxh: int, meta: bytes) -> None:
        self.payload_len = payload_len
        self.payload_xxh = payload_xxh
        self.meta = meta


def decode_header(buf: memoryview | bytes, digest: bytes, max_payload: int) -> Header:
    """Validate ``buf`` (at least ``HEADER_SIZE`` bytes) as the header of ``digest``'s file."""
    if len(buf) < HEADER_SIZE:
        raise CorruptChunk("short-header", f"{len(buf)} bytes")
    magic, version, _flags, meta_len, got_digest, payload_len, payload_xxh = _FIXED.unpack_from(
        buf, 0
    )
    if magic != MAGIC:
        raise CorruptChunk("bad-magic")
    if version != FORMAT_VERSION:
        raise CorruptChunk("bad-version", str(version))
    if meta_len > MAX_META:
        raise CorruptChunk("bad-meta-len", str(meta_len))
    meta_off = _FIXED.size + _HXXH.size
    meta = bytes(buf[meta_off : meta_off + meta_len])
    (hxxh,) = _HXXH.unpack_from(buf, _FIXED.size)
    if hxxh != xxhash.xxh3_64_intdigest(bytes(buf[: _FIXED.size]) + meta):
        raise CorruptChunk("bad-header-checksum")
    if got_digest != digest:
        raise CorruptChunk("foreign-key")
    if payload_len > max_payload:
        raise CorruptChunk("oversized", f"{payload_len} > {max_payload}")
    return Header(payload_len, payload_xxh, meta)


def verify_payload(header: Header, parts: Sequence[memoryview]) -> None:
    """Raise :class:`CorruptChunk` unless ``parts`` hold exactly the bytes ``header``
    describes."""
    n = sum(len(p) for p in parts)
    if n != header.payload_len:
        raise CorruptChunk("truncated", f"{n} of {header.payload_len} bytes")
    verify_checksum(header, payload_checksum(parts))


def verify_checksum(header: Header, payload_xxh: int) -> None:
    """Raise :class:`CorruptChunk` unless ``payload_xxh`` (the xxh3-64 of ``payload_len``
    bytes, taken as they were read) is the header's."""
    if payload_xxh != header.payload_xxh:
        raise CorruptChunk("bad-payload-checksum")
