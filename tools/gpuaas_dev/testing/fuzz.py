"""Hostile input for every subject a consumer of ours reads, built from the contract itself.

Each `Hostile` says who sends it (the identity the server lets publish there: a portal, a service, a host),
where it goes, which durables will read it and whether it must end in a dead-letter queue. Categories:

- `garbage`: random bytes; `not_object`: JSON that is not an object;
- `envelope_invalid`: an object that is not an envelope; `wrong_subject`: a valid message on a subject its
  type does not travel on; `payload_invalid`: a valid envelope around a payload that breaks the schema;
- `oversize`: a message close to the payload limit the server sets its sender;
- `wrong_node`: a host's report that names another host (the subject is the authenticated part);
- `generated`: schema-valid payloads drawn from the contract's JSON Schemas with ids that mostly match
  nothing (results for unknown tasks, placements for unknown allocations) and timestamps far in the past
  or future — inconsistent, but not malformed, so the receiver decides. A message in the allocator's own
  name never names a live allocation: the allocator owns the allocation's lifecycle, so its `allocation.failed`
  or `slice.vm_release` about one *is* the truth its consumers act on (they refuse what is out of order, but
  a forged `releasing` then `released` is a legitimate release) — that is a stolen credential, not input a
  receiver can judge;
- `replay`: real events seen earlier on the bus, sent again shuffled: duplicates and reordering.

Instances are drawn by a small JSON-Schema walker with a seeded `random.Random` rather than
hypothesis-jsonschema (not a dependency here): the walker only needs the subset pydantic emits, and each
drawn payload is checked against its pydantic model, so a draw the walker gets wrong is counted as
`payload_invalid`, never passed off as valid.
"""

from __future__ import annotations

import json
import random
import re._parser as _sre
import string
import uuid
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from datetime import datetime, timedelta, timezone
from typing import Any

from pydantic import BaseModel, ValidationError

from gpuaas_common.contract.catalog import ALL, MessageSpec
from gpuaas_common.contract.envelope import SCHEMA_VERSION
from gpuaas_common.identity.permissions import max_payload_of
from gpuaas_common.jetstream import CONSUMERS, ConsumerSpec, node_agent_consumer, subject_matches

MUST_DEAD_LETTER = frozenset(
    {"garbage", "not_object", "envelope_invalid", "wrong_subject", "payload_invalid", "oversize", "wrong_node"}
)
# Relative frequency of each category in a run.
WEIGHTS: dict[str, int] = {
    "garbage": 10,
    "not_object": 5,
    "envelope_invalid": 10,
    "wrong_subject": 5,
    "payload_invalid": 20,
    "oversize": 1,
    "wrong_node": 6,
    "generated": 33,
    "replay": 10,
}
# Close below the payload limit the server sets the sender (1 MiB by default, less for hosts and portals), with
# room for the headers: the server takes it, so the consumer has to cope with it. A bigger one the server
# refuses (test_bus_identities).
OVERSIZE_BYTES = 900 * 1024
OVERSIZE_HEADROOM = 2 * 1024


@dataclass(frozen=True)
class Hostile:
    category: str
    type: str | None
    subject: str
    body: bytes
    identity: str
    durables: tuple[str, ...]

    @property
    def must_dead_letter(self) -> bool:
        return self.category in MUST_DEAD_LETTER


@dataclass
class Pools:
    """Ids from the live system mixed into generated payloads, so some hit real rows and most do not."""

    nodes: Sequence[str]
    allocations: list[str] = field(default_factory=list)
    tasks: list[str] = field(default_factory=list)
    replayable: list[tuple[str, bytes, str]] = field(default_factory=list)  # subject, body, identity


def consumers_for(subject: str, slice_nodes: Iterable[str]) -> tuple[str, ...]:
    """Durables whose filter takes `subject` (node agents' per-host durables included)."""
    specs: list[ConsumerSpec] = [*CONSUMERS, *(node_agent_consumer(n) for n in slice_nodes)]
    return tuple(sorted(c.durable for c in specs if any(subject_matches(f, subject) for f in c.filters)))


def consumed_specs() -> list[MessageSpec]:
    """Message types some durable of ours reads (ops and portals watch with plain subscriptions; a reply goes
    to its asker's inbox, never to a durable)."""
    return [s for s in ALL if s.address is not None and set(s.consumers) - {"ops", "portal"}]


def publisher(spec: MessageSpec, node: str | None) -> str | None:
    """The identity that may publish `spec` on its subject, or None when the test holds no such creds."""
    for producer in spec.producers:
        if producer == "node-agent":
            return f"node-{node}" if node else None
        if producer in ("portal", "allocator", "scheduler", "image-pipeline", "maas-gateway"):
            return producer
    return None


class Fuzzer:
    def __init__(self, seed: int, pools: Pools) -> None:
        self.rng = random.Random(seed)
        self.pools = pools
        self.specs = [s for s in consumed_specs() if self._target(s) is not None]
        self._live_allocations = True  # set per drawn message by instance()

    # --- the run -------------------------------------------------------------------------------------

    def draw(self, count: int) -> list[Hostile]:
        names = list(WEIGHTS)
        weights = [WEIGHTS[n] for n in names]
        out: list[Hostile] = []
        while len(out) < count:
            category = self.rng.choices(names, weights)[0]
            item = getattr(self, f"_{category}")()
            # A subject no durable reads (e.g. task progress, watched by ops only) tests nothing here.
            if item is not None and item.durables:
                out.append(item)
        return out

    def _target(self, spec: MessageSpec, node: str | None = None) -> tuple[str, str, str | None] | None:
        """(subject, identity, node) for a message of `spec`."""
        if "node_id" in spec.parameters:
            node = node or self.rng.choice(list(self.pools.nodes))
            identity = publisher(spec, node)
            return (spec.subject(node_id=node), identity, node) if identity else None
        identity = publisher(spec, None)
        return (spec.subject(), identity, None) if identity else None

    def _pick(self) -> tuple[MessageSpec, str, str, str | None]:
        spec = self.rng.choice(self.specs)
        target = self._target(spec)
        assert target is not None
        return spec, *target

    def _hostile(self, category: str, spec: MessageSpec | None, subject: str, body: bytes, identity: str) -> Hostile:
        return Hostile(
            category, spec.type if spec else None, subject, body, identity, consumers_for(subject, self.pools.nodes)
        )

    def _envelope(self, spec: MessageSpec, payload: Any, **over: Any) -> bytes:
        env = {
            "event_id": str(uuid.UUID(int=self.rng.getrandbits(128))),
            "type": spec.type,
            "schema_version": SCHEMA_VERSION,
            "occurred_at": self._timestamp(),
            "correlation_id": "fuzz",
            "causation_id": None,
            "producer": "fuzz",
            "payload": payload,
            **over,
        }
        return json.dumps(env).encode()

    # --- categories ----------------------------------------------------------------------------------

    def _garbage(self) -> Hostile:
        spec, subject, identity, _ = self._pick()
        body = self.rng.randbytes(self.rng.randint(0, 2048))
        return self._hostile("garbage", spec, subject, body, identity)

    def _not_object(self) -> Hostile:
        spec, subject, identity, _ = self._pick()
        body = self.rng.choice([b"[]", b"null", b"42", b'"text"', b"true", b"[{}]", b"{", b'{"a":'])
        return self._hostile("not_object", spec, subject, body, identity)

    def _envelope_invalid(self) -> Hostile:
        spec, subject, identity, _ = self._pick()
        good = json.loads(self._envelope(spec, {}))
        mutation = self.rng.choice(["drop", "retype", "extra", "version"])
        if mutation == "drop":
            good.pop(self.rng.choice(["event_id", "type", "occurred_at", "correlation_id", "producer", "payload"]))
        elif mutation == "retype":
            good[self.rng.choice(["event_id", "payload", "occurred_at", "schema_version"])] = [1, 2]
        elif mutation == "extra":
            good["surprise"] = "x"
        else:
            good["schema_version"] = 0
        return self._hostile("envelope_invalid", spec, subject, json.dumps(good).encode(), identity)

    def _wrong_subject(self) -> Hostile | None:
        spec, subject, identity, _ = self._pick()
        others = [s for s in ALL if not s.subject_regex().match(subject) and s.type != "dead_letter"]
        other = self.rng.choice(others)
        payload = self.instance(other)
        if payload is None:
            return None
        return self._hostile("wrong_subject", spec, subject, self._envelope(other, payload), identity)

    def _payload_invalid(self) -> Hostile | None:
        spec, subject, identity, node = self._pick()
        payload = self.instance(spec, node)
        if payload is None or not payload:
            return self._hostile("payload_invalid", spec, subject, self._envelope(spec, {"?": 1}), identity)
        key = self.rng.choice(sorted(payload))
        mutation = self.rng.choice(["drop", "retype", "extra"])
        if mutation == "extra" or not _required(spec.model, key):
            payload["unexpected_field"] = self.rng.random()
        elif mutation == "drop":
            payload.pop(key)
        else:
            payload[key] = {"nested": [None, 1.5]}
        body = self._envelope(spec, payload)
        if _valid(spec.model, payload):
            return None  # the mutation happened to stay valid (e.g. a dropped field has a default)
        return self._hostile("payload_invalid", spec, subject, body, identity)

    def _oversize(self) -> Hostile | None:
        spec, subject, identity, node = self._pick()
        payload = self.instance(spec, node) or {}
        payload["padding"] = ""
        body = self._envelope(spec, payload)
        size = min(OVERSIZE_BYTES, max_payload_of(identity) - OVERSIZE_HEADROOM)
        padding = b"x" * (size - len(body))
        body = body.replace(b'"padding": ""', b'"padding": "' + padding + b'"', 1)
        return self._hostile("oversize", spec, subject, body, identity)

    def _wrong_node(self) -> Hostile | None:
        node_specs = [s for s in self.specs if "node_id" in s.parameters and "node_id" in s.model.model_fields]
        node_specs = [s for s in node_specs if "node-agent" in s.producers]
        if not node_specs or len(self.pools.nodes) < 2:
            return None
        spec = self.rng.choice(node_specs)
        sender, named = self.rng.sample(list(self.pools.nodes), 2)
        payload = self.instance(spec, named)
        if payload is None:
            return None
        payload["node_id"] = named
        return self._hostile(
            "wrong_node", spec, spec.subject(node_id=sender), self._envelope(spec, payload), f"node-{sender}"
        )

    def _generated(self) -> Hostile | None:
        spec, subject, identity, node = self._pick()
        payload = self.instance(spec, node)
        if payload is None:
            return None
        return self._hostile("generated", spec, subject, self._envelope(spec, payload), identity)

    def _replay(self) -> Hostile | None:
        if not self.pools.replayable:
            return None
        subject, body, identity = self.rng.choice(self.pools.replayable)
        spec = next((s for s in ALL if s.subject_regex().match(subject)), None)
        return self._hostile("replay", spec, subject, body, identity)

    # --- schema walker -------------------------------------------------------------------------------

    def instance(self, spec: MessageSpec, node: str | None = None) -> dict[str, Any] | None:
        """A schema-valid payload of `spec`, or None when 20 draws all failed pydantic's validation."""
        schema = spec.model.model_json_schema()
        self._live_allocations = "allocator" not in spec.producers
        for _ in range(20):
            value = self._value(schema, schema.get("$defs", {}), "", node)
            if isinstance(value, dict) and _valid(spec.model, value):
                return value
        return None

    def _value(self, schema: dict[str, Any], defs: dict[str, Any], name: str, node: str | None) -> Any:
        if "$ref" in schema:
            return self._value(defs[schema["$ref"].rsplit("/", 1)[-1]], defs, name, node)
        for combinator in ("anyOf", "oneOf"):
            if combinator in schema:
                options = [o for o in schema[combinator] if o.get("type") != "null"] or schema[combinator]
                return self._value(self.rng.choice(options), defs, name, node)
        if "allOf" in schema:
            return self._value(schema["allOf"][0], defs, name, node)
        if "const" in schema:
            return schema["const"]
        if "enum" in schema:
            return self.rng.choice(schema["enum"])
        kind = schema.get("type")
        if kind == "object" or "properties" in schema:
            out: dict[str, Any] = {}
            required = set(schema.get("required", ()))
            for prop, sub in schema.get("properties", {}).items():
                if prop in required or self.rng.random() < 0.6:
                    out[prop] = self._value(sub, defs, prop, node)
            return out
        if kind == "array":
            lo, hi = schema.get("minItems", 0), min(schema.get("maxItems", 4), 4)
            items = schema.get("items", {})
            return [self._value(items, defs, name, node) for _ in range(self.rng.randint(lo, max(lo, hi)))]
        if kind == "integer":
            return self.rng.randint(int(schema.get("minimum", -5)), int(schema.get("maximum", 10_000)))
        if kind == "number":
            return self.rng.uniform(float(schema.get("minimum", 0.0)), float(schema.get("maximum", 1e6)))
        if kind == "boolean":
            return self.rng.random() < 0.5
        return self._string(schema, name, node)

    def _string(self, schema: dict[str, Any], name: str, node: str | None) -> str:
        fmt = schema.get("format")
        if "pattern" in schema and not (name == "node_id" and node):
            return _from_regex(schema["pattern"], self.rng)
        if fmt == "date-time":
            return self._timestamp()
        if name == "node_id" and node:
            return node
        if name == "allocation_id" and self._live_allocations and self.pools.allocations and self.rng.random() < 0.2:
            return self.rng.choice(self.pools.allocations)
        if name == "task_id" and self.pools.tasks and self.rng.random() < 0.2:
            return self.rng.choice(self.pools.tasks)
        if fmt == "uuid" or name.endswith("_id"):
            return str(uuid.UUID(int=self.rng.getrandbits(128), version=4))
        lo = int(schema.get("minLength", 1))
        hi = max(lo, min(int(schema.get("maxLength", 24)), 24))
        alphabet = string.ascii_lowercase + string.digits + "-_"
        return "".join(self.rng.choice(alphabet) for _ in range(self.rng.randint(lo, hi)))

    def _timestamp(self) -> str:
        now = datetime.now(timezone.utc)
        shift = self.rng.choice([0, -1, 1]) * timedelta(days=self.rng.randint(0, 40_000))
        try:
            return (now + shift).isoformat()
        except OverflowError:
            return now.isoformat()


def _from_regex(pattern: str, rng: random.Random) -> str:
    """A string matching `pattern`, drawn by walking the parsed regex (the subset our contract uses)."""
    out: list[str] = []
    _emit(_sre.parse(pattern), rng, out)
    return "".join(out)


_PRINTABLE = string.ascii_letters + string.digits + "-_.:/"


def _emit(tokens: Any, rng: random.Random, out: list[str]) -> None:
    for op, arg in tokens:
        name = str(op)
        if name == "LITERAL":
            out.append(chr(arg))
        elif name == "ANY":
            out.append(rng.choice(_PRINTABLE))
        elif name == "IN":
            out.append(_pick_in(arg, rng))
        elif name in ("MAX_REPEAT", "MIN_REPEAT", "POSSESSIVE_REPEAT"):
            lo, hi, sub = arg
            for _ in range(rng.randint(lo, min(hi, lo + 8))):
                _emit(sub, rng, out)
        elif name == "SUBPATTERN":
            _emit(arg[-1], rng, out)
        elif name == "BRANCH":
            _emit(rng.choice(arg[1]), rng, out)
        elif name == "AT":
            continue
        else:
            raise ValueError(f"regex construct {name} not supported by the fuzzer")


def _pick_in(items: Any, rng: random.Random) -> str:
    choices: list[str] = []
    for op, arg in items:
        name = str(op)
        if name == "LITERAL":
            choices.append(chr(arg))
        elif name == "RANGE":
            choices.extend(chr(c) for c in range(arg[0], arg[1] + 1))
        elif name == "CATEGORY":
            choices.extend(string.digits if "DIGIT" in str(arg) else string.ascii_letters + string.digits + "_")
        elif name == "NEGATE":
            raise ValueError("negated character classes are not supported by the fuzzer")
    return rng.choice(choices)


def _valid(model: type[BaseModel], payload: dict[str, Any]) -> bool:
    try:
        model.model_validate(payload)
    except ValidationError:
        return False
    return True


def _required(model: type[BaseModel], key: str) -> bool:
    info = model.model_fields.get(key)
    return bool(info and info.is_required())
