"""Open a LoRA file: safetensors only (never a pickle), complete, finite; one-line errors otherwise."""
from __future__ import annotations

import stat
from dataclasses import dataclass
from pathlib import Path

import torch

from ..core.errors import ModelFileError
from ..files.file_kind import not_there
from ..formats.safetensors_reader import SAFETENSORS_OPENING, is_pickle, open_safetensors
from .adapters import peft_alphas

PICKLE_SUFFIXES = (".pt", ".pth", ".ckpt", ".bin", ".pkl", ".pickle")


@dataclass(frozen=True)
class FileStamp:
    """What identifies one version of a file on disk: a parsed LoRA is reused while this is unchanged."""

    path: str
    size: int
    mtime_ns: int


@dataclass
class LoraTensors:
    name: str  # the file name (never the full path: it may hold a user name)
    stamp: FileStamp
    tensors: dict[str, torch.Tensor]
    metadata: dict[str, str]


def file_stamp(path: Path) -> FileStamp:
    path = Path(path)
    if path.suffix.lower() in PICKLE_SUFFIXES:
        raise ModelFileError(f"LoRA {path.name} is a PyTorch pickle ({path.suffix}), which is never loaded (pickles "
                             f"can run code): use the LoRA's .safetensors file, or convert it to safetensors")
    if not path.exists():
        raise ModelFileError(f"LoRA file {path} {not_there(path)}")
    if path.is_dir():
        raise ModelFileError(f"LoRA {path} is a folder: give the .safetensors file inside it")
    found = path.stat()
    if not stat.S_ISREG(found.st_mode):  # a FIFO would block the read for ever; a device is no file
        raise ModelFileError(f"LoRA {path} is not a regular file (a pipe, device or socket): give the LoRA's "
                             f".safetensors file")
    return FileStamp(str(path.resolve()), found.st_size, found.st_mtime_ns)


def refuse_pickle(path: Path) -> None:
    """A pickle by its magic bytes, whatever its name says (a .pt renamed .safetensors)."""
    with open(path, "rb") as handle:
        opening = handle.read(SAFETENSORS_OPENING)
    if is_pickle(opening):
        raise ModelFileError(f"LoRA {path.name} is a PyTorch pickle, whatever its name says, which is never loaded "
                             f"(pickles can run code): convert the LoRA to .safetensors or get its .safetensors "
                             f"release")


def read_lora_tensors(path: Path) -> LoraTensors:
    """Every tensor of the file, checked: a pickle, a cut file, a NaN/inf inside or malformed LoRA metadata is
    refused in one line."""
    path = Path(path)
    stamp = file_stamp(path)
    try:
        refuse_pickle(path)
    except OSError as error:  # an I/O error, a file that vanished or is not readable
        raise ModelFileError(f"LoRA {path} cannot be read ({error.strerror or type(error).__name__}): check the "
                             f"file and the disk, or export the LoRA again") from None
    try:
        handle = open_safetensors(path)  # refuses truncated files and other formats
    except ModelFileError as error:  # the reader names the file; say that it was given as a LoRA
        raise ModelFileError(f"LoRA {error}") from None
    peft_alphas(handle.metadata, path.name)  # malformed lora_adapter_metadata, a NaN/inf alpha in it
    tensors: dict[str, torch.Tensor] = {}
    for key in handle.keys():
        tensor = handle.tensor(key)
        if tensor.is_floating_point() and tensor.numel() and not bool(torch.isfinite(tensor.float()).all()):
            raise ModelFileError(f"LoRA {path.name} has NaN or infinite values in {key}: the file is damaged or "
                                 f"the training diverged; use another export of this LoRA")
        tensors[key] = tensor
    if not tensors:
        raise ModelFileError(f"LoRA {path.name} holds no tensors: it is not a LoRA file; pick a LoRA .safetensors")
    return LoraTensors(path.name, stamp, tensors, handle.metadata)
