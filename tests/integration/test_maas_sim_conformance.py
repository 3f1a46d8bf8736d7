"""The simulator speaks MAAS 2.0 well enough for python-libmaas, and its errors match MAAS's.

python-libmaas is sync-over-async and drives its own event loop, so it runs in a worker thread
with a loop of its own while the simulator serves from the test's loop.
"""

from __future__ import annotations

import asyncio
import base64
import json
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import aiohttp
import pytest_asyncio
from oauthlib import oauth1

from gpuaas_dev.maas_sim import SimConfig, start, system_id_for
from gpuaas_dev.maas_sim.control import sim_user_data_headers
from gpuaas_dev.testing.waiting import eventually

KEY = "CK" * 9 + ":" + "TK" * 9 + ":" + "TS" * 16
CK, TK, TS = KEY.split(":")


class Sim:
    def __init__(self, port: int) -> None:
        self.base = f"http://127.0.0.1:{port}"
        self.maas = f"{self.base}/MAAS/"
        self.api = f"{self.base}/MAAS/api/2.0/"


@pytest_asyncio.fixture
async def sim() -> AsyncIterator[Sim]:
    config = SimConfig(
        machines=[
            {"hostname": "bm-01", "tags": ["h200"]},
            {"hostname": "bm-02"},
            {"hostname": "gpu-x", "system_id": "gpux01", "tags": ["h200", "slice"]},
        ],
        api_key=KEY,
    )
    runner, port = await start(config, "127.0.0.1", 0)
    try:
        yield Sim(port)
    finally:
        await runner.cleanup()


@pytest_asyncio.fixture
async def http() -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession() as session:
        yield session


def signed(url: str, method: str = "GET", key: str = KEY) -> dict[str, str]:
    ck, tk, ts = key.split(":")
    client = oauth1.Client(
        ck,
        client_secret="",
        resource_owner_key=tk,
        resource_owner_secret=ts,
        signature_method=oauth1.SIGNATURE_PLAINTEXT,
        realm="OAuth",
    )
    _, headers, _ = client.sign(url, http_method=method)
    return {"Authorization": headers["Authorization"]}


def oauth_header(**overrides: str | None) -> dict[str, str]:
    params: dict[str, str | None] = {
        "oauth_nonce": uuid.uuid4().hex,
        "oauth_timestamp": str(int(time.time())),
        "oauth_version": "1.0",
        "oauth_signature_method": "PLAINTEXT",
        "oauth_consumer_key": CK,
        "oauth_token": TK,
        "oauth_signature": "%26" + TS,
    }
    params.update(overrides)
    items = ", ".join(f'{k}="{v}"' for k, v in params.items() if v is not None)
    return {"Authorization": f'OAuth realm="OAuth", {items}'}


async def sim_machine(http: aiohttp.ClientSession, sim: Sim, system_id: str) -> dict[str, Any]:
    async with http.get(f"{sim.base}/_sim/machines/{system_id}", headers=sim_user_data_headers(KEY)) as r:
        assert r.status == 200
        return await r.json()


async def set_timers(http: aiohttp.ClientSession, sim: Sim, **timers: float) -> None:
    async with http.post(f"{sim.base}/_sim/timers", json=timers) as r:
        assert r.status == 200


# ---- python-libmaas ---------------------------------------------------------------------------------


def in_libmaas_thread(fn: Callable[[], Any]) -> Awaitable[Any]:
    def run() -> Any:
        loop = asyncio.new_event_loop()
        asyncio.set_event_loop(loop)
        try:
            return fn()
        finally:
            asyncio.set_event_loop(None)
            loop.close()

    return asyncio.to_thread(run)


async def test_python_libmaas_lists_reads_deploys_and_releases(sim: Sim, http: aiohttp.ClientSession) -> None:
    from maas.client import connect
    from maas.client.enum import NodeStatus

    await set_timers(http, sim, deploying=0.2, releasing=0.1, disk_erasing=0.1)
    sid = system_id_for("bm-01")

    def connect_list_read() -> tuple[list[tuple[str, str, Any]], tuple[Any, ...]]:
        client = connect(sim.maas, apikey=KEY)
        listed = [(m.hostname, m.system_id, m.status) for m in client.machines.list()]
        m = client.machines.get(system_id=sid)
        return listed, (m.hostname, m.status, m.status_name, m.power_state.value, list(m.ip_addresses))

    listed, read = await in_libmaas_thread(connect_list_read)
    assert listed == [
        ("bm-01", sid, NodeStatus.READY),
        ("bm-02", system_id_for("bm-02"), NodeStatus.READY),
        ("gpu-x", "gpux01", NodeStatus.READY),
    ]
    assert read[:4] == ("bm-01", NodeStatus.READY, "Ready", "off")
    assert read[4][0].startswith("127.")

    def deploy() -> tuple[Any, str, str]:
        client = connect(sim.maas, apikey=KEY)
        m = client.machines.get(system_id=sid)
        m.deploy(distro_series="custom/gpuaas-h200-host-ubuntu2404", user_data=b"#cloud-config\nruncmd: [echo enrol]\n")
        return m.status, m.osystem, m.distro_series

    assert await in_libmaas_thread(deploy) == (NodeStatus.DEPLOYING, "custom", "gpuaas-h200-host-ubuntu2404")
    state = await sim_machine(http, sim, sid)
    assert state["_sim"]["last_deploy"]["user_data"] == "#cloud-config\nruncmd: [echo enrol]\n"
    # The user-data (in a deploy of ours: the host's bus creds and enrolment token) only with the simulator's key.
    for headers in ({}, {"Authorization": "Bearer " + KEY[:-1] + "x"}, {"Authorization": KEY}):
        for path in (f"/_sim/machines/{sid}", "/_sim/machines"):
            async with http.get(f"{sim.base}{path}", headers=headers) as r:
                body = await r.json()
            (shown,) = [m for m in body.get("machines", [body]) if m["system_id"] == sid]
            last = shown["_sim"]["last_deploy"]
            assert (last["user_data"], last["user_data_b64"]) == (None, None) and last["user_data_withheld"], headers
            assert "enrol" not in json.dumps(body)

    async def deployed() -> bool:
        return (await sim_machine(http, sim, sid))["status_name"] == "Deployed"

    await eventually(deployed)

    def release() -> Any:
        client = connect(sim.maas, apikey=KEY)
        m = client.machines.get(system_id=sid)
        m.release(erase=True, quick_erase=True)
        return m.status

    assert await in_libmaas_thread(release) == NodeStatus.DISK_ERASING

    async def ready() -> bool:
        return (await sim_machine(http, sim, sid))["status_name"] == "Ready"

    await eventually(ready)


async def test_a_release_takes_each_flag_it_is_not_given_from_the_regions_settings(
    sim: Sim, http: aiohttp.ClientSession
) -> None:
    """As MAAS: python-libmaas sets the region's erase settings, and a release that leaves a flag out runs what
    they say (here a quick erase), while one that sends every flag runs what it asked (the full overwrite)."""
    from maas.client import connect

    def configure() -> tuple[Any, Any]:
        client = connect(sim.maas, apikey=KEY)
        client.maas.set_config("enable_disk_erasing_on_release", True)
        client.maas.set_config("disk_erase_with_quick_erase", True)
        return client.maas.get_config("disk_erase_with_quick_erase"), client.maas.get_config(
            "disk_erase_with_secure_erase"
        )

    assert await in_libmaas_thread(configure) == (True, False)
    alloc = sim.api + "machines/?op=allocate"
    ran = {}
    for hostname, form in (
        ("bm-01", {}),
        ("bm-02", {"erase": "true", "quick_erase": "false", "secure_erase": "false"}),
    ):
        sid = system_id_for(hostname)
        async with http.post(alloc, headers=signed(alloc, "POST"), data={"system_id": sid}) as r:
            assert r.status == 200
        url = sim.api + f"machines/{sid}/?op=release"
        async with http.post(url, headers=signed(url, "POST"), data=form) as r:
            assert r.status == 200 and (await r.json())["status_name"] == "Disk erasing"
        ran[hostname] = (await sim_machine(http, sim, sid))["_sim"]["last_release"]["erase_mode"]
    assert ran == {"bm-01": "quick", "bm-02": "full"}

    url = sim.api + "maas/?op=set_config"
    async with http.post(url, headers=signed(url, "POST"), data={"name": "disk_erase_with_quick_erase"}) as r:
        assert r.status == 400, await r.text()


# ---- raw HTTP ---------------------------------------------------------------------------------------


async def test_anonymous_version_and_describe(sim: Sim, http: aiohttp.ClientSession) -> None:
    async with http.get(sim.api + "version/") as r:
        assert r.status == 200
        assert r.headers["Content-Type"] == "application/json; charset=utf-8"
        assert r.headers["X-MAAS-API-Hash"]
        body = await r.json()
        assert body["version"].startswith("3.5") and "capabilities" in body
    async with http.get(sim.api + "describe/") as r:
        assert r.headers["Content-Type"] == "application/json"
        doc = await r.json()
    by_name = {res["name"]: res for res in doc["resources"]}
    machine = by_name["MachineHandler"]["auth"]
    assert machine["uri"] == sim.api + "machines/{system_id}/"
    assert machine["params"] == ["system_id"]
    assert {"name": "deploy", "method": "POST", "op": "deploy", "restful": False} in [
        {k: a[k] for k in ("name", "method", "op", "restful")} for a in machine["actions"]
    ]
    assert by_name["VersionHandler"]["anon"] is not None


async def test_bad_key_is_401_with_realm(sim: Sim, http: aiohttp.ClientSession) -> None:
    async with http.get(sim.api + "machines/", headers=oauth_header(oauth_consumer_key="nope")) as r:
        assert r.status == 401
        assert await r.text() == "Authorization Error: Invalid API key."
        assert r.headers["WWW-Authenticate"] == 'OAuth realm="OAuth"'
        assert r.headers["X-MAAS-API-Hash"]
    async with http.get(sim.api + "machines/", headers=oauth_header(oauth_token="badtoken")) as r:
        assert r.status == 401
        assert await r.text() == "Authorization Error: 'Invalid access token: badtoken'"
    async with http.get(sim.api + "machines/", headers=oauth_header(oauth_signature="%26wrong")) as r:
        assert r.status == 401


async def test_missing_oauth_param_is_400(sim: Sim, http: aiohttp.ClientSession) -> None:
    async with http.get(sim.api + "machines/", headers=oauth_header(oauth_nonce=None)) as r:
        assert r.status == 400
        body = await r.text()
        assert body.startswith("Bad Request: ") and "oauth_nonce" in body


async def test_old_timestamp_and_reused_nonce_are_rejected(sim: Sim, http: aiohttp.ClientSession) -> None:
    stale = oauth_header(oauth_timestamp=str(int(time.time()) - 301))
    async with http.get(sim.api + "machines/", headers=stale) as r:
        assert r.status == 401
        assert "Expired timestamp" in await r.text()
    headers = signed(sim.api + "machines/")
    async with http.get(sim.api + "machines/", headers=headers) as r:
        assert r.status == 200
    async with http.get(sim.api + "machines/", headers=headers) as r:
        assert r.status == 401
        assert "Nonce already used" in await r.text()
        assert r.headers["WWW-Authenticate"] == 'OAuth realm="OAuth"'


async def test_unknown_machine_and_unknown_endpoint_are_404(sim: Sim, http: aiohttp.ClientSession) -> None:
    url = sim.api + "machines/zzzzzz/"
    async with http.get(url, headers=signed(url)) as r:
        assert r.status == 404
        assert r.content_type == "text/plain"
        assert await r.text() == "No Machine matches the given query."
    url = sim.api + "machines"  # no trailing slash
    async with http.get(url, headers=signed(url)) as r:
        assert r.status == 404
        assert await r.text() == "Unknown API endpoint: /MAAS/api/2.0/machines."
        assert r.headers["X-MAAS-API-Hash"]


async def test_wrong_op_is_400_unrecognised_signature(sim: Sim, http: aiohttp.ClientSession) -> None:
    url = sim.api + "machines/?op=foo"
    async with http.post(url, headers=signed(url, "POST"), data={}) as r:
        assert r.status == 400
        assert await r.text() == "Unrecognised signature: method=POST op=foo"


async def test_deploy_in_deployed_is_409(sim: Sim, http: aiohttp.ClientSession) -> None:
    await set_timers(http, sim, deploying=0.05)
    url = sim.api + "machines/gpux01/?op=deploy"
    form = {"distro_series": "noble", "user_data": base64.b64encode(b"#!/bin/sh\n").decode()}
    async with http.post(url, headers=signed(url, "POST"), data=form) as r:
        assert r.status == 200
        assert (await r.json())["status_name"] == "Deploying"

    async def deployed() -> bool:
        return (await sim_machine(http, sim, "gpux01"))["status_name"] == "Deployed"

    await eventually(deployed)
    async with http.post(url, headers=signed(url, "POST"), data=form) as r:
        assert r.status == 409
        assert await r.text() == "Can't deploy a machine that is in the 'Deployed' state"


async def test_unknown_distro_series_is_400_json(sim: Sim, http: aiohttp.ClientSession) -> None:
    url = sim.api + "machines/gpux01/?op=deploy"
    async with http.post(url, headers=signed(url, "POST"), data={"distro_series": "plan9"}) as r:
        assert r.status == 400
        body = await r.json()
        assert body["distro_series"][0].startswith("'plan9' is not a valid")


async def test_op_in_body_and_multipart_base64_parts(sim: Sim, http: aiohttp.ClientSession) -> None:
    # python-libmaas style: every part base64-encoded; op may also travel in the body.
    with aiohttp.MultipartWriter("form-data") as mp:
        for name, value in (("op", "release"), ("erase", "true")):
            part = mp.append(base64.b64encode(value.encode()).decode())
            part.set_content_disposition("form-data", name=name)
            part.headers["Content-Transfer-Encoding"] = "base64"
    sid = system_id_for("bm-02")
    alloc = sim.api + "machines/?op=allocate"
    async with http.post(alloc, headers=signed(alloc, "POST"), data={"system_id": sid}) as r:
        assert r.status == 200 and (await r.json())["status_name"] == "Allocated"
    url = sim.api + f"machines/{sid}/"
    async with http.post(url, headers=signed(url, "POST"), data=mp) as r:
        assert r.status == 200
        assert (await r.json())["status_name"] == "Disk erasing"


async def test_list_filters_repeat_and_combine(sim: Sim, http: aiohttp.ClientSession) -> None:
    async def names(query: str) -> tuple[int, Any]:
        url = sim.api + "machines/" + query
        async with http.get(url, headers=signed(url)) as r:
            body = await r.json()
            return r.status, sorted(m["hostname"] for m in body) if r.status == 200 else body

    assert await names("?hostname=bm-01&hostname=gpu-x") == (200, ["bm-01", "gpu-x"])
    assert await names("?tags=h200&tags=slice") == (200, ["gpu-x"])
    assert await names("?id=gpux01") == (200, ["gpu-x"])
    assert await names("?status=ready&hostname=bm-02") == (200, ["bm-02"])
    assert await names("?status=deployed") == (200, [])
    assert await names("?tags=nope") == (400, {"tags": ["No such tag(s): 'nope'."]})
    alloc = sim.api + "machines/?op=allocate"
    async with http.post(alloc, headers=signed(alloc, "POST"), data={"tags": "h200", "agent_name": "agent-7"}) as r:
        assert r.status == 200
        assert (await r.json())["hostname"] == "bm-01"  # first Ready match by hostname
    assert await names("?agent_name=agent-7") == (200, ["bm-01"])
    for expected in (200, 409):
        async with http.post(alloc, headers=signed(alloc, "POST"), data={"system_id": "gpux01"}) as r:
            assert r.status == expected
            text = await r.text()
    assert text == "No machine with system ID gpux01 available."


async def test_tags_create_and_update_nodes(sim: Sim, http: aiohttp.ClientSession) -> None:
    url = sim.api + "tags/"
    async with http.post(url, headers=signed(url, "POST"), data={"name": "gpuaas-profile-bm"}) as r:
        assert r.status == 200
        body = await r.json()
        assert body["name"] == "gpuaas-profile-bm"
        assert set(body) >= {"name", "definition", "comment", "kernel_opts", "resource_uri"}
    async with http.post(url, headers=signed(url, "POST"), data={"name": "bad name!"}) as r:
        assert r.status == 400
    upd = sim.api + "tags/gpuaas-profile-bm/?op=update_nodes"
    sids = [system_id_for("bm-01"), system_id_for("bm-02")]
    form = [("add", sids[0]), ("add", sids[1]), ("remove", "gpux01")]
    async with http.post(upd, headers=signed(upd, "POST"), data=form) as r:
        assert await r.json() == {"added": 2, "removed": 0}
    async with http.post(upd, headers=signed(upd, "POST"), data=[("remove", sids[1])]) as r:
        assert await r.json() == {"added": 0, "removed": 1}
    assert (await sim_machine(http, sim, sids[0]))["tag_names"] == ["gpuaas-profile-bm", "h200"]


# ---- boot resources and scripts ----------------------------------------------------------------------


async def test_python_libmaas_uploads_a_boot_resource_in_chunks(sim: Sim, http: aiohttp.ClientSession) -> None:
    import hashlib
    import io

    from maas.client import connect

    content = bytes(range(256)) * 40_000  # ~10 MiB: three 4 MiB chunks
    digest = hashlib.sha256(content).hexdigest()

    def upload() -> tuple[Any, ...]:
        client = connect(sim.maas, apikey=KEY)
        resource = client.boot_resources.create(
            "custom/gpuaas-h200-host-ubuntu2404",
            "amd64/generic",
            io.BytesIO(content),
            title="GPUaaS H200 Host Ubuntu 24.04",
        )
        files = [f for s in resource.sets.values() for f in s.files.values()]
        listed = [(r.id, r.name, r.type) for r in client.boot_resources.list()]
        again = client.boot_resources.create(  # same bytes again: MAAS has them, nothing to upload
            "custom/gpuaas-h200-host-ubuntu2404", "amd64/generic", io.BytesIO(content)
        )
        return resource.id, resource.name, [(f.sha256, f.size, f.complete) for f in files], listed, again.id

    rid, name, files, listed, again = await in_libmaas_thread(upload)
    assert name == "gpuaas-h200-host-ubuntu2404"
    assert files == [(digest, len(content), True)]
    assert listed == [(rid, "gpuaas-h200-host-ubuntu2404", "Uploaded")]
    assert again == rid
    # Once uploaded it can be deployed by its bare name or as custom/<name>.
    url = sim.api + "machines/gpux01/?op=deploy"
    async with http.post(url, headers=signed(url, "POST"), data={"distro_series": "gpuaas-h200-host-ubuntu2404"}) as r:
        assert r.status == 200
        assert ((await r.json())["osystem"], (await r.json())["distro_series"]) == (
            "custom",
            "gpuaas-h200-host-ubuntu2404",
        )


async def test_boot_resource_upload_errors(sim: Sim, http: aiohttp.ClientSession) -> None:
    import hashlib

    async def post(data: Any) -> tuple[int, Any]:
        url = sim.api + "boot-resources/"
        async with http.post(url, headers=signed(url, "POST"), data=data) as r:
            return r.status, (await r.json() if r.content_type == "application/json" else await r.text())

    async def put(uri: str, body: bytes | None) -> tuple[int, str]:
        url = sim.base + uri
        headers = {**signed(url, "PUT"), "Content-Type": "application/octet-stream"}
        async with http.put(url, headers=headers, data=body) as r:
            return r.status, await r.text()

    status, body = await post({"name": "custom/x", "architecture": "amd64/generic"})
    assert status == 400 and body == {"sha256": ["This field is required."], "size": ["This field is required."]}
    data = b"host image bytes" * 1000
    good = hashlib.sha256(data).hexdigest()
    status, created = await post(
        {
            "name": "custom/img",
            "architecture": "amd64/generic",
            "sha256": good,
            "size": str(len(data)),
            "filetype": "tgz",
            "base_image": "ubuntu/noble",
        }
    )
    assert status == 201
    (rfile,) = next(iter(created["sets"].values()))["files"].values()
    assert rfile["complete"] is False and rfile["filename"] == "root-tgz" and rfile["progress"] == 0.0
    uri = rfile["upload_uri"]
    assert await put(uri, None) == (400, "Missing data.")
    assert await put(uri, data + b"x") == (400, "Too much data received.")
    assert await put(uri, data[:8000]) == (200, "OK")
    async with http.get(sim.base + created["resource_uri"], headers=signed(sim.base + created["resource_uri"])) as r:
        (rfile,) = next(iter((await r.json())["sets"].values()))["files"].values()
        assert rfile["progress"] == 50.0
    assert await put(uri, data[8000:]) == (200, "OK")
    assert await put(uri, data[:10]) == (400, "Cannot upload to a complete file.")
    # Bytes that do not hash to the announced sha256 are refused once the file is full.
    status, bad = await post({"name": "custom/bad", "architecture": "amd64/generic", "sha256": "0" * 64, "size": "4"})
    (bad_file,) = next(iter(bad["sets"].values()))["files"].values()
    assert await put(bad_file["upload_uri"], b"abcd") == (400, "Saved content does not match given SHA256 value.")
    # Multipart `content` in one go (as the MAAS CLI sends `content@=file`).
    with aiohttp.MultipartWriter("form-data") as mp:
        for field, value in (("name", b"custom/whole"), ("architecture", b"amd64/generic"), ("content", data)):
            part = mp.append(base64.b64encode(value).decode())
            part.set_content_disposition("form-data", name=field)
            part.headers["Content-Transfer-Encoding"] = "base64"
    status, whole = await post(mp)
    assert status == 201
    (wfile,) = next(iter(whole["sets"].values()))["files"].values()
    assert (wfile["complete"], wfile["sha256"], wfile["size"]) == (True, good, len(data))
    url = sim.api + "boot-resources/999/"
    async with http.get(url, headers=signed(url)) as r:
        assert r.status == 404 and await r.text() == "No BootResource matches the given query."


async def test_scripts_create_and_commission_with_them(sim: Sim, http: aiohttp.ClientSession) -> None:
    url = sim.api + "scripts/"
    form = {"name": "gpuaas-fw", "script": "#!/bin/sh\necho fw\n", "type": "commissioning"}
    async with http.post(url, headers=signed(url, "POST"), data=form) as r:
        assert r.status == 200
        body = await r.json()
        assert (body["name"], body["type_name"]) == ("gpuaas-fw", "commissioning")
    async with http.post(url, headers=signed(url, "POST"), data=form) as r:
        assert r.status == 400 and await r.json() == {"name": ["Script with this Name already exists."]}
    async with http.post(url, headers=signed(url, "POST"), data={**form, "name": "x", "script": "echo"}) as r:
        assert r.status == 400 and await r.json() == {"script": ["Must start with shebang."]}
    comm = sim.api + "machines/gpux01/?op=commission"
    async with http.post(comm, headers=signed(comm, "POST"), data={"commissioning_scripts": "nope"}) as r:
        assert r.status == 400 and "nope" in (await r.json())["commissioning_scripts"][0]
    async with http.post(
        comm, headers=signed(comm, "POST"), data={"commissioning_scripts": "gpuaas-fw,update_firmware"}
    ) as r:
        assert r.status == 200
        body = await r.json()
        assert body["status_name"] == "Commissioning" and body["current_commissioning_result_id"] == 1


async def test_python_libmaas_reads_commissioning_results_with_base64_output(
    sim: Sim, http: aiohttp.ClientSession
) -> None:
    """python-libmaas has no viscera object for results: bones exposes `NodeScriptResults.read`."""
    from maas.client import bones

    await set_timers(http, sim, commissioning=0.1, testing=0.1)
    url = sim.api + "scripts/"
    form = {"name": "50-gpuaas-slice-firmware-preflight", "script": "#!/bin/bash\necho x\n", "type": "commissioning"}
    async with http.post(url, headers=signed(url, "POST"), data=form) as r:
        assert r.status == 200
    comm = sim.api + "machines/gpux01/?op=commission"
    async with http.post(comm, headers=signed(comm, "POST"), data={}) as r:
        assert r.status == 200
        set_id = (await r.json())["current_commissioning_result_id"]

    async def ready() -> bool:
        return (await sim_machine(http, sim, "gpux01"))["status_name"] == "Ready"

    await eventually(ready)

    def read() -> Any:
        async def go() -> Any:
            session = await bones.SessionAPI.fromURL(sim.maas + "api/2.0/", credentials=tuple(KEY.split(":")))
            return await session.NodeScriptResults.read(system_id="gpux01", type="commissioning", include_output="1")

        return asyncio.get_event_loop().run_until_complete(go())

    sets = await in_libmaas_thread(read)
    assert [s["id"] for s in sets] == [set_id]
    results = {r["name"]: r for r in sets[0]["results"]}
    preflight = results["50-gpuaas-slice-firmware-preflight"]
    assert preflight["status_name"] == "Passed" and preflight["exit_status"] == 0
    text = base64.b64decode(preflight["stdout"]).decode()
    assert "GPUAAS_SLICE_PREFLIGHT status=PASS check=kvm" in text
    assert set(preflight) >= {
        "id",
        "created",
        "updated",
        "started",
        "ended",
        "runtime",
        "starttime",
        "endtime",
        "estimated_runtime",
        "parameters",
        "script_id",
        "script_revision_id",
        "suppressed",
        "output",
        "stdout",
        "stderr",
        "result",
    }
    assert set(sets[0]) >= {
        "id",
        "system_id",
        "type",
        "type_name",
        "last_ping",
        "status",
        "status_name",
        "started",
        "ended",
        "runtime",
        "resource_uri",
        "results",
    }
    assert [r["name"] for r in sets[0]["results"]] == sorted(results)
