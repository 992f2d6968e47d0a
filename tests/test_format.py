"""The chunk file format: every malformed header or payload is rejected with a reason."""

from __future__ import annotations

import struct

import pytest

from kvstream_backend import format as fmt
from kvstream_backend.io.memory import AlignedBuffer


def _header(digest: bytes, payload: bytes, meta: bytes = b"m") -> bytearray:
    buf = AlignedBuffer(fmt.HEADER_SIZE)
    xxh = fmt.payload_checksum([memoryview(payload)])
    fmt.encode_header(buf.view, digest, len(payload), xxh, meta)
    out = bytearray(buf.view)
    buf.release()
    return out


def test_round_trip() -> None:
    d = fmt.key_digest("model@1@0@abc@bfloat16")
    payload = bytes(range(256)) * 40
    h = fmt.decode_header(_header(d, payload, b"shape"), d, 1 << 20)
    assert (h.payload_len, h.meta) == (len(payload), b"shape")
    fmt.verify_payload(h, [memoryview(payload)])


def test_digest_is_of_the_full_key() -> None:
    assert fmt.key_digest("a@1@0@ff@bfloat16") != fmt.key_digest("a@1@1@ff@bfloat16")
    assert len(fmt.key_digest("x")) == 16


@pytest.mark.parametrize("offset", [0, 8, 12, 16, 32, 40, 48, 56])
def test_any_header_bit_flip_is_rejected(offset: int) -> None:
    d = fmt.key_digest("k")
    hdr = _header(d, b"p" * 100)
    hdr[offset] ^= 0x10
    with pytest.raises(fmt.CorruptChunk):
        fmt.decode_header(hdr, d, 1 << 20)


def test_foreign_key() -> None:
    hdr = _header(fmt.key_digest("k1"), b"p" * 10)
    with pytest.raises(fmt.CorruptChunk) as e:
        fmt.decode_header(hdr, fmt.key_digest("k2"), 1 << 20)
    assert e.value.reason == "foreign-key"


def test_huge_payload_claim_is_rejected_before_allocation() -> None:
    d = fmt.key_digest("k")
    hdr = bytearray(fmt.HEADER_SIZE)
    fmt.encode_header(memoryview(hdr), d, 1 << 50, 0, b"")  # a validly checksummed lie
    with pytest.raises(fmt.CorruptChunk) as e:
        fmt.decode_header(hdr, d, max_payload=16 << 20)
    assert e.value.reason == "oversized"


def test_absurd_meta_len_is_rejected() -> None:
    d = fmt.key_digest("k")
    hdr = _header(d, b"x")
    struct.pack_into("<I", hdr, 12, 1 << 30)
    with pytest.raises(fmt.CorruptChunk) as e:
        fmt.decode_header(hdr, d, 1 << 20)
    assert e.value.reason == "bad-meta-len"


@pytest.mark.parametrize("mutate", ["flip", "truncate", "empty"])
def test_payload_damage(mutate: str) -> None:
    d = fmt.key_digest("k")
    payload = bytearray(b"abcdefgh" * 512)
    h = fmt.decode_header(_header(d, bytes(payload)), d, 1 << 20)
    if mutate == "flip":
        payload[1000] ^= 1
    elif mutate == "truncate":
        payload = payload[:-1]
    else:
        payload = bytearray()
    with pytest.raises(fmt.CorruptChunk):
        fmt.verify_payload(h, [memoryview(payload)])


def test_short_header() -> None:
    with pytest.raises(fmt.CorruptChunk) as e:
        fmt.decode_header(b"", fmt.key_digest("k"), 1)
    assert e.value.reason == "short-header"
