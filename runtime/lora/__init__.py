"""LoRA adapters on the ERNIE-Image DiT: read trainers' files, map their keys, apply them as low-rank branches.

files.py opens a LoRA file safely, keys.py maps its keys to the DiT's Linears, adapters.py turns each layer's
weights into a delta (LoRA, LoKr, LoHa), stack.py holds what the user asked for (files and strengths), attach.py
wraps the DiT's Linears with branches and takes them off again. The base weights are never changed.
"""
from .stack import LoraEntry, LoraStack, parse_lora_argument

__all__ = ["LoraEntry", "LoraStack", "parse_lora_argument"]
