"""Running under a VRAM budget: sizes from configs, the memory plan per job, placing each phase's weights
(resident or streamed through pinned host slabs), the device-memory meter."""
