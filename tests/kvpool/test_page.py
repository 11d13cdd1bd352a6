from __future__ import annotations

import zlib

import pytest

from kvshare.kvpool.page import (
    HEADER_BYTES,
    MAX_CHECKSUM_BYTES,
    PAGE_ALIGN,
    PageFormatError,
    PageHeader,
    slot_bytes_for,
)

KEY = bytes(range(16))
PARENT = bytes(range(16, 32))


def make_header(**change: object) -> PageHeader:
    fields: dict[str, object] = {
        "layout_version": 3,
        "key": KEY,
        "parent_key": PARENT,
        "payload_bytes": 5 * 1024 * 1024 + 7,
        "checksum": bytes(range(48)),
    }
    fields.update(change)
    return PageHeader(**fields)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("payload", "slot"),
    [
        (1, HEADER_BYTES + 4096),
        (4096, HEADER_BYTES + 4096),
        (4097, HEADER_BYTES + 8192),
        (16 * 1024 * 1024, HEADER_BYTES + 16 * 1024 * 1024),
    ],
)
def test_slot_bytes_pads_payload_to_page_alignment(payload: int, slot: int) -> None:
    assert slot_bytes_for(payload) == slot
    assert slot % PAGE_ALIGN == 0


def test_slot_bytes_rejects_empty_payload() -> None:
    with pytest.raises(ValueError):
        slot_bytes_for(0)


def test_header_roundtrips_and_fills_exactly_header_bytes() -> None:
    header = make_header()
    packed = header.pack()
    assert len(packed) == HEADER_BYTES
    assert PageHeader.unpack(packed) == header
    assert PageHeader.unpack(memoryview(bytearray(packed) + b"payload")) == header


def test_header_with_largest_checksum_roundtrips() -> None:
    header = make_header(checksum=b"\xab" * MAX_CHECKSUM_BYTES)
    assert PageHeader.unpack(header.pack()) == header


def test_unpack_rejects_bad_magic_and_short_buffers() -> None:
    packed = bytearray(make_header().pack())
    with pytest.raises(PageFormatError):
        PageHeader.unpack(bytes(HEADER_BYTES))  # a zeroed (never written) slot
    packed[0] ^= 0xFF
    with pytest.raises(PageFormatError):
        PageHeader.unpack(packed)
    with pytest.raises(PageFormatError):
        PageHeader.unpack(make_header().pack()[:20])


def test_unpack_rejects_a_checksum_length_past_the_header() -> None:
    packed = bytearray(make_header(checksum=b"x" * 100).pack())
    with pytest.raises(PageFormatError):
        PageHeader.unpack(packed[:80])
    packed[52:54] = (MAX_CHECKSUM_BYTES + 1).to_bytes(2, "big")
    packed[-4:] = zlib.crc32(packed[:-4]).to_bytes(4, "big")  # a well-formed CRC of a bad length
    with pytest.raises(PageFormatError, match="checksum length"):
        PageHeader.unpack(packed)


def test_every_single_flipped_bit_of_a_header_fails_unpack() -> None:
    """Every bit of all HEADER_BYTES, the zero padding and the CRC itself included."""
    packed = bytearray(make_header().pack())
    missed = []
    for bit in range(8 * HEADER_BYTES):
        packed[bit // 8] ^= 1 << bit % 8
        try:
            PageHeader.unpack(packed)
            missed.append(bit)
        except PageFormatError:
            pass
        packed[bit // 8] ^= 1 << bit % 8
    assert missed == []
    assert PageHeader.unpack(packed) == make_header()


@pytest.mark.parametrize(
    "change",
    [
        {"key": b"short"},
        {"parent_key": bytes(17)},
        {"checksum": b"x" * (MAX_CHECKSUM_BYTES + 1)},
        {"layout_version": -1},
        {"payload_bytes": -1},
        {"magic": b"NOTAPAGE"},
    ],
)
def test_header_validation(change: dict[str, object]) -> None:
    with pytest.raises(PageFormatError):
        make_header(**change)
