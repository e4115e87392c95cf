"""``resources.host_malloc``: how a Megatron rank's C allocator (glibc's malloc) treats freed memory.

An update allocates and frees the same large tensors in every micro-batch (the vocabulary-wide logits,
their log-softmax and gradient, weight gradients, activations). glibc serves a block above its mmap
threshold (128 KiB, rising with use to at most 32 MiB) with fresh pages and unmaps it on free, and
hands the top of its heap back to the kernel past the trim threshold: the kernel faults those pages in
and zeroes them again at the next allocation. ``keep`` turns mmap off and raises the trim threshold to
1 GiB (``mallopt``), so freed blocks are reused as they are: fewer faults and less system time, at the
price of the freed memory staying resident between phases. What is computed does not change (the
weights after an update are equal to the bit). docs/cpu-profile.md ("Host memory") has the figures.

``resources.host_hugepages``: the kernel faults memory in a page at a time, 4 KB, ~8 us each on the
2-vCPU VMs this was measured on; an update's first steps grow the heap by ~1.2 GB (300-400k faults,
2-3 s of system time per step). torch's CPU allocator, started with ``THP_MEM_ALLOC_ENABLE=1``, aligns
every allocation of 2 MB or more to 2 MB and advises it as transparent huge pages, which the kernel
then faults in 2 MB at a time. torch reads the variable once, at its first allocation (at import), so
it is set in the rank's environment when Ray starts the process (``hugepages_env``), not here.
"""
from __future__ import annotations

import ctypes
import os

from rlcore.validate import HOST_MALLOC_MODES

M_TRIM_THRESHOLD, M_MMAP_MAX = -1, -4  # mallopt's parameters (glibc's malloc.h)
THP_ENV = "THP_MEM_ALLOC_ENABLE"  # torch's (c10/core/alloc_cpu.cpp)
THP_MODE_FILE = "/sys/kernel/mm/transparent_hugepage/enabled"


def hugepages_env(enabled: bool) -> dict[str, str]:
    """The environment a rank's process starts with for ``resources.host_hugepages``."""
    return {THP_ENV: "1"} if enabled else {}


def check_host_hugepages(enabled: bool, mode_file: str = THP_MODE_FILE) -> str | None:
    """In a rank's process, with ``resources.host_hugepages``: refuses a process whose torch did not
    start with the advice on (it cannot be turned on later), and returns a warning when the kernel
    ignores the advice (THP mode ``never``, or no such file: not Linux); None when all is in place."""
    if not enabled:
        return None
    if os.environ.get(THP_ENV) != "1":
        raise RuntimeError(f"resources.host_hugepages=true, but this process started without {THP_ENV}=1 "
                           f"(the rank's Ray runtime_env sets it: megatron_workers/group.py)")
    try:
        with open(mode_file) as f:
            mode = f.read()
    except OSError as e:
        return f"resources.host_hugepages=true, but {mode_file} cannot be read ({e}): 4 KB pages only"
    if "[never]" in mode:
        return (f"resources.host_hugepages=true, but the kernel's transparent huge pages are off ({mode_file}: "
                f"{mode.strip()}): 4 KB pages only; madvise or always turns them on")
    return None


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
