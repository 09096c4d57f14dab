"""What the fused-kernel seam decides without a GPU: the rotation matrices it hands comfy-kitchen's split-half
kernel rotate like the DiT's own RoPE tables, and off CUDA (or without the package) nothing changes."""
from __future__ import annotations

import torch

from ernie_image.runtime.model import fused_kernels
from ernie_image.runtime.model.dit import RopeTables, _axis_angles, _positions
from reference_models import DIT_CONFIG


def rotate_with_matrices(x: torch.Tensor, rotation: torch.Tensor) -> torch.Tensor:
    """The kernel's definition: pair i = (x[i], x[i + hd/2]) times rotation[..., i, :, :]."""
    first, second = x.chunk(2, dim=-1)
    pairs = torch.stack((first, second), dim=-1)  # [..., hd/2, 2]
    turned = torch.einsum("...ij,...j->...i", rotation, pairs)
    return torch.cat((turned[..., 0], turned[..., 1]), dim=-1)


def test_the_kernels_rotation_matrices_rotate_like_the_dits_rope_tables_to_fp32_rounding():
    positions = _positions((6, 5), [7, 4], 7, "cpu")
    tables = RopeTables(positions, DIT_CONFIG, torch.float32)
    axes = torch.cat([_axis_angles(positions[..., axis], dim, DIT_CONFIG.rope_theta)
                      for axis, dim in enumerate(DIT_CONFIG.rope_axes_dim)], dim=-1)
    angles = torch.stack([axes, axes], dim=-1).flatten(-2).unsqueeze(2)  # per element, as RopeTables builds them
    rotation = fused_kernels.rope_matrices(angles)
    assert rotation.shape == (2, 37, 1, DIT_CONFIG.head_dim // 2, 2, 2) and rotation.dtype == torch.float32
    x = torch.randn(2, 37, DIT_CONFIG.num_attention_heads, DIT_CONFIG.head_dim, generator=torch.Generator().manual_seed(0))
    assert torch.allclose(rotate_with_matrices(x, rotation), tables.apply(x), atol=1e-5)


def test_off_cuda_the_tables_carry_no_rotation_and_no_kernel_serves():
    tables = RopeTables(_positions((4, 4), [3], 3, "cpu"), DIT_CONFIG, torch.bfloat16)
    assert tables.rotation is None
    assert not fused_kernels.rope_serves(torch.zeros(2, dtype=torch.bfloat16))
    assert not fused_kernels.adaln_serves(torch.zeros(2, dtype=torch.bfloat16))
    assert not fused_kernels.rope_serves(torch.zeros(2, dtype=torch.bfloat16), head_dim=48)
