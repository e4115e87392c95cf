"""What the kernel charges for memory a rank touches for the first time, with 4 KB and with huge pages.

    .venv/bin/python -m bench.first_touch [--mb 128,256]

A heap that grows (a batch larger than any before, docs/cpu-profile.md "The updates that still grow
the heap") costs the kernel's first touch of the new pages. Each mode runs in a fresh process, set up
as a Megatron rank is (``resources.host_malloc: keep``; huge pages: torch's ``THP_MEM_ALLOC_ENABLE=1``,
as ``resources.host_hugepages`` starts a rank): it allocates a tensor of each size, writes every byte
(two threads, as the spec's rank), keeps it, and then writes it again (the same pages, now resident).
The table gives both times, the system CPU and minor faults of the first write, and fresh over
resident: ~1 where the first touch costs no more than a write, far above 1 where the kernel (or the
hypervisor under it) works for every new page. The kernel settings that decide it are printed above
the table: the THP mode and defrag, and on a VM the free page reporting order (virtio-balloon hands
every free block of that order back to the host, so a huge page taken later is cold on the host)."""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

SETTINGS = {"THP mode": "/sys/kernel/mm/transparent_hugepage/enabled",
            "THP defrag": "/sys/kernel/mm/transparent_hugepage/defrag",
            "free page reporting order (VM)": "/sys/module/page_reporting/parameters/page_reporting_order"}
MODES = {"4 KB pages": "0", "huge pages": "1"}


def child(sizes_mb: list[int]) -> list[dict]:
    """In a fresh process: per size, the first write of a new tensor and the second write of it."""
    import resource
    import time

    import torch

    from megatron_workers.host_malloc import use_host_malloc

    use_host_malloc("keep")
    torch.set_num_threads(2)
    kept, rows = [], []
    for mb in sizes_mb:
        before, t0 = resource.getrusage(resource.RUSAGE_SELF), time.perf_counter()
        x = torch.empty(mb << 20, dtype=torch.uint8)
        x.fill_(1)
        fresh = time.perf_counter() - t0
        after = resource.getrusage(resource.RUSAGE_SELF)
        t1 = time.perf_counter()
        x.fill_(2)
        resident = time.perf_counter() - t1
        kept.append(x)  # held: the next size must take new pages too
        rows.append({"mb": mb, "fresh_s": fresh, "resident_s": resident, "sys_s": after.ru_stime - before.ru_stime,
                     "faults": after.ru_minflt - before.ru_minflt})
    return rows


def read_setting(path: str) -> str:
    try:
        with open(path) as f:
            return f.read().strip()
    except OSError:
        return "(none)"


def table(results: dict[str, list[dict]]) -> str:
    lines = ["| pages | MB | first write, s | ms per MB | system CPU, s | minor faults | second write, s | first / second |",
             "|---|---:|---:|---:|---:|---:|---:|---:|"]
    for mode, rows in results.items():
        for r in rows:
            ratio = r["fresh_s"] / r["resident_s"] if r["resident_s"] > 0 else float("inf")
            lines.append(f"| {mode} | {r['mb']} | {r['fresh_s']:.3f} | {1000 * r['fresh_s'] / r['mb']:.2f} | "
                         f"{r['sys_s']:.2f} | {r['faults']:,} | {r['resident_s']:.3f} | {ratio:.0f} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--mb", default="128,256", help="comma-separated sizes in MB (default 128,256)")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    try:
        sizes = [int(s) for s in args.mb.split(",")]
    except ValueError:
        parser.error(f"--mb: expected comma-separated whole numbers of MB, got {args.mb!r}")
    if not sizes or min(sizes) < 1:
        parser.error(f"--mb: expected sizes of at least 1 MB, got {args.mb!r}")
    if args.child:
        print(json.dumps(child(sizes)))
        return
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    results = {}
    for mode, thp in MODES.items():
        env = {**os.environ, "THP_MEM_ALLOC_ENABLE": thp,
               "PYTHONPATH": os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH")) if p)}
        proc = subprocess.run([sys.executable, "-m", "bench.first_touch", "--child", "--mb", args.mb], cwd=root,
                              env=env, capture_output=True, text=True)
        if proc.returncode != 0:
            sys.exit(f"bench.first_touch: the {mode} process exited with {proc.returncode}:\n{proc.stderr[-3000:]}")
        results[mode] = json.loads(proc.stdout.strip().splitlines()[-1])
    for name, path in SETTINGS.items():
        print(f"{name}: {read_setting(path)} ({path})")
    print()
    print(table(results))


if __name__ == "__main__":
    main()
