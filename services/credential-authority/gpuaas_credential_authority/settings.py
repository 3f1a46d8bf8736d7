from pydantic import Field

from gpuaas_common.settings import ServiceSettings


class AuthoritySettings(ServiceSettings):
    # The deployment's keys directory (`gpuaas identities init` wrote it, 0700): operator, accounts, signing keys.
    # This process is the only one that reads it while the deployment runs.
    keys_dir: str
    # Address of the signed-request API (0.0.0.0 in a container, for the gateway's).
    api_host: str = "127.0.0.1"
    # 0 picks a free port (written into the ready file).
    api_port: int = Field(default=0, ge=0, le=65535)
    # The API's certificate (PEM), from the deployment's CA: it speaks HTTPS only.
    api_tls_cert_file: str
    # The certificate's key (PEM, 0600).
    api_tls_key_file: str
    # Roles whose signed requests are served (comma-separated): the MAAS gateway mints baremetal hosts' users.
    callers: str = Field(default="maas-gateway", pattern=r"^[a-z0-9-]+(,[a-z0-9-]+)*$")
    # The longest a minted baremetal host user may live, whatever a caller asks: the ledger forgets revocations
    # after a year, and a host user outliving its allocation must stay revocable.
    max_host_ttl_s: float = Field(default=7 * 24 * 3600.0, gt=0, le=365 * 24 * 3600.0)
    # How long after its deploy command (as the MAAS stream stored it) a host user may be minted for it: a deploy's
    # user-data is minted within the gateway's operation deadline (30 min by default) of its command, and the
    # allocator asks an open deploy again every 5 min (the gateway then names the newest asking); an older command
    # named again is a replay. 45 min: the deadline and a gateway that took its command 15 min late.
    deploy_command_max_age_s: float = Field(default=45 * 60.0, gt=0, le=7 * 24 * 3600.0)
    # Renewal of every role's creds file past half-life in this directory (unset: none, as in the dev stack, whose
    # supervisor renews its own run directory).
    renew_creds_dir: str | None = None
    # And of every slice host's creds file in this one (each new host user recorded in the ledger first).
    renew_hosts_dir: str | None = None
    # Seconds between renewal rounds; a file is renewed at half its life (a day's at 12 h).
    renew_every_s: float = Field(default=600.0, gt=0)
