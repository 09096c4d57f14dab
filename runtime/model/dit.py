"""The ERNIE-Image diffusion transformer, owned by the runtime.

Parameter names are diffusers' (`ErnieImageTransformer2DModel`), so every weight file in diffusers key space
loads with `load_state_dict`. The maths is the reference's; what differs is how it is scheduled:

- the shared AdaLN modulation is broadcast as [B, 1, D] instead of being materialised six times as [S, B, D],
  and its `1 + scale` terms are formed once per step, not in every block;
- the attention mask is dropped when no text key is padded, which lets SDPA pick its flash kernel;
- RoPE tables are cached per (image grid, text lengths);
- the text's projection can be made once for a run (`project_text`, the sampler does) instead of every step;
- the block loop goes through `block_runner`, the hook the offloader uses to stream weights in;
- a block hands its adaLN output to the projections it feeds as the factors it is made of (adaln.py's
  NormModulated), and the MLP its gelu(gate) * up (layer_inputs.py's GeluGated): FP8 projections make their e4m3
  input from them in one kernel, the MLP's input adding the attention's gated residual there too; every other
  layer gets the tensor;
- uncompiled, the casts around the fp32 modulation are folded into the arithmetic kernels (`out=` a bf16 tensor:
  the kernel computes in fp32 and rounds once on store, exactly as `.float()` ... `.to(bf16)` does), which halves
  the memory traffic of everything between the GEMMs with bit-identical results; compiled blocks keep the plain
  expressions, which inductor fuses itself;
- uncompiled on CUDA with the "fast" arithmetic (the default, arithmetic.py), a block's elementwise work takes
  fewer and faster passes: every operand of the large kernels stays in the activations' dtype (PyTorch's
  mixed-dtype kernels take a casting path about three times slower), using the bf16 modulation values whose fp32
  forms the reference uses (exact), the norms' weights go into their norm kernel or the RoPE tables (a block's
  q and k norm weights laid side by side once, then kept until they are edited or replaced),
  gated residuals are one `addcmul`, and q and k are normalised and rotated together. The roundings differ from the
  reference's in places, so the results differ in last bits (the tests' GPU bound), not bit for bit; the CPU and
  the "exact" arithmetic keep the bit-identical forms. Where comfy-kitchen is installed, its CUDA kernels do q/k
  RMSNorm + RoPE and each adaLN RMSNorm + modulation in one pass each (fused_kernels.py).

The arithmetic is chosen once per model (ErnieDiT(config, arithmetic=...)) and reaches every block through the
step's context.
"""
from __future__ import annotations

import copy
import math
from dataclasses import dataclass
from typing import Callable, Optional

import torch
import torch.nn.functional as F
from torch import nn
from torch.multiprocessing.reductions import StorageWeakRef

from ..core.errors import shown_shortly
from . import fused_kernels
from .adaln import FAST, NormModulated, Residual, RMSNorm, gated_residual
from .arithmetic import Arithmetic, ArithmeticName
from .layer_inputs import GeluGated


@dataclass(frozen=True)
class DiTConfig:
    hidden_size: int = 4096
    num_attention_heads: int = 32
    num_layers: int = 36
    ffn_hidden_size: int = 12288
    in_channels: int = 128
    out_channels: int = 128
    patch_size: int = 1
    text_in_dim: int = 3072
    rope_theta: int = 256
    rope_axes_dim: tuple[int, int, int] = (32, 48, 48)
    eps: float = 1e-6
    qk_layernorm: bool = True

    @classmethod
    def from_dict(cls, raw: dict) -> "DiTConfig":
        """The config a dict (config.json) describes; ValueError or TypeError for one ERNIE-Image cannot run (the
        caller names the file: formats.config_json.config_named)."""
        known = {name: raw[name] for name in cls.__dataclass_fields__ if name in raw}
        if "rope_axes_dim" in known:
            known["rope_axes_dim"] = tuple(known["rope_axes_dim"])
        config = cls(**known)
        if config.patch_size != 1:
            raise ValueError(f"patch_size {config.patch_size} is not supported: ERNIE-Image uses 1")
        if sum(config.rope_axes_dim) * config.num_attention_heads != config.hidden_size:
            head = config.hidden_size / config.num_attention_heads
            raise ValueError(f"rope_axes_dim {shown_shortly(str(list(config.rope_axes_dim)))} sums to "
                             f"{sum(config.rope_axes_dim)}, but hidden_size / num_attention_heads is {head:g}")
        if not config.qk_layernorm:
            raise ValueError("qk_layernorm false is not supported: ERNIE-Image's transformer normalises q and k "
                             "(qk_layernorm true)")
        return config

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads


class Attention(nn.Module):
    def __init__(self, config: DiTConfig) -> None:
        super().__init__()
        dim, self.heads = config.hidden_size, config.num_attention_heads
        self.to_q = nn.Linear(dim, dim, bias=False)
        self.to_k = nn.Linear(dim, dim, bias=False)
        self.to_v = nn.Linear(dim, dim, bias=False)
        self.norm_q = nn.RMSNorm(config.head_dim, eps=config.eps)
        self.norm_k = nn.RMSNorm(config.head_dim, eps=config.eps)
        self.to_out = nn.ModuleList([nn.Linear(dim, dim, bias=False)])
        self.to_qkv: Optional[nn.Module] = None  # set by fuse_projections(): one GEMM instead of three

    def fuse_projections(self, stack_packed: bool = True) -> bool:
        fused = _fuse_linears([self.to_q, self.to_k, self.to_v], stack_packed)
        if fused is None:
            return False
        self.to_qkv = fused
        del self.to_q, self.to_k, self.to_v
        return True

    def forward(self, x: torch.Tensor | NormModulated, ctx: "StepContext") -> torch.Tensor:
        """`x`: the input of q, k and v, or the adaLN output that makes it (which an FP8 projection may take)."""
        x = NormModulated.of(x)
        if ctx.arithmetic.fast_for(x.given):
            return self._fast_forward(x, ctx)
        rope = ctx.rope
        if self.to_qkv is not None:
            q, k, v = x.into(self.to_qkv).chunk(3, dim=-1)
        else:
            q, k, v = x.into(self.to_q), x.into(self.to_k), x.into(self.to_v)
        q = self.norm_q(q.unflatten(-1, (self.heads, -1)))
        k = self.norm_k(k.unflatten(-1, (self.heads, -1)))
        v = v.unflatten(-1, (self.heads, -1))
        q, k = rope.apply(q), rope.apply(k)
        out = F.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), attn_mask=ctx.key_mask
        )
        return self.to_out[0](out.transpose(1, 2).flatten(2, 3))

    def _fast_forward(self, x: NormModulated, ctx: "StepContext") -> torch.Tensor:
        """q and k normalised and rotated together (one pass each for both), their norm weights folded into the
        RoPE tables."""
        batch, length, _ = x.shape
        rope, key_mask = ctx.rope, ctx.key_mask
        if rope.rotation is not None and ctx.arithmetic.kitchen_rope and fused_kernels.rope_serves(x.given):
            return self._kitchen_forward(x, rope, key_mask)
        if self.to_qkv is not None:
            qkv = x.into(self.to_qkv).unflatten(-1, (3, self.heads, -1))  # [B, S, 3, H, hd]
            q_k, v = qkv[:, :, :2], qkv[:, :, 2]
        else:
            q_k = torch.stack((x.into(self.to_q), x.into(self.to_k)), dim=2).unflatten(-1, (self.heads, -1))
            v = x.into(self.to_v).unflatten(-1, (self.heads, -1))
        normed = _rms_normalize_short_rows(q_k, self.norm_q.eps)
        rotated = rope.apply_weighted(normed, self._laid_out_norm_weights(ctx, normed))
        out = F.scaled_dot_product_attention(
            rotated[:, :, 0].transpose(1, 2), rotated[:, :, 1].transpose(1, 2), v.transpose(1, 2), attn_mask=key_mask
        )
        return self.to_out[0](out.transpose(1, 2).reshape(batch, length, -1))

    def _kitchen_forward(self, x: NormModulated, rope: "RopeTables", key_mask: Optional[torch.Tensor]
                         ) -> torch.Tensor:
        """q and k normalised and rotated by comfy-kitchen's fused kernel, one pass each (fused_kernels.py)."""
        batch, length, _ = x.shape
        if self.to_qkv is not None:
            qkv = x.into(self.to_qkv).unflatten(-1, (3, self.heads, -1))  # [B, S, 3, H, hd]
            q, k, v = qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2]
        else:
            q, k, v = (x.into(projection).unflatten(-1, (self.heads, -1))
                       for projection in (self.to_q, self.to_k, self.to_v))
        q, k = fused_kernels.rms_rope(q, k, rope.rotation, self.norm_q.weight, self.norm_k.weight, self.norm_q.eps)
        out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                             attn_mask=key_mask)
        return self.to_out[0](out.transpose(1, 2).reshape(batch, length, -1))


    def _laid_out_norm_weights(self, ctx: "StepContext", normed: torch.Tensor) -> torch.Tensor:
        """qk_norm_weights for this block, kept in `ctx` from step to step while their WeightStamps hold: made again
        when the weights were edited in place (load_state_dict), moved (a streamed block's other ring slot) or
        replaced (.to(), load_state_dict(assign=True)); and each time inside a CUDA-graph capture, so that a replay
        reads the weights where they are, and for weights made in inference mode, which keep no edit counter (pipes
        build theirs outside it)."""
        q_weight, k_weight = self.norm_q.weight, self.norm_k.weight
        capturing = normed.is_cuda and torch.cuda.is_current_stream_capturing()
        if capturing or q_weight.is_inference() or k_weight.is_inference():  # (inference tensors count no edits)
            return qk_norm_weights(q_weight, k_weight, normed.dtype)
        made = ctx.qk_norm_weights.get((self, normed.dtype))
        if made is None or not (made[0].holds(q_weight) and made[1].holds(k_weight)):
            made = (WeightStamp(q_weight), WeightStamp(k_weight), qk_norm_weights(q_weight, k_weight, normed.dtype))
            ctx.qk_norm_weights[(self, normed.dtype)] = made
        return made[2]


class WeightStamp:
    """Which tensor a weight is and how often it was edited: its storage, its address there and its edit counter.

    A Parameter keeps its edit counter when `.to()` gives it a new tensor (`param.data = ...`), and the new tensor
    may get the address a freed one had, so the address and counter alone can match a different tensor. The storage
    is told apart by its identity, held weakly: while the stamp lives no other storage can take that identity (the
    storage's memory is freed with its last tensor as always)."""

    __slots__ = ("storage", "address", "version")

    def __init__(self, weight: torch.Tensor) -> None:
        self.storage = StorageWeakRef(weight.untyped_storage())
        self.address = weight.data_ptr()
        self.version = weight._version

    def holds(self, weight: torch.Tensor) -> bool:
        """Whether `weight` is the tensor stamped, unedited since."""
        return (weight._version == self.version and weight.data_ptr() == self.address
                and weight.untyped_storage()._cdata == self.storage.cdata)


def qk_norm_weights(q_weight: torch.Tensor, k_weight: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A block's q and k norm weights [hd] as RopeTables.apply_weighted folds them into its tables, [2, 2, 1, hd]
    in `dtype` (the activations'): per q and k, the weight (for cos) and its halves swapped (for the signed sin)."""
    half = q_weight.shape[-1] // 2
    weights = torch.cat((q_weight, q_weight[half:], q_weight[:half], k_weight, k_weight[half:], k_weight[:half]))
    return weights.to(dtype).view(2, 2, 1, -1)


def _rms_normalize_short_rows(x: torch.Tensor, eps: float) -> torch.Tensor:
    """x * rsqrt(mean(x^2) + eps) over the last dim, for rows as short as a head (128): torch's fused rms_norm
    kernel runs one row per thread block and reaches a quarter of the memory bandwidth there (and copies a
    strided input first). The mean of squares is an fp32 reduction; its rsqrt is rounded to x's dtype before the
    product (the reference rounds only the product)."""
    squares = torch.linalg.vector_norm(x, dim=-1, keepdim=True, dtype=torch.float32).square_()
    return x * torch.rsqrt(squares.div_(x.shape[-1]).add_(eps)).to(x.dtype)


class FeedForward(nn.Module):
    def __init__(self, config: DiTConfig) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(config.hidden_size, config.ffn_hidden_size, bias=False)
        self.up_proj = nn.Linear(config.hidden_size, config.ffn_hidden_size, bias=False)
        self.linear_fc2 = nn.Linear(config.ffn_hidden_size, config.hidden_size, bias=False)
        self.gate_up: Optional[nn.Module] = None  # set by fuse_projections()

    def fuse_projections(self, stack_packed: bool = True) -> bool:
        fused = _fuse_linears([self.gate_proj, self.up_proj], stack_packed)
        if fused is None:
            return False
        self.gate_up = fused
        del self.gate_proj, self.up_proj
        return True

    def forward(self, x: torch.Tensor | NormModulated, arithmetic: Arithmetic = FAST) -> torch.Tensor:
        """`x`: the input of gate and up, or the adaLN output that makes it (which an FP8 projection may take)."""
        x = NormModulated.of(x)
        if self.gate_up is not None and type(self.gate_up) is nn.Linear and arithmetic.fast_for(x.given):
            # The stacked weight's halves as two GEMMs (as fast as one here): contiguous outputs let gelu and the
            # product run vectorised, twice as fast as on the strided halves of one output.
            width = self.gate_up.weight.shape[0] // 2
            made = x.tensor()
            gate, up = F.linear(made, self.gate_up.weight[:width]), F.linear(made, self.gate_up.weight[width:])
            return self.linear_fc2(F.gelu(gate).mul_(up))
        if self.gate_up is not None:
            gate, up = x.into(self.gate_up).chunk(2, dim=-1)
        else:
            gate, up = x.into(self.gate_proj), x.into(self.up_proj)
        return GeluGated(gate, up).into(self.linear_fc2)


def _fuse_linears(linears: list[nn.Module], stack_packed: bool = True) -> Optional[nn.Module]:
    """Stack bias-free Linears sharing an input into one; packed layers (`stack_packed`) where their format can
    (their `stacked_with`); None when they cannot."""
    stack = getattr(linears[0], "stacked_with", None)
    if stack is not None:
        return stack(linears[1:]) if stack_packed else None
    if any(type(linear) is not nn.Linear or linear.bias is not None for linear in linears):
        return None
    weight = torch.cat([linear.weight.detach() for linear in linears], dim=0)
    with torch.device("meta"):
        fused = nn.Linear(weight.shape[1], weight.shape[0], bias=False)
    fused.weight = nn.Parameter(weight, requires_grad=False)
    for linear in linears:
        linear.weight = None
    return fused


class Block(nn.Module):
    def __init__(self, config: DiTConfig) -> None:
        super().__init__()
        self.adaLN_sa_ln = RMSNorm(config.hidden_size, config.eps)
        self.self_attention = Attention(config)
        self.adaLN_mlp_ln = RMSNorm(config.hidden_size, config.eps)
        self.mlp = FeedForward(config)

    def forward(self, x: torch.Tensor, ctx: "StepContext") -> torch.Tensor:
        shift_msa, one_plus_scale_msa, gate_msa, shift_mlp, one_plus_scale_mlp, gate_mlp = ctx.modulation
        raw_shift_msa, raw_scale_msa, raw_gate_msa, raw_shift_mlp, raw_scale_mlp, raw_gate_mlp = ctx.raw_modulation
        arithmetic = ctx.arithmetic
        attn_in = NormModulated(self.adaLN_sa_ln, x, one_plus_scale_msa, shift_msa, raw_scale_msa, raw_shift_msa,
                                arithmetic)
        attn = self.self_attention(attn_in, ctx)
        # The MLP's input is normalised from x after the attention's gated residual, which a projection taking the
        # factors adds in its own kernel.
        mlp_in = NormModulated(self.adaLN_mlp_ln, x, one_plus_scale_mlp, shift_mlp, raw_scale_mlp, raw_shift_mlp,
                               arithmetic, Residual(attn, gate_msa, raw_gate_msa))
        update = self.mlp(mlp_in, arithmetic)
        return gated_residual(mlp_in.source, gate_mlp, update, raw_gate_mlp, arithmetic)


class RopeTables:
    """cos/sin of ERNIE's 3-axis rotary embedding for one sequence layout, in the activations' dtype."""

    def __init__(self, positions: torch.Tensor, config: DiTConfig, dtype: torch.dtype,
                 arithmetic: Arithmetic = FAST) -> None:
        self.arithmetic = arithmetic
        angles = torch.cat(
            [_axis_angles(positions[..., axis], dim, config.rope_theta) for axis, dim in enumerate(config.rope_axes_dim)],
            dim=-1,
        )
        angles = torch.stack([angles, angles], dim=-1).flatten(-2).unsqueeze(2)  # [B, S, 1, head_dim]
        self.cos = torch.cos(angles).to(dtype)
        self.sin = torch.sin(angles).to(dtype)
        # comfy-kitchen's fused q/k norm + RoPE reads the rotations as fp32 2x2 matrices (fused_kernels.py)
        head_dim = self.cos.shape[-1]
        uses_kernel = arithmetic.fast and arithmetic.kitchen_rope and fused_kernels.rope_serves(self.cos, head_dim)
        self.rotation: Optional[torch.Tensor] = fused_kernels.rope_matrices(angles) if uses_kernel else None
        half = self.sin.shape[-1] // 2
        # -x2 * sin == x2 * -sin exactly (negation commutes with rounding): the eager path skips the negation pass.
        self.signed_sin = torch.cat((-self.sin[..., :half], self.sin[..., half:]), dim=-1)
        # apply_weighted's operand, [B, S, 1, 2, 1, hd]: both tables of a block are one product with its weights
        self.cos_sin = torch.stack((self.cos, self.signed_sin), dim=2).unsqueeze(2) if arithmetic.fast else None
        self.key_mask: Optional[torch.Tensor] = None  # set by ErnieDiT.rope_tables, cached with the tables

    def apply(self, x: torch.Tensor) -> torch.Tensor:
        x1, x2 = x.chunk(2, dim=-1)
        if self.arithmetic.folds_casts():
            return torch.cat((x2, x1), dim=-1).mul_(self.signed_sin).add_(x * self.cos)
        return x * self.cos + torch.cat((-x2, x1), dim=-1) * self.sin

    def apply_weighted(self, normed: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """apply(normed * weight) for normed [B, S, 2, H, hd] (q, k) and their norm weights as qk_norm_weights
        gives them, folded into the tables: out = n * (w cos) and, half by half, += n_other_half * (w_other_half
        signed_sin); every operand in normed's dtype (see adaln.norm_modulate). A block's weighted tables are one product
        with the tables of this shape."""
        half = normed.shape[-1] // 2
        tables = self.cos_sin * weights  # [B, S, 2, 2, 1, hd]
        cos, sin = tables[:, :, :, 0], tables[:, :, :, 1]  # each [B, S, 2, 1, hd]
        out = normed * cos
        out[..., :half].addcmul_(normed[..., half:], sin[..., :half])
        out[..., half:].addcmul_(normed[..., :half], sin[..., half:])
        return out


def _axis_angles(pos: torch.Tensor, dim: int, theta: int) -> torch.Tensor:
    omega = 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.float32, device=pos.device) / dim))
    return pos.float().unsqueeze(-1) * omega


@dataclass
class StepContext:
    # Six fp32 [B, 1, D] tensors shared by every block: shift, 1 + scale, gate for attention, then for the MLP.
    modulation: tuple[torch.Tensor, ...]
    # The same six before the fp32 conversion and `1 +` (shift, scale, gate, ...), [B, 1, D] in the model's dtype.
    raw_modulation: tuple[torch.Tensor, ...]
    rope: RopeTables
    key_mask: Optional[torch.Tensor]  # bool [B, 1, 1, S] or None when no key is padded
    # The fast form's qk_norm_weights per (block's Attention, dtype), after the stamps of the q and k norm weights
    # they were made from: made by the first step that needs them and kept by the model while the stamps hold
    # (Attention._laid_out_norm_weights).
    qk_norm_weights: dict[tuple[nn.Module, torch.dtype], tuple["WeightStamp", "WeightStamp", torch.Tensor]]
    arithmetic: Arithmetic = FAST  # the model's (ErnieDiT.arithmetic)


BlockRunner = Callable[[int, Block, torch.Tensor, StepContext], torch.Tensor]


def run_block_in_place(index: int, block: Block, x: torch.Tensor, ctx: StepContext) -> torch.Tensor:
    return block(x, ctx)


class TimestepEmbedding(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.linear_1 = nn.Linear(dim, dim)
        self.linear_2 = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear_2(F.silu(self.linear_1(x)))


class PatchEmbed(nn.Module):
    def __init__(self, config: DiTConfig) -> None:
        super().__init__()
        self.proj = nn.Conv2d(config.in_channels, config.hidden_size, kernel_size=1, stride=1, bias=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(x).flatten(2).transpose(1, 2)  # [B, H*W, D]


class FinalNorm(nn.Module):
    def __init__(self, config: DiTConfig) -> None:
        super().__init__()
        self.eps = config.eps
        self.linear = nn.Linear(config.hidden_size, 2 * config.hidden_size)

    def forward(self, x: torch.Tensor, conditioning: torch.Tensor) -> torch.Tensor:
        scale, shift = self.linear(conditioning).chunk(2, dim=-1)
        x = F.layer_norm(x, (x.shape[-1],), eps=self.eps)
        return x * (1 + scale.unsqueeze(1)) + shift.unsqueeze(1)


def sinusoidal_timestep(timestep: torch.Tensor, dim: int) -> torch.Tensor:
    half = dim // 2
    exponent = -math.log(10000) * torch.arange(half, dtype=torch.float32, device=timestep.device) / half
    angles = timestep[:, None].float() * torch.exp(exponent)[None, :]
    return torch.cat([torch.sin(angles), torch.cos(angles)], dim=-1)


class ErnieDiT(nn.Module):
    def __init__(self, config: DiTConfig, arithmetic: ArithmeticName | Arithmetic = "fast") -> None:
        """`arithmetic`: how the uncompiled forward computes ("fast", "exact", "plain"; arithmetic.py)."""
        super().__init__()
        self.config = config
        self.arithmetic = Arithmetic.of(arithmetic)
        dim = config.hidden_size
        self.x_embedder = PatchEmbed(config)
        self.text_proj = nn.Linear(config.text_in_dim, dim, bias=False) if config.text_in_dim != dim else None
        self.time_embedding = TimestepEmbedding(dim)
        self.adaLN_modulation = nn.Sequential(nn.SiLU(), nn.Linear(dim, 6 * dim))
        self.layers = nn.ModuleList([Block(config) for _ in range(config.num_layers)])
        self.final_norm = FinalNorm(config)
        self.final_linear = nn.Linear(dim, config.out_channels)
        self.block_runner: BlockRunner = run_block_in_place
        self._rope_cache: dict[tuple, RopeTables] = {}
        # Bumped by any code that changes which tensors or modules the forward uses (fusing, LoRA, re-placement):
        # a captured replay of the forward (dit_graphs.DiTGraphs) is only valid for the version it was captured at.
        # Moves of the whole model (.to(), .to_empty()) and load_state_dict(assign=True) bump it below.
        self.structure_version = 0
        self._qk_norm_weights: dict = {}  # StepContext.qk_norm_weights, kept from step to step

    @property
    def dtype(self) -> torch.dtype:
        return self.final_linear.weight.dtype

    def with_arithmetic(self, arithmetic: ArithmeticName | Arithmetic) -> "ErnieDiT":
        """This model's blocks and weights (shared, not copied) computing with `arithmetic`: a second model to
        compare the forms on the same weights."""
        twin = copy.copy(self)
        twin.arithmetic = Arithmetic.of(arithmetic)
        twin._rope_cache = {}
        twin._qk_norm_weights = {}
        return twin

    def _apply(self, fn, recurse: bool = True):  # .to(), .cuda(), .half(), .to_empty(): every tensor is a new one
        result = super()._apply(fn, recurse)
        self._tensors_replaced()
        return result

    def load_state_dict(self, state_dict, strict: bool = True, assign: bool = False):
        result = super().load_state_dict(state_dict, strict=strict, assign=assign)
        if assign:  # the file's tensors replace the module's (a copy into them is an in-place edit)
            self._tensors_replaced()
        return result

    def _tensors_replaced(self) -> None:
        """Every weight is a new tensor: a captured forward is stale, and the laid-out q/k norm weights made from the
        old ones are dropped (in place: a StepContext holds this dict), not kept alive on the old device."""
        self.structure_version += 1
        self._qk_norm_weights.clear()

    def rope_tables(self, grid: tuple[int, int], text_lens: list[int], text_max: int, device, dtype) -> RopeTables:
        key = (grid, tuple(text_lens), text_max, str(device), dtype)
        tables = self._rope_cache.get(key)
        if tables is None:
            if len(self._rope_cache) > 8:
                self._rope_cache.clear()
            tables = RopeTables(_positions(grid, text_lens, text_max, device), self.config, dtype, self.arithmetic)
            tables.key_mask = _key_mask(len(text_lens), grid[0] * grid[1], text_lens, text_max, device)
            self._rope_cache[key] = tables
        return tables

    def forward(
        self, latents: torch.Tensor, timestep: torch.Tensor, text: torch.Tensor, text_lens: list[int]
    ) -> torch.Tensor:
        """latents [B,128,h,w], timestep [B] (sigma*1000), text [B,T,3072] zero-padded (or as `project_text` gave
        it, [B,T,D]: text that stays the same over a run is projected once), text_lens per row."""
        x, ctx, conditioning = self.prepare(latents, timestep, text, text_lens)
        for index, block in enumerate(self.layers):
            x = self.block_runner(index, block, x, ctx)
        return self.finish(x, conditioning, latents.shape[-2:])

    # The forward in three parts, for code that runs the blocks itself (step_cache/: a block-residual cache runs
    # some of them, skips others): prepare, then every block through `block_runner` in order, then finish is the
    # forward exactly.
    def prepare(self, latents: torch.Tensor, timestep: torch.Tensor, text: torch.Tensor, text_lens: list[int]
                ) -> tuple[torch.Tensor, StepContext, torch.Tensor]:
        """The tokens block 0 takes [B, h*w + T, D], the context every block takes, and the conditioning `finish`
        takes."""
        _, _, height, width = latents.shape
        dtype = latents.dtype
        image_tokens = self.x_embedder(latents)
        x = torch.cat([image_tokens, self.project_text(text).to(dtype)], dim=1)
        text_max = text.shape[1]
        rope = self.rope_tables((height, width), text_lens, text_max, latents.device, dtype)
        key_mask = rope.key_mask  # cached: no host-to-device copy per call (a captured forward may not make one)

        conditioning = self.time_embedding(sinusoidal_timestep(timestep, self.config.hidden_size).to(dtype))
        raw_modulation = tuple(m.unsqueeze(1) for m in self.adaLN_modulation(conditioning).chunk(6, dim=-1))
        shift_msa, scale_msa, gate_msa, shift_mlp, scale_mlp, gate_mlp = (m.float() for m in raw_modulation)
        modulation = (shift_msa, 1 + scale_msa, gate_msa, shift_mlp, 1 + scale_mlp, gate_mlp)
        ctx = StepContext(modulation=modulation, raw_modulation=raw_modulation, rope=rope, key_mask=key_mask,
                          qk_norm_weights=self._qk_norm_weights, arithmetic=self.arithmetic)
        return x, ctx, conditioning

    def project_text(self, text: torch.Tensor) -> torch.Tensor:
        """The text as the blocks take it, [B, T, D]: text_proj of text [B, T, text_in_dim]; text already projected
        passes unchanged. The sampler projects a run's text once (sampling.text_groups) instead of every step."""
        if self.text_proj is None or text.shape[1] == 0 or text.shape[-1] != self.config.text_in_dim:
            return text
        return self.text_proj(text)

    def finish(self, x: torch.Tensor, conditioning: torch.Tensor, grid: tuple[int, int]) -> torch.Tensor:
        """The velocity [B, 128, h, w] from the last block's tokens; `grid`: the latents' (h, w)."""
        height, width = grid
        x = self.final_norm(x, conditioning).type_as(x)
        patches = self.final_linear(x[:, : height * width])
        return patches.transpose(1, 2).reshape(x.shape[0], self.config.out_channels, height, width)


def _positions(grid: tuple[int, int], text_lens: list[int], text_max: int, device) -> torch.Tensor:
    """[B, S, 3] positions: image token (y, x) -> (text_len, y, x); text token j -> (j, 0, 0)."""
    height, width = grid
    ys, xs = torch.meshgrid(
        torch.arange(height, dtype=torch.float32, device=device),
        torch.arange(width, dtype=torch.float32, device=device),
        indexing="ij",
    )
    grid_yx = torch.stack([ys, xs], dim=-1).reshape(-1, 2)
    rows = []
    for length in text_lens:
        image = torch.cat([torch.full((grid_yx.shape[0], 1), float(length), device=device), grid_yx], dim=-1)
        text = torch.zeros((text_max, 3), device=device)
        text[:, 0] = torch.arange(text_max, dtype=torch.float32, device=device)
        rows.append(torch.cat([image, text], dim=0))
    return torch.stack(rows)


def _key_mask(batch: int, image_len: int, text_lens: list[int], text_max: int, device) -> Optional[torch.Tensor]:
    if all(length == text_max for length in text_lens):
        return None
    valid_text = torch.arange(text_max, device=device)[None, :] < torch.tensor(text_lens, device=device)[:, None]
    mask = torch.cat([torch.ones((batch, image_len), dtype=torch.bool, device=device), valid_text], dim=1)
    return mask[:, None, None, :]
