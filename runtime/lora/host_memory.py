"""Host memory a merge keeps (the original weights it changes) and host memory free for it, known before any
weights are read."""
from __future__ import annotations

from typing import Iterable, Optional

from ..model.dit import DiTConfig
from .attach import _FUSED, _BLOCK
from .keys import dit_linear_shapes
from .parsed import ParsedLora


def merge_backup_bytes(parsed: Iterable[ParsedLora], config: DiTConfig, itemsize: int, fused: bool) -> int:
    """Bytes of the weights the LoRAs' merge would back up: every Linear they adapt once, a fused q/k/v or gate/up
    Linear whole (`fused`: the DiT fuses them). An upper bound: layers that take the branch are not backed up."""
    shapes = dit_linear_shapes(config)
    touched: dict[str, int] = {}
    for lora in parsed:
        for path in lora.adapters:
            out_features, in_features = shapes[path]
            match = _BLOCK.match(path)
            leaf = path.rpartition(".")[2]
            if fused and match is not None and leaf in _FUSED:
                parent = path.rpartition(".")[0]
                name, _, slices = _FUSED[leaf]
                touched[f"{parent}.{name}"] = slices * out_features * in_features
            else:
                touched[path] = out_features * in_features
    return sum(touched.values()) * itemsize


def available_host_bytes() -> Optional[int]:
    """MemAvailable of /proc/meminfo (Linux); None where the system does not say."""
    try:
        with open("/proc/meminfo") as meminfo:
            for line in meminfo:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None
