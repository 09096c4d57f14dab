"""runtime.core.host.Host implemented with ComfyUI's progress bar, interrupt flag and model management."""
from __future__ import annotations

import logging
import sys
from contextlib import contextmanager
from typing import Any, Iterator, Optional

from ..runtime.core.errors import Cancelled, named_settings
from .comfy_names import comfy_words

PREVIEW_FORMAT = "JPEG"
DEFAULT_PREVIEW_SIZE = 512

log = logging.getLogger("ernie_image")


def _model_management() -> Optional[Any]:
    try:
        import comfy.model_management as model_management  # type: ignore[import-not-found]
    except ImportError:
        return None
    return model_management


def _prompt_server() -> Optional[Any]:
    """ComfyUI's running server, when this process is ComfyUI (its `server` module is loaded by then)."""
    server_module = sys.modules.get("server")
    return getattr(getattr(server_module, "PromptServer", None), "instance", None)


def _comfy_args() -> Optional[Any]:
    """ComfyUI's parsed command line (comfy.cli_args.args), when this process is ComfyUI."""
    try:
        from comfy.cli_args import args  # type: ignore[import-not-found]
    except ImportError:
        return None
    return args


def _preview_size() -> int:
    args = _comfy_args()
    return int(getattr(args, "preview_size", DEFAULT_PREVIEW_SIZE) or DEFAULT_PREVIEW_SIZE)


def _preview_method() -> str:
    """ComfyUI's preview method for the running prompt ("none", "auto", "latent2rgb", "taesd"): --preview-method,
    or the run's own choice (the editor's setting, which ComfyUI puts into args.preview_method as each prompt starts).
    "none" outside ComfyUI."""
    method = getattr(_comfy_args(), "preview_method", None)
    return str(getattr(method, "value", method) or "none")


class ComfyHost:
    """One per node execution. Outside ComfyUI it degrades to a quiet host that never cancels."""

    def __init__(self, node_id: Optional[str] = None) -> None:
        self.node_id = node_id
        self._model_management = _model_management()
        self._progress_bar: Optional[Any] = None
        self._preview_size = _preview_size()

    @property
    def wants_previews(self) -> bool:
        """Whether this run shows latent previews (core.host.wants_previews): ComfyUI's preview method for it is not
        "none". Every method other than "none" gets the pack's latent-to-RGB picture (ComfyUI's latent2rgb)."""
        return _preview_method() != "none"

    def progress(self, value: int, total: int, preview: Optional[Any] = None) -> None:
        bar = self._bar(total)
        if bar is None:
            return
        frame = (PREVIEW_FORMAT, preview, self._preview_size) if preview is not None else None
        try:
            bar.update_absolute(value, total, frame)
        except Exception as error:  # ComfyUI's progress hook raises its interrupt exception on Cancel
            if self._is_interrupt(error):
                raise Cancelled("generation cancelled in ComfyUI") from error
            raise

    def check_cancel(self) -> None:
        mm = self._model_management
        if mm is not None and mm.processing_interrupted():
            raise Cancelled("generation cancelled in ComfyUI")

    def make_room(self, num_bytes: int, device: Any) -> None:
        mm = self._model_management
        if mm is None:
            return
        mm.free_memory(int(num_bytes), device)
        mm.soft_empty_cache()

    def log(self, message: str) -> None:
        log.info("[ERNIE-Image] %s", message)

    def status(self, text: str) -> None:
        """The running node's text in the editor (ComfyUI's progress text), e.g. what a remote batch waits for."""
        server = _prompt_server()
        if server is None or self.node_id is None or not hasattr(server, "send_progress_text"):
            return
        server.send_progress_text(text, self.node_id, getattr(server, "client_id", None))

    def _bar(self, total: int) -> Optional[Any]:
        if self._progress_bar is None:
            try:
                from comfy.utils import ProgressBar  # type: ignore[import-not-found]
            except ImportError:
                return None
            self._progress_bar = ProgressBar(total, node_id=self.node_id)
        return self._progress_bar

    def _is_interrupt(self, error: BaseException) -> bool:
        mm = self._model_management
        return mm is not None and isinstance(error, mm.InterruptProcessingException)


class NoteHost(ComfyHost):
    """ComfyHost that also keeps the notices, so they reach the node's own text and outputs, not only the log. A
    notice naming settings (errors.naming_line) names them as ComfyUI shows them, on the node and the console."""

    def __init__(self, node_id: Optional[str] = None) -> None:
        super().__init__(node_id)
        self.notes: list[str] = []

    def log(self, message: str) -> None:
        message = comfy_words(message, named_settings(message))
        self.notes.append(message)
        super().log(message)


@contextmanager
def cancel_as_comfy_interrupt() -> Iterator[None]:
    """Run a block whose Cancelled reaches ComfyUI as its interrupt (flag cleared), so the UI shows 'interrupted'."""
    try:
        yield
    except Cancelled as cancelled:
        mm = _model_management()
        if mm is None:
            raise
        mm.interrupt_current_processing(False)
        raise mm.InterruptProcessingException() from cancelled
