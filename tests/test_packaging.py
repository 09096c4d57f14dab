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
