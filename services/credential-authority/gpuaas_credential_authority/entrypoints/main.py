"""`gpuaas-credential-authority`: the one process that holds the bus's signing keys.

It mints baremetal hosts' users for the MAAS gateway, each for a deploy command it reads on the bus itself, revokes
them, ends slice hosts' identities, and (where configured) renews the deployment's creds files. On the bus it is an
identity like any other, allowed only the identity ledger and reading a MAAS stream message by its sequence; its
system-account users are minted per revocation and may only read and replace account JWTs.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

from gpuaas_common.identity import Authority
from gpuaas_common.identity.signed_request import Trust
from gpuaas_common.identity.tls import TlsFiles, server_context
from gpuaas_common.logging import get_logger
from gpuaas_common.runtime import ServiceRuntime, run_service
from gpuaas_common.startup import StartupFailed

from ..adapters.deploy_commands import DeployCommands
from ..adapters.ledger import Ledger
from ..service_layer.host_users import HostUsers
from ..service_layer.renewal import renew_forever
from ..settings import AuthoritySettings
from .http import AuthorityApi

log = get_logger(__name__)


def load_keys(settings: AuthoritySettings) -> Authority:
    try:
        return Authority.load(Path(settings.keys_dir))
    except (OSError, ValueError) as exc:
        reason = exc.strerror if isinstance(exc, OSError) and exc.strerror else type(exc).__name__
        raise StartupFailed(
            "invalid_settings", f"keys in {settings.keys_dir}: {reason}", setting="GPUAAS_KEYS_DIR"
        ) from None


def build_register(settings: AuthoritySettings):
    async def register(rt: ServiceRuntime) -> None:
        assert rt.js is not None
        authority = load_keys(settings)
        try:
            tls = server_context(TlsFiles(Path(), Path(settings.api_tls_cert_file), Path(settings.api_tls_key_file)))
        except (OSError, ValueError) as exc:
            raise StartupFailed(
                "invalid_settings", f"API certificate: {exc}", setting="GPUAAS_API_TLS_CERT_FILE"
            ) from None
        ledger = Ledger(rt.js, rt.identity.servers, rt.identity.tls_context())
        trust = Trust(
            account=authority.account.public,
            issuers=frozenset({authority.account_signing.public}),
            callers=frozenset(settings.callers.split(",")),
        )
        host_users = HostUsers(
            authority, ledger, DeployCommands(rt.js), max_command_age_s=settings.deploy_command_max_age_s
        )
        api = AuthorityApi(host_users, trust, ledger.revoked, max_host_ttl_s=settings.max_host_ttl_s)
        rt.ready_info["api_port"] = await api.start(settings.api_host, settings.api_port, tls)
        log.info(
            "authority_api_listening",
            host=settings.api_host,
            port=rt.ready_info["api_port"],
            callers=sorted(trust.callers),
        )

        async def keep() -> None:
            try:
                await asyncio.Event().wait()
            finally:
                await api.stop()

        rt.spawn(keep(), "authority-api")
        if settings.renew_creds_dir:
            hosts = Path(settings.renew_hosts_dir) if settings.renew_hosts_dir else None
            renewal = renew_forever(
                authority,
                Path(settings.keys_dir),
                Path(settings.renew_creds_dir),
                hosts,
                ledger,
                settings.renew_every_s,
            )
            rt.spawn(renewal, "creds-renewal-of-others")

    return register


def main() -> None:
    run_service("credential-authority", AuthoritySettings, build_register)


if __name__ == "__main__":
    main()
