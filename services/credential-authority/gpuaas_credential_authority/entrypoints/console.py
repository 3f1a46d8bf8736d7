"""`gpuaas-credential-authority`'s command line (gpuaas_common.service_args): the heavy main is imported only to run."""

from __future__ import annotations

from gpuaas_common.service_args import service_main

from ..settings import AuthoritySettings

SUMMARY = "Holds the bus's signing keys: mints and revokes hosts' users on signed requests, renews creds files."


def main() -> None:
    service_main(
        "gpuaas-credential-authority", SUMMARY, AuthoritySettings, "gpuaas_credential_authority.entrypoints.main:main"
    )
