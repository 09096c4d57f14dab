"""Remote Backend benchmark on fake SGLang servers (CPU is fine): client overhead and fleet throughput.

    python bench/remote.py [--requests 40] [--service-time 0.2]

1. Overhead per request: the SglangClient (retry/cancel machinery, validation, PNG decode to a tensor) and
   the whole RemotePipe.generate (sync bridge, progress) against a raw aiohttp POST + JSON parse to the same
   server; base64+PNG decode is timed separately. Target: client - raw - decode <= 5 ms.
2. Throughput with 1, 2 and 4 servers, each with a fixed service time. Target: >= 0.9 x N of one server.
"""
from __future__ import annotations

import argparse
import platform
import statistics
import sys
import time

import aiohttp
import torch

from common import REPO_ROOT, import_package

sys.path.insert(0, str(REPO_ROOT / "tests"))
import_package()

from fake_sglang import FakeSglang  # noqa: E402
from ernie_image.runtime.core.host import NullHost  # noqa: E402
from ernie_image.runtime.core.request import GenerationRequest  # noqa: E402
from ernie_image.runtime.net.loop_thread import run_sync  # noqa: E402
from ernie_image.runtime.remote.backend import RemotePipe, RemoteSettings  # noqa: E402
from ernie_image.runtime.remote.image_answer import decode_image  # noqa: E402
from ernie_image.runtime.remote.sglang import ImageParams, SglangClient, build_payload  # noqa: E402

SIDE = 512


def median_ms(values: list[float]) -> float:
    return statistics.median(values) * 1000


def overhead(requests: int) -> dict[str, float]:
    params = ImageParams("a red fox", "", SIDE, SIDE, 8, 1.0, 1, False)
    payload = build_payload(params, "bench")
    with FakeSglang(image_side_cap=SIDE) as server:
        async def measure() -> dict[str, list[float]]:
            # raw and client requests alternate, so drift in machine load hits both alike
            times: dict[str, list[float]] = {"raw": [], "decode": [], "client": []}
            client = SglangClient(server.url)
            client.model_id = "bench"
            async with aiohttp.ClientSession() as session:
                try:
                    for _ in range(requests):
                        started = time.perf_counter()
                        async with session.post(server.url + "/v1/images/generations", json=payload) as resp:
                            body = await resp.json()
                        times["raw"].append(time.perf_counter() - started)
                        started = time.perf_counter()
                        decode_image(body["data"][0]["b64_json"], SIDE, SIDE, "bench")
                        times["decode"].append(time.perf_counter() - started)
                        started = time.perf_counter()
                        await client.generate(params)
                        times["client"].append(time.perf_counter() - started)
                finally:
                    await client.close()
            return times

        times = run_sync(measure())
        pipe = RemotePipe([server.url])
        pipe_times = []
        try:
            for _ in range(requests):
                started = time.perf_counter()
                pipe.generate(GenerationRequest(prompt="a red fox", width=SIDE, height=SIDE, steps=8, cfg=1.0), NullHost())
                pipe_times.append(time.perf_counter() - started)
        finally:
            pipe.release()
    return {"raw": median_ms(times["raw"]), "decode": median_ms(times["decode"]),
            "client": median_ms(times["client"]), "pipe": median_ms(pipe_times)}


def throughput(servers: int, service_time_s: float, images_per_server: int) -> float:
    fakes = [FakeSglang(service_time_s=service_time_s, image_side_cap=256).__enter__() for _ in range(servers)]
    try:
        pipe = RemotePipe([f.url for f in fakes], RemoteSettings())
        pipe.generate(GenerationRequest(prompt="warm", width=256, height=256, steps=1, cfg=1.0), NullHost())
        images = servers * images_per_server
        started = time.perf_counter()
        pipe.generate(GenerationRequest(prompt="a red fox", width=256, height=256, steps=8, cfg=1.0, batch=images),
                      NullHost())
        elapsed = time.perf_counter() - started
        pipe.release()
    finally:
        for fake in fakes:
            fake.stop()
    return images / elapsed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=40)
    parser.add_argument("--service-time", type=float, default=0.2)
    parser.add_argument("--images-per-server", type=int, default=8)
    args = parser.parse_args()

    print(f"python {platform.python_version()}, torch {torch.__version__}, aiohttp {aiohttp.__version__}, "
          f"{platform.machine()} {platform.system()}")
    o = overhead(args.requests)
    extra = o["client"] - o["raw"] - o["decode"]
    print(f"\noverhead per request, {SIDE}x{SIDE} PNG, median of {args.requests} (ms)")
    print(f"  raw aiohttp POST + json      {o['raw']:7.2f}")
    print(f"  base64 + PNG decode          {o['decode']:7.2f}")
    print(f"  SglangClient.generate        {o['client']:7.2f}   overhead {extra:+.2f} ms (target <= 5)")
    print(f"  RemotePipe.generate (sync)   {o['pipe']:7.2f}   overhead {o['pipe'] - o['raw'] - o['decode']:+.2f} ms")

    print(f"\nthroughput, fake servers with {args.service_time:g} s service time, "
          f"{args.images_per_server} images per server")
    print(f"  {'servers':>7}  {'images/s':>9}  {'x one':>6}  {'target':>7}")
    base = None
    for count in (1, 2, 4):
        rate = throughput(count, args.service_time, args.images_per_server)
        base = base or rate
        ratio = rate / base
        verdict = "ok" if ratio >= 0.9 * count else "LOW"
        print(f"  {count:>7}  {rate:9.2f}  {ratio:6.2f}  {0.9 * count:5.1f} {verdict}")


if __name__ == "__main__":
    main()
