"""ComfyUI's folder registry (`folder_paths`) over a `models/` folder, for node tests run without ComfyUI."""
from __future__ import annotations

import types
from pathlib import Path


def fake_folder_paths(models: Path) -> types.ModuleType:
    """ComfyUI's folder registry over `models/` (its folder per key), answering as folder_paths does."""
    keys = {"diffusion_models": "diffusion_models", "text_encoders": "text_encoders", "vae": "vae", "loras": "loras",
            "diffusers": "diffusers"}
    fake = types.ModuleType("folder_paths")
    fake.folder_names_and_paths = {key: ([str(models / folder)], {".safetensors"}) for key, folder in keys.items()}
    fake.get_folder_paths = lambda key: list(fake.folder_names_and_paths[key][0])

    def files(key: str) -> list[Path]:
        folders, extensions = fake.folder_names_and_paths[key]
        return [p for f in folders if Path(f).is_dir() for p in sorted(Path(f).iterdir()) if p.suffix in extensions]

    fake.get_filename_list = lambda key: [p.name for p in files(key)]
    fake.get_full_path = lambda key, name: next((str(p) for p in files(key) if p.name == name), None)
    return fake
