"""A regular (non-editable) install must ship every subpackage and data file the pack imports or reads."""
from __future__ import annotations

import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_every_python_package_is_listed_in_pyproject():
    listed = set(tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"])
    on_disk = {"ernie_image"} | {
        "ernie_image." + ".".join(init.parent.relative_to(ROOT).parts)
        for folder in ("runtime", "nodes") for init in (ROOT / folder).rglob("__init__.py")
    }
    assert on_disk <= listed, f"add to [tool.setuptools] packages: {sorted(on_disk - listed)}"


def test_root_import_does_not_need_comfyui():
    import ernie_image

    assert ernie_image.WEB_DIRECTORY == "./web"


def test_every_template_workflow_api_copy_and_web_file_is_package_data():
    from fnmatch import fnmatch

    patterns = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["package-data"]["ernie_image"]
    shipped = [p for folder in ("example_workflows", "workflows", "web") for p in (ROOT / folder).rglob("*") if p.is_file()]
    missing = [str(p.relative_to(ROOT)) for p in shipped
               if not any(fnmatch(str(p.relative_to(ROOT)), pattern) for pattern in patterns)]
    assert shipped and missing == [], f"add to [tool.setuptools.package-data]: {missing}"


def requirement_lines() -> list[str]:
    lines = (ROOT / "requirements.txt").read_text().splitlines()
    return [line.strip() for line in lines if line.strip() and not line.lstrip().startswith("#")]


def test_requirements_txt_is_pyprojects_dependencies_without_torch():
    """ComfyUI-Manager installs requirements.txt, not pyproject's dependencies: the two must agree, and torch
    (which would replace ComfyUI's CUDA build) is left to ComfyUI."""
    dependencies = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    assert requirement_lines() == [line for line in dependencies if not line.startswith("torch")]


def test_requirements_txt_never_touches_torch():
    import re

    names = [re.split(r"[<>=!~\[; ]", line, maxsplit=1)[0].lower() for line in requirement_lines()]
    assert not {"torch", "torchvision", "torchaudio"} & set(names)
