"""How the uncompiled DiT does the elementwise work between its GEMMs, chosen once per model (ErnieDiT's
`arithmetic`, LoadOptions.arithmetic) and recorded on it:

- "fast" (the default): on CUDA, the fewer-pass forms (dit.py): every operand of the large kernels in the
  activations' dtype, norm weights folded into the norm kernel or the RoPE tables, one `addcmul` per gated
  residual, q and k normalised and rotated together, and comfy-kitchen's fused kernels where installed
  (fused_kernels.py). They round in other places than the reference, so results differ in last bits (within
  2e-3 relative). Elsewhere (the CPU) "fast" computes the exact forms;
- "exact": the reference's numbers bit for bit, with the casts around the fp32 modulation folded into the
  arithmetic kernels (`out=` a bf16 tensor: computed in fp32, rounded once on store, as `.float()` ...
  `.to(bf16)` does), which halves the memory traffic between the GEMMs;
- "plain": the reference's expressions as written (what compiled blocks trace, and what "exact" must equal).

Compiled blocks trace the plain expressions whatever the choice (inductor fuses them itself). The finer fields
pick single forms, for the tests and benches that compare them on the same weights (ErnieDiT.with_arithmetic).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, Union

import torch

ArithmeticName = Literal["fast", "exact", "plain"]
ARITHMETIC_CHOICES: tuple[ArithmeticName, ...] = ("fast", "exact", "plain")


@dataclass(frozen=True)
class Arithmetic:
    fast: bool = True  # the fewer-pass forms on `fast_devices`; False: the exact forms everywhere
    fast_devices: tuple[str, ...] = ("cuda",)  # device types the fewer-pass forms run on (the CPU gains nothing)
    kitchen_rope: bool = True  # with the fast forms: comfy-kitchen's q/k RMSNorm + RoPE kernel, where installed
    kitchen_adaln: bool = True  # with the fast forms: comfy-kitchen's adaLN RMSNorm + modulation kernel
    folded_casts: bool = True  # the exact forms' casts folded into kernels (same bits); False: the plain expressions

    @classmethod
    def of(cls, choice: Union[ArithmeticName, "Arithmetic"]) -> "Arithmetic":
        """The arithmetic `choice` names ("fast", "exact", "plain"), or `choice` itself."""
        if isinstance(choice, cls):
            return choice
        if choice == "fast":
            return cls()
        if choice == "exact":
            return cls(fast=False)
        if choice == "plain":
            return cls(fast=False, folded_casts=False)
        raise ValueError(f"arithmetic {choice!r} is not one of {', '.join(ARITHMETIC_CHOICES)}")

    @property
    def name(self) -> str:
        """"fast", "exact" or "plain"; "custom" for another mix of the fields."""
        for name in ARITHMETIC_CHOICES:
            if Arithmetic.of(name) == self:
                return name
        return "custom"

    def folds_casts(self) -> bool:
        """Whether to use the cast-folding `out=` forms: not while dynamo traces this call, where the plain
        expressions fuse better and `out=` would only get in the compiler's way. (`is_compiling()` is a
        process-wide flag: a compile on another thread would turn the forms off for the calls running beside it.)"""
        return self.folded_casts and not torch.compiler.is_dynamo_compiling()

    def fast_for(self, x: torch.Tensor) -> bool:
        """Whether the fewer-pass forms run on `x` (an activation): asked for, on one of their devices, uncompiled."""
        return self.fast and x.device.type in self.fast_devices and self.folds_casts()
