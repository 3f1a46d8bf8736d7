"""Why a service could not start: a reason code per failure class, logged as one JSON line
(`startup_failed`), and an exit code of its own, so that a supervisor or an operator reading
`docker compose ps` can tell a wrong setting from a database that is not up yet without a traceback.

Only `startup_error` (a failure nobody classified: a bug) carries the traceback, inside its one line.
"""

from __future__ import annotations

import errno
import re
import traceback
from typing import Any

from pydantic import ValidationError
from pydantic_settings import SettingsError

# reason -> exit code. Distinct per reason; sysexits.h meanings where one fits.
EXIT_CODES: dict[str, int] = {
    "invalid_settings": 78,  # EX_CONFIG: a GPUAAS_* variable, or a file it names, is unusable
    "database_unreachable": 69,  # EX_UNAVAILABLE: no Postgres answered within GPUAAS_STARTUP_TIMEOUT_S
    "database_auth_refused": 77,  # EX_NOPERM: Postgres refused the role or its password
    "migration_failed": 65,  # EX_DATAERR: a schema migration failed (nothing of it was committed)
    "nats_unreachable": 75,  # EX_TEMPFAIL: no NATS server answered within GPUAAS_STARTUP_TIMEOUT_S
    "nats_auth_refused": 76,  # NATS refused our credentials until GPUAAS_STARTUP_TIMEOUT_S passed
    "nats_setup_failed": 74,  # connected, but our consumers or streams could not be set up
    "port_unavailable": 71,  # the health or admin port could not be bound
    "startup_error": 70,  # EX_SOFTWARE: anything else (a bug); the traceback is in the line
}


class StartupFailed(Exception):
    """A classified start-up failure: `reason` is a key of EXIT_CODES, `detail` says what to fix.

    `detail` and `fields` must never hold a secret (a DSN password, a token, a seed)."""

    def __init__(self, reason: str, detail: str, **fields: Any) -> None:
        if reason not in EXIT_CODES:
            raise ValueError(f"unknown start-up failure reason {reason!r}")
        super().__init__(f"{reason}: {detail}")
        self.reason, self.detail, self.fields = reason, detail, fields

    @property
    def exit_code(self) -> int:
        return EXIT_CODES[self.reason]

    def log_fields(self) -> dict[str, Any]:
        return {"reason": self.reason, "exit_code": self.exit_code, "detail": self.detail, **self.fields}


def settings_errors(exc: ValidationError, prefix: str = "GPUAAS_") -> list[dict[str, str]]:
    """Which variable is wrong and why; never the value given (it may be a secret)."""
    out = []
    for err in exc.errors(include_input=False, include_url=False):
        field = ".".join(str(part) for part in err["loc"]) or "settings"
        out.append({"setting": f"{prefix}{field}".upper(), "error": err["msg"]})
    return out


def classify(exc: BaseException) -> StartupFailed:
    """What is known of an exception that escaped start-up without being classified where it happened."""
    from .migrations import MigrationError  # the migrations module needs asyncpg; not every caller does
    from .natsconn import CredentialError, InsecureTransport

    if isinstance(exc, StartupFailed):
        return exc
    if isinstance(exc, ValidationError):
        errors = settings_errors(exc)
        return StartupFailed(
            "invalid_settings", "; ".join(f"{e['setting']}: {e['error']}" for e in errors), errors=errors
        )
    if isinstance(exc, SettingsError):
        # pydantic-settings could not even decode a variable (a list or tuple that is not JSON, say).
        found = re.search(r'field "(\w+)"', str(exc))
        setting = f"GPUAAS_{found.group(1)}".upper() if found else "settings"
        cause = f" ({type(exc.__cause__).__name__}: {exc.__cause__})" if exc.__cause__ else ""
        hint = "; list and tuple values are JSON, e.g. [0.2,0.5]" if isinstance(exc.__cause__, ValueError) else ""
        return StartupFailed(
            "invalid_settings",
            f"{setting}: cannot be decoded{cause}{hint}",
            errors=[{"setting": setting, "error": f"cannot be decoded{cause}"}],
        )
    if isinstance(exc, CredentialError):
        return StartupFailed("invalid_settings", str(exc), setting="GPUAAS_NATS_CREDS")
    if isinstance(exc, InsecureTransport):
        return StartupFailed("invalid_settings", str(exc), setting="GPUAAS_NATS_URL")
    if isinstance(exc, MigrationError):
        return StartupFailed("migration_failed", str(exc), schema=exc.schema, migration=exc.version)
    if isinstance(exc, OSError) and exc.errno in (errno.EADDRINUSE, errno.EADDRNOTAVAIL, errno.EACCES):
        return StartupFailed("port_unavailable", str(exc))
    return StartupFailed(
        "startup_error",
        f"{type(exc).__name__}: {exc}"[:500],
        exception="".join(traceback.format_exception(exc)),
    )


def redact(text: str, *secrets: str | None) -> str:
    """`text` with every given secret replaced; for driver messages that may quote what they were given."""
    for secret in secrets:
        if secret:
            text = text.replace(secret, "**redacted**")
    return text
