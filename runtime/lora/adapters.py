"""One DiT Linear's adapter weights -> the delta it adds, in a form that never needs the base weight.

Definitions (W' = W + strength * delta, per layer; shapes [out, in]):
- LoRA: delta = (alpha / rank) * up @ down, with down = lora_A / lora_down [rank, in], up = lora_B / lora_up
  [out, rank]. No `alpha` key: diffusers/PEFT take alpha == rank (scale 1) unless the file's
  `lora_adapter_metadata` (written by diffusers/PEFT) gives lora_alpha (and alpha_pattern / rank_pattern);
  ComfyUI also uses scale 1 without alpha.
- LoHa: delta = (alpha / rank) * (w1a @ w1b) * (w2a @ w2b) (elementwise), rank = w1b's rows (LyCORIS, ComfyUI).
  Exactly low-rank: (U1 V1) * (U2 V2) = (U1 . U2)(V1 . V2) with the row-wise Kronecker (face-splitting) product,
  so a LoHa of ranks r1, r2 is a LoRA of rank r1 * r2 and joins the same branch.
- LoKr: delta = scale * kron(w1, w2), each side full or factored (w1_a @ w1_b, w2_a @ w2_b). scale = alpha / dim
  where dim is the factored side's rank (w2's when both are factored, as ComfyUI reads it), 1 when neither is
  factored or alpha is absent (LyCORIS then sets alpha = dim). Applied through (A kron B) x = vec(A X B^T), never
  as a dense [out, in] matrix.
DoRA (dora_scale, lora_magnitude_vector) rescales the merged weight's columns by their norms, which needs the
base weight: refused in one line rather than approximated (diffusers drops those keys silently).
"""
from __future__ import annotations

import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Optional, Union

import torch

from ..core.errors import ModelFileError
from ..core.json_text import JSON_ERRORS, json_fault, json_trouble, load_json


@dataclass
class LowRank:
    down: torch.Tensor  # [rank, in], fp32
    up: torch.Tensor  # [out, rank], fp32, scale not folded in
    scale: float

    @property
    def rank(self) -> int:
        return self.down.shape[0]

    def delta(self) -> torch.Tensor:
        return self.scale * (self.up @ self.down)


@dataclass
class Kron:
    w1: torch.Tensor  # [out1, in1], fp32
    w2: torch.Tensor  # [out2, in2], fp32; delta = scale * kron(w1, w2)
    scale: float

    def delta(self) -> torch.Tensor:
        return self.scale * torch.kron(self.w1, self.w2)


Adapter = Union[LowRank, Kron]
REFUSED_PARTS = {
    "dora_scale": "is a DoRA (dora_scale): DoRA needs the base weight's norms and is not supported; use a plain "
                  "LoRA export of it",
    "lora_magnitude_vector": "is a DoRA (lora_magnitude_vector): DoRA needs the base weight's norms and is not "
                             "supported; use a plain LoRA export of it",
    "lora_mid.weight": "has LoCon Tucker factors (lora_mid), which are for convolutions: not supported on Linear layers",
    "lokr_t2": "has LoKr Tucker factors (lokr_t2), which are for convolutions: not supported on Linear layers",
    "hada_t1": "has LoHa Tucker factors (hada_t1), which are for convolutions: not supported on Linear layers",
    "hada_t2": "has LoHa Tucker factors (hada_t2), which are for convolutions: not supported on Linear layers",
    "lora_B.bias": "has LoRA bias terms (lora_B.bias), which are not supported: export it without lora_bias",
    "lora_up.bias": "has LoRA bias terms (lora_up.bias), which are not supported: export it without bias",
    "diff": "has full weight differences (diff), which are not supported: use a LoRA export",
    "diff_b": "has full bias differences (diff_b), which are not supported: use a LoRA export",
}


@dataclass(frozen=True)
class PeftAlphas:
    """lora_alpha and r of a diffusers/PEFT file's `lora_adapter_metadata`, with per-module patterns."""

    alpha: Optional[float]
    rank: Optional[int]
    alpha_pattern: dict[str, float]
    rank_pattern: dict[str, int]

    def alpha_for(self, path: str) -> Optional[float]:
        return _pattern_value(self.alpha_pattern, path, self.alpha)

    def rank_for(self, path: str) -> Optional[int]:
        return _pattern_value(self.rank_pattern, path, self.rank)


def _pattern_value(patterns: dict, path: str, default):
    for key, value in patterns.items():
        key = key.lstrip("^")
        if path == key or path.endswith("." + key) or re.fullmatch(key, path):
            return value
    return default


def peft_alphas(metadata: dict[str, str], name: str = "") -> Optional[PeftAlphas]:
    """The alphas diffusers/PEFT saved in the safetensors metadata, or None when the file has none. Malformed JSON
    or an alpha that is not a finite number is refused in one line (a negative alpha is a sign flip: kept)."""
    raw = metadata.get("lora_adapter_metadata")
    if raw is None:
        return None
    label = f"LoRA {name}" if name else "LoRA"
    try:
        config = load_json(raw)
    except JSON_ERRORS as error:
        raise ModelFileError(f"{label}: its metadata key lora_adapter_metadata {json_trouble(error)}: the file is "
                             "damaged; export the LoRA again") from None
    if not isinstance(config, dict):
        raise ModelFileError(f"{label}: its metadata key lora_adapter_metadata is JSON {type(config).__name__}, not "
                             f"an object of LoRA settings: the file is damaged; export the LoRA again")
    config = {key.removeprefix("transformer."): value for key, value in config.items()}
    alpha, rank = config.get("lora_alpha"), config.get("r")
    alpha_pattern, rank_pattern = config.get("alpha_pattern") or {}, config.get("rank_pattern") or {}
    if not isinstance(alpha_pattern, dict) or not isinstance(rank_pattern, dict):
        raise ModelFileError(f"{label}: alpha_pattern/rank_pattern in its metadata key lora_adapter_metadata are not "
                             f"objects: the file is damaged; export the LoRA again")
    return PeftAlphas(None if alpha is None else _metadata_alpha(label, "lora_alpha", alpha),
                      None if rank is None else _metadata_rank(label, "r", rank),
                      {key: _metadata_alpha(label, f"alpha_pattern[{key!r}]", value)
                       for key, value in alpha_pattern.items()},
                      {key: _metadata_rank(label, f"rank_pattern[{key!r}]", value) for key, value in rank_pattern.items()})


def unread_adapter_config(path: Path, tensors: dict[str, torch.Tensor], peft: Optional[PeftAlphas]) -> list[str]:
    """The notice for a PEFT adapter_config.json beside a LoRA file that carries no alpha of its own: diffusers and
    ComfyUI read alphas from the file only, so the LoRA runs at alpha = rank, which is not what PEFT runs where
    the config's lora_alpha differs from its r."""
    config_path = path.with_name("adapter_config.json")
    if peft is not None or any(key.endswith(".alpha") for key in tensors) or not config_path.is_file():
        return []
    try:
        config = load_json(config_path.read_bytes()[:1 << 20])
        alpha, rank, rs = config.get("lora_alpha"), config.get("r"), bool(config.get("use_rslora"))
        patterns = bool(config.get("alpha_pattern") or config.get("rank_pattern"))
    except (OSError, AttributeError, *JSON_ERRORS) as error:
        said = f"it cannot be read: {json_fault(error) if isinstance(error, JSON_ERRORS) else 'not a JSON object'}"
    else:
        if not (_finite_number(alpha) and _finite_number(rank) and rank > 0):
            said = "its lora_alpha or r is unusable"
        else:
            scale = alpha / math.sqrt(rank) if rs else alpha / rank
            if scale == 1 and not patterns:  # what PEFT runs too
                return []
            said = (f"it says lora_alpha {alpha:g}, r {rank:g}{', rsLoRA' if rs else ''}: strength {scale:g} runs "
                    "the LoRA as PEFT does" + (", but for the layers its alpha_pattern or rank_pattern sets otherwise"
                                               if patterns else ""))
    return [f"LoRA {path.name}: the adapter_config.json beside it is not read, as diffusers and ComfyUI do not read "
            f"it: the file holds no alpha, so the LoRA runs at alpha = rank ({said})"]


def _finite_number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _metadata_alpha(label: str, field: str, value: object) -> float:
    number = _number(value)
    if number is None or not math.isfinite(number):
        raise ModelFileError(f"{label}: {field} {value!r} in its metadata key lora_adapter_metadata is not a finite "
                             f"number: the file is damaged; export the LoRA again")
    return number


def _metadata_rank(label: str, field: str, value: object) -> int:
    number = _number(value)
    if number is None or not math.isfinite(number) or number < 1 or number != int(number):
        raise ModelFileError(f"{label}: {field} {value!r} in its metadata key lora_adapter_metadata is not a positive "
                             f"whole number: the file is damaged; export the LoRA again")
    return int(number)


def _number(value: object) -> Optional[float]:
    """A JSON number, or a string holding one (some writers quote them); None for anything else."""
    if isinstance(value, bool) or not isinstance(value, (int, float, str)):
        return None
    try:
        return float(value)
    except (ValueError, OverflowError):  # an integer beyond float range is no finite number either
        return None


def _matrix(name: str, path: str, part: str, tensor: torch.Tensor) -> torch.Tensor:
    """A 2-D fp32 copy; a 1x1 convolution's [o, i, 1, 1] is the same matrix."""
    if tensor.ndim == 4 and tensor.shape[2:] == (1, 1):
        tensor = tensor.flatten(1)
    if tensor.ndim != 2:
        raise ModelFileError(f"LoRA {name}: {path}.{part} has shape {tuple(tensor.shape)}, not a matrix: this is not "
                             f"a LoRA of a Linear layer")
    return tensor.to(torch.float32).clone()


def _alpha(parts: dict[str, torch.Tensor]) -> Optional[float]:
    alpha = parts.get("alpha")
    return None if alpha is None else float(alpha.float().reshape(-1)[0])


def _need(name: str, path: str, parts: dict[str, torch.Tensor], *wanted: str) -> list[torch.Tensor]:
    missing = [part for part in wanted if part not in parts]
    if missing:
        raise ModelFileError(f"LoRA {name}: {path} has {', '.join(sorted(parts))} but no {', '.join(missing)}: the "
                             f"file is incomplete; export the LoRA again")
    return [_matrix(name, path, part, parts[part]) for part in wanted]


def check_parts(name: str, path: str, parts: dict[str, torch.Tensor]) -> None:
    """What one layer's parts must be, known from the file alone (kind, dtypes, completeness, ranks): one-line
    ModelFileError. Run on shapes only (meta tensors), so checking a file before any model is opened copies nothing;
    its shapes against the DiT's are checked when the pipe parses it (`build_adapter`)."""
    _check_dtypes(name, path, parts)
    shapes_only = {part: tensor if part == "alpha" else torch.empty(tensor.shape, dtype=tensor.dtype, device="meta")
                   for part, tensor in parts.items()}
    _adapter(name, path, shapes_only, None)


def build_adapter(name: str, path: str, parts: dict[str, torch.Tensor], shape: tuple[int, int],
                  peft: Optional[PeftAlphas] = None) -> Adapter:
    """The adapter one layer's parts describe, checked against the layer's (out, in) `shape`."""
    _check_dtypes(name, path, parts)
    adapter = _adapter(name, path, parts, peft)
    found = _shape(adapter)
    if found != shape:
        raise ModelFileError(f"LoRA {name}: {path} adapts a [{found[0]}, {found[1]}] weight but ERNIE-Image's is "
                             f"[{shape[0]}, {shape[1]}]: the LoRA is for a model of another size")
    return adapter


# The layouts one layer's adapter may be in: parts of two of them in one layer are two adapters of that layer.
LAYOUTS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("lora_A/lora_B", ("lora_A.", "lora_B.")),
    ("lora_down/lora_up", ("lora_down.", "lora_up.")),
    ("LoKr (lokr_*)", ("lokr_",)),
    ("LoHa (hada_*)", ("hada_",)),
)


def _adapter(name: str, path: str, parts: dict[str, torch.Tensor], peft: Optional[PeftAlphas]) -> Adapter:
    for part in parts:
        refusal = REFUSED_PARTS.get(part) or REFUSED_PARTS.get(part.removesuffix(".weight"))
        if refusal is not None:
            raise ModelFileError(f"LoRA {name} {refusal} (at {path})")
    layouts = [layout for layout, starts in LAYOUTS if any(part.startswith(starts) for part in parts)]
    if len(layouts) > 1:
        how = "two trainers' layouts" if set(layouts[:2]) == {LAYOUTS[0][0], LAYOUTS[1][0]} else "two kinds of adapter"
        raise ModelFileError(f"LoRA {name} holds two LoRAs for {path} ({layouts[0]} and {layouts[1]} keys, {how}): it "
                             f"was merged from two files; use each LoRA's own file")
    if any(part.startswith("lokr_") for part in parts):
        return _lokr(name, path, parts)
    if any(part.startswith("hada_") for part in parts):
        return _loha(name, path, parts)
    return _lora(name, path, parts, peft)


def _check_dtypes(name: str, path: str, parts: dict[str, torch.Tensor]) -> None:
    """Weights are floating point and not empty; alpha is one number (a float, or an integer some writers store)."""
    for part, tensor in parts.items():
        if part == "alpha":
            if tensor.numel() != 1 or tensor.dtype == torch.bool or tensor.is_complex():
                raise ModelFileError(f"LoRA {name}: {path}.alpha is a {tensor.dtype} tensor of shape "
                                     f"{tuple(tensor.shape)}, not one number: the file is damaged; export it again")
        elif not tensor.is_floating_point():
            raise ModelFileError(f"LoRA {name}: {path}.{part} holds {tensor.dtype} values, not floating point: the "
                                 f"file is damaged or not a LoRA; export it again")
        elif tensor.numel() == 0:
            raise ModelFileError(f"LoRA {name}: {path}.{part} is empty (shape {tuple(tensor.shape)}, rank 0): the "
                                 f"file is damaged; export the LoRA again")


def _shape(adapter: Adapter) -> tuple[int, int]:
    if isinstance(adapter, LowRank):
        return adapter.up.shape[0], adapter.down.shape[1]
    return adapter.w1.shape[0] * adapter.w2.shape[0], adapter.w1.shape[1] * adapter.w2.shape[1]


def _lora(name: str, path: str, parts: dict[str, torch.Tensor], peft: Optional[PeftAlphas]) -> LowRank:
    down_part = "lora_A.weight" if "lora_A.weight" in parts or "lora_B.weight" in parts else "lora_down.weight"
    up_part = "lora_B.weight" if down_part == "lora_A.weight" else "lora_up.weight"
    down, up = _need(name, path, parts, down_part, up_part)
    if up.shape[1] != down.shape[0]:
        raise ModelFileError(f"LoRA {name}: {path} has rank {down.shape[0]} in {down_part} but {up.shape[1]} in "
                             f"{up_part}: the file is damaged or mixes two LoRAs; export it again")
    rank = down.shape[0]
    alpha = _alpha(parts)
    if alpha is None and peft is not None:
        peft_alpha, peft_rank = peft.alpha_for(path), peft.rank_for(path)
        if peft_rank is not None and peft_rank != rank:
            raise ModelFileError(f"LoRA {name}: its lora_adapter_metadata gives rank {peft_rank} for {path} but its "
                                 f"weights have rank {rank}: the file is damaged or its metadata belongs to another "
                                 f"LoRA; export it again")
        if peft_alpha is not None:
            return LowRank(down, up, peft_alpha / (peft_rank or rank))
    return LowRank(down, up, 1.0 if alpha is None else alpha / rank)


def _factor(name: str, path: str, parts: dict[str, torch.Tensor], side: str) -> tuple[torch.Tensor, Optional[int]]:
    """LoKr side `side` ("w1"/"w2"): (matrix, rank when it is stored factored)."""
    if f"lokr_{side}" in parts:
        return _need(name, path, parts, f"lokr_{side}")[0], None
    a, b = _need(name, path, parts, f"lokr_{side}_a", f"lokr_{side}_b")
    if a.shape[1] != b.shape[0]:
        raise ModelFileError(f"LoRA {name}: {path} lokr_{side}_a and lokr_{side}_b ranks differ "
                             f"({a.shape[1]} vs {b.shape[0]}): the file is damaged; export it again")
    return a @ b, b.shape[0]


def _lokr(name: str, path: str, parts: dict[str, torch.Tensor]) -> Kron:
    w1, dim1 = _factor(name, path, parts, "w1")
    w2, dim2 = _factor(name, path, parts, "w2")
    dim = dim2 if dim2 is not None else dim1
    alpha = _alpha(parts)
    return Kron(w1, w2, alpha / dim if alpha is not None and dim is not None else 1.0)


def _loha(name: str, path: str, parts: dict[str, torch.Tensor]) -> LowRank:
    w1a, w1b, w2a, w2b = _need(name, path, parts, "hada_w1_a", "hada_w1_b", "hada_w2_a", "hada_w2_b")
    if w1a.shape[1] != w1b.shape[0] or w2a.shape[1] != w2b.shape[0] or w1a.shape[0] != w2a.shape[0] \
            or w1b.shape[1] != w2b.shape[1]:
        raise ModelFileError(f"LoRA {name}: {path} LoHa factors do not fit together ({tuple(w1a.shape)}, "
                             f"{tuple(w1b.shape)}, {tuple(w2a.shape)}, {tuple(w2b.shape)}): export it again")
    alpha = _alpha(parts)
    scale = 1.0 if alpha is None else alpha / w1b.shape[0]
    up = (w1a[:, :, None] * w2a[:, None, :]).flatten(1)  # [out, r1 * r2]
    down = (w1b[:, None, :] * w2b[None, :, :]).flatten(0, 1)  # [r1 * r2, in]
    return LowRank(down, up, scale)
