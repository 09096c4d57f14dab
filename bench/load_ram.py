"""Peak host RAM while loading a component, against the component's size.

Writes a synthetic DiT at the released width (hidden 4096, FFN 12288, 128 latent channels, 3072-wide text input)
with a few layers (default 3: ~1.6 GB in bf16), then, in a fresh process, loads it with the runtime's loader
(open_component + build_dit) and reads the kernel's peak resident set (VmHWM, which counts mapped file pages
too). Prints the ratio (peak RSS - RSS before the load) / bytes of the loaded weights, right after the load and
after every weight has been read once (as a first forward pass would). Target: <= 1.3.

    python bench/load_ram.py                      # CPU, bf16 (file dtype: weights used in place)
    python bench/load_ram.py --dtype fp32         # CPU, converted to fp32 (ratio against the fp32 weights)
    python bench/load_ram.py --device cuda        # GPU: host RAM while streaming the file to the device
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HIDDEN, FFN, LATENT, TEXT = 4096, 12288, 128, 3072


def dit_shapes(layers: int) -> dict[str, tuple[int, ...]]:
    shapes = {
        "x_embedder.proj.weight": (HIDDEN, LATENT, 1, 1), "x_embedder.proj.bias": (HIDDEN,),
        "text_proj.weight": (HIDDEN, TEXT),
        "time_embedding.linear_1.weight": (HIDDEN, HIDDEN), "time_embedding.linear_1.bias": (HIDDEN,),
        "time_embedding.linear_2.weight": (HIDDEN, HIDDEN), "time_embedding.linear_2.bias": (HIDDEN,),
        "adaLN_modulation.1.weight": (6 * HIDDEN, HIDDEN), "adaLN_modulation.1.bias": (6 * HIDDEN,),
        "final_norm.linear.weight": (2 * HIDDEN, HIDDEN), "final_norm.linear.bias": (2 * HIDDEN,),
        "final_linear.weight": (LATENT, HIDDEN), "final_linear.bias": (LATENT,),
    }
    for i in range(layers):
        p = f"layers.{i}."
        shapes.update({
            p + "adaLN_sa_ln.weight": (HIDDEN,), p + "adaLN_mlp_ln.weight": (HIDDEN,),
            p + "self_attention.to_q.weight": (HIDDEN, HIDDEN), p + "self_attention.to_k.weight": (HIDDEN, HIDDEN),
            p + "self_attention.to_v.weight": (HIDDEN, HIDDEN), p + "self_attention.to_out.0.weight": (HIDDEN, HIDDEN),
            p + "self_attention.norm_q.weight": (128,), p + "self_attention.norm_k.weight": (128,),
            p + "mlp.gate_proj.weight": (FFN, HIDDEN), p + "mlp.up_proj.weight": (FFN, HIDDEN),
            p + "mlp.linear_fc2.weight": (HIDDEN, FFN),
        })
    return shapes


def write_synthetic_dit(path: Path, layers: int, prefix: str = "model.diffusion_model.") -> int:
    """Stream a bf16 safetensors file tensor by tensor (never the whole model in memory). Returns data bytes."""
    import torch

    shapes = dit_shapes(layers)
    header, offset = {}, 0
    for key, shape in shapes.items():
        size = 2
        for dim in shape:
            size *= dim
        header[prefix + key] = {"dtype": "BF16", "shape": list(shape), "data_offsets": [offset, offset + size]}
        offset += size
    raw = json.dumps(header).encode()
    raw += b" " * (-len(raw) % 8)
    generator = torch.Generator().manual_seed(0)
    with open(path, "wb") as handle:
        handle.write(len(raw).to_bytes(8, "little") + raw)
        for shape in shapes.values():
            tensor = (torch.randn(shape, generator=generator) * 0.02).to(torch.bfloat16)
            handle.write(tensor.view(torch.int16).numpy().tobytes())
    return offset


def _status(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"{field} not in /proc/self/status")


def measure(path: Path, device: str, dtype_name: str) -> dict:
    import torch
    from common import import_package  # bench/ is on sys.path: this script runs from there

    import_package()

    from ernie_image.runtime.formats import open_component
    from ernie_image.runtime.model.builders import build_dit

    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[dtype_name]
    Path("/proc/self/clear_refs").write_text("5")  # reset VmHWM to the current RSS
    before = _status("VmRSS")
    started = time.perf_counter()
    model = build_dit(open_component(path, "dit"), torch.device(device), dtype)
    if device.startswith("cuda"):
        torch.cuda.synchronize()
    loaded_s = time.perf_counter() - started
    peak_loaded = _status("VmHWM")
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    checksum = sum(float(p.float().sum()) for p in model.parameters())  # read every weight once
    peak_touched = _status("VmHWM")
    return {
        "file_bytes": path.stat().st_size, "weights_bytes": weights, "load_s": round(loaded_s, 2),
        "ratio_after_load": round((peak_loaded - before) / weights, 3),
        "ratio_after_reading_all": round((peak_touched - before) / weights, 3),
        "finite": checksum == checksum,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", type=int, default=3)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="bf16", choices=["bf16", "fp16", "fp32"])
    parser.add_argument("--measure", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.measure is not None:
        print(json.dumps(measure(args.measure, args.device, args.dtype)))
        return
    with tempfile.TemporaryDirectory(prefix="ernie-load-ram-") as folder:
        path = Path(folder) / "synthetic-ernie-dit.safetensors"
        data_bytes = write_synthetic_dit(path, args.layers)
        print(f"synthetic DiT: {args.layers} layers at the released width, {data_bytes / 1e9:.2f} GB bf16")
        result = subprocess.run(
            [sys.executable, __file__, "--measure", str(path), "--device", args.device, "--dtype", args.dtype],
            check=True, capture_output=True, text=True,
        )
        facts = json.loads(result.stdout.strip().splitlines()[-1])
    print(f"load to {args.device} in {args.dtype}: {facts['load_s']} s, weights {facts['weights_bytes'] / 1e9:.2f} GB")
    print(f"peak host RSS / weights: {facts['ratio_after_load']:.3f}x right after the load, "
          f"{facts['ratio_after_reading_all']:.3f}x after reading every weight once (target <= 1.3)")
    sys.exit(0 if facts["ratio_after_reading_all"] <= 1.3 and facts["finite"] else 1)


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    main()
