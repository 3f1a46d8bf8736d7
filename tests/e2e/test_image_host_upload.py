"""MAAS host image path end to end: the image pipeline builds the rootfs tgz into the directory the MAAS
gateway reads, catalogs it and sends the upload command through its outbox; the gateway uploads it in
chunks to the MAAS simulator; the pipeline records the boot-resource id from the result; a site
profile is switched to custom/<name> and back. MAAS is read through its own API, the file is hashed
here, independently of both services."""

from __future__ import annotations

import hashlib
import shutil
import tarfile
import uuid
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from gpuaas_dev.stack import Stack
from gpuaas_dev.testing.waiting import eventually
from gpuaas_maas_gateway.adapters.maas_client import MaasClient

pytestmark = pytest.mark.e2e

SLUG = "gpuaas-h200-host-ubuntu2404"
PROFILE = "h200-baremetal"  # the gateway's default site profile
BOOTSTRAP_IN_IMAGE = "usr/local/share/gpuaas/site-bootstrap/h200-slice-vm/bootstrap.sh"


def sha256_and_size(path: Path) -> tuple[str, int]:
    h = hashlib.sha256()
    size = 0
    with path.open("rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
            size += len(chunk)
    return h.hexdigest(), size


async def admin(stack: Stack, method: str, path: str, body: Any = None) -> tuple[int, Any]:
    headers = {"Authorization": f"Bearer {stack.image_admin_token}"}
    if method != "GET":
        headers["Idempotency-Key"] = uuid.uuid4().hex
    async with aiohttp.ClientSession() as http:
        async with http.request(method, f"{stack.image_admin_url}{path}", json=body, headers=headers) as resp:
            return resp.status, await resp.json()


def make_rootfs(root: Path) -> Path:
    """A small root tree with enough incompressible bytes that the gateway's 4 MiB chunking takes
    several PUTs."""
    (root / "etc").mkdir(parents=True)
    (root / "etc" / "os-release").write_text('NAME="Ubuntu"\nVERSION_ID="24.04"\n')
    (root / "usr" / "lib" / "gpuaas").mkdir(parents=True)
    (root / "usr" / "lib" / "gpuaas" / "blob.bin").write_bytes(
        b"".join(hashlib.sha256(i.to_bytes(4, "big")).digest() for i in range(300_000))
    )  # ~9.6 MB
    return root


async def wait_result(portal, type_: str, operation_id: str, timeout: float = 60.0) -> dict[str, Any]:
    found = await portal.spy.wait_for(
        lambda: portal.spy.of_type(type_, operation_id=operation_id), timeout, f"{type_} {operation_id}"
    )
    return found[0]["payload"]


async def test_host_image_upload_boot_resource_and_profile_switch(stack: Stack, portal, db, tmp_path: Path) -> None:
    rootfs = make_rootfs(tmp_path / "rootfs")
    bootstrap = tmp_path / "bootstrap.sh"
    bootstrap.write_text("#!/bin/sh\necho site bootstrap\n")
    request = {"rootfs": str(rootfs), "site_bootstrap": str(bootstrap), "title": "GPUaaS H200 Host Ubuntu 24.04"}

    # Selecting an image MAAS does not hold yet is refused before anything reaches the gateway.
    status, body = await admin(stack, "POST", f"/v1/images/{SLUG}/maas-profile", {"profile": PROFILE})
    assert status == 404, body

    status, started = await admin(stack, "POST", f"/v1/images/{SLUG}/host-upload", request)
    assert status == 202, started
    op_id = started["operation_id"]
    assert started["upload_sent"] is True
    assert started["image"]["kind"] == "host" and started["image"]["status"] == "building"
    status, body = await admin(stack, "POST", f"/v1/images/{SLUG}/maas-profile", {"profile": PROFILE})
    assert (status, body["error"]["code"]) == (409, "not_uploaded"), body

    # The gateway's answer, on the bus.
    result = await wait_result(portal, "maas.image_upload_result", op_id)
    assert result["status"] == "succeeded", result
    assert result["name"] == f"custom/{SLUG}"

    async def uploaded() -> dict[str, Any] | None:
        _, image = await admin(stack, "GET", f"/v1/images/{SLUG}")
        return image if image["metadata"]["maas"]["status"] == "uploaded" else None

    image = await eventually(uploaded, timeout=30, what="catalog records the upload")
    maas_meta = image["metadata"]["maas"]
    assert image["status"] == "published" and image["kind"] == "host"
    assert maas_meta["boot_resource_id"] == result["boot_resource_id"]
    assert isinstance(maas_meta["boot_resource_id"], int)
    assert maas_meta["operation_id"] == op_id

    # The file the gateway read: in the shared directory, hashed here on our own.
    tgz = Path(maas_meta["source_path"])
    assert tgz.parent == stack.host_image_dir
    digest, size = sha256_and_size(tgz)
    assert size > 8 << 20  # more than two gateway chunks
    assert (image["digest_sha256"], maas_meta["sha256"], maas_meta["size"]) == (digest, digest, size)
    with tarfile.open(tgz, "r:gz") as tar:
        members = {t.name: t for t in tar.getmembers()}
    assert members["curtin"].isdir()
    assert members[BOOTSTRAP_IN_IMAGE].mode & 0o111
    assert "etc/os-release" in members and "usr/lib/gpuaas/blob.bin" in members

    # What MAAS itself lists, through its API.
    async with MaasClient(stack.maas_url, stack.maas_api_key, timeout=10.0, ca_file=str(stack.maas_ca_file)) as maas:
        listed = [r for r in await maas.list_boot_resources() if r["name"] == SLUG]
        assert [r["id"] for r in listed] == [maas_meta["boot_resource_id"]], listed
        resource = await maas.read_boot_resource(maas_meta["boot_resource_id"])
    assert resource["architecture"] == "amd64/generic" and resource["type"] == "Uploaded"
    assert resource["title"] == request["title"]
    files = [f for s in resource["sets"].values() for f in s["files"].values()]
    assert [(f["sha256"], f["size"], f["complete"], f["filetype"]) for f in files] == [(digest, size, True, "tgz")]

    # A rebuild of the same tree is byte-identical: nothing is uploaded again.
    status, again = await admin(stack, "POST", f"/v1/images/{SLUG}/host-upload", request)
    assert status == 200, again
    assert (again["upload_sent"], again["operation_id"], again["sha256"]) == (False, op_id, digest)

    # Only now the image may be enabled; a host image needs no node prewarm.
    status, enabled = await admin(stack, "POST", f"/v1/images/{SLUG}/enable")
    assert (status, enabled["status"]) == (200, "active"), enabled
    await portal.spy.wait_type("image.activated", slug=SLUG, digest_sha256=digest)

    # Switch the profile to the uploaded image ...
    status, switch = await admin(stack, "POST", f"/v1/images/{SLUG}/maas-profile", {"profile": PROFILE})
    assert status == 202, switch
    assert switch["params"]["distro_series"] == f"custom/{SLUG}"
    result = await wait_result(portal, "maas.profile_image_set_result", switch["operation_id"])
    assert result["status"] == "succeeded", result
    assert result["deploy_distro_series"] == f"custom/{SLUG}"

    async def profile_state(uses: bool) -> dict[str, Any] | None:
        _, img = await admin(stack, "GET", f"/v1/images/{SLUG}")
        state = img["metadata"]["maas"].get("profiles", {}).get(f"default/{PROFILE}")
        return state if state and state["uses_this_image"] is uses else None

    state = await eventually(lambda: profile_state(True), timeout=30, what="profile uses the image")
    assert state["operation_id"] == switch["operation_id"]
    assert (
        await db.fetchval(
            "SELECT distro_series FROM maas_gateway.maas_site_profiles WHERE site = 'default' AND profile = $1", PROFILE
        )
        == SLUG
    )

    # ... and back to the stock image.
    status, back = await admin(
        stack, "POST", f"/v1/images/{SLUG}/maas-profile", {"profile": PROFILE, "distro_series": "noble"}
    )
    assert status == 202, back
    result = await wait_result(portal, "maas.profile_image_set_result", back["operation_id"])
    assert result["status"] == "succeeded", result
    assert (result["deploy_distro_series"], result["previous_distro_series"]) == ("noble", SLUG)
    state = await eventually(lambda: profile_state(False), timeout=30, what="profile back on noble")
    assert state["distro_series"] == "noble"

    _, requests = await admin(stack, "GET", f"/v1/images/{SLUG}/maas-requests")
    assert {(r["operation_id"], r["kind"], r["status"]) for r in requests["requests"]} == {
        (op_id, "upload_image", "succeeded"),
        (switch["operation_id"], "set_distro_series", "succeeded"),
        (back["operation_id"], "set_distro_series", "succeeded"),
    }


async def test_host_upload_refuses_bad_input_and_slice_images(stack: Stack, tmp_path: Path) -> None:
    status, body = await admin(stack, "POST", "/v1/images/some-host/host-upload", {"rootfs": str(tmp_path / "nope")})
    assert (status, body["error"]["code"]) == (422, "rootfs_missing"), body
    status, body = await admin(stack, "POST", "/v1/images/..%2Fescape/host-upload", {"rootfs": str(tmp_path)})
    assert status in (404, 422), body
    # A slice image never goes to MAAS.
    status, body = await admin(
        stack, "POST", "/v1/images/ubuntu-24.04-h200-slice/host-upload", {"rootfs": str(tmp_path)}
    )
    assert (status, body["error"]["code"]) == (409, "not_a_host_image"), body
    # Only a build result may record a boot resource.
    status, body = await admin(
        stack, "PATCH", "/v1/images/ubuntu-24.04-h200-host", {"metadata": {"maas": {"boot_resource_id": 1}}}
    )
    assert (status, body["error"]["code"]) == (422, "protected_metadata"), body


async def test_a_built_host_image_is_uploaded_later_without_its_tree(stack: Stack, portal, tmp_path: Path) -> None:
    """build_only, then upload_only of that tgz through the real gateway to MAAS, with the tree gone meanwhile."""
    slug = "gpuaas-h200-host-reuse"
    rootfs = make_rootfs(tmp_path / "rootfs")
    status, built = await admin(
        stack, "POST", f"/v1/images/{slug}/host-upload", {"mode": "build_only", "rootfs": str(rootfs)}
    )
    assert (status, built["upload_sent"], built["image"]["status"]) == (200, False, "disabled"), built
    _, requests = await admin(stack, "GET", f"/v1/images/{slug}/maas-requests")
    assert requests["requests"] == []  # nothing asked of MAAS
    shutil.rmtree(rootfs)

    status, sent = await admin(stack, "POST", f"/v1/images/{slug}/host-upload", {"mode": "upload_only"})
    assert (status, sent["upload_sent"], sent["sha256"]) == (202, True, built["sha256"]), sent
    result = await wait_result(portal, "maas.image_upload_result", sent["operation_id"])
    assert (result["status"], result["sha256"], result["size"]) == ("succeeded", built["sha256"], built["size"]), result

    async def uploaded() -> dict[str, Any] | None:
        _, image = await admin(stack, "GET", f"/v1/images/{slug}")
        return image if image["metadata"]["maas"]["status"] == "uploaded" else None

    image = await eventually(uploaded, timeout=30, what="catalog records the reused tgz's upload")
    assert (image["status"], image["digest_sha256"]) == ("published", built["sha256"])
    async with MaasClient(stack.maas_url, stack.maas_api_key, timeout=10.0, ca_file=str(stack.maas_ca_file)) as maas:
        resource = await maas.read_boot_resource(image["metadata"]["maas"]["boot_resource_id"])
    files = [f for s in resource["sets"].values() for f in s["files"].values()]
    assert [(f["sha256"], f["size"], f["complete"]) for f in files] == [(built["sha256"], built["size"], True)]
