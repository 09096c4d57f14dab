"""Whole numbers rounded up to the sizes kernels and allocators work in."""
from __future__ import annotations


def power_of_two_at_least(n: int) -> int:
    """The least power of two >= n (1 for n <= 1): a Triton block that holds a row, a page-locked slab's size."""
    return 1 << max(n - 1, 0).bit_length()
