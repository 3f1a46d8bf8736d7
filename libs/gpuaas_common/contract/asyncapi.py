"""Render the AsyncAPI 3.0 document from the catalog, and validate wire messages against a document.

Validation reads the YAML document, not the pydantic models, so tests that validate every message
on the bus prove the *committed contract* holds, independently of the code that produced it.
"""

from __future__ import annotations

import json
from functools import lru_cache
from pathlib import Path
from typing import Any

import jsonschema
import yaml
from pydantic.json_schema import models_json_schema
from referencing import Registry, Resource
from referencing.jsonschema import DRAFT7

from .catalog import ALL, BY_TYPE, MessageSpec
from .envelope import Envelope

CONTRACT_PATH = Path(__file__).resolve().parents[3] / "contracts" / "asyncapi.yaml"
_REF = "#/components/schemas/{model}"
_URN = "urn:gpuaas:contract"

_SERVICES = ("allocator", "scheduler", "image-pipeline", "maas-gateway", "node-agent", "ops-view")


def _camel(name: str) -> str:
    parts = name.replace("-", " ").replace("_", " ").split()
    return parts[0] + "".join(p.capitalize() for p in parts[1:])


def _envelope_schema(spec: MessageSpec) -> dict[str, Any]:
    schema = Envelope.model_json_schema()
    schema.pop("title", None)
    schema["description"] = f"Envelope of a `{spec.type}` message."
    schema["properties"]["type"] = {"const": spec.type, "type": "string"}
    schema["properties"]["payload"] = {"$ref": _REF.format(model=spec.model.__name__)}
    return schema


def render() -> dict[str, Any]:
    models = sorted({spec.model for spec in ALL}, key=lambda cls: cls.__name__)
    _, defs = models_json_schema([(model, "validation") for model in models], ref_template=_REF)
    schemas: dict[str, Any] = dict(sorted(defs.get("$defs", {}).items()))
    for spec in ALL:
        schemas[f"{spec.model.__name__}Message"] = _envelope_schema(spec)

    channels: dict[str, Any] = {}
    messages: dict[str, Any] = {}
    operations: dict[str, Any] = {}
    for spec in ALL:
        msg_name = spec.model.__name__
        messages[msg_name] = {
            "name": spec.type,
            "title": spec.type,
            "summary": spec.summary,
            "contentType": "application/json",
        }
        if spec.address is not None and spec.reply is None:
            messages[msg_name]["headers"] = {
                "type": "object",
                "properties": {
                    "Nats-Msg-Id": {
                        "type": "string",
                        "description": "Equals the envelope's event_id; JetStream drops repeats.",
                    }
                },
            }
        messages[msg_name]["payload"] = {"$ref": _REF.format(model=f"{msg_name}Message")}
        channel = channels.setdefault(
            spec.channel,
            {"address": spec.address, "messages": {}},
        )
        if spec.address is None:
            channel["description"] = "The asker's reply subject (NATS request/reply): its own inbox, never stored."
        channel["messages"][msg_name] = {"$ref": f"#/components/messages/{msg_name}"}
        if spec.parameters:
            channel["parameters"] = {name: {"description": text} for name, text in sorted(spec.parameters.items())}
        msg_ref = {"$ref": f"#/channels/{spec.channel}/messages/{msg_name}"}
        # A reply is sent as part of the operation that receives its request (see `reply` below).
        for producer in spec.producers if spec.address is not None else ():
            if producer in _SERVICES:
                op = operations.setdefault(
                    _camel(f"{producer} send {spec.channel}"),
                    {
                        "action": "send",
                        "channel": {"$ref": f"#/channels/{spec.channel}"},
                        "summary": f"{producer} publishes on {spec.address}",
                        "messages": [],
                    },
                )
                op["messages"].append(msg_ref)
        for consumer in spec.consumers:
            if consumer in _SERVICES:
                op = operations.setdefault(
                    _camel(f"{consumer} receive {spec.channel}"),
                    {
                        "action": "receive",
                        "channel": {"$ref": f"#/channels/{spec.channel}"},
                        "summary": f"{consumer} consumes {spec.address}",
                        "messages": [],
                        "bindings": {"nats": {"queue": consumer, "bindingVersion": "0.1.0"}},
                    },
                )
                op["messages"].append(msg_ref)
                if spec.reply is not None:
                    answer = BY_TYPE[spec.reply]
                    op["reply"] = {
                        "channel": {"$ref": f"#/channels/{answer.channel}"},
                        "messages": [
                            {"$ref": f"#/channels/{answer.channel}/messages/{answer.model.__name__}"},
                        ],
                    }

    return {
        "asyncapi": "3.0.0",
        "info": {
            "title": "gpuaas control plane events",
            "version": "1.0.0",
            "description": (
                "Events and commands exchanged over NATS JetStream by the gpuaas services. "
                "Every message body is a JSON envelope whose `payload` follows the message's schema. "
                "Ops follow the whole allocation lifecycle with one wildcard: `gpuaas.allocation.event.>`. "
                "This file is rendered from libs/gpuaas_common/contract; a test fails when they drift."
            ),
        },
        "defaultContentType": "application/json",
        "servers": {
            "embedded": {
                "host": "127.0.0.1:4222",
                "protocol": "nats",
                "description": "The embedded development stack (gpuaas dev up).",
            }
        },
        "channels": dict(sorted(channels.items())),
        "operations": dict(sorted(operations.items())),
        "components": {"messages": dict(sorted(messages.items())), "schemas": schemas},
    }


def render_yaml() -> str:
    return yaml.safe_dump(render(), sort_keys=False, width=110, allow_unicode=True)


class ContractViolation(ValueError):
    pass


class ContractValidator:
    """Validates wire messages (subject + body) against an AsyncAPI document."""

    def __init__(self, document: dict[str, Any]) -> None:
        self.document = document
        registry = Registry().with_resource(_URN, Resource.from_contents(document, DRAFT7))
        self._validators: dict[str, jsonschema.Draft7Validator] = {}
        self._registry = registry
        self._channels: list[tuple[Any, dict[str, str]]] = []
        for channel in document["channels"].values():
            spec_like = MessageSpec(
                type="",
                model=Envelope,
                channel="",
                address=channel["address"],
                summary="",
                producers=(),
                consumers=(),
                parameters=channel.get("parameters", {}),
            )
            names = {}
            for ref in channel["messages"].values():
                target = ref["$ref"].rsplit("/", 1)[-1]
                message = document["components"]["messages"][target]
                names[message["name"]] = message["payload"]["$ref"].rsplit("/", 1)[-1]
            self._channels.append((spec_like.subject_regex(), names))

    @classmethod
    def from_file(cls, path: Path = CONTRACT_PATH) -> "ContractValidator":
        return cls(yaml.safe_load(path.read_text()))

    def _validator(self, schema_name: str) -> jsonschema.Draft7Validator:
        if schema_name not in self._validators:
            schema = {"$ref": f"{_URN}#/components/schemas/{schema_name}"}
            self._validators[schema_name] = jsonschema.Draft7Validator(
                schema, registry=self._registry, format_checker=jsonschema.FormatChecker()
            )
        return self._validators[schema_name]

    def validate(self, subject: str, body: bytes | str | dict[str, Any]) -> dict[str, Any]:
        if isinstance(body, (bytes, str)):
            try:
                data = json.loads(body)
            except ValueError as exc:
                raise ContractViolation(f"{subject}: body is not JSON: {exc}") from None
        else:
            data = body
        if not isinstance(data, dict) or "type" not in data:
            raise ContractViolation(f"{subject}: body is not an envelope")
        for regex, names in self._channels:
            if regex.match(subject):
                if data["type"] not in names:
                    continue
                errors = sorted(self._validator(names[data["type"]]).iter_errors(data), key=str)
                if errors:
                    detail = "; ".join(
                        f"{'/'.join(map(str, e.absolute_path)) or '<root>'}: {e.message}" for e in errors[:5]
                    )
                    raise ContractViolation(f"{subject} {data['type']}: {detail}")
                return data
        raise ContractViolation(f"{subject}: no channel of the contract carries type {data['type']!r}")


@lru_cache(maxsize=1)
def default_validator() -> ContractValidator:
    return ContractValidator.from_file()
