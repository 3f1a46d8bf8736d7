from pydantic import Field, SecretStr, field_validator

from gpuaas_common.settings import ServiceSettings

# An HMAC key anyone could guess would let any host enrol as any allocation's machine.
MIN_ENROLMENT_SECRET = 16


class AllocatorSettings(ServiceSettings):
    # Slice node tasks (provision, release): the lab needed 20 minutes for image import + readiness
    # (slice-node-bootstrap runbook: "Increased the deployed provisioning node-task TTL to 20m").
    task_deadline_s: float = Field(default=1200.0, gt=0)
    # The agent enforces the same deadline and reports `deadline_exceeded`; the control plane waits this much
    # longer for that answer before it gives up on a silent host itself.
    task_deadline_grace_s: float = Field(default=60.0, ge=0)
    # A task past its deadline (plus the grace) is sent once more, same task id, before the allocation fails:
    # the agent answers it from its record. This is how long that answer is waited for.
    task_reask_wait_s: float = Field(default=60.0, gt=0)
    # How often overdue node tasks are looked for.
    task_deadline_sweep_interval_s: float = Field(default=10.0, gt=0)
    # An allocation waiting this long for its placement answer (accepted, or released before it was placed) asks
    # the scheduler again, and again after as long each time; the scheduler answers with the claim it holds.
    placement_reask_after_s: float = Field(default=30.0, gt=0)
    # A baremetal allocation waiting this long for its MAAS result sends its command again (same operation id):
    # the gateway answers a finished operation with its result again and ignores one still running.
    maas_reask_after_s: float = Field(default=300.0, gt=0)
    # A baremetal host MAAS reports deployed has this long to enrol (its agent's first boot); then the allocation
    # fails with `enrolment_timeout` and the node is drained for ops: the tenant's image is on it, nobody reached it.
    enrolment_deadline_s: float = Field(default=1800.0, gt=0)
    # The MAAS site (a gateway site name) baremetal allocations are deployed at.
    maas_site: str = "default"
    # The gateway's site profile (GPUAAS_SITE_PROFILES) baremetal hosts are deployed with.
    baremetal_profile: str = "h200-baremetal"
    # Shared with the MAAS gateway, which puts HMAC(secret, allocation:system) into user_data. No default: 16
    # characters or more, the gateway's value (`gpuaas dev up` and `scripts/compose-env.sh` make a random one).
    enrolment_secret: SecretStr
    # The slice terminal's websocket (GET /v1/allocations/{id}/terminal), for the portal acting for a signed-in
    # person of a tenant: the HMAC key the portal signs its tenant assertions with (tenant, person, expiry; 32
    # characters or more); without one the endpoint does not listen.
    terminal_assertion_secret: SecretStr | None = None
    # Where it listens: loopback by default, behind the portal's own TLS front.
    terminal_host: str = "127.0.0.1"
    # 0: any free port (the ready file and the log say which).
    terminal_port: int = Field(default=0, ge=0, le=65535)
    # A terminal session ends at this age, whatever it is doing (the host's agent enforces it too).
    terminal_session_max_s: float = Field(default=8 * 3600.0, gt=0)
    # How long a host's ask for keystrokes is held when the tenant has typed nothing; it asks again at once.
    terminal_input_hold_s: float = Field(default=10.0, gt=0)
    # A session whose host has not started relaying within this long ends (agent_gone).
    terminal_open_timeout_s: float = Field(default=30.0, gt=0)
    # Guest output held for a tenant's websocket, per session; the host's ack waits until the websocket took it.
    terminal_output_buffer_bytes: int = Field(default=64 * 1024, ge=16 * 1024)
    # Tenant input the host has not confirmed yet, per session; a frame past it is refused (an `input_refused`
    # notice) and nothing of it kept.
    terminal_input_window_bytes: int = Field(default=256 * 1024, ge=64 * 1024)
    # Live terminal sessions a tenant may hold over all its allocations and every replica (one per allocation).
    terminal_sessions_per_tenant: int = Field(default=4, ge=1)
    # Host terminal requests answered at once for one host; past it a request is dropped and counted.
    terminal_node_answers: int = Field(default=16, ge=2)

    @field_validator("terminal_assertion_secret")
    @classmethod
    def _assertion_secret_long_enough(cls, v: SecretStr | None) -> SecretStr | None:
        if v is not None and len(v.get_secret_value()) < 32:
            raise ValueError("must be at least 32 characters: it is the key of the portal's tenant assertions")
        return v

    @field_validator("enrolment_secret")
    @classmethod
    def _enrolment_secret_long_enough(cls, v: SecretStr) -> SecretStr:
        if len(v.get_secret_value()) < MIN_ENROLMENT_SECRET:
            raise ValueError(f"must be at least {MIN_ENROLMENT_SECRET} characters, the same as the MAAS gateway's")
        return v
