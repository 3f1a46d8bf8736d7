from pydantic import Field, SecretStr

from gpuaas_common.settings import ServiceSettings


class AllocatorSettings(ServiceSettings):
    task_deadline_s: float = Field(default=900.0, gt=0)
    maas_site: str = "default"
    baremetal_profile: str = "h200-baremetal"
    # Shared with the MAAS gateway, which puts HMAC(secret, allocation:system) into user_data.
    enrolment_secret: SecretStr = SecretStr("dev-enrolment-secret")
