"""The pack's LATENT is ComfyUI's FLUX.2 LATENT, checked against ComfyUI's own VAE code (comfy.sd.VAE) on a
full-size random FLUX.2 VAE in BFL names: core VAE Encode gives what the pack's encoder gives, and core VAE Decode
of the pack's latents gives the pack's image. Needs a ComfyUI checkout (ERNIE_COMFYUI_DIR) and its Python
(ERNIE_COMFYUI_PYTHON), as test_comfyui_e2e.py; ComfyUI's code runs in that Python, in a subprocess."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

COMFY_DIR = os.environ.get("ERNIE_COMFYUI_DIR", "")
COMFY_PYTHON = os.environ.get("ERNIE_COMFYUI_PYTHON", sys.executable)
PROBE = Path(__file__).with_name("comfy_vae_probe.py")

pytestmark = [
    pytest.mark.comfyui,
    pytest.mark.slow,
    pytest.mark.skipif(not COMFY_DIR or not (Path(COMFY_DIR) / "comfy" / "sd.py").is_file(),
                       reason="needs a real ComfyUI: set ERNIE_COMFYUI_DIR (and ERNIE_COMFYUI_PYTHON)"),
]


def full_size_vae(folder: Path):
    """The released FLUX.2 VAE configuration with random weights (ComfyUI infers its layout from the file's
    shapes and assumes the released sizes), saved in BFL's names as vae/flux2-vae.safetensors is."""
    from diffusers import AutoencoderKLFlux2

    from ernie_image.runtime.demo.comfy_files import save_comfy_layout  # noqa: F401  (the writer's module)
    from ernie_image.runtime.formats.config_json import load_config
    from ernie_image.runtime.formats.vae_keys import to_bfl_state_dict

    config = {k: v for k, v in load_config("turbo", "vae").items() if not k.startswith("_") and k != "force_upcast"}
    torch.manual_seed(0)
    vae = AutoencoderKLFlux2.from_config(config).eval()
    with torch.no_grad():
        vae.bn.running_mean.normal_(0.0, 0.3)
        vae.bn.running_var.uniform_(0.5, 2.0)
    path = folder / "flux2-vae.safetensors"
    state = to_bfl_state_dict({k: v.contiguous() for k, v in vae.state_dict().items()},
                              len(config["block_out_channels"]))
    save_file(state, str(path))
    return path


def test_core_vae_encode_and_decode_speak_the_packs_latent(tmp_path):
    from ernie_image.runtime.formats import open_component
    from ernie_image.runtime.model.builders import build_vae
    from ernie_image.runtime.model.vae_decode import decode_images
    from ernie_image.runtime.model.vae_encode import encode_images

    path = full_size_vae(tmp_path)
    component = open_component(path, "vae")
    encoder = build_vae(component, torch.device("cpu"), torch.float32, part="encoder")
    decoder = build_vae(component, torch.device("cpu"), torch.float32)
    pixels = torch.rand((1, 256, 256, 3), generator=torch.Generator().manual_seed(1))
    ours = encode_images(pixels, encoder)
    latents = torch.randn((1, 128, 16, 16), generator=torch.Generator().manual_seed(2))
    save_file({"pixels": pixels, "latents": latents}, str(tmp_path / "in.safetensors"))
    subprocess.run([COMFY_PYTHON, str(PROBE), COMFY_DIR, str(path), str(tmp_path / "in.safetensors"),
                    str(tmp_path / "out.safetensors")], check=True, timeout=600)
    theirs = load_file(str(tmp_path / "out.safetensors"))
    assert torch.equal(theirs["flux2_process_in"], latents)  # latent_formats.Flux2: the LATENT is used as it is
    assert theirs["encoded"].shape == ours.shape == (1, 128, 16, 16)  # normalised, patchified, [B, 128, H/16, W/16]
    # The same normalisation up to the BatchNorm epsilon: ComfyUI's 1e-4 against diffusers' (and the pack's) 1e-5.
    assert float(theirs["bn_eps"]) == pytest.approx(1e-4)
    assert (theirs["encoded"] - ours).abs().max().item() < 1e-3
    assert (theirs["decoded"] - decode_images(latents, decoder)).abs().max().item() < 1e-3
