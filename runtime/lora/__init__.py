"""LoRA adapters on the ERNIE-Image DiT: read trainers' files, map their keys, apply them as low-rank branches.

files.py opens a LoRA file safely, keys.py maps its keys to the DiT's Linears, adapters.py turns each layer's
weights into a delta (LoRA, LoKr, LoHa), stack.py holds what the user asked for (files, strengths, modes), apply.py
puts a stack on the DiT: merge.py adds the deltas into the resident weights in place (backup.py keeps the
originals in host memory, requant.py re-packs FP8), attach.py wraps the other Linears with branches. Removing every
LoRA gives the base weights back bit for bit.
"""
from .stack import LoraEntry, LoraStack

__all__ = ["LoraEntry", "LoraStack"]
