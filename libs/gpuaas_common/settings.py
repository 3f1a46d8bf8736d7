"""Environment-driven settings shared by every service.

Each service subclasses `ServiceSettings` with its own prefix-free fields; every variable is read
from `GPUAAS_<FIELD>` so one `.env` or compose `environment:` block configures the whole stack.
"""

from __future__ import annotations

from pydantic import Field, SecretStr, field_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from .db import check_dsn


class ServiceSettings(BaseSettings):
    # Errors never echo a value: the database URL carries a password.
    model_config = SettingsConfigDict(env_prefix="GPUAAS_", extra="ignore", frozen=True, hide_input_in_errors=True)

    # One URL or a comma-separated list of every server of a cluster.
    nats_url: str = "nats://127.0.0.1:4222"
    # This process's identity on the bus (a `.creds` file: user JWT + seed) and the CA that signed the
    # servers' certificates; without them the process connects anonymously, which only an open dev
    # server accepts.
    nats_creds: str | None = None
    nats_ca_file: str | None = None
    # One server or several (`postgresql://u:p@h1:5432,h2:5432/db?target_session_attrs=read-write`, see db.check_dsn).
    database_url: SecretStr = SecretStr("postgresql://gpuaas@127.0.0.1:5432/gpuaas")
    health_host: str = "127.0.0.1"
    health_port: int = Field(default=0, ge=0, le=65535)
    # Written once the service is ready; lets a supervisor learn a port chosen by the OS.
    ready_file: str | None = None
    log_level: str = "INFO"
    # How long start-up waits for Postgres and NATS to answer before it exits with a reason
    # (database_unreachable, nats_unreachable, nats_auth_refused) for the supervisor to act on.
    startup_timeout_s: float = Field(default=30.0, gt=0)
    instance_id: str = "0"
    relay_poll_interval_s: float = Field(default=1.0, gt=0)
    relay_batch_size: int = Field(default=200, ge=1, le=10_000)
    consumer_max_deliver: int = Field(default=8, ge=2, le=100)
    # JetStream redelivers a message after this long without an ack or progress ack (see bus.py): how long a
    # crashed consumer's messages wait. A consumer may declare a longer one; none shorter.
    consumer_ack_wait_s: float = Field(default=5.0, gt=0)
    # How long inbox rows and stored Idempotency-Key answers are kept (retention.py says why 8 days); at
    # least JetStream's 15-minute duplicate window.
    inbox_retention_s: float = Field(default=8 * 24 * 3600.0, gt=15 * 60.0)
    idempotency_retention_s: float = Field(default=8 * 24 * 3600.0, gt=15 * 60.0)
    retention_sweep_interval_s: float = Field(default=3600.0, gt=0)
    retention_batch_size: int = Field(default=5000, ge=1, le=100_000)
    # Delays for nak-with-delay retries; the last one repeats.
    retry_delays_s: tuple[float, ...] = (0.2, 0.5, 1.0, 2.0, 5.0)

    @field_validator("nats_url")
    @classmethod
    def _nats_scheme(cls, v: str) -> str:
        urls = [u.strip() for u in v.split(",") if u.strip()]
        if not urls or not all(u.startswith(("nats://", "tls://")) for u in urls):
            raise ValueError("nats_url must be one or more comma-separated nats:// or tls:// URLs")
        return ",".join(urls)

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
