"""Activation memory of each phase, derived from the shapes the kernels see (bytes, upper estimates).

DiT block, per token of the (CFG-doubled) batch, E = activation bytes:
  the MLP is the peak: the caller's x and the block's x (2E D), the modulated input (E D), then up_proj, gate_proj
  and gelu(gate) alive together, or up, gelu and their product (3E F). With flash/SDPA the attention never
  holds an S x S matrix; its peak (x, h, q, k, v, RoPE temporaries ~ 10E D) stays below the MLP's
  (3E D + 3E F = 12E D at F = 3D). fp32 norm/modulation temporaries (3 x 4 D) are freed before the MLP.
The rest of a step (RoPE tables, modulation, fp32 latents, velocity, final layer) is small next to one block;
it is counted as three more [B, S, D] activations. A step cache (step_cache/) holds six more: two residuals
per call group for the run, and a step's first-pass outputs and residuals of every group between its passes.
A fragmentation margin and, on CUDA, a fixed overhead (cuBLAS workspace, SDPA scratch) are added on top;
bench/offload.py prints estimate against measured peak.
"""
from __future__ import annotations

from dataclasses import dataclass

from ..model.vae_decode import vae_tile
from .sizes import DEQUANT_FORMATS, ModelSizes

FRAGMENTATION = 1.10
CUDA_FIXED_OVERHEAD = 192 * 1024**2
LATENT_DOWNSCALE = 16
VAE_UPSCALE = 8
PE_MAX_TOKENS = 4096  # prompt + rewritten prompt held in the enhancer's KV cache
TEXT_MAX_TOKENS = 2048
STEP_CACHE_ACTIVATIONS = 6  # [B, S, D] tensors a step cache holds at most (module docstring)


@dataclass(frozen=True)
class Job:
    width: int = 1024
    height: int = 1024
    batch: int = 1
    cfg: float = 1.0
    text_tokens: int = 256  # padded text length the DiT sees (the tokenizer truncates at 2048)
    use_pe: bool = False
    encode: bool = False  # an init image goes through the VAE encoder first (img2img, inpainting)
    step_cache: bool = False  # a block-residual step cache holds residuals of the CFG-doubled batch (step_cache/)
    # The blocks a step cache always computes before its decision (its Fn; 0: none). The host waits there for the
    # decision before it queues the next block, so the planner keeps the blocks right after it resident.
    decision_after_blocks: int = 0

    @property
    def dit_batch(self) -> int:
        """Rows the DiT runs at once: CFG puts the unconditional and conditional branches in one batch."""
        return self.batch * (2 if self.cfg > 1.0 else 1)

    @property
    def image_tokens(self) -> int:
        return (self.height // LATENT_DOWNSCALE) * (self.width // LATENT_DOWNSCALE)

    @property
    def sequence(self) -> int:
        return self.image_tokens + self.text_tokens


def _fixed(device_type: str) -> int:
    return CUDA_FIXED_OVERHEAD if device_type == "cuda" else 0


def dit_workspace(sizes: ModelSizes, job: Job, device_type: str = "cuda") -> int:
    e, d, f = sizes.activation_bytes, sizes.dit_hidden, sizes.dit_ffn
    rows = job.dit_batch * job.sequence
    block_peak = rows * e * (3 * d + 3 * f)
    step_rest = rows * e * (3 + (STEP_CACHE_ACTIVATIONS if job.step_cache else 0)) * d
    dequant = 0
    if sizes.dit_format in DEQUANT_FORMATS:
        # one dequantised weight plus the fp32 temporaries of its unpacking
        dequant = sizes.dit.largest_linear_params * (e + 2 * 4)
    return int((block_peak + step_rest + dequant) * FRAGMENTATION) + _fixed(device_type)


def text_workspace(sizes: ModelSizes, device_type: str = "cuda") -> int:
    """One prompt of up to 2048 tokens through the tower, plus its KV cache (transformers keeps one)."""
    e, d, f = sizes.activation_bytes, sizes.text_hidden, sizes.text_ffn
    tokens = TEXT_MAX_TOKENS
    activations = tokens * e * (4 * d + 3 * f)
    kv_cache = 2 * sizes.text_layers * tokens * sizes.text_kv_width * e
    return int((activations + kv_cache) * FRAGMENTATION) + _fixed(device_type)


def pe_workspace(sizes: ModelSizes, device_type: str = "cuda") -> int:
    if sizes.pe is None:
        return 0
    e = sizes.activation_bytes
    kv_cache = 2 * sizes.pe.layers * PE_MAX_TOKENS * sizes.text_kv_width * e
    prefill = TEXT_MAX_TOKENS * e * (4 * sizes.text_hidden + 3 * sizes.text_ffn)
    logits = 4 * sizes.pe.largest_linear_params // sizes.text_hidden * 2  # last-token logits, fp32, sampling copy
    return int((kv_cache + prefill + logits) * FRAGMENTATION) + _fixed(device_type)


def _effective_tile(sizes: ModelSizes, job: Job, tile: int | None) -> int | None:
    """The tile a VAE pass of `job` runs with when asked for `tile` (model/vae_decode.py: a 'whole image' pass over
    a large image tiles by itself at the VAE's sample size)."""
    return vae_tile(tile, job.width * job.height, sizes.vae_sample_size)


def vae_workspace(sizes: ModelSizes, job: Job, tile: int | None, device_type: str = "cuda") -> int:
    """Decoder peak: the last up-block's resnets at full resolution hold ~8 maps of the base channel count.

    Tiled decode bounds the map to one tile (all batch rows at once) plus the output image being assembled.
    """
    e, base = sizes.activation_bytes, sizes.vae_base_channels
    tile = _effective_tile(sizes, job, tile)
    pixels = job.width * job.height if tile is None else tile * tile
    maps = 8 * job.batch * base * pixels * e
    output = 2 * job.batch * 3 * job.width * job.height * 4 if tile is not None else 0
    return int((maps + output) * FRAGMENTATION) + _fixed(device_type)


def vae_encode_workspace(sizes: ModelSizes, job: Job, tile: int | None, device_type: str = "cuda") -> int:
    """Encoder peak: the first down-block's resnets at full resolution hold ~8 maps of the base channel count (as
    the decoder's last up-block), plus the mid-block attention's score matrix over the 1/8-scale grid (one head
    of 512 channels, beyond what flash kernels take: counted as a full fp32 matrix), plus the input pixels.

    Tiled encode bounds the maps and the attention to one tile (all batch rows at once); the whole input stays on
    the device.
    """
    e, base = sizes.activation_bytes, sizes.vae_base_channels
    tile = _effective_tile(sizes, job, tile)
    pixels = job.width * job.height if tile is None else tile * tile
    maps = 8 * job.batch * base * pixels * e
    tokens = pixels // (VAE_UPSCALE * VAE_UPSCALE)
    attention = job.batch * tokens * tokens * 4
    inputs = job.batch * 3 * job.width * job.height * (4 + e)
    return int((maps + attention + inputs) * FRAGMENTATION) + _fixed(device_type)
