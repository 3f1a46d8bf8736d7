from pydantic import Field

from gpuaas_common.settings import ServiceSettings


class AgentSettings(ServiceSettings):
    node_id: str | None = None
    # Root of the host's filesystem as the agent sees it: "/" on a real host, a fixture tree in tests.
    host_root: str = "/"
    libvirt_uri: str = "qemu:///system"
    state_dir: str = "/var/lib/gpuaas/agent"
    ssh_port: int = Field(default=22, ge=1, le=65535)
    readiness_timeout_s: float = Field(default=120.0, gt=0)
    shutdown_timeout_s: float = Field(default=30.0, gt=0)
    image_cache_dir: str = "/var/lib/gpuaas/images"
    dnsmasq_hostsdir: str = "/etc/gpuaas/dnsmasq-hosts"
    dnsmasq_lease_file: str = "/var/lib/misc/dnsmasq.leases"
    seed_dir: str = "/var/lib/gpuaas/seeds"
    # Simulated fleet: run one agent per host of this fleet file in this process.
    fleet_file: str | None = None
    # Simulated fleet: each host connects with `<dir>/node-<node_id>.creds`, its own NATS user.
    nats_creds_dir: str | None = None
    # Simulated fleet: images copied into every simulated host's cache at start (until prewarm lands).
    sim_image_dir: str | None = None
    # Simulated fleet: where simulated baremetal hosts learn that MAAS deployed them.
    maas_sim_url: str | None = None
    sim_disk_size_mib: int = Field(default=64, ge=1)
    # How long JetStream waits for a task's ack before redelivering it (a slice provision can take minutes).
    task_ack_wait_s: float = Field(default=120.0, gt=0)
    # Simulated fleet for control-plane benchmarks: hosts answer tasks at once (see adapters/sim_instant.py).
    sim_instant_hosts: bool = False
    # Tasks handled in parallel per host (on disjoint slots).
    task_concurrency: int = Field(default=8, ge=1, le=64)
