"""Quantised DiT weights: GGUF blocks, FP8 and NVFP4, kept packed and dequantised per layer (or run
natively where the GPU has the matmul). See linear.py for the contract with the offloader."""
from .gguf_files import load_dit_gguf, load_text_encoder_gguf
from .gpu_support import SELECTOR_CHOICES, choose_auto, detect_device, format_reasons
from .linear import QuantLinear, enable_compiled_dequant, load_quantized_into, quantize_linears
from .qweight import QuantizedWeight
from .writer import quantize_state_dict, quantize_weight, write_quantized_file

__all__ = [
    "QuantLinear", "QuantizedWeight", "SELECTOR_CHOICES", "choose_auto", "detect_device", "enable_compiled_dequant",
    "format_reasons", "load_dit_gguf", "load_quantized_into", "load_text_encoder_gguf",
    "quantize_linears", "quantize_state_dict", "quantize_weight", "write_quantized_file",
]
