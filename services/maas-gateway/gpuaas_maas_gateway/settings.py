from pydantic import BaseModel, Field, SecretStr

from gpuaas_common.settings import ServiceSettings


class SiteProfile(BaseModel):
    distro_series: str = "noble"
    hwe_kernel: str | None = None
    erase_on_release: bool = True
    quick_erase: bool = True
    bootstrap_user_data: str = ""


class GatewaySettings(ServiceSettings):
    maas_url: str = "http://127.0.0.1:5240/MAAS/"
    maas_api_key: SecretStr = SecretStr("")
    maas_timeout_s: float = Field(default=10.0, gt=0)
    # How often an unknown or accepted operation is observed; real MAAS clients use 5-10 s.
    maas_poll_interval_s: float = Field(default=1.0, gt=0)
    # How long a machine may still look untouched before an unknown submit counts as not accepted.
    maas_grace_s: float = Field(default=5.0, ge=0)
    maas_deadline_s: float = Field(default=1800.0, gt=0)
    maas_max_concurrency: int = Field(default=8, ge=1)
    maas_uploaded_images: tuple[str, ...] = ()
    enrolment_secret: SecretStr = SecretStr("dev-enrolment-secret")
    site_profiles: dict[str, SiteProfile] = {"h200-baremetal": SiteProfile()}
