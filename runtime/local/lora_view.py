"""`LoraPipe`: a pipe that shares a LocalPipe's loaded model and runs it with its own LoRA stack.

Graphs branch: two samplers may take the same Loader through different LoRA nodes. Each gets a view; the model
is loaded once, and the stack a view carries is put on the DiT when that view generates (only the branches
change). The base pipe itself is "no LoRA" (or the stack given to LocalPipe.load).
"""
from __future__ import annotations

from typing import Any, Iterable, Optional

from ..core.host import Host
from ..core.request import GenerationRequest, GenerationResult
from ..lora.stack import LoraStack, describe_stack


class LoraPipe:
    def __init__(self, base: Any, loras: LoraStack) -> None:
        self.base = base
        self.loras = loras

    @property
    def kind(self) -> str:
        return self.base.kind

    def with_loras(self, entries: Iterable, mode: Optional[str] = None) -> "LoraPipe":
        """This view's stack followed by `entries` (LoraEntry, path, (path, strength) or (path, strength, mode));
        `mode` ("merge", "branch") for those that name none. The new files are checked and parsed for this DiT now
        (one-line ModelFileError: not a LoRA, another model's, NaN inside, layers or shapes this DiT lacks); the
        parse is cached for the runs."""
        from ..lora.parsed import check_lora_files

        added = LoraStack.of(entries, mode)
        stack = self.loras.plus(added)  # refuses a file given twice
        check_lora_files(added)
        self.base._lora.resolve(added, self.base.sources)
        return LoraPipe(self.base, stack)

    def with_step_cache(self, step_cache: Any) -> Any:
        """This view (its LoRA stack included) running every job with a step cache (step_cache/view.py)."""
        from ..step_cache.view import with_step_cache

        return with_step_cache(self, step_cache)

    def check(self) -> None:
        """Read and check every LoRA file of the stack now (cached for the run): one-line ModelFileError."""
        self.base._lora.resolve(self.loras, self.base.sources)

    def generate(self, request: GenerationRequest, host: Host) -> GenerationResult:
        return self.base.generate(request, host, loras=self.loras)

    def describe(self, *args: Any, **kwargs: Any) -> str:
        lines = [line for line in self.base.describe(*args, **kwargs).splitlines() if not line.startswith("LoRA: ")]
        return "\n".join(lines + [describe_stack(self.loras)])  # this view's stack, not the base pipe's

    def release(self) -> None:
        self.base.release()

    def is_loaded(self) -> bool:
        return self.base.is_loaded()

    def has_enhancer(self) -> bool:
        return self.base.has_enhancer()

    def enhance(self, *args: Any, **kwargs: Any) -> Any:
        return self.base.enhance(*args, **kwargs)

    def __getattr__(self, name: str) -> Any:  # the rest of LocalPipe (defaults, variant, device_bytes_needed...)
        if name in ("base", "loras"):
            raise AttributeError(name)
        return getattr(self.base, name)
