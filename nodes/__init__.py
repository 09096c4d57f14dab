"""ComfyUI adapter: thin node classes over runtime/. Filled in by the nodes issue."""
NODE_CLASS_MAPPINGS: dict = {}
NODE_DISPLAY_NAME_MAPPINGS: dict = {}
