"""Run ComfyUI's native ERNIE-Image DiT (comfy/ldm/ernie/model.py), unmodified, outside ComfyUI.

ComfyUI's code is never part of this repository. `load_native_model(path)` executes the given model.py as
`comfy.ldm.ernie.model` with the stand-ins below in `sys.modules` for the `comfy.*` modules it imports, and puts
`sys.modules` back as it was afterwards. They stand in for ComfyUI's own modules (as of ComfyUI commit 7b30bf3) and
reproduce what those do for a resident model on one device: no offloading, no LoRA or other weight patches, no
quantised weights, no transformer_options overrides.

- `comfy.model_management`: `supports_fp64` (False on MPS and XPU, True elsewhere), `in_training = False`, and
  `throw_exception_if_processing_interrupted`, the lock-guarded flag check that every op makes.
- `comfy.ops`: `disable_weight_init.{Linear, Conv2d, LayerNorm, RMSNorm}`, torch's modules with their initialisation
  skipped whose `forward` runs `run_every_op()` (the interrupt check, skipped while compiling) and then torch's own
  forward: what ComfyUI's ops run when `comfy_cast_weights` is off and no weight function is patched in.
  `CastBiasWeightContext(module, input, offloadable=True)` yields (weight, bias) cast to the input's dtype and device
  (the module's own tensors when they match already) and has nothing to release afterwards (no offload stream);
  ComfyUI's does more Python bookkeeping per call, so native eager times here are, if anything, a little optimistic.
  `scaled_dot_product_attention`: torch's SDPA; on CUDA, for inputs of 128 Ki elements or more, under
  `sdpa_kernel([FLASH, CUDNN, EFFICIENT, MATH], set_priority=True)` as ComfyUI sets it (its GQA branches do not
  apply: ERNIE has as many key heads as query heads).
- `comfy.quant_ops.ck`: the `comfy_kitchen` module itself, with the backend choices ComfyUI's quant_ops makes on
  import: CUDA disabled unless torch is built for CUDA 13 or later, Triton disabled (opt-in in ComfyUI).
- `comfy.ldm.modules.attention.optimized_attention`: ComfyUI's `attention_pytorch` (its attention on NVIDIA GPUs by
  default): q, k, v [B, S, heads * dim_head] viewed as [B, heads, S, dim_head], a 2-D or 3-D mask given batch and
  heads dimensions, one SDPA call (batches above SDP_BATCH_LIMIT, 2**15 on NVIDIA, in slices), the output back as
  [B, S, heads * dim_head].
"""
from __future__ import annotations

import importlib.util
import inspect
import sys
import threading
from contextlib import contextmanager
from pathlib import Path
from types import ModuleType
from typing import Callable, Iterator, Optional

import torch

# ---- comfy.model_management -------------------------------------------------------------------------------------

in_training = False
interrupt_processing = False
interrupt_processing_mutex = threading.RLock()


class InterruptProcessingException(Exception):
    pass


def supports_fp64(device: Optional[torch.device] = None) -> bool:
    return device is None or torch.device(device).type not in ("mps", "xpu")


def throw_exception_if_processing_interrupted() -> None:
    global interrupt_processing
    with interrupt_processing_mutex:
        if interrupt_processing:
            interrupt_processing = False
            raise InterruptProcessingException()


def is_nvidia() -> bool:
    return torch.cuda.is_available() and torch.version.cuda is not None


# ---- comfy.ops --------------------------------------------------------------------------------------------------

def run_every_op() -> None:
    if torch.compiler.is_compiling():
        return
    throw_exception_if_processing_interrupted()


class CastBiasWeightContext:
    def __init__(self, module: Optional[torch.nn.Module], input: Optional[torch.Tensor] = None,
                 offloadable: bool = False) -> None:
        if module is None:
            self.state = (None, None)
            return
        weight, bias = module.weight, getattr(module, "bias", None)
        if input is not None:
            weight = weight.to(device=input.device, dtype=input.dtype)
            bias = bias.to(device=input.device, dtype=input.dtype) if bias is not None else None
        self.state = (weight, bias)

    def __enter__(self):
        return self.state

    def __exit__(self, *_exc) -> None:
        return None


_SDPA_PRIORITY: Optional[list] = None
if torch.cuda.is_available():
    from torch.nn.attention import SDPBackend, sdpa_kernel

    if "set_priority" in inspect.signature(sdpa_kernel).parameters:
        _SDPA_PRIORITY = [SDPBackend.FLASH_ATTENTION, SDPBackend.CUDNN_ATTENTION, SDPBackend.EFFICIENT_ATTENTION,
                          SDPBackend.MATH]


def scaled_dot_product_attention(q, k, v, *args, **kwargs):
    if _SDPA_PRIORITY is None or q.nelement() < 1024 * 128:
        return torch.nn.functional.scaled_dot_product_attention(q, k, v, *args, **kwargs)
    with sdpa_kernel(_SDPA_PRIORITY, set_priority=True):
        return torch.nn.functional.scaled_dot_product_attention(q, k, v, *args, **kwargs)


def _comfy_op(base: type) -> type:
    def reset_parameters(self) -> None:
        if base is torch.nn.RMSNorm:
            self.bias = None
        return None

    def forward(self, *args, **kwargs):
        run_every_op()
        return base.forward(self, *args, **kwargs)

    return type(base.__name__, (base,), {"reset_parameters": reset_parameters, "forward": forward,
                                         "comfy_cast_weights": False, "weight_function": [], "bias_function": []})


class disable_weight_init:  # noqa: N801 (ComfyUI's name)
    Linear = _comfy_op(torch.nn.Linear)
    Conv2d = _comfy_op(torch.nn.Conv2d)
    LayerNorm = _comfy_op(torch.nn.LayerNorm)
    RMSNorm = _comfy_op(torch.nn.RMSNorm)


# ---- comfy.ldm.modules.attention --------------------------------------------------------------------------------

SDP_BATCH_LIMIT = 2**15 if is_nvidia() else 2**31


def attention_pytorch(q, k, v, heads, mask=None, attn_precision=None, skip_reshape=False, skip_output_reshape=False,
                      **kwargs):
    if skip_reshape:
        b, _, _, dim_head = q.shape
    else:
        b, _, dim_head = q.shape
        dim_head //= heads
        q, k, v = (t.view(b, -1, heads, dim_head).transpose(1, 2) for t in (q, k, v))
    if mask is not None:
        if mask.ndim == 2:
            mask = mask.unsqueeze(0)
        if mask.ndim == 3:
            mask = mask.unsqueeze(1)
    if SDP_BATCH_LIMIT >= b:
        out = scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=0.0, is_causal=False)
        if not skip_output_reshape:
            out = out.transpose(1, 2).reshape(b, -1, heads * dim_head)
        return out
    out = torch.empty((b, q.shape[2], heads * dim_head), dtype=q.dtype, layout=q.layout, device=q.device)
    for i in range(0, b, SDP_BATCH_LIMIT):
        m = mask[i:i + SDP_BATCH_LIMIT] if mask is not None and mask.shape[0] > 1 else mask
        out[i:i + SDP_BATCH_LIMIT] = scaled_dot_product_attention(
            q[i:i + SDP_BATCH_LIMIT], k[i:i + SDP_BATCH_LIMIT], v[i:i + SDP_BATCH_LIMIT], attn_mask=m, dropout_p=0.0,
            is_causal=False,
        ).transpose(1, 2).reshape(-1, q.shape[2], heads * dim_head)
    return out


# ---- comfy.quant_ops --------------------------------------------------------------------------------------------

def import_kitchen() -> ModuleType:
    """comfy_kitchen with the backends ComfyUI's quant_ops leaves enabled."""
    import comfy_kitchen as ck

    cuda = torch.version.cuda
    if cuda is None or tuple(int(part) for part in cuda.split(".")[:2]) < (13,):
        ck.registry.disable("cuda")
    ck.registry.disable("triton")
    return ck


# ---- loading ----------------------------------------------------------------------------------------------------

def _stand_in_modules(ck: ModuleType) -> dict[str, ModuleType]:
    this = sys.modules[__name__]
    comfy, ldm, modules = ModuleType("comfy"), ModuleType("comfy.ldm"), ModuleType("comfy.ldm.modules")
    attention, model_management = ModuleType("comfy.ldm.modules.attention"), ModuleType("comfy.model_management")
    ops, quant_ops = ModuleType("comfy.ops"), ModuleType("comfy.quant_ops")
    for package in (comfy, ldm, modules):
        package.__path__ = []
    attention.optimized_attention = attention_pytorch
    attention.attention_pytorch = attention_pytorch
    for name in ("supports_fp64", "in_training", "throw_exception_if_processing_interrupted", "is_nvidia",
                 "InterruptProcessingException"):
        setattr(model_management, name, getattr(this, name))
    for name in ("run_every_op", "CastBiasWeightContext", "scaled_dot_product_attention", "disable_weight_init"):
        setattr(ops, name, getattr(this, name))
    quant_ops.ck = ck
    comfy.ldm, comfy.model_management, comfy.ops, comfy.quant_ops = ldm, model_management, ops, quant_ops
    ldm.modules, modules.attention = modules, attention
    return {m.__name__: m for m in (comfy, ldm, modules, attention, model_management, ops, quant_ops)}


def load_native_model(path: Path, ck: ModuleType) -> ModuleType:
    """ComfyUI's ernie model.py executed against the stand-ins; its `comfy` global is the stand-in package."""
    stand_ins = _stand_in_modules(ck)
    saved = {name: sys.modules.get(name) for name in stand_ins}
    sys.modules.update(stand_ins)
    try:
        spec = importlib.util.spec_from_file_location("comfy.ldm.ernie.model", path)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    finally:
        for name, previous in saved.items():
            if previous is None:
                sys.modules.pop(name, None)
            else:
                sys.modules[name] = previous
    if not hasattr(module, "ErnieImageModel"):
        raise SystemExit(f"{path} defines no ErnieImageModel: give the path of ComfyUI's comfy/ldm/ernie/model.py")
    return module


@contextmanager
def kitchen_backends(native_module: ModuleType, function: str) -> Iterator[list[str]]:
    """While active, the native model's calls of comfy_kitchen's `function` note which backend the registry picks for
    their arguments (the same choice the op's dispatcher makes); yields that list."""
    quant_ops = native_module.comfy.quant_ops
    ck = quant_ops.ck
    real: Callable = getattr(ck, function)
    signature = inspect.signature(real)
    chosen: list[str] = []

    class Probe:
        def __getattr__(self, name: str):
            if name != function:
                return getattr(ck, name)

            def traced(*args, **kwargs):
                bound = signature.bind(*args, **kwargs)
                bound.apply_defaults()
                chosen.append(ck.registry.get_capable_backend(function, dict(bound.arguments)))
                return real(*args, **kwargs)
            return traced

    quant_ops.ck = Probe()
    try:
        yield chosen
    finally:
        quant_ops.ck = ck
