from __future__ import annotations

import pytest

from kvshare.sizes import format_size, parse_size


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("0", 0),
        ("4096", 4096),
        ("512B", 512),
        ("1KiB", 1024),
        ("1KB", 1000),
        ("256GiB", 256 * 1024**3),
        ("256GB", 256 * 1000**3),
        ("4 MiB", 4 * 1024**2),
        ("1.5GiB", 3 * 1024**3 // 2),
        ("1.1GB", 1_100_000_000),
        ("2TiB", 2 * 1024**4),
        ("3TB", 3 * 1000**4),
        ("16mib", 16 * 1024**2),
        (" 8 gib ", 8 * 1024**3),
        (123, 123),
    ],
)
def test_parse_size_accepts_units(text: str | int, expected: int) -> None:
    assert parse_size(text) == expected


@pytest.mark.parametrize(
    "text", ["", "GiB", "-1GiB", "1.5", "0.5KiB3", "4 PiB", "4GiBs", "1e3", "0.1B", "abc", "1,024"]
)
def test_parse_size_rejects_garbage(text: str) -> None:
    with pytest.raises(ValueError):
        parse_size(text)


def test_parse_size_rejects_negative_int_and_bool() -> None:
    with pytest.raises(ValueError):
        parse_size(-5)
    with pytest.raises(ValueError):
        parse_size(True)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("size", "expected"),
    [
        (0, "0 B"),
        (1023, "1023 B"),
        (1024, "1 KiB"),
        (1536, "1.50 KiB"),
        (4 * 1024**3, "4 GiB"),
        (3 * 1024**4 // 2, "1.50 TiB"),
    ],
)
def test_format_size(size: int, expected: str) -> None:
    assert format_size(size) == expected


@pytest.mark.parametrize("size", [1, 4096, 1024**3, 5 * 1024**4, 1024**2 * 7])
def test_format_then_parse_roundtrips_whole_units(size: int) -> None:
    assert parse_size(format_size(size).replace(" ", "")) == size


def test_format_size_rejects_negative() -> None:
    with pytest.raises(ValueError):
        format_size(-1)
