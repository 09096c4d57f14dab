"""Whole images with the prompt enhancer (PE) on and off: this pack's LocalPipe beside diffusers' ErnieImagePipeline.

    python bench/speed.py --pe-e2e --out DIR          # CUDA GPU, full-size random weights (planned: ~4 min, H200)
    python bench/speed.py --pe-e2e --tiny --out DIR   # CPU smoke test of the same code with the tiny models

Rows: Turbo (8 steps, CFG 1) with an FP8 and with a bf16 DiT, Base (50 steps, CFG 4) with an FP8 DiT, each with the
PE on and off, then diffusers' pipeline (bf16 DiT, eager: it has no FP8 path) for Turbo and Base, PE on and off.
Each image is timed whole and split into PE rewrite / text encode / DiT sampling / VAE decode / the rest.

- Weights: full-size random ones built on the GPU from the released configs (runtime/formats/configs; no file is written or
  read). Both pipelines hold the same tensors (DiT, text encoder, PE, VAE), so both fit on one GPU at once; the
  pack's DiT additionally holds its fused projections and, for the FP8 rows, an FP8 copy of the block Linears.
- The PE rewrite is forced to exactly `--pe-tokens` (256) new tokens, since random weights stop anywhere: both
  pipelines mask the EOS logit until then (min_new_tokens = max_new_tokens; the pack through its sampler's
  min_new_tokens, diffusers through the PE's generation_config.min_new_tokens and pe_tokenizer.model_max_length,
  which diffusers passes as max_new_tokens). Sampling as each pipeline does it: temperature 0.6, top_p 0.95, top_k 50
  (diffusers: transformers' generate(); the pack: its static-cache CUDA-graph decoder with sampling on the GPU).
- Tokenizers: word-level over the PE's whole vocabulary (131,072 ids), so a 256-token rewrite decodes to 256 words
  and the text encoder then reads 257 tokens, as with a real rewrite; the user prompt is a short one.
- The pack's PE stays resident between images, as its VRAM plan keeps it when everything fits (an H200 does).
- warm: the median of `--warm-runs` images after the first of that row in this process. first in process: the
  row's first image (what it paid is in the notes). fresh process: a new Python process for the row (imports,
  random weights built on the GPU in place of reading files, compile from an empty inductor/Triton cache, the
  first image), timed from its start; `--cold-process` picks the rows (each costs ~20-45 s; default: the pack's
  Turbo FP8 and diffusers' Turbo, PE on), and runs them before this process builds anything.
Writes DIR/pe_e2e.json and DIR/pe_e2e.md.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable, Optional

import torch

from common import REPO_ROOT, environment, import_package, table

import_package()

from ernie_image.runtime.core.host import NullHost  # noqa: E402
from ernie_image.runtime.core.request import GenerationRequest  # noqa: E402
from ernie_image.runtime.demo.tiny_vocab import BOS_ID, SPECIAL_TOKENS  # noqa: E402
from ernie_image.runtime.sampling.euler import initial_noise  # noqa: E402
from ernie_image.runtime.text.enhancer import LocalEnhancer  # noqa: E402
from ernie_image.runtime.text.pe_model import PeWeights  # noqa: E402
from ernie_image.runtime.text.pe_prompt import ERNIE_PE_CHAT_TEMPLATE  # noqa: E402

PROMPT = "a red fox standing in fresh snow at sunrise, soft golden light, pine forest in the background"
SEED = 3
PRESETS = {"Turbo": (8, 1.0), "Base": (50, 4.0)}
TINY_PRESETS = {"Turbo": (2, 1.0), "Base": (3, 4.0)}  # the CPU smoke run: the same code, fewer steps
OURS_ROWS = (("Turbo", "fp8"), ("Turbo", "bf16"), ("Base", "fp8"))
DIFFUSERS_ROWS = (("Turbo", "bf16"), ("Base", "bf16"))
# The speed issue's targets for a whole image with the PE on (1024x1024, one H200).
TARGETS_S = {("Turbo", "fp8"): 2.0, ("Turbo", "bf16"): 2.4, ("Base", "fp8"): 10.5}
COLD_MARK = "PE_E2E_COLD "


def row_key(pipeline: str, preset: str, dit: str, pe: bool) -> str:
    return f"{pipeline}-{preset}-{dit}-{'on' if pe else 'off'}".lower()


def parse_row_key(key: str) -> tuple[str, str, str, bool]:
    """'ours-turbo-fp8-on' -> ("ours", "Turbo", "fp8", True); a key naming no row of this bench is refused."""
    keys = {row_key(p, preset, dit, pe): (p, preset, dit, pe) for p, rows in (("ours", OURS_ROWS),
            ("diffusers", DIFFUSERS_ROWS)) for preset, dit in rows for pe in (True, False)}
    if key not in keys:
        raise SystemExit(f"--cold-process: no row {key!r}; rows are {', '.join(sorted(keys))}")
    return keys[key]


# -- timing -------------------------------------------------------------------------------------------------------

def device_sync(device: torch.device) -> Callable[[], None]:
    return (lambda: torch.cuda.synchronize(device)) if device.type == "cuda" else (lambda: None)


@dataclass
class Image:
    """One whole image's wall seconds and where they went."""

    wall_s: float
    pe_s: float
    text_s: float
    dit_s: float
    vae_s: float
    pe_tokens: int

    @property
    def other_s(self) -> float:
        return self.wall_s - self.pe_s - self.text_s - self.dit_s - self.vae_s


class PhaseClock:
    """Seconds spent inside wrapped methods (device drained on entry and exit), with each phase's first entry and
    last exit, for a pipeline that reports no timings of its own (diffusers)."""

    def __init__(self, sync: Callable[[], None]) -> None:
        self.sync = sync
        self.reset()

    def reset(self) -> None:
        self.seconds: dict[str, float] = {}
        self.first_start: dict[str, float] = {}
        self.last_end: dict[str, float] = {}
        self.new_tokens = 0

    def wrap(self, owner: Any, name: str, phase: str) -> None:
        original = getattr(owner, name)

        def timed(*args, **kwargs):
            self.sync()
            started = time.perf_counter()
            result = original(*args, **kwargs)
            self.sync()
            ended = time.perf_counter()
            self.seconds[phase] = self.seconds.get(phase, 0.0) + ended - started
            self.first_start.setdefault(phase, started)
            self.last_end[phase] = ended
            if phase == "generate":
                self.new_tokens += int(result.shape[1] - kwargs["input_ids"].shape[1])
            return result

        setattr(owner, name, timed)


# -- weights ------------------------------------------------------------------------------------------------------

@dataclass
class Components:
    """Every model both pipelines use, each held once (the pack's DiT and text tower share diffusers' tensors)."""

    device: torch.device
    dtype: torch.dtype
    dit: Any  # the pack's ErnieDiT
    reference_dit: Any  # diffusers' ErnieImageTransformer2DModel on the same tensors
    text_encoder: Any  # transformers' Mistral3Model, diffusers' text encoder
    tower: Any  # the pack's text tower on the text encoder's tensors
    vae: Any
    pe: Any  # one Ministral3ForCausalLM for both pipelines
    text_tokenizer: Any
    pe_tokenizer: Any
    described: dict = field(default_factory=dict)


def word_tokenizers(vocab_size: int, pe_max_new_tokens: int):
    """(text tokenizer, PE tokenizer): one word per id over the whole vocabulary (the specials first, as in
    Tekken), so a rewrite of N sampled ids decodes to N words and encodes back to N tokens. The text tokenizer adds
    BOS (as Tekken does); the PE's does not (Baidu's chat template writes it) and carries the chat template and a
    model_max_length of `pe_max_new_tokens` (diffusers passes it to generate as max_new_tokens)."""
    from tokenizers import Tokenizer, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    vocab = {token: index for index, token in enumerate(SPECIAL_TOKENS)}
    for word, _ in pre_tokenizers.Whitespace().pre_tokenize_str(PROMPT):
        vocab.setdefault(word, len(vocab))
    while len(vocab) < vocab_size:
        vocab[f"w{len(vocab)}"] = len(vocab)

    def build(adds_bos: bool, max_length: int):
        tokenizer = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
        tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
        tokenizer.add_special_tokens(SPECIAL_TOKENS)
        if adds_bos:
            tokenizer.post_processor = processors.TemplateProcessing(
                single="<s> $A", pair="<s> $A $B", special_tokens=[("<s>", BOS_ID)])
        return PreTrainedTokenizerFast(tokenizer_object=tokenizer, bos_token="<s>", eos_token="</s>",
                                       pad_token="<pad>", unk_token="<unk>", model_max_length=max_length)

    pe_tokenizer = build(False, pe_max_new_tokens)
    pe_tokenizer.chat_template = ERNIE_PE_CHAT_TEMPLATE
    return build(True, 2048), pe_tokenizer


def force_rewrite_length(pe, pe_tokens: int) -> None:
    """diffusers' generate() takes its settings from the PE's generation_config: EOS masked until `pe_tokens`."""
    pe.generation_config.min_new_tokens = pe_tokens


def build_full_size(pe_tokens: int) -> Components:
    from e2e import build_components
    from enhancer import full_size_pe

    device = torch.device("cuda")
    dit, reference_dit, text_encoder, tower, vae, _ = build_components()
    pe, raw = full_size_pe(device)
    vocab = min(raw["vocab_size"], text_encoder.config.text_config.vocab_size)
    text_tokenizer, pe_tokenizer = word_tokenizers(vocab, pe_tokens)
    force_rewrite_length(pe, pe_tokens)
    described = {"DiT": f"{dit.config.num_layers} blocks, hidden {dit.config.hidden_size}",
                 "PE": f"{raw['num_hidden_layers']} layers, hidden {raw['hidden_size']}, vocab {raw['vocab_size']}",
                 "weights": "full-size random (runtime/formats/configs), bf16, built on the GPU"}
    return Components(device, torch.bfloat16, dit, reference_dit, text_encoder, tower, vae, pe, text_tokenizer,
                      pe_tokenizer, described)


def build_tiny(pe_tokens: int) -> Components:
    from e2e import shared_text_tower

    from ernie_image.runtime.demo.tiny import TinySizes, build_dit, build_text_encoder, build_vae, lively_prompt_enhancer
    from ernie_image.runtime.model.dit import DiTConfig, ErnieDiT

    device, sizes = torch.device("cpu"), TinySizes()
    reference_dit = build_dit(sizes, 0).requires_grad_(False)
    dit = ErnieDiT(DiTConfig.from_dict(dict(reference_dit.config)))
    dit.load_state_dict(reference_dit.state_dict(), assign=True)
    text_encoder = build_text_encoder(sizes, 1).requires_grad_(False)
    pe = lively_prompt_enhancer(sizes, 3).eval().requires_grad_(False)
    text_tokenizer, pe_tokenizer = word_tokenizers(pe.config.vocab_size, pe_tokens)
    force_rewrite_length(pe, pe_tokens)
    described = {"DiT": f"tiny, {sizes.dit_layers} blocks", "PE": f"tiny, vocab {pe.config.vocab_size}",
                 "weights": "tiny random (runtime/demo/tiny.py), fp32, CPU"}
    return Components(device, torch.float32, dit.eval().requires_grad_(False), reference_dit, text_encoder,
                      shared_text_tower(text_encoder, device), build_vae(sizes, 2).requires_grad_(False), pe,
                      text_tokenizer, pe_tokenizer, described)


class ForcedLengthEnhancer(LocalEnhancer):
    """The pack's local PE with EOS masked until the cap: every rewrite is exactly max_new_tokens long."""

    def settings(self, temperature: float, top_p: float, max_new_tokens: int, min_new_tokens: int = 0):
        return super().settings(temperature, top_p, max_new_tokens, max_new_tokens)


class DiTs:
    """The pack's DiT per format, prepared as LocalPipe prepares a loaded one (fused projections on CUDA, blocks
    compiled where Triton is), each built on first use."""

    def __init__(self, components: Components) -> None:
        from ernie_image.runtime.model.compile import fuse_projections

        self.components = components
        if components.device.type == "cuda":
            fuse_projections(components.dit)
        self.models: dict[str, Any] = {}

    def get(self, fmt: str):
        from ernie_image.runtime.model.compile import compile_blocks
        from common import quantised_copy

        if fmt not in self.models:
            model = self.components.dit if fmt == "bf16" else quantised_copy(self.components.dit, fmt)
            compile_blocks(model)  # False (left eager) off CUDA or without Triton
            self.models[fmt] = model
        return self.models[fmt]


def our_pipe(components: Components):
    """LocalPipe with the components given in memory (its VRAM manager off, since no file is read), the PE
    resident as the pack's plan keeps it when everything fits."""
    from ernie_image.runtime.formats.sources import ModelSources
    from ernie_image.runtime.local.options import LoadOptions
    from ernie_image.runtime.local.pipe import LocalPipe

    weights_path = Path("(random weights in memory)")
    dtype = "bf16" if components.dtype == torch.bfloat16 else "fp32"
    pipe = LocalPipe(ModelSources(pe=weights_path), LoadOptions(device=str(components.device), dtype=dtype,
                                                                previews=False), "turbo")
    pipe.memory.active = False
    loaded = pipe.parts
    loaded.tokenizer, loaded.text_tower, loaded.vae = components.text_tokenizer, components.tower, components.vae
    enhancer = ForcedLengthEnhancer(components.pe, components.pe_tokenizer, PeWeights(weights_path, None, {}),
                                    components.device, components.dtype)
    enhancer.placed = True  # stays on the device after its phase (a resident PE in the pack's plan)
    loaded.enhancer = enhancer
    return pipe


def our_image(pipe, model, steps: int, cfg: float, pe: bool, size: int, pe_tokens: int) -> Image:
    pipe.parts.dit = model
    request = GenerationRequest(prompt=PROMPT, steps=steps, cfg=cfg, width=size, height=size, seed=SEED, use_pe=pe,
                                pe_max_new_tokens=pe_tokens)
    sync = device_sync(pipe.device)
    sync()
    started = time.perf_counter()
    result = pipe.generate(request, NullHost())
    sync()
    wall = time.perf_counter() - started
    assert torch.isfinite(result.images).all(), "the pack's image is not finite"
    info = result.info
    if pe:
        assert info.get("pe") == "local" and info.get("pe_tokens") == pe_tokens, f"PE did not rewrite: {info}"
    return Image(wall, info.get("pe_s", 0.0), info["text_s"], info["sampling_s"], info["decode_s"],
                 info.get("pe_tokens", 0))


def diffusers_pipe(components: Components):
    from diffusers import ErnieImagePipeline, FlowMatchEulerDiscreteScheduler

    config = json.loads((REPO_ROOT / "runtime" / "formats" / "configs" / "ERNIE-Image" / "scheduler" / "config.json").read_text())
    reference = ErnieImagePipeline(transformer=components.reference_dit, vae=components.vae,
                                   text_encoder=components.text_encoder, tokenizer=components.text_tokenizer,
                                   scheduler=FlowMatchEulerDiscreteScheduler.from_config(config), pe=components.pe,
                                   pe_tokenizer=components.pe_tokenizer)
    reference.set_progress_bar_config(disable=True)
    clock = PhaseClock(device_sync(components.device))
    clock.wrap(reference, "_enhance_prompt_with_pe", "pe")
    clock.wrap(reference, "encode_prompt", "text")
    clock.wrap(components.vae, "decode", "vae")
    clock.wrap(components.pe, "generate", "generate")
    return reference, clock


def diffusers_image(reference, clock: PhaseClock, components: Components, steps: int, cfg: float, pe: bool,
                    size: int, pe_tokens: int) -> Image:
    import numpy

    latents = initial_noise(SEED, 1, size, size).to(components.device, components.dtype)
    torch.manual_seed(SEED)  # diffusers samples the PE from the global RNG
    clock.reset()
    clock.sync()
    started = time.perf_counter()
    images = reference(prompt=PROMPT, negative_prompt="", width=size, height=size, num_inference_steps=steps,
                       guidance_scale=cfg, latents=latents, output_type="np", use_pe=pe).images
    clock.sync()
    wall = time.perf_counter() - started
    assert numpy.isfinite(images).all(), "diffusers' image is not finite"
    if pe:
        assert clock.new_tokens == pe_tokens, f"diffusers' PE wrote {clock.new_tokens} tokens, not {pe_tokens}"
    sampling = clock.first_start["vae"] - clock.last_end["text"]
    return Image(wall, clock.seconds.get("pe", 0.0), clock.seconds["text"], sampling, clock.seconds["vae"],
                 clock.new_tokens)


# -- the run ------------------------------------------------------------------------------------------------------

@dataclass
class Row:
    pipeline: str
    preset: str
    dit: str
    pe: bool
    first: Optional[Image] = None
    warm: list[Image] = field(default_factory=list)
    fresh_process_s: Optional[float] = None
    fresh_process: Optional[dict] = None

    @property
    def key(self) -> str:
        return row_key(self.pipeline, self.preset, self.dit, self.pe)

    @property
    def target_s(self) -> Optional[float]:
        return TARGETS_S.get((self.preset, self.dit)) if self.pipeline == "ours" and self.pe else None

    def warm_image(self) -> Optional[Image]:
        """The warm image of median wall time."""
        if not self.warm:
            return None
        return sorted(self.warm, key=lambda image: image.wall_s)[(len(self.warm) - 1) // 2]


def timed_runs(row: Row, run: Callable[[], Image], warm_runs: int, first: bool = True) -> Row:
    if first:
        row.first = run()
    row.warm = [run() for _ in range(warm_runs)]
    print("# " + json.dumps({"row": row.key, "first_s": round(row.first.wall_s, 3) if row.first else None,
                             "warm_s": [round(i.wall_s, 3) for i in row.warm]}), flush=True)
    return row


def measure_ours(components: Components, args, dits: DiTs) -> list[Row]:
    pipe = our_pipe(components)
    rows = []
    for preset, fmt in OURS_ROWS:
        model = dits.get(fmt)
        for pe in (True, False):
            rows.append(timed_runs(Row("ours", preset, fmt, pe),
                                   lambda: our_image(pipe, model, *args.presets[preset], pe, args.size,
                                                     args.pe_tokens),
                                   args.warm_runs))
    return rows


def measure_diffusers(components: Components, args) -> list[Row]:
    reference, clock = diffusers_pipe(components)
    rows = []
    for preset, fmt in DIFFUSERS_ROWS:
        base_single = preset == "Base" and args.diffusers_base_runs == 1
        for pe in (True, False):
            rows.append(timed_runs(Row("diffusers", preset, fmt, pe),
                                   lambda: diffusers_image(reference, clock, components, *args.presets[preset], pe,
                                                           args.size, args.pe_tokens),
                                   1 if base_single else args.warm_runs, first=not base_single))
    return rows


def build(args) -> Components:
    return build_tiny(args.pe_tokens) if args.tiny else build_full_size(args.pe_tokens)


def cold_child(args) -> None:
    """One row's first image in this fresh process, everything included; prints one COLD_MARK line."""
    entered = time.time()
    pipeline, preset, fmt, pe = parse_row_key(args.cold_child)
    components = build(args)
    components_built = time.time()
    if pipeline == "ours":
        model = DiTs(components).get(fmt)
        prepared = time.time()
        image = our_image(our_pipe(components), model, *args.presets[preset], pe, args.size, args.pe_tokens)
    else:
        reference, clock = diffusers_pipe(components)
        prepared = time.time()
        image = diffusers_image(reference, clock, components, *args.presets[preset], pe, args.size,
                                args.pe_tokens)
    finished = time.time()
    print(COLD_MARK + json.dumps({
        "row": args.cold_child, "process_s": round(finished - args.spawned_at, 2),
        "start_and_imports_s": round(entered - args.spawned_at, 2), "build_s": round(components_built - entered, 2),
        "prepare_dit_s": round(prepared - components_built, 2), "image_s": round(image.wall_s, 3),
        "image": {**asdict(image), "other_s": image.other_s}}), flush=True)


def fresh_process_runs(args, keys: list[str]) -> dict[str, dict]:
    """Each row in a new Python process, one after another, each with its own empty inductor and Triton caches."""
    results = {}
    for key in keys:
        with tempfile.TemporaryDirectory(prefix="pe_e2e_cold_") as caches:
            env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": os.path.join(caches, "inductor"),
                   "TRITON_CACHE_DIR": os.path.join(caches, "triton")}
            command = [sys.executable, str(Path(__file__).resolve().parent / "speed.py"), "--pe-e2e",
                       "--cold-child", key, "--size", str(args.size), "--pe-tokens", str(args.pe_tokens)]
            command += ["--tiny"] if args.tiny else []
            spawned = time.time()
            try:
                done = subprocess.run(command + ["--spawned-at", repr(spawned)], env=env, capture_output=True,
                                      text=True, timeout=args.cold_timeout)
            except subprocess.TimeoutExpired:
                results[key] = {"row": key, "error": f"no image within --cold-timeout {args.cold_timeout} s"}
                print("# fresh process " + json.dumps(results[key]), flush=True)
                continue
        lines = [line for line in done.stdout.splitlines() if line.startswith(COLD_MARK)]
        if done.returncode != 0 or not lines:
            tail = (done.stderr or done.stdout).strip().splitlines()[-3:]
            results[key] = {"row": key, "error": f"exit {done.returncode}: {' | '.join(tail)}"[:400]}
        else:
            results[key] = json.loads(lines[-1][len(COLD_MARK):])
        print("# fresh process " + json.dumps(results[key]), flush=True)
    return results


def seconds(value: Optional[float], digits: int = 2) -> str:
    return "" if value is None else f"{value:.{digits}f}"


def table_rows(rows: list[Row], smoke: bool) -> list[dict]:
    out = []
    for row in rows:
        warm = row.warm_image()
        target = row.target_s
        dit = {"fp8": "FP8", "bf16": "bf16"}[row.dit]
        out.append({
            "pipeline": "ours (LocalPipe)" if row.pipeline == "ours" else "diffusers ErnieImagePipeline",
            "preset": row.preset, "DiT": dit + (" eager" if row.pipeline == "diffusers" else ""),
            "PE": "on" if row.pe else "off",
            "warm s": seconds(warm.wall_s if warm else None), "first in process s": seconds(
                row.first.wall_s if row.first else None),
            "fresh process s": seconds(row.fresh_process_s) if row.fresh_process_s is not None else (
                "failed" if row.fresh_process else ""),
            "PE s": seconds(warm.pe_s if warm and row.pe else None), "text s": seconds(warm.text_s if warm else None, 3),
            "DiT s": seconds(warm.dit_s if warm else None, 3), "VAE s": seconds(warm.vae_s if warm else None, 3),
            "other s": seconds(warm.other_s if warm else None, 3),
            "PE tokens": str(warm.pe_tokens) if warm and row.pe else "",
            "target s": f"<= {target}" if target is not None else "",
            "meets": "" if target is None or not warm else "(smoke)" if smoke else "yes" if warm.wall_s <= target
            else "no",
        })
    return out


COLUMNS = ["pipeline", "preset", "DiT", "PE", "warm s", "first in process s", "fresh process s", "PE s", "text s",
           "DiT s", "VAE s", "other s", "PE tokens", "target s", "meets"]


def markdown_table(rows: list[dict]) -> str:
    lines = ["| " + " | ".join(COLUMNS) + " |", "| " + " | ".join("---" for _ in COLUMNS) + " |"]
    lines += ["| " + " | ".join(row[c] for c in COLUMNS) + " |" for row in rows]
    return "\n".join(lines)


def pe_prompt_tokens(components: Components, size: int) -> int:
    """Tokens the PE reads for this request (chat template with Baidu's system text, the prompt as JSON)."""
    from ernie_image.runtime.text.pe_prompt import prompt_token_ids, render_chat

    tokenizer = components.pe_tokenizer
    return len(prompt_token_ids(tokenizer, render_chat(tokenizer, PROMPT, size, size)))


ENVIRONMENT_COLUMNS = ["device", "gpu", "torch", "cuda", "triton", "transformers", "diffusers", "python", "date"]


def environment_table(env: dict) -> str:
    return ("| " + " | ".join(ENVIRONMENT_COLUMNS) + " |\n| " + " | ".join("---" for _ in ENVIRONMENT_COLUMNS)
            + " |\n| " + " | ".join(str(env.get(c, "")) for c in ENVIRONMENT_COLUMNS) + " |")


def notes(args, components: Components, peak_gib: Optional[float]) -> list[str]:
    steps = ", ".join(f"{name} {s} steps CFG {c:g}" for name, (s, c) in args.presets.items())
    lines = [
        f"{args.size}x{args.size}, seed {SEED}, {steps}; prompt: {PROMPT!r}.",
        f"Weights: {components.described['weights']}; DiT {components.described['DiT']}; PE "
        f"{components.described['PE']}. Both pipelines hold the same tensors and were loaded together"
        + (f"; peak GPU memory allocated {peak_gib:.1f} GiB." if peak_gib is not None else "."),
        f"PE rewrite forced to exactly {args.pe_tokens} new tokens: the EOS logit is masked until then in both "
        f"pipelines (the pack: sampler min_new_tokens = max_new_tokens; diffusers: pe.generation_config."
        f"min_new_tokens = {args.pe_tokens} and pe_tokenizer.model_max_length = {args.pe_tokens}, which diffusers "
        "passes to generate() as max_new_tokens; Baidu's tokenizer has 2048 there). Temperature 0.6, top_p 0.95, "
        "top_k 50 in both.",
        "Word-level tokenizers over the PE's vocabulary: the rewrite decodes to one word per token, so the text "
        f"encoder reads {args.pe_tokens + 1} tokens with the PE on; the PE reads "
        f"{pe_prompt_tokens(components, args.size)} (Baidu's system text is a few words here, ~70 Tekken tokens "
        "in the real tokenizer: a prefill that much shorter).",
        "Phases: the pack's own timings (PE = its sampler's prefill + decode, text = text phase, DiT = sampling "
        "loop, VAE = decode); diffusers' measured around _enhance_prompt_with_pe, encode_prompt (both calls) and "
        "vae.decode with the device drained at each boundary, DiT = from the last text encode to the decode. "
        "other = the rest of the wall time (chat template, tokenising, noise, copies to the host).",
        "Rows ran in table order in one process. first in process: for the pack, the first PE-on row of each DiT "
        "includes compiling that DiT's blocks (through inductor's default cache, warm if an earlier run on this "
        "machine filled it; FP8 first; the Base rows reuse the compiled FP8 DiT) and the first "
        "PE-on row the PE's first kernels; the PE-off rows include the recompile for the shorter text. diffusers "
        "compiles nothing; its rows ran after the pack's"
        + (", and its Base rows are one image each (warm: not the first image of that pipeline)."
           if args.diffusers_base_runs == 1 else "."),
        f"warm: median of {args.warm_runs} image(s) after the first. fresh process: a new Python process for that "
        "row with empty inductor and Triton caches, timed from its start: imports, weights built (random, on the "
        "device: no file read), DiT prepared and compiled, the first image.",
        "Targets (the speed issue's, for the pack with the PE on): Turbo <= 2.0 s with an FP8 DiT, <= 2.4 s bf16; "
        "Base with the PE <= 10.5 s FP8. diffusers has no FP8 path: its rows are bf16 and eager.",
    ]
    if args.tiny:
        lines.insert(0, "SMOKE RUN: tiny models on the CPU, fewer steps; the figures say nothing about speed.")
    return lines


def run(args) -> None:
    started = time.perf_counter()
    env = environment()
    env["device"] = "cpu (tiny models)" if args.tiny else "cuda"
    print("# " + json.dumps(env), flush=True)
    phases: dict[str, float] = {}
    cold_keys = [] if args.cold_process in ("", "none") else [k.strip() for k in args.cold_process.split(",")]
    for key in cold_keys:
        parse_row_key(key)
    mark = time.perf_counter()
    fresh = fresh_process_runs(args, cold_keys)
    phases["fresh processes"] = time.perf_counter() - mark
    mark = time.perf_counter()
    components = build(args)
    dits = DiTs(components)
    phases["build"] = time.perf_counter() - mark
    mark = time.perf_counter()
    rows = measure_ours(components, args, dits)
    phases["ours"] = time.perf_counter() - mark
    if not args.skip_diffusers:
        mark = time.perf_counter()
        rows += measure_diffusers(components, args)
        phases["diffusers"] = time.perf_counter() - mark
    for row in rows:
        result = fresh.get(row.key)
        if result is not None:
            row.fresh_process = result
            row.fresh_process_s = result.get("process_s")
    peak = torch.cuda.max_memory_allocated(components.device) / 2**30 if components.device.type == "cuda" else None
    phases["total"] = time.perf_counter() - started
    phases = {name: round(value, 1) for name, value in phases.items()}

    printed = table_rows(rows, args.tiny)
    title = (f"Whole images with the prompt enhancer, {args.size}x{args.size}, {env['gpu']}, torch {env['torch']}, "
             f"CUDA {env['cuda']}, diffusers {env['diffusers']}, transformers {env['transformers']}, "
             f"triton {env['triton']}, {env['date']}")
    note_lines = notes(args, components, peak)
    print("\n" + title)
    print(table(printed, COLUMNS))
    print("\n".join("- " + line for line in note_lines))
    print(f"phases (s): {phases}")
    args.out.mkdir(parents=True, exist_ok=True)
    config = {"size": args.size, "seed": SEED, "prompt": PROMPT, "presets": args.presets, "pe_tokens": args.pe_tokens,
              "pe_sampling": {"temperature": 0.6, "top_p": 0.95, "top_k": 50}, "warm_runs": args.warm_runs,
              "pe_prompt_tokens": pe_prompt_tokens(components, args.size),
              "diffusers_base_runs": args.diffusers_base_runs, "cold_process": cold_keys, "tiny": args.tiny,
              "models": components.described,
              "targets_s": {f"{preset} {fmt}": value for (preset, fmt), value in TARGETS_S.items()}}
    record = {"environment": env, "title": title, "config": config, "table": printed, "notes": note_lines,
              "rows": [{"key": row.key, "pipeline": row.pipeline, "preset": row.preset, "dit": row.dit, "pe": row.pe,
                        "target_s": row.target_s,
                        "first": {**asdict(row.first), "other_s": row.first.other_s} if row.first else None,
                        "warm": [{**asdict(image), "other_s": image.other_s} for image in row.warm],
                        "fresh_process": row.fresh_process} for row in rows],
              "fresh_process": fresh, "peak_gib": peak, "phases_s": phases}
    (args.out / "pe_e2e.json").write_text(json.dumps(record, indent=1))
    (args.out / "pe_e2e.md").write_text(f"**{title}**\n\n{markdown_table(printed)}\n\n"
                                        + "\n".join("- " + line for line in note_lines) + "\n\n"
                                        + environment_table(env) + "\n")
    failed = [key for key, result in fresh.items() if "error" in result]
    if failed:
        raise SystemExit(f"fresh-process run(s) failed: {', '.join(failed)} (the table was written)")


def main(argv: Optional[list[str]] = None) -> None:
    parser = argparse.ArgumentParser(prog="bench/speed.py --pe-e2e", description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, help="folder for pe_e2e.json and pe_e2e.md (required)")
    parser.add_argument("--tiny", action="store_true", help="CPU smoke test with the tiny models")
    parser.add_argument("--size", type=int, help="image side in pixels (default 1024; --tiny: 256)")
    parser.add_argument("--pe-tokens", type=int, help="forced rewrite length (default 256; --tiny: 8)")
    parser.add_argument("--warm-runs", type=int, default=1, help="warm images per row after the first (median)")
    parser.add_argument("--diffusers-base-runs", type=int, choices=(1, 2), default=1,
                        help="diffusers' Base images per row: 1 (warm only, ~50 s) or 2 (first and warm)")
    parser.add_argument("--skip-diffusers", action="store_true")
    parser.add_argument("--cold-process", default="ours-turbo-fp8-on,diffusers-turbo-bf16-on",
                        help="rows (comma-separated keys, or 'none') also timed in a fresh process")
    parser.add_argument("--cold-timeout", type=int, default=240, help="seconds one fresh process may take")
    parser.add_argument("--cold-child", help=argparse.SUPPRESS)
    parser.add_argument("--spawned-at", type=float, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    args.size = args.size or (256 if args.tiny else 1024)
    args.pe_tokens = args.pe_tokens or (8 if args.tiny else 256)
    args.presets = TINY_PRESETS if args.tiny else PRESETS
    if args.warm_runs < 1:
        parser.error("--warm-runs must be at least 1")
    if not args.tiny and not torch.cuda.is_available():
        raise SystemExit("bench/speed.py --pe-e2e needs a CUDA GPU (or --tiny for the CPU smoke test)")
    if args.cold_child is None and args.out is None:
        parser.error("--out is required")
    threads = torch.get_num_threads()
    if args.tiny:
        torch.set_num_threads(1)  # tiny kernels: a second thread only adds synchronisation (100x on a busy CPU)
    try:
        cold_child(args) if args.cold_child else run(args)
    finally:
        torch.set_num_threads(threads)
