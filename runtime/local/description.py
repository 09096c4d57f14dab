"""How a LocalPipe describes itself: variant, device, formats, LoRAs and the VRAM plan, a few lines for the user."""
from __future__ import annotations

from typing import Any, Optional

from ..core.errors import ErnieImageError, NamedLine, named_settings, naming_line
from ..core.request import GenerationRequest
from ..lora.stack import describe_stack
from ..model.compile import compile_available


def dit_mode(pipe: Any) -> str:
    """How a LocalPipe's DiT forward runs: compiled, or eager (replayed as CUDA graphs where it can be, in the exact
    arithmetic where asked)."""
    if pipe.compiles_dit:
        return "compiled"
    exact = ", exact arithmetic" if pipe.options.arithmetic == "exact" else ""
    until = ""
    if pipe.options.compile == "auto" and compile_available(pipe.device):
        until = ", compiled once that pays for itself"
    elif pipe.options.compile is True:
        until = f" (compile asked for: it needs a CUDA device and Triton, and {pipe.device} has not both)"
    if pipe.options.cuda_graphs and pipe.device.type == "cuda":
        return f"eager{exact}, replayed as CUDA graphs when resident{until}"
    return f"eager{exact}{until}"


def describe_pipe(pipe: Any, request: Optional[GenerationRequest] = None) -> NamedLine:
    """A LocalPipe's variant, device, formats and VRAM plan (of the last job, else of `request` or a default 1024x1024
    job, labelled as that size's), recording the settings it names."""
    defaults = pipe.defaults
    weights = pipe.dit_weights + ", " if pipe.dit_weights else ""
    lines = [
        f"ERNIE-Image {pipe.variant_choice.text()}; on {pipe.device} in "
        f"{str(pipe.dtype).replace('torch.', '')}; defaults {int(defaults['steps'])} steps, "
        f"CFG {defaults['cfg']:g}; DiT {weights}{dit_mode(pipe)}"
    ]
    if pipe.quant_reason:
        lines.append(pipe.quant_reason)
    if pipe.loras:
        lines.append(describe_stack(pipe.loras))
    merged = pipe._lora.describe(pipe.parts.dit)
    if merged:
        lines.append(merged)
    settings = pipe.variant_choice.settings
    if pipe.memory.plan is not None and request is None:
        lines.append(pipe.memory.describe())
    else:
        job = (request or GenerationRequest(prompt="")).with_defaults(pipe.variant)
        preview = pipe.memory.preview if request is not None else pipe.memory.preview_before_a_size
        try:
            plan = preview(job, pipe.sources, pipe.variant, pipe.options.pe_endpoint is None)
        except ErnieImageError as error:
            plan = naming_line(f"VRAM plan unavailable: {error}", *error.settings)
        lines.append(plan)
        settings = (*settings, *named_settings(plan))
    return naming_line("\n".join(lines), *settings)
