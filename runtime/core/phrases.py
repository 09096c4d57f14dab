"""Phrases the library's messages use where each front end has words of its own (nodes/comfy_names.py,
runtime/cli/names.py map them): kept here, light to import, so a front end can map them without loading models."""
from __future__ import annotations

AUTO_BUDGET = "None for free VRAM minus a reserve"  # LoadOptions.vram_budget_gb's automatic budget
RUN_CHECKS_ITS_SIZE = "generate() checks each request's own size before it starts"
