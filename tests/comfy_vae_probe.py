"""Run inside ComfyUI's Python (a subprocess of test_image_in_comfy_latent.py): ComfyUI's own VAE (comfy.sd.VAE)
on a FLUX.2 VAE file, VAE Encode of the given pixels and VAE Decode of the given latents, written back.

    python comfy_vae_probe.py COMFYUI_DIR VAE_FILE INPUT.safetensors OUTPUT.safetensors
"""
import sys

comfy_dir, vae_file, inputs, outputs = sys.argv[1:5]
sys.argv = [sys.argv[0], "--cpu"]  # comfy.cli_args parses the command line when imported
sys.path.insert(0, comfy_dir)

import comfy.options  # noqa: E402

comfy.options.enable_args_parsing()  # as main.py does: --cpu takes effect

import torch  # noqa: E402
from safetensors.torch import load_file, save_file  # noqa: E402

import comfy.sd  # noqa: E402
import comfy.latent_formats  # noqa: E402

given = load_file(inputs)
vae = comfy.sd.VAE(sd=load_file(vae_file))
with torch.no_grad():
    encoded = vae.encode(given["pixels"])  # what core VAE Encode returns as LATENT["samples"]
    decoded = vae.decode(given["latents"])  # what core VAE Decode does with a LATENT["samples"]
process_in = comfy.latent_formats.Flux2().process_in(given["latents"])
save_file({"encoded": encoded.float().contiguous(), "decoded": decoded.float().contiguous(),
           "flux2_process_in": process_in.contiguous(),
           "bn_eps": torch.tensor(vae.first_stage_model.bn.eps)}, outputs)
