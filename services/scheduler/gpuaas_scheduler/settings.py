from pydantic import Field

from gpuaas_common.settings import ServiceSettings


class SchedulerSettings(ServiceSettings):
    # Fleet description to seed the inventory from (the simulated fleet, or a lab's export).
    inventory_file: str | None = None
    # Keep at least this many whole clean slice hosts unsliced while sliced ones have room.
    clean_node_watermark: int = Field(default=0, ge=0)
