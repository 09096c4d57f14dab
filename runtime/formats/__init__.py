"""Reading ERNIE-Image weight files in every layout users have, in one canonical key space per component."""
from .component_file import ComponentFile, open_component
from .detect import identify
from .tekken import tokenizer_from_tekken_json, tokenizer_from_text_encoder_file

__all__ = ["ComponentFile", "identify", "open_component", "tokenizer_from_tekken_json", "tokenizer_from_text_encoder_file"]
