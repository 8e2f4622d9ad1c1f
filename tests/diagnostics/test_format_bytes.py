"""format_bytes (torch_remat._integration): the one byte formatter every report uses."""

import pytest

from torch_remat._integration import format_bytes


@pytest.mark.parametrize(
    "n, text",
    [
        (0, "0 B"),
        (48, "48 B"),
        (1023, "1023 B"),
        (1024, "1.00 KiB"),
        (1536, "1.50 KiB"),
        (1024**2 - 1, "1024.00 KiB"),
        (1024**2, "1.00 MiB"),
        (12 * 1024**2, "12.00 MiB"),
        (int(3.25 * 1024**3), "3.25 GiB"),
        (2048 * 1024**3, "2048.00 GiB"),
        (-2048, "-2.00 KiB"),
    ],
)
def test_format_bytes(n, text):
    assert format_bytes(n) == text
