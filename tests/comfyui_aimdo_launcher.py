"""Start a ComfyUI checkout's main.py with comfy-aimdo's DynamicVRAM allocator hooks in place, the way current
ComfyUI starts itself on NVIDIA cards (its main.py, read 2026-12): `comfy_aimdo.control.init()` before torch is
imported (the library is loaded RTLD_GLOBAL so its cuMemAlloc_v2 / cuMemAllocAsync hooks serve every CUDA
allocation of the process), then, once torch has a device, `comfy_aimdo.control.init_devices(...)`. ComfyUI
v0.8.0 predates DynamicVRAM, so its own models keep the older ModelPatcher; what runs here is the pack's memory
manager under the hooked allocator, with cudaMallocAsync as current ComfyUI selects it on CUDA 13 torch.

    python comfyui_aimdo_launcher.py COMFYUI_DIR [main.py arguments...]

Prints "aimdo: ..." lines saying what was initialised; exits 3 when comfy-aimdo cannot start (no silent fallback).
"""
from __future__ import annotations

import os
import runpy
import sys


def main() -> None:
    if len(sys.argv) < 2 or not os.path.isfile(os.path.join(sys.argv[1], "main.py")):
        sys.exit("usage: comfyui_aimdo_launcher.py COMFYUI_DIR [main.py arguments...]")
    comfy_dir = os.path.abspath(sys.argv[1])
    if "torch" in sys.modules:
        sys.exit("aimdo: torch was imported before comfy-aimdo: its allocation hooks would miss torch's context")
    os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "backend:cudaMallocAsync")
    import comfy_aimdo.control

    if not comfy_aimdo.control.init():
        print("aimdo: comfy_aimdo.control.init() failed", flush=True)
        sys.exit(3)
    import torch

    device = torch.cuda.current_device()
    if not comfy_aimdo.control.init_devices([(device, 0)]):
        print(f"aimdo: init_devices([{device}]) failed", flush=True)
        sys.exit(3)
    print(f"aimdo: DynamicVRAM hooks on cuda:{device}, torch {torch.__version__}, allocator "
          f"{torch.cuda.get_allocator_backend()}", flush=True)
    sys.argv = [os.path.join(comfy_dir, "main.py"), *sys.argv[2:]]
    sys.path.insert(0, comfy_dir)
    os.chdir(comfy_dir)
    runpy.run_path(sys.argv[0], run_name="__main__")


if __name__ == "__main__":
    main()
