"""The layer streamer: streamed output equals resident output exactly, copies are ordered by events, packed
quantised weights stream as they are, nothing is allocated in the loop, and closing frees everything.

On the CPU the "device" is a second CPU tensor; FakeSync runs copies at once ("eager": catches a copy that
overwrites a slot still in use) or only when compute waits for them ("lazy": catches a missing wait).
"""
from __future__ import annotations

import pytest
import torch

from ernie_image.runtime.dit import DiTConfig, ErnieDiT
from ernie_image.runtime.offload.pinned import HostSlab
from ernie_image.runtime.offload.placement import DiTPlacement, TextPlacement
from ernie_image.runtime.offload.planner import DiTPlan, LayeredPlan
from ernie_image.runtime.offload.streamer import LayerStreamer, typed_view
from ernie_image.runtime.quant.fp8 import quantize_fp8
from ernie_image.runtime.quant.linear import quantize_linears
from ernie_image.runtime.quant.qweight import QuantizedWeight

CPU = torch.device("cpu")
CONFIG = DiTConfig(hidden_size=64, num_attention_heads=2, num_layers=6, ffn_hidden_size=128, text_in_dim=48,
                   rope_axes_dim=(8, 12, 12))


def random_dit(seed: int = 0) -> ErnieDiT:
    torch.manual_seed(seed)
    dit = ErnieDiT(CONFIG).eval().requires_grad_(False)
    with torch.no_grad():
        for param in dit.parameters():
            param.normal_(0.0, 0.5 / param.shape[-1] ** 0.5 if param.ndim > 1 else 0.02)
    return dit


def copy_of(dit: ErnieDiT) -> ErnieDiT:
    clone = ErnieDiT(CONFIG).eval().requires_grad_(False)
    clone.load_state_dict(dit.state_dict())
    return clone


def inputs(seed: int = 1):
    generator = torch.Generator().manual_seed(seed)
    latents = torch.randn(2, 128, 4, 6, generator=generator)
    text = torch.randn(2, 7, 48, generator=generator)
    text[0, 5:] = 0
    return latents, torch.tensor([900.0, 300.0]), text, [5, 7]


def dit_plan(streamed: tuple[int, ...], slots: int) -> DiTPlan:
    resident = tuple(i for i in range(CONFIG.num_layers) if i not in streamed)
    return DiTPlan(CONFIG.num_layers, resident, streamed, slots, 0, 0, 0)


@pytest.fixture(scope="module")
def reference():
    dit = random_dit()
    with torch.inference_mode():
        outputs = [dit(*inputs(seed)).clone() for seed in (1, 2, 3)]
    return dit, outputs


@pytest.mark.parametrize("mode", ["eager", "lazy"])
@pytest.mark.parametrize("streamed, slots", [((1, 3, 5), 2), (tuple(range(6)), 2), (tuple(range(6)), 3),
                                              ((0, 1, 2, 3, 4), 2), ((4,), 2)])
def test_streamed_dit_equals_resident_exactly(reference, mode, streamed, slots):
    dit, expected = reference
    model = copy_of(dit)
    placement = DiTPlacement(model, dit_plan(streamed, slots), CPU, fake_mode=mode)
    with torch.inference_mode():
        for seed, want in zip((1, 2, 3), expected):  # several steps: the ring wraps across step boundaries
            assert torch.equal(model(*inputs(seed)), want)
    # every streamed block was copied once per step, plus the prefetch the ring issued for a next step
    assert placement.streamer.sync.copies >= 3 * len(streamed)
    placement.release()


def test_a_missing_wait_is_caught_by_the_lazy_mode(reference):
    dit, expected = reference
    model = copy_of(dit)
    placement = DiTPlacement(model, dit_plan((1, 3, 5), 2), CPU, fake_mode="lazy")
    placement.streamer.sync.wait_ready = lambda slot: None  # a streamer that forgot to wait for its copy
    with torch.inference_mode():
        assert not torch.equal(model(*inputs(1)), expected[0])
    placement.release()


def test_a_premature_copy_is_caught_by_the_eager_mode(reference):
    dit, expected = reference
    model = copy_of(dit)
    placement = DiTPlacement(model, dit_plan((0, 1, 2, 3), 2), CPU, fake_mode="eager")
    streamer = placement.streamer
    original_pump = streamer._pump

    def greedy_pump():  # ignores the "slot still in use" rule: issues one copy too many
        original_pump()
        k = streamer._next
        streamer.sync.copy(streamer._slot(k), streamer._dev[k], streamer._host[k])

    streamer._pump = greedy_pump
    with torch.inference_mode():
        assert not torch.equal(model(*inputs(1)), expected[0])
    placement.release()


def test_the_ring_is_allocated_once_and_weights_keep_their_slots(reference):
    dit, _ = reference
    model = copy_of(dit)
    placement = DiTPlacement(model, dit_plan((0, 2, 4), 2), CPU)
    streamer = placement.streamer
    pointers = {name: p.data_ptr() for name, p in model.named_parameters()}
    ring = streamer.ring.data_ptr()
    with torch.inference_mode():
        for seed in (1, 2):
            model(*inputs(seed))
    assert streamer.ring.data_ptr() == ring
    assert {name: p.data_ptr() for name, p in model.named_parameters()} == pointers
    # blocks 0 and 4 share ring slot 0: their weights are views of the same device bytes
    assert model.layers[0].mlp.up_proj.weight.data_ptr() == model.layers[4].mlp.up_proj.weight.data_ptr()
    assert streamer.ring_bytes == 2 * streamer.slot_bytes
    assert streamer.weight_bytes <= streamer.host_bytes < streamer.weight_bytes + 256 * 20 * 3
    placement.release()


def test_release_leaves_no_weight_behind(reference):
    dit, _ = reference
    model = copy_of(dit)
    placement = DiTPlacement(model, dit_plan((1, 3), 2), CPU)
    placement.release()
    assert all(t.is_meta for t in list(model.parameters()) + list(model.buffers()))
    assert placement.streamer is None


def test_a_stopped_run_restarts_the_ring_cleanly(reference):
    dit, expected = reference
    model = copy_of(dit)
    placement = DiTPlacement(model, dit_plan((1, 3, 5), 2), CPU)

    class StopAfter:
        def __init__(self, blocks: int) -> None:
            self.left = blocks

        def check_cancel(self) -> None:
            self.left -= 1
            if self.left < 0:
                raise RuntimeError("stop")

    placement.host = StopAfter(4)
    with torch.inference_mode(), pytest.raises(RuntimeError, match="stop"):
        model(*inputs(1))
    placement.host = None
    with torch.inference_mode():
        assert torch.equal(model(*inputs(1)), expected[0])
    placement.release()


def test_quantised_blocks_stream_packed(reference):
    dit, _ = reference
    model = copy_of(dit)
    for block in model.layers:
        state = {}
        for name, module in block.named_modules():
            if isinstance(module, torch.nn.Linear):
                data, scale = quantize_fp8(module.weight.detach())
                state[f"{name}.weight"] = QuantizedWeight("fp8", "F8_E4M3", data, tuple(module.weight.shape), scale)
        quantize_linears(block, state, compute_dtype=torch.float32)
    with torch.inference_mode():
        resident = model(*inputs(1)).clone()
    packed_bytes = sum(t.numel() * t.element_size() for t in model.layers[2].buffers())
    placement = DiTPlacement(model, dit_plan((0, 2, 4), 2), CPU)
    assert model.layers[2].mlp.up_proj.weight.dtype == torch.float8_e4m3fn
    assert placement.streamer.slot_bytes < packed_bytes + 4 * 1024 + 2 * 64 * 4 * 8
    with torch.inference_mode():
        assert torch.equal(model(*inputs(1)), resident)
    placement.release()


def test_text_tower_streams_layer_by_layer_through_hooks():
    from ernie_image.runtime.tiny import TinySizes, build_text_encoder

    tower = build_text_encoder(TinySizes(), seed=3).language_model
    ids = torch.tensor([[1, 40, 41, 42, 43, 44]])
    with torch.inference_mode():
        want = tower(input_ids=ids).last_hidden_state.clone()
    placement = TextPlacement(tower, LayeredPlan("streamed", 2, 0, 0, 0, len(tower.layers)), CPU)
    assert type(tower.embed_tokens).__name__ == "HostEmbedding"
    layers = len(tower.layers)
    assert placement.streamer.slots == 2 < layers
    for run in range(1, 3):  # park between phases frees the ring; the next use brings it back
        with torch.inference_mode():
            assert torch.equal(tower(input_ids=ids).last_hidden_state, want)
        assert placement.streamer.sync.copies >= run * layers  # every layer came through the 2-slot ring
        placement.streamer.park()
        assert placement.streamer.parked and placement.streamer.ring_bytes == 0
    placement.release()
    assert all(t.is_meta for t in tower.layers.parameters())


def test_host_slab_without_cuda_is_plain_memory():
    slab = HostSlab(1000, pin=False)
    assert slab.nbytes == 1000 and slab.pinned_bytes == 0
    assert slab.data.dtype == torch.uint8 and slab.data.numel() == 1000 and not slab.data.is_pinned()
    typed_view(slab.data, 256, torch.float32, (10, 2)).fill_(3.0)  # a typed window writes through to the slab
    assert slab.data[256:336].view(torch.float32).sum().item() == 60.0


def test_streamer_rejects_an_empty_stream():
    with pytest.raises(ValueError, match="at least one"):
        LayerStreamer([torch.nn.Linear(2, 2)], [], 2, CPU)


# -- CUDA ------------------------------------------------------------------------------------------------

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@pytest.mark.gpu
@cuda
def test_pinned_slab_is_not_rounded_to_a_power_of_two():
    size = 300 * 1024**2 + 12345
    slab = HostSlab(size, pin=True)
    assert slab.data.is_pinned()
    assert slab.pinned_bytes == size
    slab.free()


@pytest.mark.gpu
@cuda
@pytest.mark.parametrize("streamed, slots", [((1, 3, 5), 2), (tuple(range(6)), 2)])
def test_cuda_streamed_dit_is_bitwise_resident(reference, streamed, slots):
    dit, _ = reference
    device = torch.device("cuda")
    resident = copy_of(dit).to(device, torch.bfloat16)
    latents, timestep, text, lens = inputs(1)
    args = (latents.to(device, torch.bfloat16), timestep.to(device, torch.bfloat16), text.to(device, torch.bfloat16),
            lens)
    with torch.inference_mode():
        want = resident(*args).clone()
    del resident
    model = copy_of(dit).to(torch.bfloat16)
    before = torch.cuda.memory_allocated()
    placement = DiTPlacement(model, dit_plan(streamed, slots), device)
    assert placement.streamer.slab.data.is_pinned()
    with torch.inference_mode():
        for _ in range(3):
            assert torch.equal(model(*args), want)
    placement.release()
    torch.cuda.synchronize()
    assert torch.cuda.memory_allocated() <= before
