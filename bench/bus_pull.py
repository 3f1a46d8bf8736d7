"""What consuming a durable costs the consumer: FastStream's pull subscriber as the bus used it (one request per
message) next to `gpuaas_common.pull.PullLoop` (one open request for as many messages as there are free places),
on one real nats-server, each acking every message and doing nothing else.

Two loads: a backlog (every message already in the stream) and a trickle (a publisher at a steady rate, so
most requests find nothing waiting). Printed per variant: consumer CPU microseconds per message (this process,
publisher excluded where it runs: the trickle's publisher is a subprocess), pull requests per message, and
the trickle's p50 delay from publish to handler.

    .venv/bin/python bench/bus_pull.py [--messages 5000] [--rate 300] [--seconds 5] [--json]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import nats
from faststream import AckPolicy
from faststream.nats import JStream, NatsBroker, NatsMessage, PullSub

from gpuaas_common.jetstream import ConsumerSpec, StreamSpec, ensure_consumer, ensure_stream
from gpuaas_common.pull import PullLoop
from gpuaas_dev.testing.servers import NatsServer

STREAM = StreamSpec("BENCH", ("bench.>",), description="bench")
PLACES = 16


async def _durable(js: Any, name: str) -> ConsumerSpec:
    spec = ConsumerSpec(durable=name, stream="BENCH", filter_subject=f"bench.{name}")
    await ensure_consumer(js, spec)
    return spec


async def _publish(js: Any, subject: str, n: int) -> None:
    acks = [js.publish(subject, json.dumps({"t": time.time()}).encode()) for _ in range(n)]
    for i in range(0, n, 500):
        await asyncio.gather(*acks[i : i + 500])


async def _trickle(url: str, subject: str, rate: float, seconds: float) -> None:
    """A steady publisher in its own process, so its CPU is not counted as the consumer's."""
    code = (
        "import asyncio, json, time, nats\n"
        "async def main():\n"
        f"    nc = await nats.connect({url!r}); js = nc.jetstream()\n"
        f"    start = time.monotonic(); n = int({rate} * {seconds})\n"
        "    for i in range(n):\n"
        f"        await asyncio.sleep(max(0.0, start + i / {rate} - time.monotonic()))\n"
        f"        await js.publish({subject!r}, json.dumps({{'t': time.time()}}).encode())\n"
        "    await nc.drain()\n"
        "asyncio.run(main())\n"
    )
    proc = await asyncio.create_subprocess_exec(sys.executable, "-c", code)
    await proc.wait()


class _Counter:
    def __init__(self, expected: int) -> None:
        self.expected = expected
        self.delays: list[float] = []
        self.done = asyncio.Event()

    def seen(self, data: bytes) -> None:
        self.delays.append(time.time() - json.loads(data)["t"])
        if len(self.delays) >= self.expected:
            self.done.set()


async def _faststream(url: str, spec: ConsumerSpec, counter: _Counter) -> tuple[float, int]:
    broker = NatsBroker(url, apply_types=False)

    async def as_is(msg: NatsMessage) -> NatsMessage:
        return msg

    async def handle(msg: NatsMessage) -> None:
        counter.seen(msg.raw_message.data)
        await msg.ack()

    broker.subscriber(
        spec.filter_subject,
        stream=JStream(spec.stream, declare=False),
        durable=spec.durable,
        pull_sub=PullSub(batch_size=1, timeout=1.0),
        ack_policy=AckPolicy.MANUAL,
        decoder=as_is,
    )(handle)
    cpu = time.process_time()
    await broker.start()
    await counter.done.wait()
    used = time.process_time() - cpu
    await broker.stop()
    return used, len(counter.delays)  # FastStream sends one request per message it receives


async def _pull_loop(url: str, spec: ConsumerSpec, counter: _Counter) -> tuple[float, int]:
    nc = await nats.connect(url)
    tasks: set[asyncio.Task[None]] = set()

    async def handle(msg: Any, done: Any) -> None:
        try:
            counter.seen(msg.data)
            await msg.ack()
        finally:
            done()

    def start(msg: Any, done: Any) -> None:
        task = asyncio.create_task(handle(msg, done))
        tasks.add(task)
        task.add_done_callback(tasks.discard)

    loop = PullLoop(nc, spec, start, PLACES)
    cpu = time.process_time()
    runner = asyncio.create_task(loop.run())
    await counter.done.wait()
    used = time.process_time() - cpu
    runner.cancel()
    await asyncio.gather(runner, return_exceptions=True)
    await nc.drain()
    return used, loop.requests


async def main_async(args: argparse.Namespace) -> dict:
    with tempfile.TemporaryDirectory(prefix="gpuaas-bench-pull-") as tmp:
        server = NatsServer(Path(tmp))
        server.start()
        try:
            nc = await nats.connect(server.url)
            js = nc.jetstream()
            await ensure_stream(js, STREAM)
            out: dict[str, Any] = {}
            for name, consume in (("faststream_batch1", _faststream), ("pull_loop", _pull_loop)):
                spec = await _durable(js, f"backlog_{name}")
                await _publish(js, spec.filter_subject, args.messages)
                counter = _Counter(args.messages)
                cpu_s, requests = await consume(server.url, spec, counter)
                backlog = {
                    "cpu_us_per_message": round(cpu_s / args.messages * 1e6, 1),
                    "requests_per_message": round(requests / args.messages, 3),
                }
                spec = await _durable(js, f"trickle_{name}")
                n = int(args.rate * args.seconds)
                counter = _Counter(n)
                publisher = asyncio.create_task(_trickle(server.url, spec.filter_subject, args.rate, args.seconds))
                cpu_s, requests = await consume(server.url, spec, counter)
                await publisher
                trickle = {
                    "cpu_us_per_message": round(cpu_s / n * 1e6, 1),
                    "requests_per_message": round(requests / n, 3),
                    "p50_delay_ms": round(statistics.median(counter.delays) * 1000, 2),
                }
                out[name] = {"backlog": backlog, "trickle": trickle}
            await nc.drain()
        finally:
            server.stop()
    base, ours = out["faststream_batch1"], out["pull_loop"]
    out["ratio_pull_loop_over_faststream_cpu"] = {
        load: round(ours[load]["cpu_us_per_message"] / base[load]["cpu_us_per_message"], 3)
        for load in ("backlog", "trickle")
    }
    out["config"] = {"messages": args.messages, "rate": args.rate, "seconds": args.seconds, "places": PLACES}
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--messages", type=int, default=5000)
    parser.add_argument("--rate", type=float, default=300.0)
    parser.add_argument("--seconds", type=float, default=5.0)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    result = asyncio.run(main_async(args))
    print(json.dumps(result, indent=None if args.json else 2))


if __name__ == "__main__":
    main()
