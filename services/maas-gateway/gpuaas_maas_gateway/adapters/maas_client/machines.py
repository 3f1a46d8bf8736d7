"""Machine calls: list, read, allocate, deploy, release, commission, abort."""

from __future__ import annotations

import base64
from collections.abc import Iterable

from ..maas_models import Machine
from .transport import MaasTransport

Filter = str | int | Iterable[str | int] | None


class MachineCalls(MaasTransport):
    async def list_machines(self, *, timeout: float | None = None, **filters: Filter) -> list[Machine]:
        """Filters as MAAS names them (hostname, id, tags, status, agent_name, …); lists repeat."""
        data = await self._call("GET", "machines/", operation="list_machines", query=filters, timeout=timeout)
        return [Machine.from_json(m) for m in data]

    async def read_machine(self, system_id: str, *, timeout: float | None = None) -> Machine:
        data = await self._call(
            "GET",
            f"machines/{system_id}/",
            operation="read_machine",
            system_id=system_id,
            timeout=timeout,
        )
        return Machine.from_json(data)

    async def allocate(
        self,
        system_id: str | None = None,
        agent_name: str | None = None,
        comment: str | None = None,
        *,
        tags: Iterable[str] | None = None,
        timeout: float | None = None,
    ) -> Machine:
        """Not idempotent: after an unknown outcome, look for the machine by `agent_name`."""
        form = {
            "system_id": system_id,
            "agent_name": agent_name,
            "comment": comment,
            "tags": list(tags) if tags is not None else None,
        }
        data = await self._call(
            "POST",
            "machines/",
            op="allocate",
            operation="allocate",
            form=form,
            system_id=system_id,
            mutation=True,
            timeout=timeout,
        )
        return Machine.from_json(data)

    async def deploy(
        self,
        system_id: str,
        distro_series: str,
        user_data: bytes | str | None = None,
        hwe_kernel: str | None = None,
        agent_name: str | None = None,
        comment: str | None = None,
        *,
        timeout: float | None = None,
    ) -> Machine:
        """`user_data` is the raw document (cloud-config, script); it is base64-encoded here."""
        encoded = None
        if user_data is not None:
            raw = user_data.encode("utf-8") if isinstance(user_data, str) else user_data
            encoded = base64.b64encode(raw).decode("ascii")
        form = {
            "distro_series": distro_series,
            "user_data": encoded,
            "hwe_kernel": hwe_kernel,
            "agent_name": agent_name,
            "comment": comment,
        }
        data = await self._call(
            "POST",
            f"machines/{system_id}/",
            op="deploy",
            operation="deploy",
            form=form,
            system_id=system_id,
            mutation=True,
            timeout=timeout,
        )
        return Machine.from_json(data)

    async def set_storage_layout(self, system_id: str, storage_layout: str, *, timeout: float | None = None) -> Machine:
        """Ready or Allocated machines only; setting the layout they already have changes nothing."""
        data = await self._call(
            "POST",
            f"machines/{system_id}/",
            op="set_storage_layout",
            operation="set_storage_layout",
            form={"storage_layout": storage_layout},
            system_id=system_id,
            mutation=True,
            timeout=timeout,
        )
        return Machine.from_json(data)

    async def release(
        self,
        system_id: str,
        erase: bool | None = None,
        quick_erase: bool | None = None,
        secure_erase: bool | None = None,
        comment: str | None = None,
        *,
        timeout: float | None = None,
    ) -> Machine:
        # None leaves a flag out, and MAAS then takes its global setting for it (enable_disk_erasing_on_release,
        # disk_erase_with_secure_erase, disk_erase_with_quick_erase): a caller that must know which erase runs
        # sends every flag, false included.
        form = {"erase": erase, "quick_erase": quick_erase, "secure_erase": secure_erase, "comment": comment}
        data = await self._call(
            "POST",
            f"machines/{system_id}/",
            op="release",
            operation="release",
            form=form,
            system_id=system_id,
            mutation=True,
            timeout=timeout,
        )
        return Machine.from_json(data)

    async def commission(
        self,
        system_id: str,
        commissioning_scripts: Iterable[str] | None = None,
        testing_scripts: Iterable[str] | None = None,
        enable_ssh: bool | None = None,
        skip_bmc_config: bool | None = None,
        skip_networking: bool | None = None,
        skip_storage: bool | None = None,
        *,
        timeout: float | None = None,
    ) -> Machine:
        form = {
            # MAAS takes script lists comma-separated.
            "commissioning_scripts": ",".join(commissioning_scripts) if commissioning_scripts else None,
            "testing_scripts": ",".join(testing_scripts) if testing_scripts else None,
            "enable_ssh": enable_ssh,
            "skip_bmc_config": skip_bmc_config,
            "skip_networking": skip_networking,
            "skip_storage": skip_storage,
        }
        data = await self._call(
            "POST",
            f"machines/{system_id}/",
            op="commission",
            operation="commission",
            form=form,
            system_id=system_id,
            mutation=True,
            timeout=timeout,
        )
        return Machine.from_json(data)

    async def abort(self, system_id: str, comment: str | None = None, *, timeout: float | None = None) -> Machine:
        data = await self._call(
            "POST",
            f"machines/{system_id}/",
            op="abort",
            operation="abort",
            form={"comment": comment},
            system_id=system_id,
            mutation=True,
            timeout=timeout,
        )
        return Machine.from_json(data)
