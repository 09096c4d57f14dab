"""The first image after a restart: seconds from a fresh process's start to its first and its second image.

    python bench/cold_start.py --out DIR [--models DIR] [--schedule ...]   # CUDA GPU, full-size random weights
    python bench/cold_start.py --out DIR --tiny                           # CPU smoke test of the same code

Each row of the schedule is a new Python process started the way a user starts one (`ERNIE-Image` through the
library's LocalPipe, or diffusers' ErnieImagePipeline.from_pretrained), reading the weights from files that are
already in the page cache (the script reads every file once first), under the CUDA allocator the row names
(PyTorch's default "native", or "cudaMallocAsync", which ComfyUI selects) and with its own inductor/Triton cache
folders: `empty` starts from empty folders, `warm` reuses the folders an `empty` run of the same allocator, pipeline,
variant, format and PE filled, in whichever compile mode (a restart of a process that compiled the same graphs
before: an `empty` row with `-compiled` fills them for a `warm` row that compiles only later). Each process makes
`--images` images (3) and reports:

- start+imports: from the parent's spawn to the child's imports done (Python start, torch, the pack);
- open: LocalPipe.load (every file's header and config checked; the text encoder's and VAE's libraries,
  transformers and diffusers, imported on first use);
- load: every part's weights built on the device (each part's first load, timed inside the first image);
  diffusers: from_pretrained and the move to the GPU;
- first-use: what the first image cost beyond its load and the warm (last) image: compiling, CUDA-graph captures,
  the allocator's first growth, and, while LoadOptions.compile="auto" runs uncompiled, the uncompiled calls' extra;
- images: each whole `generate` call; to first / second image: from the spawn to that image's end.

The weights: full-size random ones (runtime/formats/configs) saved once as a diffusers folder under --models
(about 31 GB, rewritten only when missing), with word-level tokenizers over the whole vocabulary so that a forced
256-token PE rewrite decodes to 256 words (random weights stop anywhere: the EOS logit is masked until the cap, in
the pack and in diffusers alike). FP8 rows quantise the bf16 DiT on load (`quant="fp8"`, as the Quant Config node
does with a bf16 file). Writes DIR/cold_start.json and DIR/cold_start.md.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable, Optional

BENCH = Path(__file__).resolve().parent
MARK = "COLD_START "
PROMPT = "a red fox standing in fresh snow at sunrise, soft golden light, pine forest in the background"
SEED = 3
PRESETS = {"turbo": (8, 1.0), "base": (50, 4.0)}
TINY_PRESETS = {"turbo": (2, 1.0), "base": (3, 4.0)}

# pipeline-variant-format-pe[-eager]: e.g. ours-turbo-fp8-pe, ours-base-bf16-nope, diffusers-turbo-bf16-pe
DEFAULT_SCHEDULE = (
    "native:empty:ours-turbo-fp8-pe", "native:warm:ours-turbo-fp8-pe",
    "cudaMallocAsync:empty:ours-turbo-fp8-pe", "cudaMallocAsync:warm:ours-turbo-fp8-pe",
    "native:empty:ours-base-fp8-nope", "native:warm:ours-base-bf16-nope",
    "native:warm:ours-turbo-fp8-pe-compiled",
    "native:empty:diffusers-turbo-bf16-pe",
)


@dataclass(frozen=True)
class Row:
    allocator: str  # "native" or "cudaMallocAsync"
    caches: str  # "empty" or "warm"
    pipeline: str  # "ours" or "diffusers"
    variant: str  # "turbo" or "base"
    fmt: str  # "bf16" or "fp8"
    pe: bool
    compile: str = "auto"  # LoadOptions.compile: "auto", "compiled" (True) or "eager" (False)

    @classmethod
    def parse(cls, text: str) -> "Row":
        allocator, caches, what = text.split(":") if text.count(":") == 2 else ("", "", "")
        parts = what.split("-")
        if (allocator not in ("native", "cudaMallocAsync") or caches not in ("empty", "warm") or len(parts) not in (4, 5)
                or parts[4:] not in ([], ["eager"], ["compiled"])):
            raise SystemExit(f"schedule entry {text!r}: use "
                             "ALLOCATOR:empty|warm:ours|diffusers-turbo|base-bf16|fp8-pe|nope[-eager|-compiled]")
        return cls(allocator, caches, parts[0], parts[1], parts[2], parts[3] == "pe", (parts[4:] or ["auto"])[0])

    @property
    def what(self) -> str:
        return f"{self.pipeline}-{self.variant}-{self.fmt}-{'pe' if self.pe else 'nope'}" + (
            "" if self.compile == "auto" else f"-{self.compile}")


# -- the weights ----------------------------------------------------------------------------------------------------

def word_level_tokenizer_folder(folder: Path, vocab_size: int, adds_bos: bool, max_length: int,
                                chat_template: Optional[str] = None) -> None:
    """A tokenizer folder the pack and transformers both read: one word per id over the whole vocabulary."""
    from tokenizers import Tokenizer, models, pre_tokenizers, processors

    from ernie_image.runtime.demo.tiny_vocab import BOS_ID, SPECIAL_TOKENS

    vocab = {token: index for index, token in enumerate(SPECIAL_TOKENS)}
    for word, _ in pre_tokenizers.Whitespace().pre_tokenize_str(PROMPT):
        vocab.setdefault(word, len(vocab))
    while len(vocab) < vocab_size:
        vocab[f"w{len(vocab)}"] = len(vocab)
    tokenizer = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer.add_special_tokens(SPECIAL_TOKENS)
    if adds_bos:
        tokenizer.post_processor = processors.TemplateProcessing(single="<s> $A", pair="<s> $A $B",
                                                                 special_tokens=[("<s>", BOS_ID)])
    shutil.rmtree(folder, ignore_errors=True)
    folder.mkdir(parents=True)
    tokenizer.save(str(folder / "tokenizer.json"))
    specials = {"bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>", "pad_token": "<pad>"}
    config = {"tokenizer_class": "TokenizersBackend", **specials, "model_max_length": max_length,
              "add_bos_token": adds_bos, "add_eos_token": False}
    (folder / "tokenizer_config.json").write_text(json.dumps(config, indent=2))
    (folder / "special_tokens_map.json").write_text(json.dumps(specials))
    if chat_template is not None:
        (folder / "chat_template.jinja").write_text(chat_template)


def write_full_size_folder(scratch: Path, pe_tokens: int) -> None:
    import torch
    from e2e import build_components
    from enhancer import full_size_pe

    from ernie_image.runtime.demo.tiny import save_diffusers_layout
    from ernie_image.runtime.formats.config_json import released_config_folder
    from ernie_image.runtime.text.pe_prompt import ERNIE_PE_CHAT_TEMPLATE

    _, reference_dit, text_encoder, _, vae, _ = build_components()
    pe, raw = full_size_pe(torch.device("cuda"))
    save_diffusers_layout(scratch, released_config_folder("turbo"), reference_dit, text_encoder, vae, pe)
    vocab = min(raw["vocab_size"], text_encoder.config.text_config.vocab_size)
    word_level_tokenizer_folder(scratch / "tokenizer", vocab, True, 2048)
    word_level_tokenizer_folder(scratch / "pe_tokenizer", vocab, False, pe_tokens, ERNIE_PE_CHAT_TEMPLATE)


def write_tiny_folder(scratch: Path) -> None:
    from ernie_image.runtime.demo.tiny import build_tiny_model

    build_tiny_model(scratch, "diffusers", "turbo", with_pe=True)


def write_once(folder: Path, write: Callable[[Path], None]) -> None:
    """`write` into a scratch folder of this run's own, then put it in place; a run that finished first wins, and
    nothing half-written is left behind, whatever happens."""
    scratch = Path(tempfile.mkdtemp(prefix=folder.name + ".partial.", dir=folder.parent))
    try:
        write(scratch)
        os.replace(scratch, folder)
    except OSError:
        if not folder.is_dir():
            raise
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


def read_into_page_cache(folder: Path) -> float:
    """Read every file once, so each process reads its weights from memory as a restarted ComfyUI usually does."""
    started = time.perf_counter()
    for path in sorted(folder.rglob("*")):
        if path.is_file():
            with path.open("rb") as handle:
                while handle.read(64 << 20):
                    pass
    return time.perf_counter() - started


# -- one fresh process -------------------------------------------------------------------------------------------

def force_pe_length() -> None:
    """Random PE weights stop anywhere: mask EOS until the cap, so every rewrite is exactly pe_max_new_tokens."""
    from ernie_image.runtime.text.enhancer import LocalEnhancer

    settings = LocalEnhancer.settings

    def forced(self, temperature, top_p, max_new_tokens, min_new_tokens=0):
        return settings(self, temperature, top_p, max_new_tokens, max_new_tokens)

    LocalEnhancer.settings = forced


class LoadClock:
    """Seconds spent in the pipe's part loaders (weights built and placed), the device drained around each."""

    def __init__(self, parts, sync) -> None:
        self.seconds = 0.0
        for name in ("load_tokenizer", "load_text_tower", "load_dit", "load_vae", "load_enhancer"):
            self._wrap(parts, name, sync)

    def _wrap(self, parts, name: str, sync) -> None:
        method = getattr(parts, name)

        def timed(*args, **kwargs):
            sync()
            started = time.perf_counter()
            try:
                return method(*args, **kwargs)
            finally:
                sync()
                self.seconds += time.perf_counter() - started

        setattr(parts, name, timed)


def child(args) -> None:
    row = Row.parse(args.child)
    imported_at_start = time.time()
    import torch

    sys.path.insert(0, str(BENCH))
    from common import import_package

    import_package()
    device = "cpu" if args.tiny else "cuda"
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    steps, cfg = (TINY_PRESETS if args.tiny else PRESETS)[row.variant]
    if row.pipeline == "ours":
        from ernie_image.runtime.core.host import NullHost
        from ernie_image.runtime.core.request import GenerationRequest
        from ernie_image.runtime.formats.sources import ModelSources
        from ernie_image.runtime.local.options import LoadOptions
        from ernie_image.runtime.local.pipe import LocalPipe

        imported = time.time()
        force_pe_length()
        compile_choice = {"auto": "auto", "compiled": True, "eager": False}[row.compile]
        options = LoadOptions(device=device, quant="fp8" if row.fmt == "fp8" else "none", compile=compile_choice,
                              previews=False)
        opening = time.perf_counter()
        pipe = LocalPipe.load(ModelSources(model_dir=args.models, variant=row.variant), options)
        open_s = time.perf_counter() - opening
        clock = LoadClock(pipe.parts, sync)
        request = GenerationRequest(prompt=PROMPT, steps=steps, cfg=cfg, width=args.size, height=args.size, seed=SEED,
                                    use_pe=row.pe, pe_max_new_tokens=args.pe_tokens)

        host = NullHost()
        notes = host.messages

        def image() -> dict:
            result = pipe.generate(request, host)
            assert torch.isfinite(result.images).all(), "the image is not finite"
            if row.pe:
                assert result.info.get("pe_tokens") == args.pe_tokens, f"the PE did not rewrite: {result.info}"
            return {key: result.info[key] for key in ("pe_s", "text_s", "sampling_s", "decode_s") if key in result.info}
    else:
        from diffusers import ErnieImagePipeline

        from ernie_image.runtime.sampling.euler import initial_noise

        imported = time.time()
        dtype = torch.float32 if args.tiny else torch.bfloat16
        sync()
        loading = time.perf_counter()
        open_s = 0.0
        reference = ErnieImagePipeline.from_pretrained(args.models, torch_dtype=dtype).to(device)
        reference.set_progress_bar_config(disable=True)
        reference.pe.generation_config.min_new_tokens = args.pe_tokens
        reference.pe_tokenizer.model_max_length = args.pe_tokens
        sync()
        clock = argparse.Namespace(seconds=time.perf_counter() - loading)
        notes = []

        def image() -> dict:
            latents = initial_noise(SEED, 1, args.size, args.size).to(device, dtype)
            torch.manual_seed(SEED)
            reference(prompt=PROMPT, width=args.size, height=args.size, num_inference_steps=steps, guidance_scale=cfg,
                      latents=latents, output_type="np", use_pe=row.pe)
            return {}

    timed = []
    for _ in range(args.images):
        sync()
        started = time.perf_counter()
        phases = image()
        sync()
        timed.append((time.perf_counter() - started, phases, time.time()))
    (first_s, first_phases, first_done), (second_s, _, second_done) = timed[:2]
    warm_s, warm_phases, _ = timed[-1]
    load_s = clock.seconds
    print(MARK + json.dumps({
        "row": asdict(row), "start_and_imports_s": round(imported - args.spawned_at, 2),
        "python_start_s": round(imported_at_start - args.spawned_at, 2), "open_s": round(open_s, 2),
        "load_s": round(load_s, 2), "images_s": [round(wall, 2) for wall, _, _ in timed],
        "first_image_s": round(first_s, 2), "second_image_s": round(second_s, 2), "warm_image_s": round(warm_s, 2),
        "first_use_s": round(first_s - (load_s if row.pipeline == "ours" else 0.0) - warm_s, 2),
        "to_first_image_s": round(first_done - args.spawned_at, 2),
        "to_second_image_s": round(second_done - args.spawned_at, 2),
        "first_phases": first_phases, "warm_phases": warm_phases,
        "notes": [note for note in notes if "compil" in note]}), flush=True)


# -- the parent --------------------------------------------------------------------------------------------------

def run_row(row: Row, args, cache_root: Path) -> dict:
    caches = cache_root / f"{row.allocator}-{row.what.removesuffix('-' + row.compile)}"  # one compile, any mode
    if row.caches == "empty":
        shutil.rmtree(caches, ignore_errors=True)
    caches.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "PYTORCH_CUDA_ALLOC_CONF": f"backend:{row.allocator}",
           "TORCHINDUCTOR_CACHE_DIR": str(caches / "inductor"), "TRITON_CACHE_DIR": str(caches / "triton"),
           "PYTHONUNBUFFERED": "1"}
    command = [sys.executable, str(Path(__file__).resolve()), "--child", f"{row.allocator}:{row.caches}:{row.what}",
               "--models", str(args.models), "--size", str(args.size), "--pe-tokens", str(args.pe_tokens),
               "--images", str(args.images)]
    command += ["--tiny"] if args.tiny else []
    spawned = time.time()
    try:
        done = subprocess.run(command + ["--spawned-at", repr(spawned)], env=env, capture_output=True, text=True,
                              timeout=args.child_timeout)
    except subprocess.TimeoutExpired:
        return {"row": asdict(row), "error": f"no second image within --child-timeout {args.child_timeout} s"}
    lines = [line for line in done.stdout.splitlines() if line.startswith(MARK)]
    if done.returncode != 0 or not lines:
        tail = (done.stderr or done.stdout).strip().splitlines()[-4:]
        return {"row": asdict(row), "error": f"exit {done.returncode}: {' | '.join(tail)}"[:600]}
    return json.loads(lines[-1][len(MARK):])


COLUMNS = ["allocator", "caches", "row", "start+imports s", "open s", "load s", "first-use s", "images s",
           "to first image s", "to second image s", "first <= load + warm + 3 / 10 s"]


def table_row(result: dict) -> dict:
    row = Row(**result["row"])
    shown = {"allocator": row.allocator, "caches": row.caches, "row": row.what}
    if "error" in result:
        return {**shown, "start+imports s": result["error"]}
    margin = 3.0 if row.caches == "warm" else 10.0
    target = result["load_s"] + result["warm_image_s"] + margin
    return {**shown, "start+imports s": result["start_and_imports_s"], "open s": result["open_s"],
            "load s": result["load_s"], "first-use s": result["first_use_s"],
            "images s": " / ".join(str(wall) for wall in result["images_s"]),
            "to first image s": result["to_first_image_s"], "to second image s": result["to_second_image_s"],
            "first <= load + warm + 3 / 10 s": ("yes" if result["first_image_s"] <= target else "no")
            if row.pipeline == "ours" else ""}


def main(argv: Optional[list[str]] = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, help="folder for cold_start.json and cold_start.md (required)")
    parser.add_argument("--models", type=Path, help="the weights folder (default: DIR/models; written when missing)")
    parser.add_argument("--schedule", nargs="+", help="ALLOCATOR:empty|warm:ROW entries, run in order")
    parser.add_argument("--tiny", action="store_true", help="CPU smoke test with the tiny models")
    parser.add_argument("--size", type=int, help="image side (default 1024; --tiny: 256)")
    parser.add_argument("--pe-tokens", type=int, default=256, help="the PE rewrite's length (forced)")
    parser.add_argument("--images", type=int, default=3, help="images per process (the last is the warm one)")
    parser.add_argument("--child-timeout", type=float, default=240.0)
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument("--spawned-at", type=float, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    args.size = args.size or (256 if args.tiny else 1024)
    if args.images < 2:
        parser.error("--images must be 2 or more: the first image and a warm one")
    if args.child:
        child(args)
        return
    if args.out is None:
        parser.error("--out DIR is required")
    sys.path.insert(0, str(BENCH))
    from common import environment, import_package, table

    import_package()
    schedule = [Row.parse(entry) for entry in (args.schedule or DEFAULT_SCHEDULE)]  # refused before any work
    args.out.mkdir(parents=True, exist_ok=True)
    args.models = args.models or args.out / "models"
    if not args.models.is_dir():
        started = time.perf_counter()
        write_once(args.models, write_tiny_folder if args.tiny else
                   lambda scratch: write_full_size_folder(scratch, args.pe_tokens))
        print(f"# weights written to {args.models} in {time.perf_counter() - started:.1f} s", flush=True)
    print(f"# weights read into the page cache in {read_into_page_cache(args.models):.1f} s", flush=True)
    results = []
    with tempfile.TemporaryDirectory(prefix="cold_start_caches_") as cache_root:
        for row in schedule:
            results.append(run_row(row, args, Path(cache_root)))
            print("# " + json.dumps(results[-1]), flush=True)
            (args.out / "cold_start.json").write_text(json.dumps(
                {"environment": environment(), "size": args.size, "pe_tokens": args.pe_tokens, "results": results},
                indent=2))
    markdown = table([table_row(result) for result in results], COLUMNS)
    (args.out / "cold_start.md").write_text(markdown + "\n")
    print(markdown)
    failed = [result for result in results if "error" in result]
    if failed:
        sys.exit(f"{len(failed)} of {len(results)} rows failed (their errors are in the table)")


if __name__ == "__main__":
    main()
