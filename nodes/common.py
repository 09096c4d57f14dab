"""What every node of the pack shares: its menu category, the pipe socket type, and the text it shows on itself."""
from __future__ import annotations

from typing import Any

CATEGORY = "ERNIE-Image"
PIPE_TYPE = "ERNIE_PIPE"


def shown_on_node(text: str, *outputs: Any) -> dict[str, Any]:
    """A node's return value that also shows `text` on the node (web/ernie_image.js reads ui.text)."""
    return {"ui": {"text": [text]}, "result": outputs}
