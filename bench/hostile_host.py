"""A hostile baremetal tenant beside the 50/s pipeline: what a host that holds real credentials can make the
control plane store, drop and slow down.

The stack is bench/pipeline.py's (real nats-server in operator mode with every identity its own user, durable
Postgres, instant simulated slice hosts) plus one baremetal machine in the MAAS simulator. A real baremetal
allocation is deployed through it, so the MAAS gateway gets the host's user from the credential authority and
writes it into the deploy's user-data; the bench reads the creds file from there, as the tenant would on its
machine. (Should the deploy not go active, the bench mints the user through the authority's own issuer for that
allocation instead and says so: `creds_source`.)

Then, in this order, on one stack:
1. baseline: `--baseline-windows` pipeline windows of `--window` s at `--rate`/s, no attacker;
2. attack: a process of its own connects with the tenant's creds and, for `--duration` s, publishes as fast as
   it can on every subject the baremetal host template allows (identity/permissions.py, filled with its own
   node id), on the same subjects filled with other nodes' ids and on the slice host's subjects (the server
   must refuse those), with valid payloads (the host's own enrolment replayed as it was, and re-wrapped under
   fresh event ids), garbage and forged ones; and on a second connection, oversized ones (over the template's
   payload limit: the server closes the connection, the attacker connects again). Beside it the pipeline runs
   window after window at the same rate, until the attack ends.

Windows are pipeline.sweep_point runs (slots reset between them, pipeline.reset_slots), each waiting for every
durable to drain except the three that read the attacked subject (skipped in the baseline too, for the same
measure). Reported: per service database its size and rows per table at start, after the baseline and after the
attack; the NODE_REPORTS and DLQ streams; allocations completed and their requested -> active p50/p99 (baseline
vs attack), the offered rate the bench achieved as a share of `--rate`; the attacker's sends by subject class
and payload kind, what the server refused (permission violations; connections closed for size), what the
consumers dropped over their node budget (`gpuaas_host_messages_dropped_total` on each service's /metrics and
their `host_over_budget` log lines), dead letters (DLQ stream, the fleet's held ones); CPU per allocation per
process (pipeline.py's accounting; the attacker's own under `hostile-host`).

    .venv/bin/python bench/hostile_host.py --duration 60 --json
    .venv/bin/python bench/hostile_host.py --json                     # 10 minutes of attack at 50/s
    .venv/bin/python bench/hostile_host.py --rate 20 --window 30      # where the machine does not carry 50/s

Not a test: it prints numbers. The machine it runs on is shared by the stack, the pipeline load and the attacker,
so read the baseline and attack figures as a ratio.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import sys
import tempfile
import time
import uuid
from collections import Counter
from pathlib import Path
from typing import Any

import aiohttp
import asyncpg
import nats
import yaml
from nats.aio.client import RawCredentials
from prometheus_client.parser import text_string_to_metric_families

sys.path.insert(0, str(Path(__file__).resolve().parent))

import pipeline  # noqa: E402 - bench/ is no package; the pipeline's stack and measurement are reused as they are

from gpuaas_common.contract import Envelope  # noqa: E402
from gpuaas_common.contract import messages as m  # noqa: E402
from gpuaas_common.identity import creds as creds_files  # noqa: E402
from gpuaas_common.identity.permissions import (  # noqa: E402
    NODE_TAG,
    baremetal_template,
    node_template,
    node_user_name,
)
from gpuaas_common.identity.tls import client_tls_options  # noqa: E402
from gpuaas_common.logging import configure_logging  # noqa: E402
from gpuaas_common.pg_roles import SERVICE_ROLES  # noqa: E402
from gpuaas_dev.maas_sim.control import sim_user_data_headers  # noqa: E402
from gpuaas_dev.stack import Stack  # noqa: E402
from gpuaas_dev.testing.fuzz_run import _held_dead_letters  # noqa: E402
from gpuaas_dev.testing.waiting import eventually  # noqa: E402

CREDS_PATH = "/etc/gpuaas/node.creds"  # where the gateway's user-data puts the host's creds file
# The durables (and the ops read model's follower) that read what a baremetal host may publish: a flood keeps
# them busy for as long as it lasts, so a window does not wait for them to drain.
ATTACKED_CONSUMERS = frozenset({"allocator-enrolments", "image-pipeline-enrolments", "ops-view-node-reports"})
HOST_FED_SERVICES = ("allocator", "scheduler", "image-pipeline", "ops-view")
FLUSH_EVERY = 512
SLICE_IMAGE = "ubuntu-24.04-h200-slice"  # what pipeline.sweep_point requests


# --- the attacker (its own process) --------------------------------------------------------------------------


def _fill(subjects: tuple[str, ...], node: str) -> list[str]:
    """A template's subjects for `node`; a NATS wildcard left in one is expanded with tokens of the attacker's."""
    out = []
    for s in subjects:
        s = s.replace("{{tag(" + NODE_TAG + ")}}", node).replace("{{name()}}", node_user_name(node))
        s = s.replace(".*", ".hostile").replace(".>", ".hostile.x")
        out.append(s)
    return out


def _payloads(replay: bytes, node: str, other: str, limit: int) -> dict[str, Any]:
    """Payload kinds by name; a callable makes a fresh one per send."""
    envelope = json.loads(replay)
    rng = random.Random(1)

    def fresh_event() -> bytes:
        return (
            Envelope.wrap(envelope["type"], envelope["payload"], producer=envelope["producer"], correlation_id=node)
            .model_dump_json()
            .encode()
        )

    def forged_other_node() -> bytes:
        body = {**envelope["payload"], "node_id": other}
        return (
            Envelope.wrap("node.enrolled", body, producer=envelope["producer"], correlation_id=other)
            .model_dump_json()
            .encode()
        )

    def slice_claim() -> bytes:
        body = m.NodeEnrolled(node_id=node, kind="slice_host", hostname="hostile", agent_version="0").model_dump(
            mode="json"
        )
        return (
            Envelope.wrap("node.enrolled", body, producer="node-agent", correlation_id=node).model_dump_json().encode()
        )

    return {
        "valid_replay": replay,
        "valid_fresh_event_id": fresh_event,
        "forged_other_node_in_payload": forged_other_node,
        "forged_slice_host_claim": slice_claim,
        "garbage_bytes": lambda: rng.randbytes(rng.randint(1, 2048)),
        "garbage_json": lambda: json.dumps({"type": "node.enrolled", "payload": rng.random()}).encode(),
        "near_limit": lambda: b"{" + b" " * (limit - 200) + b"}",
    }


def _setter(event: asyncio.Event) -> Any:
    async def on_closed() -> None:
        event.set()

    return on_closed


async def _ignore(_exc: Exception) -> None:
    return None


async def _connect(cfg: dict, creds_text: str, **kw: Any) -> Any:
    name = creds_files.parse(creds_text).name
    tls = client_tls_options(Path(cfg["ca_file"])) if cfg["ca_file"] else {}
    return await nats.connect(
        cfg["nats_url"],
        user_credentials=RawCredentials(creds_text),
        inbox_prefix=f"_INBOX_{name}".encode(),
        connect_timeout=5,
        **tls,
        **kw,
    )


async def attack(cfg: dict, creds_text: str, replay: bytes) -> dict:
    creds = creds_files.parse(creds_text)
    node = next(t.split(":", 1)[1] for t in creds.claims["nats"]["tags"] if t.startswith("node:"))
    template = baremetal_template()
    limit = template.max_payload
    own = _fill(template.pub_allow, node)
    others = [s for o in cfg["other_nodes"] for s in _fill(template.pub_allow, o)]
    slice_only = [s for s in _fill(node_template().pub_allow, node) if s not in own]
    refusable = [("other_node", s) for s in others] + [("slice_host", s) for s in slice_only]
    kinds = _payloads(replay, node, cfg["other_nodes"][0], limit)

    sent: Counter[str] = Counter()
    refused: Counter[str] = Counter()
    errors: Counter[str] = Counter()

    async def on_error(exc: Exception) -> None:
        text = str(exc).lower()
        if "permissions violation" in text:
            refused["permission_violation"] += 1
        else:
            errors[type(exc).__name__ + ": " + str(exc)[:80]] += 1

    nc = await _connect(cfg, creds_text, error_cb=on_error, max_reconnect_attempts=-1)
    end = time.monotonic() + cfg["duration_s"]

    async def flood() -> None:
        i = 0
        names = list(kinds)
        while time.monotonic() < end:
            # Every other send goes to a subject the host may publish: what its consumers must read.
            j = i // 2
            cls, subject = ("own", own[j % len(own)]) if i % 2 == 0 else refusable[j % len(refusable)]
            kind = names[(j // len(refusable)) % len(names)] if cls != "own" else names[(j // len(own)) % len(names)]
            make = kinds[kind]
            await nc.publish(subject, make() if callable(make) else make)
            sent[f"{cls}/{kind}"] += 1
            i += 1
            if i % FLUSH_EVERY == 0:
                await nc.flush(timeout=30)  # keeps the client's buffer bounded; the server sets the pace

    async def oversized() -> None:
        # Over the template's payload limit the server answers "Maximum Payload Violation" and closes the
        # connection: each try costs the attacker a connect (and the server a handshake).
        body = b"x" * (limit + 1024)
        while time.monotonic() < end:
            closed = asyncio.Event()
            try:
                conn = await _connect(
                    cfg, creds_text, allow_reconnect=False, closed_cb=_setter(closed), error_cb=_ignore
                )
            except Exception as exc:  # noqa: BLE001 - counted: a refused connect is a result
                errors[f"oversized connect: {type(exc).__name__}"] += 1
                await asyncio.sleep(0.1)
                continue
            await conn.publish(own[0], body)
            sent["own/oversized"] += 1
            try:
                await conn.flush(timeout=5)
                await asyncio.wait_for(closed.wait(), timeout=5)
                refused["closed_for_size"] += 1
            except Exception:  # noqa: BLE001 - flush fails when the server closed first: that is the refusal
                if conn.is_closed or closed.is_set():
                    refused["closed_for_size"] += 1
                else:
                    errors["oversized accepted"] += 1
            if not conn.is_closed:
                await conn.close()

    started = time.monotonic()
    await asyncio.gather(flood(), oversized())
    await nc.flush(timeout=30)  # every -ERR of what was sent arrives before the PONG
    await nc.drain()
    return {
        "node_id": node,
        "subjects": {"own": own, "other_node": others, "slice_host": slice_only},
        "payload_limit_bytes": limit,
        "seconds": round(time.monotonic() - started, 1),
        "sent": dict(sorted(sent.items())),
        "sent_total": sum(sent.values()),
        "sent_per_s": round(sum(sent.values()) / max(time.monotonic() - started, 1e-9)),
        # Its own CPU (the process's), beside the stack's per allocation in the windows.
        "cpu_s": round(time.process_time(), 1),
        "should_be_refused": sum(n for k, n in sent.items() if not k.startswith("own/")) + sent["own/oversized"],
        "refused": dict(refused),
        "other_errors": dict(errors),
    }


# --- what the stack holds ----------------------------------------------------------------------------------


async def database_snapshot(stack: Stack) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for service in SERVICE_ROLES:
        conn = await asyncpg.connect(stack.dsn_for(service))
        try:
            tables = await conn.fetch(
                "SELECT schemaname, relname FROM pg_stat_user_tables ORDER BY schemaname, relname"
            )
            rows = {}
            for t in tables:
                q = f'SELECT count(*) FROM "{t["schemaname"]}"."{t["relname"]}"'
                rows[f"{t['schemaname']}.{t['relname']}"] = await conn.fetchval(q)
            out[service] = {
                "bytes": await conn.fetchval("SELECT pg_database_size(current_database())"),
                "rows": rows,
            }
        finally:
            await conn.close()
    return out


def growth(before: dict, after: dict) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for service, b in before.items():
        a = after[service]
        rows = {
            t: {"before": b["rows"].get(t, 0), "after": n, "growth": n - b["rows"].get(t, 0)}
            for t, n in a["rows"].items()
        }
        out[service] = {
            "bytes_before": b["bytes"],
            "bytes_after": a["bytes"],
            "bytes_growth": a["bytes"] - b["bytes"],
            "rows": {t: r for t, r in rows.items() if r["before"] or r["after"]},
        }
    return out


async def streams_snapshot(js: Any) -> dict[str, Any]:
    out = {}
    for name in ("NODE_REPORTS", "DLQ"):
        info = await js.stream_info(name)
        out[name] = {"messages": info.state.messages, "bytes": info.state.bytes, "last_seq": info.state.last_seq}
    return out


async def dropped_over_budget(stack: Stack) -> dict[str, float]:
    """gpuaas_host_messages_dropped_total by service/consumer, from each host-fed service's /metrics."""
    out: dict[str, float] = {}
    async with aiohttp.ClientSession() as http:
        for service in HOST_FED_SERVICES:
            async with http.get(f"{stack.health_url(service)}/metrics") as resp:
                text = await resp.text()
            for family in text_string_to_metric_families(text):
                for s in family.samples:
                    if s.name == "gpuaas_host_messages_dropped_total":
                        out[f"{service}/{s.labels.get('consumer')}"] = s.value
    return out


def over_budget_log_lines(stack: Stack) -> dict[str, int]:
    out: dict[str, int] = {}
    for service in HOST_FED_SERVICES:
        n = sum(
            1 for line in stack.log_path(service).read_text(errors="replace").splitlines() if "host_over_budget" in line
        )
        out[service] = n
    return out


def nats_disk(stack: Stack) -> dict[str, int]:
    """What the NATS servers hold on disk: their log files and their JetStream stores."""
    logs = store = 0
    for server in stack.nats_servers:
        logs += server.log_path.stat().st_size if server.log_path.exists() else 0
        store += sum(f.stat().st_size for f in (server.data_dir / "js").rglob("*") if f.is_file())
    return {"log_bytes": logs, "jetstream_store_bytes": store}


async def snapshot(stack: Stack, js: Any) -> dict[str, Any]:
    return {
        "nats_disk": await asyncio.to_thread(nats_disk, stack),
        "databases": await database_snapshot(stack),
        "streams": await streams_snapshot(js),
        "dropped_over_budget": await dropped_over_budget(stack),
        "over_budget_log_lines": over_budget_log_lines(stack),
        "fleet_held_dead_letters": sum(_held_dead_letters(stack.log_path("node-agent")).values()),
    }


def delta(before: dict, after: dict) -> dict[str, Any]:
    def num(d: dict, k: str) -> float:
        return d.get(k, 0)

    return {
        "databases": growth(before["databases"], after["databases"]),
        "streams": {
            s: {k: after["streams"][s][k] - before["streams"][s][k] for k in ("messages", "bytes", "last_seq")}
            for s in after["streams"]
        },
        "dropped_over_budget": {
            k: v - num(before["dropped_over_budget"], k) for k, v in after["dropped_over_budget"].items()
        },
        "over_budget_log_lines": {
            k: v - num(before["over_budget_log_lines"], k) for k, v in after["over_budget_log_lines"].items()
        },
        "fleet_held_dead_letters": after["fleet_held_dead_letters"] - before["fleet_held_dead_letters"],
        "nats_disk": {k: v - before["nats_disk"][k] for k, v in after["nats_disk"].items()},
    }


# --- the tenant's machine ----------------------------------------------------------------------------------


async def _events_until(nc: Any, alloc: str, wanted: set[str], timeout_s: float) -> dict[str, dict]:
    seen: dict[str, dict] = {}
    done = asyncio.Event()

    async def on(msg: Any) -> None:
        data = json.loads(msg.data)
        if data["payload"].get("allocation_id") == alloc:
            seen[data["type"]] = data
            if wanted & seen.keys() or data["type"] in pipeline.TERMINAL:
                done.set()

    sub = await nc.subscribe("gpuaas.allocation.event.>", cb=on)
    try:
        await asyncio.wait_for(done.wait(), timeout=timeout_s)
    except TimeoutError:
        pass
    await sub.unsubscribe()
    return seen


async def baremetal_tenant(stack: Stack, run_dir: Path) -> dict[str, Any]:
    """A real baremetal allocation deployed through the stack; its host's creds file as the tenant finds it."""
    portal = await nats.connect(**stack.nats_options("portal"))
    alloc = str(uuid.uuid4())
    req = m.AllocationRequested(
        allocation_id=uuid.UUID(alloc),
        tenant_id="hostile-tenant",
        shape="baremetal",
        sku="h200-sxm",
        gpu_count=8,
        image="ubuntu-24.04-h200-host",
        ssh_public_keys=["ssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAAIHostile hostile@tenant"],
    )
    env = Envelope.wrap("allocation.requested", req.model_dump(mode="json"), producer="bench", correlation_id=alloc)
    waiting = asyncio.create_task(_events_until(portal, alloc, {"allocation.active"}, 240))
    await asyncio.sleep(0)
    await portal.jetstream().publish("gpuaas.allocation.requested", env.model_dump_json().encode())
    started = time.monotonic()
    seen = await waiting
    await portal.drain()
    placed = seen.get("allocation.placed", {}).get("payload", {})
    node_id = placed.get("node_id")
    creds_text, source = None, None
    if "allocation.active" in seen and placed.get("maas_system_id"):
        tls = stack.maas_ssl_context or True
        async with aiohttp.ClientSession(headers=sim_user_data_headers(stack.maas_api_key)) as http:
            url = f"{stack.maas_base_url}/_sim/machines/{placed['maas_system_id']}"
            async with http.get(url, ssl=tls) as resp:
                machine = await resp.json()
        user_data = yaml.safe_load(machine["_sim"]["last_deploy"]["user_data"])
        creds_text = next(f["content"] for f in user_data["write_files"] if f["path"] == CREDS_PATH)
        source = "gateway: the deploy's user-data, minted by the credential authority"
    if creds_text is None:
        if node_id is None:
            raise RuntimeError(f"the baremetal allocation was never placed: {sorted(seen)}")
        creds_text = stack.authority.issuer().issue_node(node_id, ttl_s=3600, allocation_id=alloc).render()
        source = f"minted by the authority's issuer for the allocation (the deploy did not go active: {sorted(seen)})"
    path = run_dir / "hostile-node.creds"
    path.write_text(creds_text)
    path.chmod(0o600)
    return {
        "allocation_id": alloc,
        "node_id": node_id,
        "creds_file": str(path),
        "creds_source": source,
        "active_after_s": round(time.monotonic() - started, 1),
        "events": sorted(seen),
    }


async def slice_image_active(stack: Stack) -> None:
    """The pipeline's slice image passes the activation gate once every slice host verified it."""
    conn = await asyncpg.connect(stack.dsn_for("image-pipeline"))
    try:
        await eventually(
            lambda: conn.fetchval(
                "SELECT status = 'active' FROM image_pipeline.os_images WHERE slug = $1", SLICE_IMAGE
            ),
            timeout=300,
            interval=0.5,
            what=f"{SLICE_IMAGE} active",
        )
    finally:
        await conn.close()


async def release(stack: Stack, alloc: str) -> bool:
    portal = await nats.connect(**stack.nats_options("portal"))
    body = m.AllocationReleaseRequested(allocation_id=uuid.UUID(alloc), reason="bench")
    env = Envelope.wrap(
        "allocation.release_requested", body.model_dump(mode="json"), producer="bench", correlation_id=alloc
    )
    waiting = asyncio.create_task(_events_until(portal, alloc, {"allocation.released"}, 120))
    await asyncio.sleep(0)
    await portal.jetstream().publish("gpuaas.allocation.release_requested", env.model_dump_json().encode())
    seen = await waiting
    await portal.drain()
    return "allocation.released" in seen


async def creds_refused(stack: Stack, creds_file: str) -> bool:
    cfg = {"nats_url": stack.nats_url, "ca_file": str(stack.ca_file) if stack.ca_file else ""}
    try:
        text = await asyncio.to_thread(Path(creds_file).read_text)
        nc = await _connect(cfg, text, allow_reconnect=False, error_cb=_ignore)
    except Exception:  # noqa: BLE001 - refused: what is measured
        return True
    await nc.close()
    return False


# --- the run -----------------------------------------------------------------------------------------------


def summary(points: list[dict], rate: float) -> dict[str, Any]:
    lat = [x for p in points for x in p.pop("latencies_ms")]
    requests = sum(p["requests"] for p in points)
    active = sum(p["active"] for p in points)
    cpu: Counter[str] = Counter()
    for p in points:
        for k, v in p["cpu_ms_per_allocation"].items():
            cpu[k] += v * p["requests"]
    return {
        "windows": len(points),
        "requests": requests,
        "active": active,
        "released": sum(p["released"] for p in points),
        "failed": sum(p["failed"] for p in points),
        "failure_reasons": sorted({r for p in points for r in p["failure_reasons"]}),
        "timed_out_windows": sum(1 for p in points if p["timed_out"]),
        "p50_ms": round(pipeline.pct(lat, 0.5), 1),
        "p99_ms": round(pipeline.pct(lat, 0.99), 1),
        "achieved_offer_over_rate": round(min(p["achieved_offer_per_s"] for p in points) / rate, 3),
        "cpu_ms_per_allocation": {k: round(v / max(requests, 1), 2) for k, v in sorted(cpu.items())},
        "left_after_windows": [p["left_after_window"] for p in points if any(p["left_after_window"].values())],
    }


async def window(stack: Stack, pids: dict, args: argparse.Namespace) -> dict:
    # The whole phase's percentiles come from every window's latencies, not from the windows' own.
    point = await pipeline.sweep_point(
        stack, pids, args.rate, args.window, 1, args.idle_s, settle_skip=ATTACKED_CONSUMERS, keep_latencies=True
    )
    point["slots_after"] = await pipeline.reset_slots(stack)
    print(
        json.dumps({k: point[k] for k in ("offered_per_s", "achieved_offer_per_s", "active", "p50_ms", "p99_ms")}),
        file=sys.stderr,
    )
    return point


async def run(stack: Stack, args: argparse.Namespace) -> dict[str, Any]:
    pids = pipeline.stack_pids(stack)
    admin = await nats.connect(**stack.nats_options("admin"))
    js = admin.jetstream()
    tenant = await baremetal_tenant(stack, stack.run_dir)
    node = tenant["node_id"]
    replay = await js.get_last_msg("NODE_REPORTS", f"gpuaas.node.{node}.report.enrolled")
    replay_file = stack.run_dir / "hostile-replay.json"
    replay_file.write_bytes(replay.data)

    await slice_image_active(stack)
    await pipeline.sweep_point(stack, pids, 20.0, 1.0, 1, 0.1, settle_skip=ATTACKED_CONSUMERS)  # warm-up
    await pipeline.reset_slots(stack)
    at_start = await snapshot(stack, js)
    baseline = [await window(stack, pids, args) for _ in range(args.baseline_windows)]
    after_baseline = await snapshot(stack, js)

    others = [n.node_id for n in stack.fleet.nodes if n.node_id != node][:3]
    cfg = {
        "nats_url": stack.nats_url,
        "ca_file": str(stack.ca_file) if stack.ca_file else "",
        "creds_file": tenant["creds_file"],
        "replay_file": str(replay_file),
        "other_nodes": [*others, "hostile-made-up-node"],
        "duration_s": args.duration,
    }
    cfg_file = stack.run_dir / "hostile-attack.json"
    cfg_file.write_text(json.dumps(cfg))
    with open(stack.run_dir / "hostile-attacker.log", "wb") as err:  # noqa: ASYNC230 - opened once, before the run
        child = await asyncio.create_subprocess_exec(
            sys.executable, __file__, "--attacker", str(cfg_file), stdout=asyncio.subprocess.PIPE, stderr=err
        )
    attack_started = time.monotonic()
    under_attack = []
    # A window takes its `window` s, its drain, its idle and raw baselines (under load, up to twice the window):
    # none starts that could not end within the attack.
    while time.monotonic() - attack_started + args.window * 2.5 < args.duration:
        under_attack.append(await window(stack, pids, args))
    out, _ = await child.communicate()
    attacker = json.loads(out)
    after_attack = await snapshot(stack, js)
    released = await release(stack, tenant["allocation_id"])
    refused_after = await creds_refused(stack, tenant["creds_file"])
    await admin.drain()

    base, hostile = summary(baseline, args.rate), summary(under_attack, args.rate)
    return {
        "benchmark": "hostile_host",
        "tenant": {**tenant, "released": released, "creds_refused_after_release": refused_after},
        "attacker": attacker,
        "pipeline_baseline": base,
        "pipeline_under_attack": hostile,
        "p99_ratio_attack_over_baseline": pipeline._ratio(hostile["p99_ms"], base["p99_ms"]),  # noqa: SLF001
        "p50_ratio_attack_over_baseline": pipeline._ratio(hostile["p50_ms"], base["p50_ms"]),  # noqa: SLF001
        "growth_baseline": delta(at_start, after_baseline),
        "growth_attack": delta(after_baseline, after_attack),
        "at_start": {
            "streams": at_start["streams"],
            "nats_disk": at_start["nats_disk"],
            "databases_bytes": {k: v["bytes"] for k, v in at_start["databases"].items()},
        },
        "windows": {"baseline": baseline, "under_attack": under_attack},
        "config": {
            "rate": args.rate,
            "window_s": args.window,
            "duration_s": args.duration,
            "baseline_windows": args.baseline_windows,
            "slice_hosts": args.hosts,
            "cpus": os.cpu_count(),
            "postgres": "durable (fsync, synchronous_commit on)",
        },
    }


async def main_async(args: argparse.Namespace) -> dict:
    configure_logging("bench", "WARNING", stream=sys.stderr)
    args.hosts = args.hosts or pipeline.fleet_for(args.rate, args.window, 1)
    run_dir = Path(tempfile.mkdtemp(prefix="gpuaas-hostile-"))
    # The pipeline's stack, with one baremetal machine for the tenant.
    stack = pipeline.side_stack(run_dir, args.hosts, args.service_log_level, baremetal_hosts=1)
    started = time.perf_counter()
    result = await pipeline._with_stack(stack, lambda s: run(s, args), args.keep_run_dir)  # noqa: SLF001
    result["wall_s"] = round(time.perf_counter() - started, 1)
    return result


def print_text(r: dict) -> None:
    a = r["attacker"]
    print(
        f"creds: {r['tenant']['creds_source']}; node {a['node_id']}; refused after release: "
        f"{r['tenant']['creds_refused_after_release']}"
    )
    print(
        f"attacker: {a['sent_total']} sent in {a['seconds']} s ({a['sent_per_s']}/s); should be refused "
        f"{a['should_be_refused']}; refused {a['refused']}; other errors {a['other_errors']}"
    )
    for name in ("pipeline_baseline", "pipeline_under_attack"):
        p = r[name]
        print(
            f"{name}: {p['active']}/{p['requests']} active, p50 {p['p50_ms']} ms p99 {p['p99_ms']} ms, "
            f"offer achieved {p['achieved_offer_over_rate']:.0%} of {r['config']['rate']}/s, failed {p['failed']}"
        )
    for phase in ("growth_baseline", "growth_attack"):
        g = r[phase]
        print(
            f"{phase}: nats disk {g['nats_disk']} streams {g['streams']} "
            f"dropped over budget {g['dropped_over_budget']} log lines {g['over_budget_log_lines']} "
            f"fleet dead letters {g['fleet_held_dead_letters']}"
        )
        for service, d in g["databases"].items():
            grown = {t: x["growth"] for t, x in d["rows"].items() if x["growth"]}
            print(f"  {service}: {d['bytes_growth']:+} bytes; rows {grown}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--duration", type=float, default=600.0, help="seconds of attack")
    parser.add_argument("--rate", type=float, default=50.0, help="pipeline allocations/s beside the attack")
    parser.add_argument("--window", type=float, default=20.0, help="seconds of offered load per pipeline window")
    parser.add_argument("--baseline-windows", type=int, default=1, help="windows with no attacker, first")
    parser.add_argument("--hosts", type=int, default=0, help="slice hosts; default: sized for one window")
    parser.add_argument("--idle-s", type=float, default=1.0, help="seconds of idle CPU measured before each window")
    parser.add_argument("--service-log-level", default="INFO", help="GPUAAS_LOG_LEVEL of every service")
    parser.add_argument("--keep-run-dir", action="store_true", help="keep the stack's logs and data afterwards")
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--attacker", metavar="CONFIG", help=argparse.SUPPRESS)  # the attacker process itself
    args = parser.parse_args()
    if args.attacker:
        cfg = json.loads(Path(args.attacker).read_text())
        creds_text, replay = Path(cfg["creds_file"]).read_text(), Path(cfg["replay_file"]).read_bytes()
        print(json.dumps(asyncio.run(attack(cfg, creds_text, replay))))
        return
    result = asyncio.run(main_async(args))
    if args.json:
        print(json.dumps(result, indent=2))
    else:
        print_text(result)


if __name__ == "__main__":
    main()
