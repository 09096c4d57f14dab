"""bench/native_comfy.py: ComfyUI's native ERNIE-Image DiT, run against bench/comfy_stand_ins.py, computes the same
function as ours. The end-to-end check needs ComfyUI's comfy/ldm/ernie/model.py (not part of this repository:
COMFYUI_ERNIE_MODEL_PY or .native/model.py) and comfy_kitchen (installed, or unpacked under .native/site)."""
from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

REPO_ROOT = Path(__file__).resolve().parent.parent
BENCH = REPO_ROOT / "bench"


def _bench_module(name: str):
    """A bench/ module imported by file, without putting bench/ (whose module names are generic) on sys.path."""
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, BENCH / f"{name}.py")
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
    return sys.modules[name]


comfy_stand_ins = _bench_module("comfy_stand_ins")


@pytest.fixture
def bench_on_path(monkeypatch):
    """bench/ on sys.path for one test; the bench modules it imported are dropped afterwards."""
    monkeypatch.syspath_prepend(str(BENCH))
    before = set(sys.modules)
    yield
    for name in set(sys.modules) - before:
        if Path(getattr(sys.modules[name], "__file__", None) or "/").parent == BENCH:
            del sys.modules[name]


def _native_model_py() -> Path | None:
    path = Path(os.environ.get("COMFYUI_ERNIE_MODEL_PY") or REPO_ROOT / ".native" / "model.py")
    return path if path.is_file() else None


def _kitchen_available() -> bool:
    if (REPO_ROOT / ".native" / "site" / "comfy_kitchen").is_dir():
        return True
    return importlib.util.find_spec("comfy_kitchen") is not None


@pytest.mark.slow
def test_native_dit_on_the_stand_ins_equals_ours_in_fp32(tmp_path):
    model_py = _native_model_py()
    if model_py is None:
        pytest.skip("ComfyUI's comfy/ldm/ernie/model.py is not here (set COMFYUI_ERNIE_MODEL_PY or put it at "
                    ".native/model.py); it is not part of this repository")
    if not _kitchen_available():
        pytest.skip("comfy_kitchen is neither installed nor unpacked under .native/site")
    run = subprocess.run([sys.executable, str(BENCH / "native_comfy.py"), "--tiny", "--iters", "1",
                          "--native-model-py", str(model_py), "--out", str(tmp_path)],
                         capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    result = json.loads((tmp_path / "native_comfy.json").read_text())
    native_vs_ours = {d["batch"]: float(d["rel_l2"]) for d in result["differences"]
                      if d["comparison"] == "native eager vs ours eager"}
    assert set(native_vs_ours) == {1, 2}
    assert all(rel <= 1e-4 for rel in native_vs_ours.values()), native_vs_ours
    assert all(check["ok"] for check in result["checks"])
    assert any("wrong timestep scale" in check["check"] for check in result["checks"])
    # on the CPU ComfyUI's quant_ops leaves comfy_kitchen its eager backend, and the fused q/k norm + RoPE goes there
    assert result["comfy_kitchen"]["rms_rope_split_half"] == ["eager"]
    assert {"native eager", "ours eager (as shipped)"} <= {row["variant"] for row in result["rows"]}
    assert (tmp_path / "native_comfy.md").read_text().startswith("### ERNIE-Image DiT step, ComfyUI native")


def test_a_missing_native_model_py_is_a_one_line_error_naming_the_flag(tmp_path, monkeypatch, bench_on_path):
    import native_comfy

    missing = tmp_path / "model.py"
    monkeypatch.setattr(sys, "argv", ["native_comfy.py", "--tiny", "--native-model-py", str(missing),
                                      "--out", str(tmp_path / "out")])
    with pytest.raises(SystemExit) as raised:
        native_comfy.main()
    message = str(raised.value)
    assert "\n" not in message and str(missing) in message and "--native-model-py" in message
    assert not (tmp_path / "out").exists()


def test_the_loaded_file_sees_the_stand_ins_and_sys_modules_is_left_as_it_was(tmp_path):
    source = tmp_path / "model.py"
    source.write_text(
        "from comfy.ldm.modules.attention import optimized_attention\n"
        "import comfy.model_management\nimport comfy.ops\nimport comfy.quant_ops\n"
        "class ErnieImageModel:\n    pass\n"
    )
    before = {name for name in sys.modules if name == "comfy" or name.startswith("comfy.")}
    marker = object()
    module = comfy_stand_ins.load_native_model(source, ck=marker)
    assert {name for name in sys.modules if name == "comfy" or name.startswith("comfy.")} == before
    assert module.optimized_attention is comfy_stand_ins.attention_pytorch
    assert module.comfy.quant_ops.ck is marker
    assert module.comfy.model_management.in_training is False
    assert module.comfy.ops.disable_weight_init.RMSNorm.__mro__[1] is torch.nn.RMSNorm


def test_a_file_without_the_model_class_is_refused(tmp_path):
    source = tmp_path / "model.py"
    source.write_text("import comfy.ops\n")
    with pytest.raises(SystemExit, match="defines no ErnieImageModel"):
        comfy_stand_ins.load_native_model(source, ck=None)


def test_attention_pytorch_is_sdpa_over_heads_split_from_the_feature_dim():
    generator = torch.Generator().manual_seed(0)
    batch, length, heads, head_dim = 2, 7, 3, 4
    q, k, v = (torch.randn(batch, length, heads * head_dim, generator=generator) for _ in range(3))
    split = [t.view(batch, length, heads, head_dim).transpose(1, 2) for t in (q, k, v)]
    want = torch.nn.functional.scaled_dot_product_attention(*split).transpose(1, 2).reshape(batch, length, -1)
    assert torch.equal(comfy_stand_ins.attention_pytorch(q, k, v, heads), want)
    mask = torch.rand(length, length, generator=generator) > 0.3
    mask[:, 0] = True
    want = torch.nn.functional.scaled_dot_product_attention(*split, attn_mask=mask[None, None])
    got = comfy_stand_ins.attention_pytorch(q, k, v, heads, mask=mask)
    assert torch.equal(got, want.transpose(1, 2).reshape(batch, length, -1))


def test_comfy_ops_skip_initialisation_and_run_torchs_forward():
    linear = comfy_stand_ins.disable_weight_init.Linear(3, 2, bias=True, device="meta")
    assert isinstance(linear, torch.nn.Linear) and linear.weight.is_meta
    norm = comfy_stand_ins.disable_weight_init.RMSNorm(4, eps=1e-6)
    norm.weight.data.copy_(torch.arange(4.0))
    x = torch.randn(2, 4)
    assert torch.equal(norm(x), torch.nn.functional.rms_norm(x, (4,), norm.weight, 1e-6))
    with comfy_stand_ins.CastBiasWeightContext(norm, x.double(), offloadable=True) as (weight, bias):
        assert weight.dtype == torch.float64 and bias is None
    with comfy_stand_ins.CastBiasWeightContext(norm, x, offloadable=True) as (weight, _):
        assert weight is norm.weight
