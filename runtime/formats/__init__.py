"""Reading ERNIE-Image weight files in every layout users have, in one canonical key space per component."""
from .component_file import ComponentFile, open_component

__all__ = ["ComponentFile", "open_component"]
