"""The DiT's blocks compiled on a thread of their own while its calls run uncompiled, then switched to compiled.

Compiling the blocks costs a process seconds before its first compiled call (FP8 on an H200: 3.7 s with inductor's
caches warm, 16 s from empty ones), which a first image would wait for. All blocks are one compiled graph
(compile.py), so one block's compile serves them all: `BlockCompile` compiles a twin of one block (new module
objects over the same weights, so a LoRA attached meanwhile does not reach the graph being traced) and calls it on
the tokens and context of the run's DiT calls, one per input signature (CFG's two text lengths are two, the second
a dynamic-shape graph), on a thread, while the run's calls go on uncompiled. When those are done, compiling the real
blocks in place leaves their first calls a lookup in the caches the twin filled.

`CompilingForward` is the DiT forward that does this: it hands the compile each new signature, runs the DiT
uncompiled, and switches at the first call of a known signature once the compile has caught up, so the rest of the
run is compiled. A run that spans the switch is computed uncompiled up to it and compiled after it: the same seed
gives the same picture within the compiled form's tolerance, as runs before and after a compile do.

The compile thread holds Python's GIL while it traces, so it slows whatever the caller does in Python meanwhile
(an uncompiled DiT call launching ~1,700 kernels ran two to three times slower beside it on an H200). A call
replayed as a CUDA graph (dit_graphs.py) is one launch, and waits for the GPU without the GIL: so a signature is
handed to the compile only after its first two calls, which warm up and capture its graph, and while the compile
runs no graph is made (a warm-up makes every host sync in the process raise, PyTorch's sync debug mode being
process-wide, which would fail the compile's own syncs): a signature without a graph runs eagerly. A failed compile
(out of memory beside the run, say) is said once and the blocks compile in place, so the next call compiles in the
foreground as LoadOptions.compile=True would.

What the compile holds: the twin until its thread ends (the block's module objects, and through them the tensors
the block held when the twin was made: its weights, and FP8's scale rows; a tensor the block replaces meanwhile
stays alive until then), and each given call's tokens until that call is compiled. The switch and `abandon()` (the
DiT unloaded or rebuilt) end the thread after the call it is in, since a compile cannot be interrupted; calls given
but not yet begun are let go.

PyTorch's sync debug mode is process-wide: a capture's warm-up elsewhere in the process (the prompt enhancer's
graph decoding, built once per load, when a compile outlasts its job and runs on into the next job's enhancer) makes
the compile's own syncs raise, and that compile fails as any failed compile does: said once, then compiled in the
foreground. The captures themselves bar only their own thread's unsafe CUDA calls, so the compile does not break
them.
"""
from __future__ import annotations

import copy
import queue
import threading
import time
from typing import Callable, Optional, Union

import torch
from torch import nn

from .compile import allow_cache_size, compile_blocks


def twin_of(block: nn.Module) -> nn.Module:
    """A copy of `block`'s module objects that shares every tensor with it (no weight is copied): its structure can
    be traced while the original's changes (LoRA wrappers put in or taken out), its weights are the original's."""
    shared = {}
    for module in block.modules():
        for value in (*module._parameters.values(), *module._buffers.values(), *vars(module).values()):
            if isinstance(value, torch.Tensor):
                shared[id(value)] = value
    memo = dict(shared)
    twin = copy.deepcopy(block, memo)
    copied = [value for key, value in memo.items() if key not in shared and isinstance(value, torch.Tensor)]
    if copied:
        raise RuntimeError(f"a twin of {type(block).__name__} would copy a tensor of shape {tuple(copied[0].shape)} "
                           "that is not one of its modules' own attributes")
    return twin


class BlockCompile:
    """A thread compiling a twin of `block` for each call it is given (`add(x, ctx)`: one per input signature, so
    that CFG's two text lengths and the dynamic-shape graph the second one makes are both compiled). `idle` is set
    while every call given so far is done; `error` says why the compile failed (it takes no more calls then);
    `close()` lets the thread end, and with it the twin."""

    def __init__(self, block: nn.Module, backend: Union[str, Callable] = "inductor") -> None:
        self.idle = threading.Event()
        self.idle.set()
        self.error: Optional[str] = None
        self.seconds = 0.0  # the calls' compiles and runs, summed (not the wall time since the first was given)
        self._backend = backend
        self._calls: queue.Queue = queue.Queue()
        self._lock = threading.Lock()
        self._outstanding = 0
        self._closed = False
        self._thread = threading.Thread(target=self._run, name="ernie-image-block-compile", daemon=True)
        self._twin: Optional[nn.Module] = None
        try:
            self._twin = twin_of(block)
        except RuntimeError as error:
            self.error = str(error)
        allow_cache_size()

    def add(self, x: torch.Tensor, ctx) -> None:
        with self._lock:
            if self.error is not None or self._closed:
                return
            self._outstanding += 1
            self.idle.clear()
        self._calls.put((x, ctx))
        if self._thread.ident is None:
            try:
                self._thread.start()
            except RuntimeError as error:  # e.g. no thread can be started: the caller compiles in the foreground
                self.error = _first_line(error)
                while not self._calls.empty():  # the queued calls' tokens are let go
                    self._calls.get_nowait()
                with self._lock:
                    self._outstanding = 0
                    self.idle.set()

    def close(self) -> None:
        """No more calls: the thread ends after the one it is in (a compile cannot be interrupted)."""
        with self._lock:
            self._closed = True
        self._calls.put(None)

    def _run(self) -> None:
        twin = self._twin
        self._twin = None
        while True:
            call = self._calls.get()
            if call is None:
                return
            started = time.perf_counter()
            try:
                if self.error is None and not self._closed:  # a closed compile's queued calls are let go
                    self._compile(twin, *call)
            except Exception as error:  # the caller says it and compiles in the foreground
                self.error = _first_line(error)
                twin = None
            finally:
                call = None  # the call's tokens are let go before the next one
                self.seconds += time.perf_counter() - started
                with self._lock:
                    self._outstanding -= 1
                    if self._outstanding == 0:
                        self.idle.set()

    def _compile(self, twin: nn.Module, x: torch.Tensor, ctx) -> None:
        if x.is_cuda:  # the device and its context made this thread's: Triton's launches need them
            torch.cuda.set_device(x.device)
            torch.cuda.synchronize(x.device)
        with torch.inference_mode():
            if twin._compiled_call_impl is None:
                twin.compile(backend=self._backend)
            twin(x, ctx)
        if x.is_cuda:
            torch.cuda.current_stream(x.device).synchronize()

    def join(self, timeout: Optional[float] = None) -> bool:
        """Wait for the thread; whether it has ended (or never started)."""
        if self._thread.ident is not None:
            self._thread.join(timeout)
        return not self._thread.is_alive()


def _first_line(error: BaseException) -> str:
    """The error at the root of `error`'s chain (dynamo wraps a backend's own error), as one line."""
    while True:
        inner = getattr(error, "inner_exception", None) or error.__cause__
        if not isinstance(inner, BaseException):
            break
        error = inner
    lines = str(error).strip().splitlines()
    return f"{type(error).__name__}: {lines[0] if lines else ''}"[:300]


def graph_structure(block: nn.Module) -> tuple:
    """What a compiled block's graph depends on beyond its tensors' values: its modules' kinds and settings, and
    the shapes and types of their tensors (a LoRA's rank, an FP8 layer's format)."""
    return tuple((name, type(module).__name__, module.extra_repr(),
                  tuple((key, tuple(t.shape), t.dtype) for key, t in (*module._parameters.items(),
                                                                      *module._buffers.items()) if t is not None))
                 for name, module in block.named_modules())


Forward = Callable[..., torch.Tensor]
GRAPH_CALLS = 2  # a signature's first calls, which warm up and capture its CUDA graph (graph_cache.py)


class CompilingForward:
    """Callable like the DiT: `uncompiled` (the DiT or its dit_graphs.DiTGraphs) until the blocks' background compile
    is done, then the DiT with its blocks compiled. `say(message)` tells the user what happened; `compiled(seconds)`
    is called once the real blocks are compiled (the seconds its calls took on the thread, summed; None after a failed
    or unstarted one)."""

    def __init__(self, dit: nn.Module, uncompiled: Forward, say: Callable[[str], None],
                 compiled: Callable[[Optional[float]], None], backend: Union[str, Callable] = "inductor",
                 compile_in_place: Callable[[nn.Module], object] = compile_blocks) -> None:
        self.dit = dit
        self.uncompiled = uncompiled
        self._say = say
        self._compiled = compiled
        self._backend = backend
        self._compile_in_place = compile_in_place  # the real blocks, as compile.compile_blocks compiles them
        self.block_compile: Optional[BlockCompile] = None
        self._structure: Optional[tuple] = None  # graph_structure of the first block when the twin was made
        self._calls: dict[tuple, int] = {}  # DiT calls so far, by input signature
        self._handed: set[tuple] = set()  # the signatures given to the compile
        self.switched = False
        self.abandoned = False

    def __call__(self, latents: torch.Tensor, timestep: torch.Tensor, text: torch.Tensor,
                 text_lens: list[int]) -> torch.Tensor:
        if self.switched or self.abandoned:
            return (self.dit if self.switched else self.uncompiled)(latents, timestep, text, text_lens)
        signature = (tuple(latents.shape), latents.dtype, tuple(timestep.shape), tuple(text.shape),
                     tuple(int(n) for n in text_lens))
        calls = self._calls[signature] = self._calls.get(signature, 0) + 1
        if self.block_compile is None:
            if calls <= GRAPH_CALLS:
                return self.uncompiled(latents, timestep, text, text_lens)
            self._graphs_made(False)
            self._structure = graph_structure(self.dit.layers[0])
            self.block_compile = BlockCompile(self.dit.layers[0], self._backend)
        if signature not in self._handed:
            self._handed.add(signature)
            x, ctx, _ = self.dit.prepare(latents, timestep, text, text_lens)
            self.block_compile.add(x, ctx)
        elif self.block_compile.idle.is_set():
            self.switch()
            return self.dit(latents, timestep, text, text_lens)
        return self.uncompiled(latents, timestep, text, text_lens)

    def outdated(self) -> bool:
        """Whether the blocks' structure changed (a LoRA put in or taken out, not a strength changed in place) since
        the twin was made: the graph being compiled is not the one the blocks would run, and switching would compile
        theirs in the foreground."""
        return self.block_compile is not None and graph_structure(self.dit.layers[0]) != self._structure

    def switch(self) -> None:
        """Compile the real blocks in place now (a cache lookup after the twin's compile; a compile after a failed
        one), and let the compile's thread end. Called between two DiT calls, or by a caller that waited for the
        compile to be idle."""
        if self.switched:
            return
        self.switched = True
        block_compile = self.block_compile
        if block_compile is None:
            self._say("the DiT's blocks had not started compiling in the background: they compile on their next "
                      "call instead")
        else:
            block_compile.close()
            if block_compile.error:
                self._say(f"the DiT's blocks could not compile in the background ({block_compile.error}): they "
                          "compile on their next call instead")
        self.release_graphs()
        self._graphs_made(True)
        self._compile_in_place(self.dit)
        compiled_beside = block_compile is not None and not block_compile.error
        self._compiled(block_compile.seconds if compiled_beside else None)

    def wait_and_switch(self, check_cancel: Callable[[], None], poll_s: float = 0.1) -> None:
        """Before a run that cannot switch between its calls: let the compile's calls end (cancel is checked every
        `poll_s`), then switch."""
        if self.switched or self.abandoned:
            return
        if self.block_compile is not None:
            while not self.block_compile.idle.wait(poll_s):
                check_cancel()
        self.switch()

    def abandon(self) -> None:
        """The DiT is unloaded or rebuilt: no switch happens (a compile in flight ends on its own)."""
        self.abandoned = True
        if self.block_compile is not None:
            self.block_compile.close()
        self.release_graphs()
        self._graphs_made(True)

    def _graphs_made(self, made: bool) -> None:
        if hasattr(self.uncompiled, "makes_graphs"):
            self.uncompiled.makes_graphs = made

    def release_graphs(self) -> None:
        release = getattr(self.uncompiled, "release_graphs", None)
        if release is not None:
            release()
