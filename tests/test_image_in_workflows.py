"""The image-in example workflows (example_workflows/: img2img, inpainting, hires fix) do what their names say. That
they agree with the pack's node definitions and with the ComfyUI v0.8.0 core nodes they use (Load Image, Image Scale),
in UI format and in their API twins (workflows/api/), test_workflows.py checks for every shipped workflow."""
from __future__ import annotations

from typing import Any

import test_workflows as tw
from ernie_image.runtime.sampling.image_in import denoise_sigmas

SCENARIOS = {"ernie_image_turbo_img2img", "ernie_image_turbo_inpaint", "ernie_image_turbo_hires_fix"}


def test_the_workflow_checks_cover_the_image_in_scenarios_and_their_core_nodes() -> None:
    assert SCENARIOS <= tw.SCENARIOS
    used = {n["class_type"] for name in SCENARIOS for n in tw.load(tw.API_FOLDER / f"{name}.json").values()}
    assert {"LoadImage", "ImageScale"} <= used <= set(tw.CORE_NODES) | set(tw.NODE_CLASS_MAPPINGS)


def samplers(name: str) -> list[dict[str, Any]]:
    api = tw.load(tw.API_FOLDER / f"{name}.json")
    return [node for node in api.values() if node["class_type"] == "ErnieImageTurboSampler"]


def test_img2img_starts_from_load_image_at_a_partial_denoise() -> None:
    (sampler,) = samplers("ernie_image_turbo_img2img")
    assert "image" in sampler["inputs"] and 0 < sampler["inputs"]["denoise"] < 1
    assert len(denoise_sigmas(sampler["inputs"]["steps"], 4.0, sampler["inputs"]["denoise"])) == 9


def test_inpainting_takes_load_images_mask_and_composites() -> None:
    (sampler,) = samplers("ernie_image_turbo_inpaint")
    image, mask = sampler["inputs"]["image"], sampler["inputs"]["mask"]
    assert image[0] == mask[0] and (image[1], mask[1]) == (0, 1)  # Load Image's IMAGE and MASK
    assert sampler["inputs"]["composite"] is True


def test_hires_fix_is_a_second_turbo_pass_at_2048_inside_12_gb() -> None:
    api = tw.load(tw.API_FOLDER / "ernie_image_turbo_hires_fix.json")
    first, second = samplers("ernie_image_turbo_hires_fix")
    assert (first["inputs"]["width"], first["inputs"]["denoise"]) == (1024, 1.0)
    assert 0.3 <= second["inputs"]["denoise"] <= 0.5
    scale = api[second["inputs"]["image"][0]]
    assert scale["class_type"] == "ImageScale" and (scale["inputs"]["width"], scale["inputs"]["height"]) == (2048, 2048)
    loader = api[second["inputs"]["pipe"][0]]
    assert loader["inputs"]["vram_budget_gb"] == 12.0
