"""Environment-driven settings shared by every service.

Each service subclasses `ServiceSettings` with its own prefix-free fields; every variable is read
from `GPUAAS_<FIELD>` so one `.env` or compose `environment:` block configures the whole stack.
The comment above a field is its documentation: the README's configuration table is generated from it
(`python -m gpuaas_dev.docs`).
"""

from __future__ import annotations

import json
from typing import Annotated, Any, Literal, TypeVar

from pydantic import BeforeValidator, Field, SecretStr, ValidationInfo, field_validator
from pydantic_settings import BaseSettings, NoDecode, SettingsConfigDict

from .db import check_dsn
from .natsconn import split_servers, transport_refusal

T = TypeVar("T")


def _list_from_env(value: Any) -> Any:
    """A list variable as people write it: `0.2,0.5` like GPUAAS_NATS_URL, or a JSON array `[0.2,0.5]`."""
    if not isinstance(value, str):
        return value
    text = value.strip()
    if text.startswith("["):
        return json.loads(text)  # a JSONDecodeError is a ValueError: a validation error naming the field
    return [item.strip() for item in text.split(",") if item.strip()]


# A tuple setting read from one variable; pydantic-settings alone would demand JSON and fail on `0.2,0.5`.
EnvList = Annotated[tuple[T, ...], NoDecode, BeforeValidator(_list_from_env)]


class ServiceSettings(BaseSettings):
    # Errors never echo a value: the database URL carries a password.
    model_config = SettingsConfigDict(env_prefix="GPUAAS_", extra="ignore", frozen=True, hide_input_in_errors=True)

    # Allows a nats:// URL (plaintext) or a tls:// one without GPUAAS_NATS_CA_FILE; only for an open dev bus
    # (the test suite, and the stack a benchmark starts without auth, set it). Off, both are refused at start.
    nats_insecure_dev: bool = False
    # One URL or a comma-separated list of every server of a cluster: tls:// (the client speaks TLS before
    # the server says a word); nats:// only with GPUAAS_NATS_INSECURE_DEV.
    nats_url: str = "nats://127.0.0.1:4222"
    # This process's identity on the bus (a `.creds` file: user JWT + seed); without it the process
    # connects anonymously, which only an open dev server accepts.
    nats_creds: str | None = None
    # The CA that signed the NATS servers' certificates (only this CA is trusted for tls:// URLs); required
    # unless GPUAAS_NATS_INSECURE_DEV.
    nats_ca_file: str | None = Field(default=None, validate_default=True)
    # How often the process looks whether its creds file holds renewed credentials, which it then switches to
    # without a gap in its traffic (gpuaas_common.creds_renewal); a stat of one file.
    nats_creds_check_interval_s: float = Field(default=5.0, gt=0)
    # The service's own Postgres role; it migrates and uses only its own schema.
    # One server or several (`postgresql://u:p@h1:5432,h2:5432/db?target_session_attrs=read-write`, see db.check_dsn).
    database_url: SecretStr = SecretStr("postgresql://gpuaas@127.0.0.1:5432/gpuaas")
    # /readyz, /healthz and /metrics; 0.0.0.0 in a container so probes and scrapers can reach them.
    health_host: str = "127.0.0.1"
    # 0 picks a free port (named in the ready file).
    health_port: int = Field(default=0, ge=0, le=65535)
    # Written once the service is ready; lets a supervisor learn a port chosen by the OS.
    ready_file: str | None = None
    # JSON log lines on stderr at this level: DEBUG, INFO, WARNING or ERROR.
    log_level: str = "INFO"
    # How long start-up waits for Postgres and NATS to answer before it exits with a reason
    # (database_unreachable, nats_unreachable, nats_auth_refused) for the supervisor to act on.
    startup_timeout_s: float = Field(default=30.0, gt=0)
    # Names this replica; no code reads it yet.
    instance_id: str = "0"
    # How often the outbox relay reads its table even though the NOTIFYs carry the rows (a safety net), and
    # its wait between tries for the relay lock that keeps one relay per schema.
    relay_poll_interval_s: float = Field(default=1.0, gt=0)
    # Outbox rows read and published at a time.
    relay_batch_size: int = Field(default=200, ge=1, le=10_000)
    # Deliveries of one message before it goes to the dead-letter subject with its reason.
    consumer_max_deliver: int = Field(default=8, ge=2, le=100)
    # JetStream redelivers a message after this long without an ack or progress ack (see bus.py): how long a
    # crashed consumer's messages wait. A consumer may declare a longer one; none shorter.
    consumer_ack_wait_s: float = Field(default=5.0, gt=0)
    # Messages each durable consumer handles at once, in order per aggregate (allocation, node, image):
    # one slow allocation never holds up the others. 1 handles strictly one at a time.
    consumer_concurrency: int = Field(default=16, ge=1, le=256)
    # How long inbox rows and stored Idempotency-Key answers are kept (retention.py says why 8 days); at
    # least JetStream's 15-minute duplicate window.
    inbox_retention_s: float = Field(default=8 * 24 * 3600.0, gt=15 * 60.0)
    # How long stored Idempotency-Key answers of the admin APIs are kept; like the inbox rows.
    idempotency_retention_s: float = Field(default=8 * 24 * 3600.0, gt=15 * 60.0)
    # How often expired inbox and idempotency rows are deleted.
    retention_sweep_interval_s: float = Field(default=3600.0, gt=0)
    # Rows deleted per statement, so a sweep never holds long locks.
    retention_batch_size: int = Field(default=5000, ge=1, le=100_000)
    # What one host may send each host-fed consumer (every durable reading gpuaas.node.<id>.report.*), per node
    # and per replica: messages a minute, refilled continuously, a minute's worth at most in one burst. Over it a
    # message is acked and dropped unread, counted (gpuaas_host_messages_dropped_total) and logged once per node a
    # minute (bus_budget.py). Replicas each hold their own buckets: a node gets this times the replica count.
    host_budget_messages_per_min: float = Field(default=600.0, gt=0)
    # The same budget in bytes of message bodies a minute, per node, consumer and replica.
    host_budget_bytes_per_min: float = Field(default=8 * 1024 * 1024.0, gt=0)
    # How long rows a host's messages make (drift reports, node tasks and phases, dead letters: retention.HostRows)
    # are kept; each host's newest stays.
    host_rows_retention_s: float = Field(default=30 * 24 * 3600.0, gt=0)
    # Such rows kept per host (each service's HOST_ROWS says what a host is for each table), the newest; the older
    # go in the transaction that inserted them (ops-view's, adapters/host_rows.py; the scheduler's drift reports),
    # else at the next retention sweep. Each host-fed consumer's inbox rows too, per node, capped as each is added.
    host_rows_per_node: int = Field(default=1000, ge=1)
    # The asyncio event loop: `uvloop` (libuv: the loop, its TLS and socket calls in compiled code; 3-9 % less CPU
    # per allocation in bench/pipeline.py at 50/s on 2 cores) or Python's own `asyncio`.
    event_loop: Literal["uvloop", "asyncio"] = "uvloop"
    # Delays for nak-with-delay retries; the last one repeats.
    retry_delays_s: EnvList[float] = Field(default=(0.2, 0.5, 1.0, 2.0, 5.0), min_length=1)

    @field_validator("nats_url")
    @classmethod
    def _nats_scheme(cls, v: str, info: ValidationInfo) -> str:
        urls = [u.strip() for u in v.split(",") if u.strip()]
        if not urls or not all(u.startswith(("nats://", "tls://")) for u in urls):
            raise ValueError("nats_url must be one or more comma-separated nats:// or tls:// URLs")
        if not info.data.get("nats_insecure_dev") and not all(u.startswith("tls://") for u in urls):
            raise ValueError(transport_refusal(urls, None, False))
        return ",".join(urls)

    @field_validator("nats_ca_file")
    @classmethod
    def _nats_ca_pinned(cls, v: str | None, info: ValidationInfo) -> str | None:
        # A bad URL was already reported on its own line; this one is about the CA only.
        if "nats_url" in info.data and not v and not info.data.get("nats_insecure_dev"):
            raise ValueError(transport_refusal(split_servers(info.data["nats_url"]), None, False))
        return v

    @field_validator("database_url")
    @classmethod
    def _postgres_dsn(cls, v: SecretStr) -> SecretStr:
        check_dsn(v.get_secret_value())
        return v

    @field_validator("log_level")
    @classmethod
    def _level(cls, v: str) -> str:
        v = v.upper()
        if v not in {"DEBUG", "INFO", "WARNING", "ERROR"}:
            raise ValueError("log_level must be DEBUG, INFO, WARNING or ERROR")
        return v
