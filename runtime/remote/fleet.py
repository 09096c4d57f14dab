"""Several SGLang servers as one: images spread over the servers that work, whatever the others do.

Each server serves one request at a time (SGLang queues the rest), so the fleet keeps one request in flight per
server and hands the next image to whichever server is free. A server takes images only once its /health says
ready; until then it is asked again every `probe_every_s`, so a server still loading joins the batch when it is
ready and a dead one costs nothing but its probes.

What a failure does depends on whether the server can have started the image (see net/client.py):
- not started (refused, 503, 429, 408): the image goes back to the queue for any server; the server waits
  (Retry-After, or a growing pause) and is probed again; after `max_failures_per_server` such failures in a row
  it is given up on for this batch;
- may have started (sent, then no answer in time or the connection broke): the image is NOT sent again, here or
  elsewhere, so no server runs the same job twice; that server is given up on for this batch, the other images
  go on on the servers that work, and the batch ends in an error naming the image(s) left unmade and how many
  were received. With `resend_unanswered` it is queued again instead, and the user is told the first server may
  still be working on it;
- the server answered that it failed (500, an unusable answer): it is done with the image, so the image goes
  back to the queue for another server and the failing server is given up on for this batch (each server fails
  an image at most once, so a request that fails everywhere ends once every server has failed it);
- the request itself is wrong (4xx): the batch stops; another server would answer the same.
The user gets one line each time a server's state changes (failed, loading, refused, ready again), not one per
retry; a server not ready at its first look is told about once another server takes the images meanwhile (when
none can, the waiting lines and the final error say it). When no server can take work the batch waits up to
`wait_for_servers_s`, counted from the moment none could, a server's first look included: an answer still
outstanding at the deadline is not waited for (a first look gets at least FIRST_LOOK_S, so 0 still hears a
working server). A wait of `notice_every_s` or more tells the user every `notice_every_s` what it waits for;
a shorter one ends in its one-line error alone. Cancelling the task (as run_sync's poll does) ends the wait at
once.
"""
from __future__ import annotations

import asyncio
import dataclasses
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Callable, Optional, Sequence

from ..core.errors import RemoteError, named_settings, naming_line
from ..net.credentials import ServerKeys
from ..net.errors import BadResponse, ConnectionLost, ServerFailed, ServerRejected, ServerUnavailable
from ..net.settings import HttpSettings, RetryPolicy
from ..net.urls import normalize_base_url
from .sglang import (PROBE_READ_S, READY, REFUSED, UNREACHABLE, GeneratedImage, ImageParams, ReadTimeoutPolicy,
                     Readiness, ServerModel, SglangClient)

Notify = Callable[[str], None]
OnWait = Callable[[str, float, float], None]  # (what the batch waits for, seconds waited, seconds it may wait)

# Until a server has reported its own speed: ERNIE-Image at 1 MP, 50 steps is ~15 s on one H200.
DEFAULT_SECONDS_PER_STEP_MEGAPIXEL = 0.3
SINGLE_ATTEMPT = RetryPolicy(attempts=1)  # the fleet itself decides when and where an image is sent again
MAX_PAUSE_S = 60.0
GIVEN_UP = "given up"
UNKNOWN = "not asked yet"
FAILED = "failed"  # did not take the last image; asked again after a pause
RESEND_SETTING = "resend_unanswered"  # named by ErnieImageError.naming: the CLI shows its flag
WAIT_SETTING = "wait_for_servers_s"
FIRST_LOOK_S = 1.0  # a server's first answer is awaited this long even when the wait is shorter (0: no waiting)


class UnansweredImage(ConnectionLost):
    """An image was sent and got no answer; it is not sent again (the server may still be working on it)."""


class ServersNotReady(ServerUnavailable):
    """No server could take work within the wait."""


@dataclass(frozen=True)
class FleetSettings:
    http: HttpSettings = HttpSettings()  # the same timeouts and size cap for every server
    keys: ServerKeys = ServerKeys()  # each server's own credential, if the user bound one to it
    read_timeout: ReadTimeoutPolicy = ReadTimeoutPolicy()
    retry_down_after_s: float = 10.0  # first pause after a server did not take an image; doubles, up to 60 s
    busy_retry_s: float = 1.0  # the same after it answered "busy" (503/429/408): it is up, /health is asked first
    max_failures_per_server: int = 3  # images in a row a ready server did not take before it is given up on
    wait_for_servers_s: float = 600.0  # how long a batch waits while no server can take work (loading, refused)
    resend_unanswered: bool = False  # send an image again after it got no answer (the server may be running it)
    probe_every_s: float = 1.0  # /health of a server that is not ready
    notice_every_s: float = 10.0  # how often the user hears what the batch waits for
    status_every_s: float = 1.0  # how often the waiting state is shown where the run is shown (a node, a status)


@dataclass
class ServerSlot:
    client: SglangClient
    model: Optional[ServerModel] = None
    seconds_per_step_megapixel: Optional[float] = None
    images_served: int = 0
    state: str = UNKNOWN  # READY, a Readiness state, or GIVEN_UP; kept between batches
    detail: str = ""  # the line that explains `state`
    cause: str = ""  # `state` in plain words, without the server's name or a fix ("still loading")
    failures: int = 0  # images in a row this server did not take
    next_try_at: float = 0.0
    busy: bool = False
    reported: Optional[str] = None  # the state last told to the user
    gave_up: Optional[BaseException] = None

    @property
    def label(self) -> str:
        return self.client.label

    def available(self, now: float) -> bool:
        return self.busy or (self.state == READY and self.next_try_at <= now)

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
            # A read timeout asked for below the readiness look's own 10 s caps that look too.
            probe_read_s = min(PROBE_READ_S, settings.read_timeout.base_s * settings.read_timeout.scale)
            http = dataclasses.replace(settings.http, credential=settings.keys.for_url(normalize_base_url(url)))
            client = SglangClient(url, http, settings.read_timeout, probe_read_s=probe_read_s)
            if client.http.base_url in seen:
                continue
            seen.add(client.http.base_url)
            self.slots.append(ServerSlot(client))

    async def close(self) -> None:
        for slot in self.slots:
            await slot.client.close()

    # -------------------------------------------------------------------------------------- estimates
    def measured(self) -> bool:
        """Whether a server has reported its speed (otherwise estimates are a guess for one H200)."""
        return any(s.seconds_per_step_megapixel for s in self.slots)

    def estimate_seconds(self, params: ImageParams) -> float:
        rates = [s.seconds_per_step_megapixel for s in self.slots if s.seconds_per_step_megapixel]
        rate = sum(rates) / len(rates) if rates else DEFAULT_SECONDS_PER_STEP_MEGAPIXEL
        return rate * params.steps * params.width * params.height / 1e6

    def estimate_batch_seconds(self, jobs: Sequence[ImageParams]) -> float:
        if not jobs:
            return 0.0
        servers = max(1, sum(1 for s in self.slots if s.state in (READY, UNKNOWN)))
        rounds = -(-len(jobs) // servers)
        return rounds * self.estimate_seconds(jobs[0])

    # ------------------------------------------------------------------------------------- discovery
    async def discover(self, slot: ServerSlot) -> ServerModel:
        if slot.model is None:
            slot.model = await slot.client.ernie_model()
        return slot.model

    async def first_model(self, notify: Notify, on_wait: Optional[OnWait] = None, images: int = 0) -> ServerModel:
        """The model of the first server that is ready, waiting for one as a batch would."""
        return await _Batch(self, [], notify, None, until_ready=True, on_wait=on_wait,
                            images_for=images).run_until_ready()

    # ------------------------------------------------------------------------------------- generation
    async def generate(self, jobs: Sequence[ImageParams], notify: Notify,
                       on_image: Optional[Callable[[int, GeneratedImage], None]] = None,
                       on_first_send: Optional[Callable[[], None]] = None,
                       on_wait: Optional[OnWait] = None, model: Optional[ServerModel] = None,
                       after_first_look: bool = False) -> list[GeneratedImage]:
        """All `jobs`, in order; images are spread over the servers that work. Cancel by cancelling the task
        (run_sync's poll does): open requests are closed. `on_first_send` is called as the first image goes out
        (the caller's start notice: a batch that no server takes ends in its one error line alone); `on_wait` every
        `status_every_s` while no server can take work, with what the batch waits for. With `model`, a batch is made
        by that model alone (ServerModel.identity: the weights, whatever each server names them): a server serving
        another is set aside for the batch, with one line.
        `after_first_look`: first_model has just looked for these images; a server it gave up on is not asked again."""
        return await _Batch(self, jobs, notify, on_image, on_first_send=on_first_send, on_wait=on_wait,
                            model=model, after_first_look=after_first_look).run()


@dataclass
class _Batch:
    """One call of Fleet.generate: the queue of images, and a worker per server taking from it."""

    fleet: Fleet
    jobs: Sequence[ImageParams]
    notify: Notify
    on_image: Optional[Callable[[int, GeneratedImage], None]]
    pending: deque = field(default_factory=deque)
    results: list = field(default_factory=list)
    done: int = 0
    fatal: Optional[BaseException] = None
    until_ready: bool = False  # the goal is one ready server, not images (Fleet.first_model)
    on_first_send: Optional[Callable[[], None]] = None  # called as the first image goes out
    unanswered: list = field(default_factory=list)  # (index, error) of images sent that got no answer: not re-sent
    on_wait: Optional[OnWait] = None  # told, while no server can take work, what the batch waits for
    model: Optional[ServerModel] = None  # the one model this batch is made by (None: whatever each server serves)
    images_for: int = 0  # until_ready: the images of the batch a ready server is sought for (named in its error)
    after_first_look: bool = False  # follows first_model for the same images: what it gave up on stays given up

    def __post_init__(self) -> None:
        self.settings = self.fleet.settings
        self.slots = self.fleet.slots
        self.pending = deque(range(len(self.jobs)))
        self.results = [None] * len(self.jobs)
        self._change = asyncio.Event()
        for slot in self.slots:  # a server given up on in an earlier batch gets another chance
            slot.failures, slot.busy, slot.next_try_at = 0, False, 0.0
            if slot.state == GIVEN_UP and not self.after_first_look:
                slot.state, slot.gave_up, slot.reported = UNKNOWN, None, None

    # --------------------------------------------------------------------------------------- signals
    def _signal(self) -> None:
        """Wake everything waiting for a change (an image done or back in the queue, a server's state)."""
        self._change.set()
        self._change = asyncio.Event()

    async def _until_change(self, timeout_s: float) -> None:
        event = self._change
        try:
            await asyncio.wait_for(event.wait(), timeout=max(0.0, timeout_s))
        except asyncio.TimeoutError:
            pass

    def _finished(self) -> bool:
        if self.fatal is not None:
            return True
        if self.until_ready:
            return any(slot.state == READY for slot in self.slots)
        return self.done + len(self.unanswered) == len(self.jobs)

    # ------------------------------------------------------------------------------------ supervision
    async def run(self) -> list[GeneratedImage]:
        self._tell_given_up_at_first_look()
        await self._run_workers()
        return list(self.results)

    async def run_until_ready(self) -> ServerModel:
        await self._run_workers()
        ready = next(s for s in self.slots if s.state == READY)
        assert ready.model is not None
        return ready.model

    async def _run_workers(self) -> None:
        """One worker per server under the supervisor; every worker is cancelled when it is done."""
        workers = [asyncio.ensure_future(self._serve(slot)) for slot in self.slots]
        try:
            await self._supervise()
        finally:
            for task in workers:
                task.cancel()
            await asyncio.gather(*workers, return_exceptions=True)
            # The error raised next reaches the caller, whose frames (a pipe's own) its traceback then holds: kept
            # on the fleet, it would keep that pipe alive for as long as the fleet, the pipe's own finalizer included.
            for slot in self.slots:
                slot.gave_up = None
        if self.fatal is None and self.unanswered:
            self.fatal = self._unanswered_error()
        if self.fatal is not None:
            fatal, self.fatal = self.fatal, None
            try:
                raise fatal
            finally:
                del fatal

    def _received(self) -> str:
        """How many images came back before the batch failed (a batch is returned whole or not at all)."""
        if not self.jobs or not self.done:
            return ""
        return (f"; {self.done} of {len(self.jobs)} images were received before this and are not kept (a batch is "
                f"returned whole or not at all)")

    def _unanswered_error(self) -> UnansweredImage:
        index, error = self.unanswered[0]
        others = len(self.unanswered) - 1
        more = f" (and {others} more image(s) likewise)" if others else ""
        return UnansweredImage(
            f"image {index + 1} of {len(self.jobs)} (seed {self.jobs[index].seed}): {error}; it is not sent again, to "
            f"this server or another, so no server runs it twice{more}{self._received()} (to send such images "
            f"again, turn on {RESEND_SETTING})").naming(RESEND_SETTING, *named_settings(error))

    async def _supervise(self) -> None:
        """Until the batch is done or cannot go on: every server given up on, or none ready within the wait."""
        stalled_since: Optional[float] = None
        next_notice = next_status = 0.0
        wait_s = self.settings.wait_for_servers_s
        while not self._finished():
            now = time.monotonic()
            if all(slot.state == GIVEN_UP for slot in self.slots):
                self.fatal = self._all_given_up()
                break
            self._report_first_looks()
            if any(slot.available(now) for slot in self.slots):
                stalled_since = None
            else:
                if stalled_since is None:
                    stalled_since, next_notice = now, now
                waited = now - stalled_since
                first_looks = any(slot.state == UNKNOWN for slot in self.slots)
                if waited >= (max(wait_s, FIRST_LOOK_S) if first_looks else wait_s):
                    self.fatal = self._not_ready(waited)  # the workers, a look still under way included, are cut
                    break
                if now >= next_notice and not first_looks and wait_s >= self.settings.notice_every_s:
                    self.notify(self._waiting_line(waited, wait_s))
                    next_notice = now + self.settings.notice_every_s
                if self.on_wait is not None and now >= next_status:
                    self.on_wait(self._waiting_line(waited, wait_s), waited, wait_s)
                    next_status = now + self.settings.status_every_s
            await self._until_change(0.1)
        if self.fatal is None:
            self._report_first_looks()

    def _tell_given_up_at_first_look(self) -> None:
        """A server first_model gave up on while another was ready (so nothing was said then), told once now."""
        others = [s.label for s in self.slots if s.state != GIVEN_UP]
        for slot in self.slots:
            if self.after_first_look and slot.state == GIVEN_UP and slot.reported != GIVEN_UP and others:
                self._report(slot, f"giving up on {slot.label} for this batch: {slot.detail}; the batch goes on "
                                   f"with {', '.join(others)}")

    def _report_first_looks(self) -> None:
        """A server not ready at its first look, told once another takes the images (else the wait's lines and
        error tell it)."""
        ready = [s.label for s in self.slots if s.state == READY]
        if not ready:
            return
        for slot in self.slots:
            if slot.reported is None and slot.state not in (READY, UNKNOWN, GIVEN_UP):
                meanwhile = f"; images go to {', '.join(ready)} meanwhile" if self.jobs or self.images_for else ""
                self._report(slot, f"{slot.detail}{meanwhile}")

    def _waiting_line(self, waited_s: float, wait_s: float) -> str:
        waiting = [s for s in self.slots if s.state != GIVEN_UP]
        states = ", ".join(f"{s.label}: {_pause_state(s)}" for s in waiting)
        sep = ", " if len(waiting) == 1 else "; "
        return f"waiting for {states}{sep}{waited_s:.0f} s (up to {wait_s:g} s; cancelling the run stops the wait)"

    def _not_ready(self, waited_s: float) -> ServersNotReady:
        """One line: each server and what it did, in plain words, then the fixes (the wait named for `naming`)."""
        causes = "; ".join(f"{s.label}: {_cause(s, waited_s)}" for s in self.slots)
        wait_s = self.settings.wait_for_servers_s
        within = f" within {wait_s:g} s" if wait_s else ""
        more_time = (f"wait longer with {WAIT_SETTING} SECONDS" if wait_s else
                     f"give a server that is still loading time with {WAIT_SETTING} SECONDS")
        if len(self.slots) == 1:
            still = "" if self.slots[0].state == UNKNOWN else within.replace(" within", ", still after")  # timed
            return ServersNotReady(f"{causes}{still}: start the server, check "
                                   f"the URL, or {more_time}").naming(WAIT_SETTING)
        return ServersNotReady(f"no server could take {self._images_left()}{within}: {causes}: start or fix the "
                               f"servers, check the URLs, or {more_time}").naming(WAIT_SETTING)

    def _images_left(self) -> str:
        """The images no server took, in words: "the image", "the 4 images", "the remaining 2 of 4 images"; "any
        work" when the batch has none yet (the first look for a ready server, for no images in particular)."""
        total = len(self.jobs) or self.images_for
        left = len(self.pending) if self.jobs else total
        if not total or not left:
            return "any work"
        if left < total:
            return f"the remaining {left} of {total} images"
        return "the image" if total == 1 else f"the {total} images"

    def _all_given_up(self) -> BaseException:
        if self.unanswered and not self.pending:
            return self._unanswered_error()
        if len(self.slots) == 1 and self.slots[0].gave_up is not None and not self.done:
            return self.slots[0].gave_up  # its own error says what to fix
        reasons = "; ".join(s.detail for s in self.slots)
        unmade = f"; {len(self.unanswered)} image(s) sent got no answer and are not sent again" if self.unanswered else ""
        named = [name for s in self.slots if s.gave_up is not None for name in named_settings(s.gave_up)]
        return RemoteError(
            f"no server could take {self._images_left()} ({reasons}){unmade}{self._received()}; check that the "
            f"servers are running and ready (ernie-image check-remote URL)").naming(*dict.fromkeys(named))

    # ---------------------------------------------------------------------------------------- workers
    async def _serve(self, slot: ServerSlot) -> None:
        try:
            await self._serve_until_done(slot)
        except Exception as exc:  # noqa: BLE001 - whatever stops a worker stops the batch, not a silent hang
            self.fatal = self.fatal or exc
            self._signal()

    async def _serve_until_done(self, slot: ServerSlot) -> None:
        while not self._finished() and slot.state != GIVEN_UP:
            now = time.monotonic()
            if slot.next_try_at > now:
                await asyncio.sleep(min(slot.next_try_at - now, 1.0))
                continue
            if slot.state != READY:
                await self._probe(slot)
                continue
            if self._serves_another_model(slot):
                return
            if not self.pending:
                await self._until_change(1.0)  # an image may come back to the queue
                continue
            await self._send(slot, self.pending.popleft())

    async def _probe(self, slot: ServerSlot) -> None:
        try:
            readiness = await slot.client.health()
            if readiness.ready:
                await self.fleet.discover(slot)
        except (ServerUnavailable, ConnectionLost) as exc:
            readiness = Readiness(REFUSED if getattr(exc, "reason", "") == "refused" else UNREACHABLE, str(exc),
                                  exc.cause)
        except (ServerRejected, BadResponse) as exc:  # not an ERNIE server, a refused key, a wrong path
            self._give_up(slot, exc, str(exc))
            return
        if readiness.ready:
            slot.state, slot.detail = READY, readiness.detail
            if slot.reported is not None:
                self._report(slot, f"{slot.label} is ready: it takes images again")
            self._signal()
            return
        slot.state, slot.detail, slot.cause = readiness.state, readiness.detail, readiness.cause
        if slot.reported == READY:  # it stopped taking images; a first look is told by _report_first_looks
            others = [s.label for s in self.slots if s is not slot and s.state == READY]
            meanwhile = f"; images go to {', '.join(others)} meanwhile" if others and self.jobs else ""
            self._report(slot, f"{readiness.detail}{meanwhile}")
        self._signal()
        slot.next_try_at = time.monotonic() + self.settings.probe_every_s

    def _serves_another_model(self, slot: ServerSlot) -> bool:
        """A ready server of another model than the batch's is set aside for the batch (one picture, one model).
        Another name for the same weights (a served-model-name, a path or repo id of the same release) is the
        same model (ServerModel.identity)."""
        if self.model is None or slot.model is None or slot.model.identity == self.model.identity:
            return False
        why = f"it serves {slot.model.named()}, not {self.model.named()}, which makes this batch"
        self._give_up(slot, RemoteError(f"{slot.label}: {why}"), why)
        return True

    def _report(self, slot: ServerSlot, line: str) -> None:
        slot.reported = slot.state
        self.notify(line)

    def _give_up(self, slot: ServerSlot, error: BaseException, why: str, then: str = "") -> None:
        """`why` goes into the final error too; `then` (what becomes of its image) only into the line told now."""
        slot.state, slot.gave_up, slot.detail = GIVEN_UP, error, why
        others = [s.label for s in self.slots if s is not slot and s.state != GIVEN_UP]
        if others and not self._finished():  # alone, its error ends the run and says it once
            self._report(slot, naming_line(f"giving up on {slot.label} for this batch: {why}{then}; the batch goes on "
                                           f"with {', '.join(others)}", *named_settings(error)))
        self._signal()

    async def _send(self, slot: ServerSlot, index: int) -> None:
        params = self.jobs[index]
        slot.busy = True
        if self.on_first_send is not None:
            self.on_first_send()
            self.on_first_send = None
        try:
            result = await slot.client.generate(params, retry=SINGLE_ATTEMPT)
        except ServerUnavailable as exc:  # the server did not take it: it can go anywhere
            self.pending.appendleft(index)
            self._not_taken(slot, exc, index)
            return
        except ConnectionLost as exc:  # sent, no answer: the server may be running it
            self._unanswered(slot, exc, index)
            return
        except (ServerFailed, BadResponse) as exc:  # it answered, so it is done with the image: another may make it
            self.pending.appendleft(index)
            self._failed(slot, exc, index)
            return
        except Exception as exc:  # 4xx: the request is wrong, another server would answer the same
            self.fatal = exc
            return
        finally:
            slot.busy = False
            self._signal()
        slot.failures, slot.detail = 0, ""
        slot.images_served += 1
        slot.learn_speed(params, result.inference_time_s)
        self.results[index] = result
        self.done += 1
        if self.on_image is not None:
            self.on_image(index, result)

    def _not_taken(self, slot: ServerSlot, error: ServerUnavailable, index: int) -> None:
        slot.failures += 1
        if slot.failures >= self.settings.max_failures_per_server:
            self._give_up(slot, error, f"{error} ({slot.failures} images in a row not taken)")
            return
        first_pause = self.settings.retry_down_after_s
        if error.reason == "busy":  # it answered: up, and /health is asked before the next image
            first_pause = min(first_pause, self.settings.busy_retry_s)
        pause = min(MAX_PAUSE_S, first_pause * 2 ** (slot.failures - 1))
        if error.retry_after is not None:
            pause = max(pause, error.retry_after)
        slot.next_try_at = time.monotonic() + pause
        slot.state, slot.detail, slot.cause = FAILED, str(error), error.cause  # /health asked before the next image
        others = [s.label for s in self.slots if s is not slot and s.state != GIVEN_UP]
        where = f"another server ({', '.join(others)}) or this one" if others else "this server"
        if slot.reported != FAILED:
            slot.reported = FAILED
            self.notify(f"server failed: {error}; image {index + 1} goes back to the queue for {where} "
                        f"(asked again in {pause:g} s)")

    def _failed(self, slot: ServerSlot, error: RemoteError, index: int) -> None:
        """An answered failure: the server is out of the rotation for this batch, its image goes to another."""
        self._give_up(slot, error, str(error), f"; image {index + 1} goes back to the queue")

    def _unanswered(self, slot: ServerSlot, error: ConnectionLost, index: int) -> None:
        seed = self.jobs[index].seed
        if not self.settings.resend_unanswered:
            self.unanswered.append((index, error))
            self._give_up(slot, error, str(error), f"; image {index + 1} (seed {seed}) is not sent again, so no "
                                                   f"server runs it twice")
            return
        self.pending.appendleft(index)
        slot.failures += 1
        slot.state, slot.detail, slot.cause = FAILED, str(error), error.cause
        slot.next_try_at = time.monotonic() + self.settings.retry_down_after_s
        self.notify(naming_line(f"{error}; image {index + 1} (seed {seed}) is sent again, as {RESEND_SETTING} asks: "
                                f"{slot.label} may still be working on the first copy", RESEND_SETTING,
                                *named_settings(error)))
        if slot.failures >= self.settings.max_failures_per_server:
            self._give_up(slot, error, f"{error} ({slot.failures} images in a row unanswered)")


def _cause(slot: ServerSlot, waited_s: float) -> str:
    if slot.state == READY:
        return "busy (asked to retry later)"
    if slot.state == UNKNOWN:  # its first look was still under way: no connection accepted, or /health unanswered
        return f"no answer within {waited_s:.0f} s (the connection was not accepted or /health not answered)"
    if slot.state == FAILED:
        return f"did not take the last image ({slot.cause or slot.detail})"
    return slot.cause or slot.detail or slot.state


def _pause_state(slot: ServerSlot) -> str:
    if slot.state == READY:
        return "busy (asked to retry later)"
    if slot.state == REFUSED:
        return "refused (nothing listening: not started, loading its weights, or dead)"
    if slot.state == FAILED:
        return "did not take the last image, asked again shortly"
    return slot.state
