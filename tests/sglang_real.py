"""Real `sglang serve` processes on a tiny random-weight ERNIE-Image checkpoint, for @pytest.mark.sglang tests.

The checkpoint is built here with diffusers/transformers classes (the test's own Python: diffusers >= 0.38)
in the baidu/ERNIE-Image folder layout; SGLang serves it with its own pinned diffusers. Output is noise,
but deterministic per seed and sensitive to every setting. SGLang runs from another Python given by
ERNIE_SGLANG_PYTHON (a venv; see the README). SGLang imports torchvision at start-up but ERNIE never uses it, and
PyPI's torchvision does not import beside the CPU torch wheel: when that Python has no importable torchvision,
the import stub in tests/sglang_stubs/ is put on its path (ERNIE_SGLANG_PYTHONPATH, if set, goes first).
Servers run with --sleep-on-idle: an idle SGLang scheduler otherwise spins a CPU core each.
"""
from __future__ import annotations

import json
import os
import socket
import subprocess
from functools import lru_cache
from pathlib import Path
from typing import Optional

from waiting import wait_until

SGLANG_PYTHON_ENV = "ERNIE_SGLANG_PYTHON"
SGLANG_PYTHONPATH_ENV = "ERNIE_SGLANG_PYTHONPATH"
TEXT_DIM = 64
TORCHVISION_STUB = Path(__file__).resolve().parent / "sglang_stubs"


def sglang_python() -> Optional[str]:
    value = os.environ.get(SGLANG_PYTHON_ENV, "").strip()
    return value if value and Path(value).exists() else None


@lru_cache(maxsize=None)
def needs_torchvision_stub(python: str) -> bool:
    """Whether `python` cannot import torchvision (then the stub in tests/sglang_stubs/ stands in for it)."""
    probe = subprocess.run([python, "-c", "import torchvision"], capture_output=True, timeout=120)
    return probe.returncode != 0


def server_pythonpath(python: str) -> str:
    paths = [p for p in (os.environ.get(SGLANG_PYTHONPATH_ENV, "").strip(),) if p]
    if needs_torchvision_stub(python):
        paths.append(str(TORCHVISION_STUB))
    if os.environ.get("PYTHONPATH"):
        paths.append(os.environ["PYTHONPATH"])
    return os.pathsep.join(paths)


def build_tiny_checkpoint(folder: Path) -> Path:
    """A ~4 MB ERNIE-Image pipeline folder (the folder name must contain 'ERNIE-Image' for SGLang)."""
    import torch
    from diffusers import AutoencoderKLFlux2, ErnieImageTransformer2DModel, FlowMatchEulerDiscreteScheduler
    from tokenizers import Tokenizer, models, pre_tokenizers, processors
    from transformers import Mistral3Config, Mistral3Model, PreTrainedTokenizerFast

    assert "ERNIE-Image" in folder.name, "SGLang picks its pipeline from the folder name"
    torch.manual_seed(0)
    folder.mkdir(parents=True, exist_ok=True)
    dit = ErnieImageTransformer2DModel(hidden_size=128, num_attention_heads=1, num_layers=2, ffn_hidden_size=256,
                                       in_channels=128, out_channels=128, patch_size=1, text_in_dim=TEXT_DIM)
    with torch.no_grad():
        # DiT zero-init of the output layers would make the image ignore prompt, CFG and steps
        for weight in dit.parameters():
            if weight.dim() > 1 and not weight.any():
                weight.normal_(0.0, 0.02)
    dit.save_pretrained(folder / "transformer")
    AutoencoderKLFlux2(block_out_channels=(32, 32, 32, 32), layers_per_block=1, norm_num_groups=8,
                       latent_channels=32).save_pretrained(folder / "vae")
    FlowMatchEulerDiscreteScheduler(shift=4.0).save_pretrained(folder / "scheduler")

    vocab = {"<pad>": 0, "<s>": 1, "</s>": 2, "<unk>": 3}
    for word in "a the red fox cat dog in snow photo of on with and blue green sky city night".split():
        vocab[word] = len(vocab)
    tokenizer = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer.post_processor = processors.TemplateProcessing(single="<s> $A", pair="<s> $A <s> $B",
                                                             special_tokens=[("<s>", 1)])
    PreTrainedTokenizerFast(tokenizer_object=tokenizer, pad_token="<pad>", bos_token="<s>", eos_token="</s>",
                            unk_token="<unk>", model_max_length=64).save_pretrained(folder / "tokenizer")
    config = Mistral3Config(
        text_config=dict(model_type="ministral3", vocab_size=128, hidden_size=TEXT_DIM, intermediate_size=128,
                         num_hidden_layers=3, num_attention_heads=2, num_key_value_heads=1, head_dim=32,
                         max_position_embeddings=256, pad_token_id=0, bos_token_id=1, eos_token_id=2,
                         tie_word_embeddings=True),
        vision_config=dict(model_type="pixtral", hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                           num_attention_heads=2, head_dim=16, image_size=64, patch_size=16),
    )
    Mistral3Model(config).save_pretrained(folder / "text_encoder")
    (folder / "model_index.json").write_text(json.dumps({
        "_class_name": "ErnieImagePipeline", "_diffusers_version": "0.37.0",
        "scheduler": ["diffusers", "FlowMatchEulerDiscreteScheduler"],
        "text_encoder": ["transformers", "Mistral3Model"],
        "tokenizer": ["transformers", "PreTrainedTokenizerFast"],
        "transformer": ["diffusers", "ErnieImageTransformer2DModel"],
        "vae": ["diffusers", "AutoencoderKLFlux2"],
    }, indent=1))
    return folder


def free_port(span: int = 1) -> int:
    """A loopback port p with p..p+span-1 all free (SGLang also binds port+1 for its job broker)."""
    while True:
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            port = sock.getsockname()[1]
        if port + span > 65535:
            continue
        try:
            for offset in range(1, span):
                with socket.socket() as probe:
                    probe.bind(("127.0.0.1", port + offset))
            return port
        except OSError:
            continue


class SglangServer:
    """One `sglang serve` child process on loopback; `stop()` ends exactly this process."""

    def __init__(self, python: str, model: Path, workdir: Path) -> None:
        self.port = free_port(span=2)
        workdir.mkdir(parents=True, exist_ok=True)
        self.log_path = workdir / "server.log"
        env = dict(os.environ)
        env["PYTHONPATH"] = server_pythonpath(python)
        sglang = Path(python).parent / "sglang"
        command = [str(sglang), "serve", "--model-path", str(model), "--host", "127.0.0.1",
                   "--port", str(self.port), "--master-port", str(free_port()),
                   "--scheduler-port", str(free_port()), "--log-requests", "--sleep-on-idle"]
        self._log = open(self.log_path, "wb")
        self.process = subprocess.Popen(command, cwd=workdir, env=env, stdout=self._log, stderr=subprocess.STDOUT,
                                        start_new_session=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def log_text(self) -> str:
        return self.log_path.read_text(errors="replace")

    def stop(self) -> None:
        if self.process.poll() is None:
            # the server has worker children: end its own process group, which it leads
            os.killpg(self.process.pid, 15)
            try:
                self.process.wait(20)
            except subprocess.TimeoutExpired:
                os.killpg(self.process.pid, 9)
                self.process.wait(10)
        self._log.close()


def wait_until_ready(servers: list[SglangServer], timeout_s: float = 300.0) -> dict[str, list[str]]:
    """Poll /health through the client until every server is ready; returns the readiness states seen."""
    from ernie_image.runtime.net.loop_thread import run_sync
    from ernie_image.runtime.remote.sglang import SglangClient

    seen: dict[str, list[str]] = {s.url: [] for s in servers}
    pending = list(servers)

    def all_ready() -> bool:
        for server in list(pending):
            if server.process.poll() is not None:
                raise RuntimeError(f"sglang serve exited ({server.process.returncode}); log:\n{server.log_text()[-3000:]}")
            client = SglangClient(server.url)

            async def probe():
                try:
                    return await client.health()
                finally:
                    await client.close()

            state = run_sync(probe()).state
            if not seen[server.url] or seen[server.url][-1] != state:
                seen[server.url].append(state)
            if state == "ready":
                pending.remove(server)
        return not pending

    wait_until(all_ready, timeout_s, poll_s=0.5, what=lambda: f"sglang serve ready: {seen}")
    return seen
