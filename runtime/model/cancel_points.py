"""Cancel checks inside one long module call: a forward pre-hook on each of a module's leaf modules calls the host's
check, so a cancel lands between two layers of a VAE pass (a tiled decode of a large image runs for seconds on a GPU
and for minutes on a CPU), not after the whole pass."""
from __future__ import annotations

from contextlib import contextmanager
from typing import Callable, Iterator

from torch import nn


@contextmanager
def cancellable(module: nn.Module, check_cancel: Callable[[], None]) -> Iterator[None]:
    """While inside, every leaf module of `module` calls `check_cancel` (which raises to cancel) before it runs."""
    handles = [leaf.register_forward_pre_hook(lambda _leaf, _args: check_cancel())
               for leaf in module.modules() if next(leaf.children(), None) is None]
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()
