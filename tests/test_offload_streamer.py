"""The layer streamer: streamed output equals resident output exactly, copies are ordered by events, packed
quantised weights stream as they are, nothing is allocated in the loop, and closing frees everything.

On the CPU the "device" is a second CPU tensor; FakeSync runs copies at once ("eager": catches a copy that
overwrites a slot still in use) or only when compute waits for them ("lazy": catches a missing wait).
"""
from __future__ import annotations

import pytest
import torch

from ernie_image.runtime.model.dit import DiTConfig, ErnieDiT
from ernie_image.runtime.offload.pinned import HostSlab
from ernie_image.runtime.offload.placement import DiTPlacement, TextPlacement
from ernie_image.runtime.offload.planner import DiTPlan, LayeredPlan
from ernie_image.runtime.offload.streamer import CudaSync, LayerStreamer, typed_view
from ernie_image.runtime.quant.fp8 import quantize_fp8
from ernie_image.runtime.quant.linear import quantize_linears
from ernie_image.runtime.quant.qweight import QuantizedWeight

CPU = torch.device("cpu")
CONFIG = DiTConfig(hidden_size=64, num_attention_heads=2, num_layers=6, ffn_hidden_size=128, text_in_dim=48,
                   rope_axes_dim=(8, 12, 12))


def random_dit(seed: int = 0, config: DiTConfig = CONFIG) -> ErnieDiT:
    torch.manual_seed(seed)
    dit = ErnieDiT(config).eval().requires_grad_(False)
    with torch.no_grad():
        for param in dit.parameters():
            param.normal_(0.0, 0.5 / param.shape[-1] ** 0.5 if param.ndim > 1 else 0.02)
    return dit


def dit_from(state: dict, config: DiTConfig = CONFIG) -> ErnieDiT:
    model = ErnieDiT(config).eval().requires_grad_(False)
    model.load_state_dict(state)
    return model


def copy_of(dit: ErnieDiT) -> ErnieDiT:
    return dit_from(dit.state_dict(), dit.config)


def inputs(seed: int = 1):
    generator = torch.Generator().manual_seed(seed)
    latents = torch.randn(2, 128, 4, 6, generator=generator)
    text = torch.randn(2, 7, 48, generator=generator)
    text[0, 5:] = 0
    return latents, torch.tensor([900.0, 300.0]), text, [5, 7]


def dit_plan(streamed: tuple[int, ...], slots: int, layers: int = CONFIG.num_layers) -> DiTPlan:
    resident = tuple(i for i in range(layers) if i not in streamed)
    return DiTPlan(layers, resident, streamed, slots, 0, 0, 0)


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
        k, slot = streamer._next, streamer._cursor
        streamer.sync.copy(slot, streamer._dev[k][slot], streamer._host[k])

    streamer._pump = greedy_pump
    with torch.inference_mode():
        assert not torch.equal(model(*inputs(1)), expected[0])
    placement.release()


def test_the_ring_is_allocated_once_and_weights_keep_their_slots(reference):
    dit, _ = reference
    model = copy_of(dit)
    placement = DiTPlacement(model, dit_plan((0, 2, 4, 5), 2), CPU)  # 4 streamed, 2 slots: same slot every step
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
    assert streamer.weight_bytes <= streamer.host_bytes < streamer.weight_bytes + 256 * 20 * 4
    placement.release()


def test_with_a_count_that_is_no_multiple_of_the_slots_weights_rotate_through_the_ring(reference):
    dit, expected = reference
    model = copy_of(dit)
    placement = DiTPlacement(model, dit_plan((0, 2, 4), 2), CPU)  # 3 streamed, 2 slots
    streamer = placement.streamer
    ring = streamer.ring.data_ptr()

    def slot_of(index: int) -> int:
        offsets = {p.data_ptr() - ring for p in model.layers[index].parameters()}
        assert all(0 <= offset < streamer.ring_bytes for offset in offsets)
        return min(offsets) // streamer.slot_bytes

    seen = []
    with torch.inference_mode():
        for seed, want in zip((1, 2), expected):
            assert torch.equal(model(*inputs(seed)), want)
            seen.append([slot_of(index) for index in (0, 2, 4)])
            assert streamer.ring.data_ptr() == ring
    # The j-th copy goes to slot j % 2, and a block points at its slot from the moment its copy is issued. Step 1
    # copies blocks 0,2,4 to slots 0,1,0 and, while blocks 2 and 4 run, the next step's 0,2 to slots 1,0; step 2
    # copies 4 to slot 1 and then the third step's 0,2 to slots 0,1.
    assert seen == [[1, 0, 0], [0, 1, 1]]
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
    from ernie_image.runtime.demo.tiny import TinySizes, build_text_encoder

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


def test_host_slab_stays_pageable_when_the_system_refuses_to_lock_memory(monkeypatch, caplog):
    class RefusingRuntime:
        def cudaHostRegister(self, ptr, nbytes, flags):
            return 2  # cudaErrorMemoryAllocation

    monkeypatch.setattr(torch.cuda, "cudart", lambda: RefusingRuntime())
    real_empty = torch.empty

    def empty_refusing_to_pin(*args, pin_memory=False, **kwargs):  # the caching allocator's pinning fails too
        if pin_memory:
            raise RuntimeError("out of locked memory")
        return real_empty(*args, **kwargs)

    monkeypatch.setattr(torch, "empty", empty_refusing_to_pin)
    slab = HostSlab(1 << 20, pin=True)
    assert slab.pinned_bytes == 0 and slab.data.numel() == 1 << 20 and not slab.data.is_pinned()
    slab.data.fill_(5)
    assert int(slab.data[-1]) == 5
    assert "using pageable memory" in caplog.text
    slab.free()


def test_streamer_rejects_an_empty_stream():
    with pytest.raises(ValueError, match="at least one"):
        LayerStreamer([torch.nn.Linear(2, 2)], [], 2, CPU)



# -- guesses: layers copied before the caller knows whether they run (a step cache's decision) -----------------
def linear_layers(count: int = 6) -> tuple[list[torch.nn.Linear], list[torch.nn.Linear]]:
    torch.manual_seed(0)
    layers = [torch.nn.Linear(8, 8) for _ in range(count)]
    originals = [torch.nn.Linear(8, 8) for _ in range(count)]
    for original, layer in zip(originals, layers):
        original.load_state_dict(layer.state_dict())
    return layers, originals


@pytest.mark.parametrize("mode", ["eager", "lazy"])
@pytest.mark.parametrize("slots", [2, 3])
def test_a_dropped_guess_is_never_run_and_a_confirmed_one_is_copied_once(mode, slots):
    layers, originals = linear_layers()
    streamer = LayerStreamer(layers, range(6), slots, CPU, pin=False, fake_mode=mode)
    trace: list[tuple] = []
    streamer.sync.trace = trace
    source = {host.data_ptr(): index for index, host in enumerate(streamer._host)}
    x = torch.randn(2, 8)

    def run(indices) -> None:
        for index in indices:
            streamer.before(index)
            assert torch.equal(layers[index](x), originals[index](x)), f"layer {index} ran on other bytes"
            streamer.after(index)

    streamer.follow_route()
    for decided, rest in (("skip", [5]), ("compute", [2, 3, 4, 5]), ("skip", [4, 5]), ("compute", [2, 3, 4, 5])):
        streamer.extend_route([0, 1])
        streamer.guess([2, 3, 4], limit=1)
        run([0, 1])
        streamer.extend_route(rest)  # the decision: a rest that begins with the guess confirms it
        run(rest)
    copied = [source[event[2]] for event in trace if event[0] == "copy"]
    assert copied == [0, 1, 2, 5] + [0, 1, 2, 3, 4, 5] + [0, 1, 2, 4, 5] + [0, 1, 2, 3, 4, 5]
    assert ("join",) in trace[:1] and trace.count(("join",)) == 1  # the route was always known: no restart
    streamer.end_route()
    run(range(6))  # back to every layer in turn


def test_guesses_copied_or_still_routed_are_dropped_together_and_the_ring_goes_on():
    layers, originals = linear_layers()
    streamer = LayerStreamer(layers, range(6), 3, CPU, pin=False, fake_mode="lazy")
    x = torch.randn(2, 8)
    streamer.follow_route()
    streamer.extend_route([0, 1])
    streamer.guess([3, 4, 5], limit=3)  # more than the ring has room for: one waits in the route
    streamer.before(0)
    assert torch.equal(layers[0](x), originals[0](x))
    streamer.after(0)
    assert [k for k, _ in streamer._issued] == [1, 3, 4] and list(streamer._route) == [5]
    streamer.extend_route([2, 5])  # no guess confirmed: the copied ones give their slots back, the routed one goes
    assert [k for k, _ in streamer._issued] == [1, 2, 5] and not streamer._route and not streamer._guessed
    for index in (1, 2, 5):
        streamer.before(index)
        assert torch.equal(layers[index](x), originals[index](x))
        streamer.after(index)


def streamer_over_three_of_six(slots: int = 2):
    """Layers 0-2 streamed, 3-5 resident; `run(i)` runs layer i and checks it ran on its own bytes."""
    layers, originals = linear_layers()
    streamer = LayerStreamer(layers, (0, 1, 2), slots, CPU, pin=False, fake_mode="lazy")
    x = torch.randn(2, 8)

    def run(index: int) -> None:
        streamer.before(index)
        assert torch.equal(layers[index](x), originals[index](x)), f"layer {index} ran on other bytes"
        streamer.after(index)

    return streamer, run


def test_an_extend_route_naming_only_resident_layers_drops_the_guess():
    streamer, run = streamer_over_three_of_six()
    streamer.follow_route()
    streamer.extend_route([0, 1])
    streamer.guess([2], limit=1)
    run(0), run(1)
    streamer.extend_route([3, 4])  # the decision: 2 does not run next
    assert not streamer._guessed and not streamer._issued
    run(3), run(4)
    streamer.extend_route([0, 1, 2])
    run(0), run(1), run(2)


@pytest.mark.parametrize("interruption", ["a guessed layer run unannounced", "a park mid-route",
                                          "a new route without end_route"])
def test_a_guess_settled_by_a_run_or_forgotten_with_its_copies_leaves_the_stream_consistent(interruption):
    streamer, run = streamer_over_three_of_six()
    streamer.follow_route()
    if interruption == "a guessed layer run unannounced":
        streamer.extend_route([0, 1])
        streamer.guess([2], limit=1)
        run(0), run(1), run(2)  # running the guess confirms it
    elif interruption == "a park mid-route":
        streamer.extend_route([0, 2])
        streamer.guess([2], limit=1)
        run(0)
        streamer.park()  # between phases: the copies issued are forgotten, the guess among them
        run(2)
    else:
        streamer.extend_route([0, 1, 0, 1])
        streamer.guess([2], limit=1)
        run(0)
        streamer.follow_route()  # the last run never ended its route
    streamer.extend_route([1, 0])
    run(1), run(0)
    assert not streamer._guessed
    streamer.end_route()
    for index in range(6):
        run(index)

# -- the ring across step boundaries ---------------------------------------------------------------------
#
# With s slots, the copy for a layer can start only once the layer that used its slot before has finished. At
# best that layer is the one s positions earlier (all s slots are taken by the s-1 layers in between and the one
# that just finished), so a copy overlaps at most s-1 layers of compute. A "stall" is a copy into a slot that had
# a previous user and overlaps fewer than s-1 layers: the compute then waits for it unless a copy takes under
# that many layers' time. Fixed slots (k % s) stall the first s-1 copies of every step when n % s != 0 (with
# n % s == 1, layer 0 shares layer n-1's slot and overlaps nothing): 2 (s-1) over 3 steps. The rotating ring
# reaches the minimum, 0. Only the cold start is unavoidable: the very first s copies overlap 0..s-1 layers.

SEVEN = DiTConfig(hidden_size=64, num_attention_heads=2, num_layers=7, ffn_hidden_size=128, text_in_dim=48,
                  rope_axes_dim=(8, 12, 12))
STREAMED_OF_SEVEN = {5: (0, 1, 3, 4, 6), 6: (0, 1, 2, 3, 5, 6), 7: tuple(range(7))}
STEPS = (1, 2, 3)  # input seeds, one per step


ALL_SEVEN_STREAMED = dit_plan(tuple(range(7)), 3, layers=7)  # 7 % 3 == 1: the ring's hardest case


@pytest.fixture(scope="module")
def seven_layers():
    dit = random_dit(7, SEVEN)
    with torch.inference_mode():
        outputs = [dit(*inputs(seed)).clone() for seed in STEPS]
    return dit.state_dict(), outputs


def traced(streamer: LayerStreamer, layers) -> list[tuple]:
    """The streamer's FakeSync calls in issue order, plus ("run", index, slot its weights point into) per layer."""
    trace: list[tuple] = []
    streamer.sync.trace = trace
    ring, original_before = streamer.ring.data_ptr(), streamer.before

    def before(index: int) -> None:
        original_before(index)
        if index in streamer.position:
            offsets = {t.data_ptr() - ring for t in list(layers[index].parameters()) + list(layers[index].buffers())}
            slots = {offset // streamer.slot_bytes for offset in offsets}
            assert all(0 <= offset < streamer.ring_bytes for offset in offsets) and len(slots) == 1
            trace.append(("run", index, slots.pop()))

    streamer.before = before
    return trace


def replay(trace: list[tuple], streamer: LayerStreamer) -> tuple[list[int], list[int], int]:
    """Check the ordering of `trace`; returns (overlaps of the cold-start copies, of all other consumed copies,
    copies issued). A copy's overlap is the number of streamed layers that finished between its issue and its use.
    """
    position_of_source = {host.data_ptr(): k for k, host in enumerate(streamer._host)}
    state = ["empty"] * streamer.slots  # empty -> loaded (copy) -> in use (wait) -> free (released) -> loaded ...
    holds: list[int] = [-1] * streamer.slots  # stream position whose bytes a slot holds
    issued_at = [0] * streamer.slots  # layers finished when the slot's copy was issued
    first_fill = [True] * streamer.slots
    finished, issued, in_use = 0, 0, None
    cold, warm = [], []
    for event in trace:
        kind, *rest = event
        if kind == "copy":
            slot, source = rest
            # (2) a slot is refilled only once the layer that used it last has released it
            assert state[slot] in ("empty", "free"), f"copy {issued} into slot {slot} while it is {state[slot]}"
            first_fill[slot] = state[slot] == "empty"
            state[slot], holds[slot], issued_at[slot] = "loaded", position_of_source[source], finished
            issued += 1
        elif kind == "wait":
            (slot,) = rest
            assert state[slot] == "loaded" and in_use is None
            state[slot], in_use = "in use", slot
            (cold if first_fill[slot] else warm).append(finished - issued_at[slot])
        elif kind == "join":  # the side stream waits for all queued compute: every used slot may be refilled
            state = ["empty" if st == "empty" else "free" for st in state]
            in_use = None
        elif kind == "run":
            index, pointed = rest
            # (1) the layer runs on its own bytes: its tensors point at the slot it waited for, holding its copy
            assert pointed == in_use and holds[pointed] == streamer.position[index], f"layer {index}"
        else:
            (slot,) = rest
            assert kind == "free" and slot == in_use
            state[slot], in_use, finished = "free", None, finished + 1
    return cold, warm, issued


@pytest.mark.parametrize("mode", ["eager", "lazy"])
@pytest.mark.parametrize("slots", [2, 3])
@pytest.mark.parametrize("n", [5, 6, 7])
def test_every_copy_is_issued_slots_minus_one_layers_ahead_across_steps(seven_layers, n, slots, mode):
    state, expected = seven_layers
    model = dit_from(state, SEVEN)
    placement = DiTPlacement(model, dit_plan(STREAMED_OF_SEVEN[n], slots, layers=7), CPU, fake_mode=mode)
    trace = traced(placement.streamer, model.layers)
    with torch.inference_mode():
        for seed, want in zip(STEPS, expected):
            assert torch.equal(model(*inputs(seed)), want)  # (1) bit-exact with the resident model
    assert trace[0] == ("join",)  # the fresh ring's first copies wait for the compute queued before them
    cold, warm, issued = replay(trace, placement.streamer)
    assert cold == list(range(slots))  # the first fill: copy j is issued with layer 0 and used by layer j
    assert len(cold) + len(warm) == 3 * n  # every layer of every step waited for exactly one copy
    assert issued == 3 * n + slots  # and the next step's first `slots` layers are prefetched
    stalls = [overlap for overlap in warm if overlap < slots - 1]
    assert stalls == [] and set(warm) == {slots - 1}  # (3) 0 stalls: the minimum
    placement.release()


def test_a_run_that_fails_inside_a_streamed_block_restarts_cleanly(seven_layers):
    state, expected = seven_layers
    model = dit_from(state, SEVEN)
    placement = DiTPlacement(model, ALL_SEVEN_STREAMED, CPU, fake_mode="lazy")
    failing = model.layers[4]

    def fail_once(*args, **kwargs):
        del failing.forward  # the next call uses the class's forward again
        raise RuntimeError("out of memory")

    trace = traced(placement.streamer, model.layers)
    with torch.inference_mode():
        assert torch.equal(model(*inputs(1)), expected[0])
        failing.forward = fail_once
        with pytest.raises(RuntimeError, match="out of memory"):
            model(*inputs(2))
        failed_at = len(trace)
        assert torch.equal(model(*inputs(2)), expected[1])
        assert torch.equal(model(*inputs(3)), expected[2])
    # Block 4 waited for its copy and never released its slot: the restart joins the compute stream before its
    # first copy, so no copy can overwrite that slot while the stopped block's kernels may still read it.
    assert trace[failed_at - 2:failed_at] == [("wait", trace[failed_at - 1][2]), ("run", 4, trace[failed_at - 1][2])]
    assert trace[failed_at][0] == "join" and trace[failed_at + 1][0] == "copy"
    replay(trace, placement.streamer)  # and every copy went into a released slot, every block ran on its own bytes
    placement.release()


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


def cuda_bf16_inputs(seed: int) -> tuple:
    latents, timestep, text, lens = inputs(seed)
    to_cuda = dict(device="cuda", dtype=torch.bfloat16)
    return latents.to(**to_cuda), timestep.to(**to_cuda), text.to(**to_cuda), lens


def cuda_seven_streamed(state: dict, seeds: tuple[int, ...]) -> tuple[ErnieDiT, DiTPlacement, list[torch.Tensor]]:
    """The seven-block DiT in bf16 streamed through three slots on CUDA, and the resident model's outputs for
    `seeds`, computed first (and freed) so they are the reference."""
    resident = dit_from(state, SEVEN).to(torch.bfloat16).to("cuda")
    with torch.inference_mode():
        wants = [resident(*cuda_bf16_inputs(seed)).clone() for seed in seeds]
    del resident
    model = dit_from(state, SEVEN).to(torch.bfloat16)
    return model, DiTPlacement(model, ALL_SEVEN_STREAMED, torch.device("cuda")), wants


@pytest.mark.gpu
@cuda
def test_cuda_seven_streamed_through_three_slots_equal_resident_over_three_steps(seven_layers):
    # 7 % 3 == 1: with fixed slots block 0 would share block 6's slot at every step boundary; the rotating ring
    # re-points blocks between slots, on real CUDA events and a side copy stream.
    model, placement, wants = cuda_seven_streamed(seven_layers[0], STEPS)
    streamer = placement.streamer
    assert isinstance(streamer.sync, CudaSync) and streamer.slab.data.is_pinned()
    with torch.inference_mode():
        for seed, want in zip(STEPS, wants):
            assert torch.equal(model(*cuda_bf16_inputs(seed)), want)
    assert streamer._at != [k % 3 for k in range(7)]  # blocks did move between slots
    placement.release()


@pytest.mark.gpu
@cuda
def test_cuda_run_that_fails_inside_a_streamed_block_restarts_bitwise_resident(seven_layers):
    model, placement, (want,) = cuda_seven_streamed(seven_layers[0], (2,))
    args = cuda_bf16_inputs(2)
    failing = model.layers[4]

    def fail_once(*call_args, **kwargs):
        del failing.forward
        raise RuntimeError("out of memory")

    with torch.inference_mode():
        assert torch.equal(model(*args), want)
        failing.forward = fail_once
        with pytest.raises(RuntimeError, match="out of memory"):
            model(*args)
        for _ in range(2):
            assert torch.equal(model(*args), want)
    placement.release()
