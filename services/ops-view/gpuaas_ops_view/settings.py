from pydantic import Field, SecretStr

from gpuaas_common.settings import ServiceSettings


class OpsViewSettings(ServiceSettings):
    # Ops API address; 0.0.0.0 in a container so a published port reaches it.
    admin_host: str = "127.0.0.1"
    # 0 picks a free port (written into the ready file).
    admin_port: int = Field(default=0, ge=0, le=65535)
    # Bearer token of the ops API (the `ops` principal: reads only); without one the API does not listen.
    admin_token: SecretStr | None = None
    # Bearer token of the `billing` principal: the usage records (`GET /v1/usage`, `gpuaas usage export`) and
    # nothing else. Unset: only the ops token reads them.
    billing_token: SecretStr | None = None
    # The key of the console's login links and session cookies (`gpuaas console` mints links with it), a secret of
    # its own, none of the bearer tokens. Unset: no link signs anyone in to the console.
    console_login_secret: SecretStr | None = None
    # Names this follower's stream consumers (`<prefix>-allocations`, ...) and its dead-letter subjects: the
    # ops-view identity may use only the default's; another name is for a second follower under admin creds.
    follower_prefix: str = Field(default="ops-view", pattern=r"^[A-Za-z0-9_-]{1,40}$")
    # Messages pulled and applied per transaction at most; each stream is followed by its own loop.
    follow_batch: int = Field(default=256, ge=1, le=4096)
    # The scheduler's admin API, which the console's drain goes through (as `gpuaas nodes drain` does) and whose
    # node view (mode, drained, maintenance) the console's fleet shows; without both the console only reads.
    scheduler_admin_url: str | None = Field(default=None, pattern=r"^https?://")
    # The console's own bearer token there (the scheduler's GPUAAS_CONSOLE_TOKEN, principal `ops-console`): its
    # changes carry the signed-in person, whose rights the scheduler checks.
    scheduler_console_token: SecretStr | None = None
