"""How a LocalPipe loads and runs: LoadOptions, checked before any file is read, and the device and dtype they name."""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Optional, Union

import torch

from ..core.errors import InvalidInputError
from ..core.phrases import AUTO_BUDGET
from ..model.fill import QUANT_ON_LOAD_FORMATS
from ..offload.planner import MAX_BUDGET_GB

# LoadOptions.quant: a bf16 DiT is quantised on load to the format named; a quantised DiT file runs in its own
# format (with 'none', 'auto' or that format; another is refused).
QUANT_CHOICES = ("none", "auto", "bf16", *QUANT_ON_LOAD_FORMATS)
DTYPE_CHOICES = ("auto", "bf16", "fp16", "fp32")  # auto: bf16 on a GPU, fp32 on the CPU
DIT_ARITHMETIC_CHOICES = ("fast", "exact")


SWITCHES = ("keep_loaded", "previews", "pe_compile", "cuda_graphs")  # options that are True or False, nothing else


@dataclass
class LoadOptions:
    """How a LocalPipe loads and runs. device: auto, cpu, cuda, cuda:N. dtype: auto, bf16, fp16, fp32.
    vram_budget_gb: GiB (2**30 bytes) the pipe may use (None: free VRAM less a reserve). keep_loaded, previews,
    pe_compile, cuda_graphs: True or False. quant: none, auto, bf16, fp8, q8_0, q4_k, nvfp4. compile: "auto" (the
    default: the DiT's blocks are compiled once that pays for itself), True (at load) or False; compiling needs a CUDA device and
    Triton, and elsewhere the DiT runs uncompiled whatever is asked (the pipe's description says so).
    arithmetic: fast or exact. pe_quant: none or fp8. pe_endpoint: a text.remote_enhancer.ChatEndpoint.
    lora_mode: merge or branch. Checked in full by validate(), before any file is read."""

    device: str = "auto"  # "auto", "cpu", "cuda", "cuda:1"...
    dtype: str = "auto"  # "auto" (bf16 on GPU, fp32 on CPU), "bf16", "fp16", "fp32"
    vram_budget_gb: Optional[float] = None  # None: free VRAM minus a reserve
    keep_loaded: bool = True  # keep weights (in host RAM when they do not fit) between runs
    quant: str = "none"  # "none", "auto", "fp8", "q8_0", "nvfp4", or a quantised file given as the DiT
    previews: bool = True  # latent previews for a host that wants them (core.host.wants_previews); False: never
    # Regional torch.compile of the DiT's blocks, on CUDA when Triton is installed: True (at load), False, or "auto"
    # (uncompiled until compiling has paid for itself: local/compile_policy.py).
    compile: Union[bool, str] = "auto"
    # The local prompt enhancer's decode step through torch.compile as well. Off by default: it saves about 0.2 s a
    # rewrite and costs 8-60 s on its first use in each process (docs/performance.md#the-first-image), so it pays
    # back only after hundreds of rewrites. Its uncompiled step still replays as a CUDA graph.
    pe_compile: bool = False
    # Uncompiled DiT resident on a CUDA device (compile off or no Triton): replay its forward as CUDA graphs
    # (dit_graphs.py; bit-identical output). Streamed blocks always run eagerly.
    cuda_graphs: bool = True
    # How the uncompiled DiT computes on CUDA: "fast" (fewer passes, last-bit differences from the reference) or
    # "exact" (the reference's numbers bit for bit); see model/arithmetic.py. Compiled blocks are not affected.
    arithmetic: str = "fast"
    pe_quant: str = "none"  # "none" or "fp8": the local prompt enhancer's layer weights packed on load (text/pe_quant.py)
    # Prompt enhancer on an OpenAI-compatible chat server (text.remote_enhancer.ChatEndpoint; holds no secret).
    # When set, requests with use_pe are revised there instead of by a local PE.
    pe_endpoint: Optional[Any] = None
    # How LoRAs that name no mode of their own are applied: "merge" (added into the resident weights in place, no
    # cost per step, originals kept in host memory) or "branch" (beside the weights). See lora/merge.py.
    lora_mode: str = "merge"

    def validate(self) -> None:
        """Refuse a device name or quantisation the pipe cannot use, before any file is read or model built."""
        for name in SWITCHES:
            if not isinstance(getattr(self, name), bool):
                raise InvalidInputError(f"{name} {getattr(self, name)!r} is not supported: use True or False"
                                        ).naming(name)
        if not (isinstance(self.compile, bool) or self.compile == "auto"):
            raise InvalidInputError(f"compile {self.compile!r} is not supported: use True, False or 'auto'"
                                    ).naming("compile")
        if not isinstance(self.device, str):
            raise InvalidInputError(f"device {self.device!r} is not supported: use 'auto', 'cpu', 'cuda' or "
                                    "'cuda:N' (str(device) for a torch.device)").naming("device")
        kind, colon, index = self.device.partition(":")
        plain_index = index.isascii() and index.isdigit()  # str.isdigit() takes any script's digits, torch does not
        if self.device not in ("auto", "cpu") and not (kind == "cuda" and (not colon or plain_index)):
            raise InvalidInputError(f"device {self.device!r} is not supported: use auto, cpu, cuda or cuda:N"
                                    ).naming("device")
        from ..text.pe_quant import PE_QUANT_FORMATS

        if self.pe_quant not in ("none", *PE_QUANT_FORMATS):
            raise InvalidInputError(f"pe_quant {self.pe_quant!r} is not supported: use none or "
                                    f"{', '.join(PE_QUANT_FORMATS)}")
        from ..lora.stack import check_mode

        check_mode(self.lora_mode)
        if self.dtype not in DTYPE_CHOICES:
            raise InvalidInputError(f"dtype {self.dtype!r} is not supported: use {', '.join(DTYPE_CHOICES)}"
                                    ).naming("dtype")
        if self.arithmetic not in DIT_ARITHMETIC_CHOICES:
            raise InvalidInputError(f"arithmetic {self.arithmetic!r} is not supported: use "
                                    f"{' or '.join(DIT_ARITHMETIC_CHOICES)}").naming("arithmetic")
        if self.quant not in QUANT_CHOICES:
            raise InvalidInputError(f"quant {self.quant!r} is not supported: use one of {', '.join(QUANT_CHOICES)}, "
                                    "or give a quantised DiT file").naming("quant")
        if self.vram_budget_gb is not None:
            check_budget_gb(self.vram_budget_gb)


def check_budget_gb(budget: Any, shown: Optional[str] = None) -> None:
    """A VRAM budget in GiB: a positive finite number up to MAX_BUDGET_GB. The one refusal of a budget out of range,
    for LoadOptions and the CLI's --budget alike; `shown`: the value as the user typed it (else its repr)."""
    if isinstance(budget, bool) or not isinstance(budget, (int, float)) or not math.isfinite(budget) \
            or not 0 < budget <= MAX_BUDGET_GB:
        raise InvalidInputError(f"vram_budget_gb {shown or repr(budget)} is not a positive number of GiB up to "
                                f"{MAX_BUDGET_GB:g}: give the GiB the pipe may use, or {AUTO_BUDGET}"
                                ).naming("vram_budget_gb", AUTO_BUDGET)


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    kind, _, index = name.partition(":")
    if kind == "cuda" and not torch.cuda.is_available():
        raise InvalidInputError(f"device {name} was asked for but PyTorch sees no CUDA GPU: choose cpu"
                                ).naming("device")
    # The index compared as a Python int first: torch.device cannot parse one past 64 bits.
    if kind == "cuda" and index.isascii() and index.isdigit() and int(index) >= torch.cuda.device_count():
        count = torch.cuda.device_count()
        raise InvalidInputError(f"device {name} was asked for but PyTorch sees {count} CUDA GPU(s): choose "
                                f"{' or '.join(f'cuda:{index}' for index in range(min(count, 4)))}"
                                f"{' or another' if count > 4 else ''}").naming("device")
    return torch.device(name)


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    table = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
    if name == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    if name not in table:
        raise InvalidInputError(f"dtype {name!r} is not supported: use {', '.join(DTYPE_CHOICES)}").naming("dtype")
    return table[name]
