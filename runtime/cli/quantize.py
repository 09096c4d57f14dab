"""`ernie-image quantize`: a quantised copy of the bf16 DiT, written once (quant/writer.py writes it).

The output path is checked first, then the input (a bf16 DiT; FP8/NVFP4 and GGUF files are refused from their
headers) and its variant (base or Turbo: `--variant`, else what the input's metadata, config or name says; an input
that says nothing is refused), then its tensors against its config as `generate` holds them at load (a tensor
missing, in another shape or with no place in the model is refused, not written into a file generate would refuse),
then what can be packed is counted (nothing packable is an error), then the file is written whole or not at all,
recording the variant. The report says how many weight matrices went into which format, and which variant was
recorded and how it was decided.
"""
from __future__ import annotations

import argparse
import os
import sys
from collections import Counter
from pathlib import Path
from typing import Optional

import torch

from ..core.errors import ErnieImageError, InvalidInputError, ModelFileError
from ..core.non_finite import refuse_non_finite_weights
from ..core.weight_dtypes import refuse_non_floating
from ..core.variant import (VARIANT_SETTING, VariantChoice, checked_variant_option, decide_variant,
                            files_notices)
from ..files.file_kind import not_there
from ..files.inputs_outputs import refuse_outputs_over_inputs
from ..formats.component_file import QUANT_MARKERS, WHAT_TO_PICK, ComponentFile, open_component
from ..formats.detect import identify
from ..formats.folder_files import open_weights
from ..formats.safetensors_reader import is_gguf, open_safetensors
from ..model.builders import check_config_builds
from ..quant.gguf_files import DIT_MARKER_KEYS, strip_dit_prefix
from ..quant.qweight import QuantizedWeight
from ..quant.safetensors_files import read_safetensors_file
from ..quant.writer import (WRITE_FORMATS, file_suffix, quantized_layer_counts, refuse_unpackable, should_quantize,
                            write_quantized_file)
from .checks import check_input_path, check_output_file
from .names import cli_message, cli_words
from .parser import OneLineParser, OutputPath, PathOption


def _source_files(source: Path) -> list[Path]:
    if source.is_dir():  # the files generate reads: the ones its index names, or every one where it has none
        return [reader.path for reader in open_weights(source, WHAT_TO_PICK["dit"]).readers]
    if not source.exists():
        raise ModelFileError(f"--dit {source} {not_there(source)}")
    if is_gguf(source):
        raise InvalidInputError(f"--dit {source.name} is a GGUF file, already quantised: quantise from the bf16 DiT "
                                "(the transformer folder or diffusion_models/ernie-image*.safetensors)")
    if source.suffix != ".safetensors":
        raise ModelFileError(f"--dit {source.name} is not a .safetensors file: quantise from the bf16 weights")
    return [source]


def refuse_quantized_source(files: list[Path], source: Path) -> None:
    """FP8/NVFP4 (comfy_quant, scaled_fp8) sources are refused from their headers, before any tensor is read."""
    for file in files:
        header = open_safetensors(file)
        markers = [key for key in header.keys() if key.endswith(QUANT_MARKERS) or key == "scaled_fp8"]
        packed = [key for key in header.keys() if key.endswith(".weight") and
                  (header.infos[key].dtype.startswith("F8_") or header.infos[key].dtype == "U8")]
        if markers or packed or "_quantization_metadata" in header.metadata:
            example = (markers or packed or ["_quantization_metadata"])[0]
            raise InvalidInputError(f"--dit {source} is already quantised (FP8/NVFP4: {example}): quantise from the "
                                    "bf16 DiT (the transformer folder or diffusion_models/ernie-image*.safetensors)")


def bf16_dit_files(source: str | Path) -> list[Path]:
    """The safetensors files of a bf16 DiT (a transformer folder's or the file itself), from their headers alone."""
    source = Path(source)
    files = _source_files(source)
    refuse_quantized_source(files, source)
    return files


def source_variant(source: Path, asked: str | None, component: ComponentFile | None = None) -> VariantChoice:
    """The variant the written file records: `--variant`, else what the bf16 source says (its metadata, config or
    name; runtime/core/variant.py); a source that says nothing is refused rather than recorded as the base model.
    `component`: the source opened, when the caller has it already."""
    component = open_component(source, "dit") if component is None else component
    choice = decide_variant(component, checked_variant_option(asked))
    if choice.source == "default":
        raise InvalidInputError(
            f"--dit {source.name} does not say whether it is ERNIE-Image or ERNIE-Image-Turbo (its metadata records "
            f"neither, it has no transformer config, and its name has no word 'ernie', 'base' or 'turbo', or has "
            f"both variants'): set {VARIANT_SETTING} to base or turbo, which the written file records"
        ).naming(VARIANT_SETTING)
    return choice


def read_bf16_dit(source: str | Path, files: list[Path] | None = None) -> dict[str, torch.Tensor]:
    """A diffusers transformer folder or single bf16 DiT file -> {diffusers key: tensor}. `files`: its
    bf16_dit_files, when the caller has them already."""
    source = Path(source)
    files = bf16_dit_files(source) if files is None else files
    owner = open_weights(source, WHAT_TO_PICK["dit"]).owner  # each tensor's file: as generate reads the folder
    state: dict[str, torch.Tensor] = {}
    for file in files:
        tensors, _ = read_safetensors_file(file)
        tensors = {key: tensor for key, tensor in tensors.items() if key in owner and owner[key].path == file}
        refuse_non_floating(tensors, file)  # the DiT holds no integer tensor: one would not quantise, nor load
        state.update((strip_dit_prefix(key), tensor) for key, tensor in tensors.items())
    missing = [k for k in DIT_MARKER_KEYS if k not in state]
    if missing:
        raise ModelFileError(f"{source} is not an ERNIE-Image DiT (missing {missing}): pass the transformer "
                             f"folder or diffusion_models/ernie-image*.safetensors")
    return state


def _parser() -> OneLineParser:
    parser = OneLineParser(prog="ernie-image quantize",
                           description="Write a quantised copy of the ERNIE-Image DiT, from its bf16 weights.")
    # A second, different --dit or --out is refused, not taken as the last one (parser.py says why).
    parser.add_argument("--dit", required=True, action=PathOption, once=True,
                        help="bf16 DiT: transformer folder or single .safetensors file (not an FP8/NVFP4/GGUF file)")
    parser.add_argument("--format", required=True, choices=WRITE_FORMATS,
                        help="fp8 and nvfp4: ComfyUI comfy_quant .safetensors; q8_0 and q4_k: GGUF .gguf")
    parser.add_argument("--out", required=True, action=OutputPath, once=True, metavar="FILE",
                        what="a .safetensors (fp8, nvfp4) or .gguf (q8_0, q4_k) path",
                        help="output file in an existing folder (.safetensors for fp8/nvfp4, .gguf for q8_0/q4_k); "
                             "an earlier quantised DiT there is replaced once the new one is complete; any other "
                             "file there is refused")
    parser.add_argument("--variant", choices=("auto", "base", "turbo"), default="auto",
                        help="the DiT's release, recorded in the file (auto: what the input's metadata, config or "
                             "name says)")
    parser.add_argument("--overwrite", action="store_true", help=argparse.SUPPRESS)  # the rule now; kept for scripts
    return parser


def model_folder(dit: Path) -> Path | None:
    """The folder that loads as a model with --dit's weights: --dit itself when it is a folder, else a weights file's
    folder where it holds their config.json (a diffusers component folder; ComfyUI's model folders hold none)."""
    if os.path.isdir(dit):  # os.path's tests read a name too long for the system as absent; Path's raise
        return dit
    return dit.parent if os.path.isfile(dit.parent / "config.json") else None


def holding_model(folder: Path) -> Path | None:
    """The model part `folder` is: itself where it holds a config.json (a component folder) or where its parent holds
    a model_index.json (a part of a diffusers model: text_encoder/, tokenizer/, ...); None for others, a folder of
    single files (ComfyUI's model folders) or a diffusers model's own folder, whose loose files no loader reads."""
    if os.path.isfile(folder / "config.json") or os.path.isfile(folder.parent / "model_index.json"):
        return folder
    return None


def refuse_output_in_model_folder(out: Path, dit: Path) -> None:
    """A new file inside the folder --dit loads from would make that folder two models, and one inside any other
    model's folder (the text encoder's beside it, say) would replace or join that model's files. `out` is judged
    where the writer puts the file: a link to a folder is followed, a link at the name itself is replaced."""
    folder = model_folder(dit)
    where = out if os.path.isdir(out) else out.parent
    if folder is not None and where.resolve().is_relative_to(folder.resolve()):
        place = "is the --dit folder" if out.resolve() == folder.resolve() else f"is inside the --dit folder {folder}"
        raise InvalidInputError(f"--out {out} {place}: a quantised file there would stop the folder loading as the "
                                f"bf16 model; write it elsewhere")
    other = holding_model(where)
    if other is not None:
        raise InvalidInputError(f"--out {out} is inside the model folder {other}: a quantised file there would "
                                f"replace or join the files of the model it holds; write it elsewhere")


def refuse_replacing_another_model(out: Path) -> Optional[str]:
    """An existing --out is replaced only where it is a quantised ERNIE-Image DiT (an earlier run's output, FP8,
    NVFP4 or GGUF): any other file would be lost without a word (the user's bf16 original, a LoRA, a text encoder's
    or a VAE's file in ComfyUI's folders, another model's GGUF, a file that is no model at all). Returns the format
    of the quantised DiT it holds ("NVFP4", "Q8_0"), None where there is no file."""
    if not os.path.isfile(out):
        return None
    held = _held_at(out)
    if held is not None:
        raise InvalidInputError(f"--out {out} holds {held}: the quantised DiT would replace it; give another name, "
                                f"or remove that file first")
    return _packed_format(open_component(out, "dit"))


def _packed_format(component: ComponentFile) -> str:
    """The format most of a quantised DiT's packed weights are in, as --format names it, upper-case."""
    formats = Counter(value.qtype if value.format == "gguf" else value.format
                      for value in map(component.tensor, component.keys) if isinstance(value, QuantizedWeight))
    return formats.most_common(1)[0][0].upper() if formats else "unpacked"


def _held_at(out: Path) -> str | None:
    """What an existing --out holds, in words, where it is not a quantised ERNIE-Image DiT; None where it is."""
    try:
        if not is_gguf(out):
            reader = open_safetensors(out)
            if any("lora" in key.lower() for key in reader.keys()):
                return "a LoRA"
            identity = identify({key: reader.shape(key) for key in reader.keys()})
            if identity.kind != "dit":
                return identity.description if identity != identify({}) else "no ERNIE-Image DiT"
        component = open_component(out, "dit")
    except ModelFileError:
        return "no ERNIE-Image DiT this command could have written (it does not read as one)"
    return None if component.quantized else "a DiT in full precision (the weights a quantised file is made from)"


def refuse_output_over_input(out: Path, dit: Path) -> Optional[str]:
    """--out naming a file --dit reads (the file itself, a link to it, its path spelled otherwise) would replace the
    bf16 weights: refused first, as generate refuses an output onto an input (refuse_outputs_over_inputs), so that
    this is the reason given; then a new file inside the folder --dit loads from. Returns the format of the earlier
    quantised DiT --out holds, which it replaces (None: no file there)."""
    refuse_outputs_over_inputs([("--dit", dit)], [("--out", out, out)])
    refuse_output_in_model_folder(out, dit)
    return refuse_replacing_another_model(out)


def kept_dtypes(state: dict[str, torch.Tensor], fmt: str) -> str:
    """The dtypes of the weight matrices left unpacked ("float32", "bfloat16/float32"): the file keeps them so."""
    return "/".join(sorted({str(tensor.dtype).removeprefix("torch.") for name, tensor in state.items()
                            if name.endswith(".weight") and tensor.dim() == 2 and not should_quantize(name, tensor, fmt)}))


def main_quantize(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        if os.path.isdir(args.out):  # not "give a file name inside it" where inside is the model folder
            refuse_output_in_model_folder(args.out, args.dit)
        # ComfyUI(-GGUF) picks a loader by the name's suffix; a folder is named as one before the name is judged
        check_output_file(args.out, "--out", (file_suffix(args.format),), f"ernie-image-{args.format}")
        check_input_path(args.dit, "--dit", "file or folder")
        replaced = refuse_output_over_input(args.out, args.dit)
        files = bf16_dit_files(args.dit)
        component = open_component(args.dit, "dit")  # headers only: no weight is read until the checks pass
        variant = source_variant(args.dit, args.variant, component)
        made = check_config_builds(component, "dit", variant.variant)  # generate's refusals, before any write
        for notice in files_notices(variant):  # what the written file records, told
            print(cli_words(notice, notice.settings), file=sys.stderr)
        for notice in component.notices:  # a file of the folder left out of what is quantised
            print(notice, file=sys.stderr)
        state = {key: tensor for key, tensor in read_bf16_dit(args.dit, files).items() if key in made}  # told above
        refuse_non_finite_weights(state, f"--dit {args.dit}", "re-download them, then quantise again")
        counts = quantized_layer_counts(state, args.format)
        refuse_unpackable(counts, args.format, "format")
        if replaced is not None and replaced != args.format.upper():
            print(f"--out {args.out} holds an earlier {replaced} DiT: the {args.format.upper()} one replaces it",
                  file=sys.stderr)
        out = write_quantized_file(state, args.format, args.out, variant=variant.variant)
    except ErnieImageError as err:
        print(f"error: {cli_message(err)}", file=sys.stderr)
        return 2
    kept = f", {counts['kept']} kept in high precision ({kept_dtypes(state, args.format)}, as --dit holds them)" \
        if counts["kept"] else ""
    print(f"wrote {out} ({out.stat().st_size / 1e9:.2f} GB): {counts[args.format]} weight matrices as "
          f"{args.format}{kept}; recorded as {cli_words(variant.text(), variant.settings)}")
    return 0
