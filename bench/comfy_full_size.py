"""Full-size random ERNIE-Image weights written as the Comfy-Org single files ComfyUI users have, into a ComfyUI
models/ folder, under the file names the example workflows expect:

    diffusion_models/ernie-image-turbo.safetensors      the DiT (bf16, `model.diffusion_model.` names)
    diffusion_models/ernie-image.safetensors            the same file (a hard link): its metadata says Turbo, so
                                                        a run of it as Base sets the Loader's variant to base
    diffusion_models/ernie-image-turbo-UD-Q4_K_M.gguf   that DiT in GGUF Q4_K blocks (quantised on the GPU)
    text_encoders/ministral-3-3b.safetensors             Ministral-3B text model, lm_head, embedded Tekken tokenizer
    text_encoders/ernie-image-prompt-enhancer.safetensors  the PE (Ministral3ForCausalLM, head tied)
    vae/flux2-vae.safetensors                            the FLUX.2 VAE, BFL names

    python bench/comfy_full_size.py MODELS_DIR      (needs CUDA; ~40 GB of files)

Random weights from bench/e2e.py and bench/enhancer.py's builders; written by the pack's own Comfy-layout writer
(runtime/demo/comfy_files.py) with the tiny byte-level Tekken tokenizer (the vocabulary is the full 131072).
"""
from __future__ import annotations

import dataclasses
import json
import os
import shutil
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import import_package  # noqa: E402

import_package()

from ernie_image.runtime.demo.comfy_files import save_comfy_layout  # noqa: E402
from ernie_image.runtime.quant.qweight import QuantizedWeight  # noqa: E402
from ernie_image.runtime.cli.quantize import read_bf16_dit  # noqa: E402
from ernie_image.runtime.quant.writer import quantize_state_dict, write_quantized_file  # noqa: E402

NAMES = {
    "dit": "diffusion_models/ernie-image-turbo.safetensors",
    "base_dit": "diffusion_models/ernie-image.safetensors",
    "gguf": "diffusion_models/ernie-image-turbo-UD-Q4_K_M.gguf",
    "text_encoder": "text_encoders/ministral-3-3b.safetensors",
    "pe": "text_encoders/ernie-image-prompt-enhancer.safetensors",
    "vae": "vae/flux2-vae.safetensors",
}


def write_models(models: Path) -> dict[str, str]:
    from e2e import build_components
    from enhancer import full_size_pe

    started = time.perf_counter()
    _, diffusers_dit, text_encoder, _, vae, _ = build_components()  # diffusers' DiT: the released key names
    pe, _ = full_size_pe(torch.device("cuda"))
    scratch = models / ".written"
    sources = save_comfy_layout(scratch, "turbo", diffusers_dit, text_encoder, vae, pe)
    del diffusers_dit, text_encoder, vae, pe
    torch.cuda.empty_cache()
    written = {"dit": sources.dit, "text_encoder": sources.text_encoder, "vae": sources.vae, "pe": sources.pe}
    paths = {}
    for key, source in written.items():
        target = models / NAMES[key]
        target.parent.mkdir(parents=True, exist_ok=True)
        os.replace(source, target)
        paths[key] = str(target)
    base = models / NAMES["base_dit"]
    base.unlink(missing_ok=True)
    os.link(models / NAMES["dit"], base)  # not a second 15 GB file; the metadata it shares says Turbo
    paths["base_dit"] = str(base)
    state = {name: tensor.cuda() for name, tensor in read_bf16_dit(models / NAMES["dit"]).items()}
    packed = quantize_state_dict(state, "q4_k")  # on the GPU: minutes faster than on the host
    on_host = {name: dataclasses.replace(entry, data=entry.data.cpu()) if isinstance(entry, QuantizedWeight)
               else entry.cpu() for name, entry in packed.items()}
    del packed, state
    gguf = models / NAMES["gguf"]
    write_quantized_file(on_host, "q4_k", gguf, overwrite=True)
    paths["gguf"] = str(gguf)
    shutil.rmtree(scratch, ignore_errors=True)
    paths["seconds"] = f"{time.perf_counter() - started:.1f}"
    return paths


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit("usage: python bench/comfy_full_size.py MODELS_DIR")
    print(json.dumps(write_models(Path(sys.argv[1]))))
