"""Page-locked host copies of GPU weights: how fast the pack makes them (offload/pinned.py's HostSlab), against
registering freshly allocated memory page by page and against plain pageable copies.

The workload is a LoRA merge's backup of every block Linear of the full-size bf16 DiT (36 blocks x q/k/v, out,
gate/up, fc2: 15.7 GB in 144 tensors): allocate, lock, copy off the GPU; then the restore (copy back).
Usage: python bench/host_memory.py [--blocks 36] [--out DIR]
"""
from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Callable

import torch

from common import import_package, print_environment, table

import_package()
from ernie_image.runtime.offload.pinned import HostSlab  # noqa: E402

SHAPES = [(12288, 4096), (4096, 4096), (24576, 4096), (4096, 12288)]  # fused q/k/v, out, fused gate/up, fc2


def page_by_page(nbytes: int) -> tuple[torch.Tensor, Callable[[], None]]:
    memory = torch.empty(nbytes, dtype=torch.uint8)
    assert int(torch.cuda.cudart().cudaHostRegister(memory.data_ptr(), nbytes, 0)) == 0
    return memory, lambda: torch.cuda.cudart().cudaHostUnregister(memory.data_ptr())


def host_slab(nbytes: int) -> tuple[torch.Tensor, Callable[[], None]]:
    slab = HostSlab(nbytes, pin=True)
    assert slab.pinned_bytes == nbytes
    return slab.data, slab.free


def pageable(nbytes: int) -> tuple[torch.Tensor, Callable[[], None]]:
    return torch.empty(nbytes, dtype=torch.uint8), lambda: None


def measure(name: str, make, sources: list[torch.Tensor], pinned: bool) -> dict:
    total = sum(t.numel() * t.element_size() for t in sources)
    torch.cuda.synchronize()
    started = time.perf_counter()
    copies = []
    for source in sources:
        memory, free = make(source.numel() * source.element_size())
        host = memory.view(source.dtype).view(source.shape)
        host.copy_(source, non_blocking=pinned)
        copies.append((host, free))
    torch.cuda.synchronize()
    made = time.perf_counter() - started
    started = time.perf_counter()
    for source, (host, _) in zip(sources, copies):
        source.copy_(host, non_blocking=pinned)
    torch.cuda.synchronize()
    restored = time.perf_counter() - started
    started = time.perf_counter()
    for _, free in copies:
        free()
    copies.clear()
    freed = time.perf_counter() - started
    return {"way": name, "GB": round(total / 1e9, 2), "make s": round(made, 3), "make GB/s": round(total / made / 1e9, 1),
            "restore s": round(restored, 3), "free s": round(freed, 3)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--blocks", type=int, default=36)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    env = print_environment()
    for path in ("/sys/kernel/mm/transparent_hugepage/enabled",):
        try:
            env["transparent_hugepage"] = Path(path).read_text().strip()
        except OSError:
            env["transparent_hugepage"] = "unknown"
    env["cpu_threads"] = torch.get_num_threads()
    unique = {shape: torch.randn(shape, device="cuda", dtype=torch.bfloat16) for shape in SHAPES}
    sources = [unique[shape] for _ in range(args.blocks) for shape in SHAPES]
    # A virtual machine's first touch of its RAM costs the hypervisor's faults too (whichever way runs first pays
    # them): the first row is the machine's first 15.7 GB, the rows after it compare the ways on touched memory.
    slab_row = "HostSlab (huge pages, faulted in by all threads, then registered)"
    rows = [dict(measure(slab_row, host_slab, sources, True), way=slab_row + ", first in the process"),
            measure("fresh memory registered page by page", page_by_page, sources, True),
            measure(slab_row, host_slab, sources, True),
            measure("pageable memory, blocking copies", pageable, sources, False),
            measure(slab_row, host_slab, sources, True)]
    print(table(rows, list(rows[0])))
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "host_memory.json").write_text(json.dumps({"environment": env, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
