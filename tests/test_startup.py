"""rlcore/startup.py: a role process's imports and build run with automatic collections off; on
leaving, one collection frees what the block left unreachable and the survivors are frozen. Run in a
fresh interpreter: freezing is for the life of a process, and this one is pytest's."""
from __future__ import annotations

import os
import subprocess
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

PAUSED = """
import gc, weakref
from rlcore.startup import collector_paused

class Node:
    pass

def cycle():
    node = Node()
    node.me = node  # unreachable once dropped: only the collector frees it
    return weakref.ref(node)

gc.enable()
frozen_before = gc.get_freeze_count()
with collector_paused():
    assert not gc.isenabled()
    first = cycle()
    kept = [Node() for _ in range(1000)]
    garbage = [cycle() for _ in range(5000)]  # far past the first generation's threshold (700)
    assert first() is not None, "an automatic collection ran inside the block"
assert gc.isenabled()
assert first() is None and all(ref() is None for ref in garbage), "the block's garbage was not collected on leaving"
assert gc.get_freeze_count() >= frozen_before + len(kept)  # the survivors are frozen

gc.disable()
with collector_paused():
    pass
assert not gc.isenabled()  # left off, as it was
print("ok")
"""


def test_collections_wait_for_the_end_of_the_block_which_frees_its_garbage_and_freezes_the_rest():
    proc = subprocess.run([sys.executable, "-c", PAUSED], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0 and proc.stdout.strip() == "ok", proc.stderr[-2000:]
