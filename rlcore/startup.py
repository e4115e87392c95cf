"""Process start-up without the cyclic garbage collector's repeated walks.

Importing vLLM or megatron-core creates hundreds of thousands of objects that live as long as the
process (modules, classes, functions). Each allocation burst past the collector's thresholds starts a
collection, and every few of them one of the older generations: walks over everything created so far
that find nothing to free. Measured on a 2-core box (2026-12-08), with torch and Ray already imported
and frozen: ``import vllm.entrypoints.llm`` took 8.8-9.0 CPU-s with the collector on and 6.4-7.3 off;
megatron-core's model, optimizer, DDP and pipeline modules (a plain import, torch's dynamo with it)
5.0 against 3.4-3.9. Each role process pays that once at start-up, on every job start and every engine
restart.
"""
from __future__ import annotations

import gc
from contextlib import contextmanager


@contextmanager
def collector_paused():
    """Runs the block with automatic collections off (explicit ``gc.collect()`` calls still run),
    then collects once what the block left unreachable, freezes what survives (it is start-up state
    that lives as long as the process, so later collections no longer walk it) and turns collections
    back on if they were on. Objects frozen before the block are not walked by that one collection."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        gc.collect()
        gc.freeze()
        if enabled:
            gc.enable()
