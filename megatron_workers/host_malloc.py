"""``resources.host_malloc``: how a Megatron rank's C allocator (glibc's malloc) treats freed memory.

An update allocates and frees the same large tensors in every micro-batch (the vocabulary-wide logits,
their log-softmax and gradient, weight gradients, activations). glibc serves a block above its mmap
threshold (128 KiB, rising with use to at most 32 MiB) with fresh pages and unmaps it on free, and
hands the top of its heap back to the kernel past the trim threshold: the kernel faults those pages in
and zeroes them again at the next allocation. ``keep`` turns mmap off and raises the trim threshold to
1 GiB (``mallopt``), so freed blocks are reused as they are: fewer faults and less system time, at the
price of the freed memory staying resident between phases. What is computed does not change (the
weights after an update are equal to the bit). docs/cpu-profile.md ("Host memory") has the figures.
"""
from __future__ import annotations

import ctypes

from rlcore.validate import HOST_MALLOC_MODES

M_TRIM_THRESHOLD, M_MMAP_MAX = -1, -4  # mallopt's parameters (glibc's malloc.h)


def use_host_malloc(mode: str) -> None:
    """Sets this process's allocator to ``mode`` ("glibc": leave the defaults)."""
    if mode not in HOST_MALLOC_MODES:
        raise ValueError(f"resources.host_malloc: expected one of {', '.join(HOST_MALLOC_MODES)}, got {mode!r}")
    if mode == "glibc":
        return
    libc = ctypes.CDLL(None)
    if libc.mallopt(M_MMAP_MAX, 0) != 1 or libc.mallopt(M_TRIM_THRESHOLD, 1 << 30) != 1:
        raise RuntimeError("resources.host_malloc=keep: glibc's mallopt refused M_MMAP_MAX=0 / M_TRIM_THRESHOLD=1 GiB "
                           "(is this process's C library glibc?)")
