from pydantic import Field, SecretStr, ValidationInfo, field_validator

from gpuaas_node_agent.settings import AgentSettings


class SimFleetSettings(AgentSettings):
    """The agent's settings, applied to every host of the fleet, plus what only a simulation has."""

    # The fleet to simulate (`gpuaas dev fleet` writes one): every host of it runs in this process.
    fleet_file: str
    # Each host connects with `<dir>/node-<node_id>.creds`, its own NATS user; without it, as GPUAAS_NATS_CREDS
    # (an open dev server).
    nats_creds_dir: str | None = None
    # Images copied into every simulated host's cache at start, as a real host's provisioning puts seeded images;
    # each host proves its copy to the image pipeline when asked.
    sim_image_dir: str | None = None
    # Where simulated baremetal hosts learn that MAAS deployed them; without it they never boot.
    maas_sim_url: str | None = None
    # The CA that signed the simulator's HTTPS certificate (the dev stack's): only it is trusted. Required for an
    # https:// GPUAAS_MAAS_SIM_URL, whose answers carry each deploy's user-data (the host's creds).
    maas_sim_ca_file: str | None = Field(default=None, validate_default=True)
    # The simulator's API key: it shows a deploy's user-data only to a caller that has it, as real MAAS gives it
    # only to the deployed machine; the simulated machines read theirs with it.
    maas_sim_api_key: SecretStr | None = None
    # Size of each simulated NVMe disk's backing file.
    sim_disk_size_mib: int = Field(default=64, ge=1)
    # For control-plane benchmarks: hosts answer tasks at once (see instant.py).
    sim_instant_hosts: bool = False
    # A simulated guest is an SSH banner on a loopback address, not a machine one could log in to: the agent's
    # readiness login goes to the simulator instead, which answers with the guest's GPU report (dhcp_guest.py);
    # the lab's real guests get the real login.
    readiness_login: bool = False
    # Simulated hosts run libvirt's test driver, whose domains have whatever type the XML names.
    domain_type: str = "kvm"

    @field_validator("maas_sim_ca_file")
    @classmethod
    def _https_is_pinned(cls, v: str | None, info: ValidationInfo) -> str | None:
        url = info.data.get("maas_sim_url") or ""
        if url.lower().startswith("https://") and not v:
            raise ValueError("GPUAAS_MAAS_SIM_URL is https:// and needs the CA its certificate is pinned to")
        return v
