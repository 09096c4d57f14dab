"""Several SGLang servers as one: images spread over servers, one in flight per server, failover.

Each server serves one request at a time (SGLang queues the rest), so the fleet keeps exactly one request
in flight per server and hands the next image to whichever server frees up first. A server that refuses,
answers 503 or drops the connection is set aside for a while and the image goes to another server; the
user is told which server failed and why. A 4xx (the request itself is wrong) or a 500 (the server failed
to generate) stops the batch: another server would answer the same.
"""
from __future__ import annotations

import asyncio
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Callable, Optional, Sequence

from ..errors import RemoteError
from .http import ConnectionLost, HttpSettings, RetryPolicy, ServerUnavailable
from .sglang import GeneratedImage, ImageParams, ReadTimeoutPolicy, ServerModel, SglangClient

Notify = Callable[[str], None]

# Until a server has reported its own speed: ERNIE-Image at 1 MP, 50 steps is ~15 s on one H200.
DEFAULT_SECONDS_PER_STEP_MEGAPIXEL = 0.3
SINGLE_ATTEMPT = RetryPolicy(attempts=1)


@dataclass(frozen=True)
class FleetSettings:
    http: HttpSettings = HttpSettings()  # the same key, timeouts, retries and size cap for every server
    read_timeout: ReadTimeoutPolicy = ReadTimeoutPolicy()
    retry_down_after_s: float = 10.0  # how long a failed server is left alone before it is tried again
    max_failures_per_server: int = 3  # consecutive failures in one batch before a server is given up on


@dataclass
class ServerSlot:
    client: SglangClient
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)  # one request in flight per server
    down_until: float = 0.0
    last_error: Optional[str] = None
    model: Optional[ServerModel] = None
    seconds_per_step_megapixel: Optional[float] = None
    images_served: int = 0

    @property
    def label(self) -> str:
        return self.client.label

    def learn_speed(self, params: ImageParams, inference_time_s: Optional[float]) -> None:
        if not inference_time_s or inference_time_s <= 0:
            return
        rate = inference_time_s / (params.steps * params.width * params.height / 1e6)
        previous = self.seconds_per_step_megapixel
        self.seconds_per_step_megapixel = rate if previous is None else 0.5 * previous + 0.5 * rate


class Fleet:
    """Servers and their state; lives on the private event loop (create it there)."""

    def __init__(self, urls: Sequence[str], settings: FleetSettings = FleetSettings()) -> None:
        if not urls:
            raise RemoteError("no server URL given: add at least one, like http://127.0.0.1:30000")
        self.settings = settings
        seen: set[str] = set()
        self.slots: list[ServerSlot] = []
        for url in urls:
            client = SglangClient(url, settings.http, settings.read_timeout)
            if client.http.base_url in seen:
                continue
            seen.add(client.http.base_url)
            self.slots.append(ServerSlot(client))

    async def close(self) -> None:
        for slot in self.slots:
            await slot.client.close()

    # -------------------------------------------------------------------------------------- estimates
    def estimate_seconds(self, params: ImageParams) -> float:
        rates = [s.seconds_per_step_megapixel for s in self.slots if s.seconds_per_step_megapixel]
        rate = sum(rates) / len(rates) if rates else DEFAULT_SECONDS_PER_STEP_MEGAPIXEL
        return rate * params.steps * params.width * params.height / 1e6

    def estimate_batch_seconds(self, jobs: Sequence[ImageParams]) -> float:
        if not jobs:
            return 0.0
        servers = max(1, sum(1 for s in self.slots if s.down_until <= time.monotonic()))
        rounds = -(-len(jobs) // servers)
        return rounds * self.estimate_seconds(jobs[0])

    # ------------------------------------------------------------------------------------- discovery
    async def discover(self, slot: ServerSlot) -> ServerModel:
        if slot.model is None:
            slot.model = await slot.client.ernie_model()
        return slot.model

    # ------------------------------------------------------------------------------------- generation
    async def generate(self, jobs: Sequence[ImageParams], notify: Notify,
                       on_image: Optional[Callable[[int, GeneratedImage], None]] = None) -> list[GeneratedImage]:
        """All `jobs`, in order; images are spread over the servers that answer. Cancel by cancelling the task
        (run_sync's poll does): open requests are closed."""
        pending: deque[int] = deque(range(len(jobs)))
        results: list[Optional[GeneratedImage]] = [None] * len(jobs)
        failures = {id(slot): 0 for slot in self.slots}
        wake = asyncio.Event()  # set when an image finishes or a server fails, so idle workers look again
        fatal: list[BaseException] = []

        def usable(slot: ServerSlot) -> bool:
            return failures[id(slot)] < self.settings.max_failures_per_server

        async def worker(slot: ServerSlot) -> None:
            while pending and not fatal and usable(slot):
                wait = slot.down_until - time.monotonic()
                if wait > 0:
                    if any(usable(s) and s.down_until <= time.monotonic() for s in self.slots if s is not slot):
                        # another server is up: idle until something changes, then look again
                        wake.clear()
                        try:
                            await asyncio.wait_for(wake.wait(), timeout=min(wait, 1.0))
                        except asyncio.TimeoutError:
                            pass
                        continue
                    await asyncio.sleep(min(wait, 1.0))
                    continue
                async with slot.lock:
                    if not pending or fatal:
                        return
                    index = pending.popleft()
                    params = jobs[index]
                    alone = sum(1 for s in self.slots if usable(s)) == 1
                    try:
                        await self.discover(slot)
                        result = await slot.client.generate(
                            params, retry=self.settings.http.retry if alone else SINGLE_ATTEMPT)
                    except (ServerUnavailable, ConnectionLost) as exc:
                        pending.appendleft(index)
                        failures[id(slot)] += 1
                        slot.down_until = time.monotonic() + self.settings.retry_down_after_s
                        slot.last_error = str(exc)
                        others = [s.label for s in self.slots if s is not slot and usable(s)]
                        if not usable(slot):
                            what = "giving up on it for this batch"
                        elif others:
                            what = f"retrying it in {self.settings.retry_down_after_s:g} s"
                        else:
                            what = f"retrying in {self.settings.retry_down_after_s:g} s"
                        moved = f"; image {index + 1} goes to {', '.join(others)}" if others else ""
                        notify(f"server failed: {exc} ({what}{moved})")
                        wake.set()
                        continue
                    except BaseException as exc:  # 4xx, 500, bad response, cancel: the batch stops
                        fatal.append(exc)
                        wake.set()
                        return
                failures[id(slot)] = 0
                slot.down_until = 0.0
                slot.last_error = None
                slot.images_served += 1
                slot.learn_speed(params, result.inference_time_s)
                results[index] = result
                if on_image is not None:
                    on_image(index, result)
                wake.set()

        tasks = [asyncio.ensure_future(worker(slot)) for slot in self.slots]
        try:
            await asyncio.gather(*tasks)
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
        if fatal:
            raise fatal[0]
        if pending:
            reasons = "; ".join(s.last_error or f"{s.label} unusable" for s in self.slots)
            raise RemoteError(
                f"no server could take the remaining {len(pending)} of {len(jobs)} images ({reasons}); check that "
                f"the servers are running and ready (ernie-image check-remote URL)"
            )
        return [r for r in results if r is not None]
