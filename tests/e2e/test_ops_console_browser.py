"""The ops console in a real headless browser (Debian's chromium driven by Selenium through chromedriver),
against the dev stack's processes: signed in by the login link minted from the ops identity, it watches an
allocation made over the bus appear and change state on the page with no reload, shows the why-not of an
unschedulable one, shows a dead letter arrive, and drains a node from the fleet page through the scheduler's
admin API (the scheduler's node and its audit row name the console's user and request, and the audit page shows
the record ops-view read off the bus: who, what, why, which request) and undrains it. On the host's page it asks
for a waiver without reason or expiry (the scheduler's refusal shown, no waiver) and with both (listed there),
disables a free slot, repairs it and approves its candidate again; on the quotas & wipe page it sets a tenant's
quota (a quota that is no number is refused in the API's words, the quota unchanged) and the site's wipe policy;
the audit page then lists each of those requests under the console's user. It force-releases an active
allocation from its page, which then turns failed there. Without a link the browser sees only the refusal.

Screenshots of every page are written as test artifacts, one PNG per page (`fleet.png`, `allocations.png`,
`allocation.png`, `unschedulable.png`, `images.png`, `maas.png`, `dead-letters.png`, `usage.png`,
`fleet-drained.png`, `host.png`, `audit.png`, `host-acted.png`, `policies.png`, `audit-actions.png`,
`force-released.png`, `refused.png`), to the directory
`$GPUAAS_CONSOLE_SCREENSHOTS` names, or else to the test's pytest tmp path under `screenshots/` (printed at the
end of the test; `pytest -s` shows it)."""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import uuid
from collections.abc import Callable, Iterator
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from selenium import webdriver
from selenium.common.exceptions import NoSuchElementException, StaleElementReferenceException, TimeoutException
from selenium.webdriver.chrome.service import Service
from selenium.webdriver.common.by import By
from selenium.webdriver.remote.webdriver import WebDriver
from selenium.webdriver.support.ui import Select, WebDriverWait

from gpuaas_common.admin_http import login_link

pytestmark = pytest.mark.e2e

WAIT_S = 90.0
# Set by the test once a page has loaded; a reload would lose it.
MARK = "window.__consoleMark"


@pytest.fixture(scope="module")
def browser() -> Iterator[WebDriver]:
    chromium, driver = shutil.which("chromium"), shutil.which("chromedriver")
    assert chromium and driver, "Debian's chromium and chromium-driver are missing: run `make setup`"
    options = webdriver.ChromeOptions()
    options.binary_location = chromium
    for arg in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--window-size=1500,1000"):
        options.add_argument(arg)
    # The driver named here: Selenium neither looks for nor downloads another.
    b = webdriver.Chrome(options=options, service=Service(executable_path=driver))
    yield b
    b.quit()


@pytest.fixture
def shots(tmp_path: Path) -> Path:
    where = Path(os.environ.get("GPUAAS_CONSOLE_SCREENSHOTS") or tmp_path / "screenshots")
    where.mkdir(parents=True, exist_ok=True)
    return where


def _until(b: WebDriver, what: str, check: Callable[[WebDriver], Any], timeout: float = WAIT_S) -> Any:
    """An explicit wait on the page; an element replaced by a live refresh while it was read is read again. A
    timeout says what the page showed."""
    wait = WebDriverWait(b, timeout, ignored_exceptions=(NoSuchElementException, StaleElementReferenceException))
    try:
        return wait.until(check)
    except TimeoutException:
        raise AssertionError(f"waited {timeout:.0f}s for {what}; {b.current_url} shows:\n{_shown(b)}") from None


def _shown(b: WebDriver) -> str:
    found = b.find_elements(By.TAG_NAME, "main") or b.find_elements(By.TAG_NAME, "body")
    return found[0].text[:3000] if found else b.page_source[:3000]


def _text(b: WebDriver, what: str, by: str, value: str) -> str:
    """An element's text, read inside the wait: the page's live part may be replaced between finding and reading."""
    return _until(b, what, lambda d: d.find_element(by, value).text or False)


def _click(b: WebDriver, what: str, by: str, value: str) -> None:
    _until(b, what, lambda d: d.find_element(by, value).click() or True)


def _fill(b: WebDriver, values: dict[str, str]) -> None:
    """Type into the form's fields by id, each cleared first (a page shown again after a refusal keeps nothing)."""
    for field_id, value in values.items():
        el = b.find_element(By.ID, field_id)
        el.clear()
        el.send_keys(value)


def _select(b: WebDriver, field_id: str, value: str) -> None:
    Select(b.find_element(By.ID, field_id)).select_by_value(value)


def _live(b: WebDriver) -> None:
    body = b.find_element(By.TAG_NAME, "body")
    _until(b, "the page's event stream", lambda _d: body.get_attribute("data-live") == "on")


def _row_state(b: WebDriver, alloc: uuid.UUID) -> str | None:
    rows = b.find_elements(By.CSS_SELECTOR, f'tr[data-allocation="{alloc}"]')
    return rows[0].get_attribute("data-state") if rows else None


async def _browse(fn: Callable[..., Any], *args: Any) -> Any:
    # The WebDriver calls block; the portal and the stack's bus clients share this test's event loop.
    return await asyncio.to_thread(fn, *args)


async def _scheduler(stack, method: str, path: str, **kw: Any) -> Any:
    headers = {"Authorization": f"Bearer {stack.admin_token('scheduler')}", **kw.pop("headers", {})}
    async with aiohttp.ClientSession() as http:
        async with http.request(method, f"{stack.admin_url('scheduler')}{path}", headers=headers, **kw) as resp:
            body = await resp.json()
            assert resp.status < 400, body
            return body


async def test_the_console_follows_the_fleet_live_and_drains_a_node(stack, portal, db, browser, shots) -> None:
    b, url = browser, stack.admin_url("ops-view")
    # Signed in with ops-admin rights: it drains (through the scheduler, as the console's principal for this person).
    link = login_link(url, stack.principal_secret("console_login_secret"), "ops-admin", "console-e2e")

    # Signed in by the link: the session cookie, then the fleet.
    await _browse(b.get, link)
    await _browse(_until, b, "the fleet page", lambda d: d.current_url.endswith("/console/fleet"))
    await _browse(_until, b, "the hosts", lambda d: len(d.find_elements(By.CSS_SELECTOR, "#hosts tr[data-node]")) > 0)
    assert (await _browse(b.find_element, By.ID, "actor")).text == "console-e2e"
    await _browse(b.save_screenshot, str(shots / "fleet.png"))

    # An allocation over the bus appears on the open allocations page and changes state there, with no reload.
    tenant = f"console-{uuid.uuid4().hex[:8]}"
    await _browse(b.get, f"{url}/console/allocations?tenant={tenant}")
    await _browse(_live, b)
    await _browse(b.execute_script, f"{MARK} = 'loaded once';")
    alloc = await portal.request("gpu_slice", gpus=1, tenant_id=tenant)
    await _browse(_until, b, "the allocation on the page", lambda d: _row_state(d, alloc) is not None)
    await _browse(_until, b, "the allocation active", lambda d: _row_state(d, alloc) == "active")
    await _browse(b.save_screenshot, str(shots / "allocations.png"))
    await portal.release(alloc)
    await _browse(_until, b, "the allocation released", lambda d: _row_state(d, alloc) == "released")
    assert await _browse(b.execute_script, f"return {MARK};") == "loaded once", "the page was reloaded"
    assert int(await _browse(lambda: b.find_element(By.TAG_NAME, "body").get_attribute("data-refreshed"))) >= 2

    # Its detail: the timeline from accepted to released, its claim released.
    await _browse(_click, b, "the allocation's link", By.CSS_SELECTOR, f'tr[data-allocation="{alloc}"] a')
    timeline = await _browse(_text, b, "the timeline", By.ID, "timeline")
    for state in ("accepted", "placed", "provisioning", "active", "releasing", "released"):
        assert state in timeline, timeline
    assert "(whole node)" not in await _browse(_text, b, "the claims", By.ID, "claims")
    await _browse(b.save_screenshot, str(shots / "allocation.png"))

    # An allocation nothing can hold: unschedulable on the page, its why-not on its detail.
    nowhere = await portal.request("gpu_slice", gpus=1, tenant_id=tenant, region="nowhere")
    await portal.wait_state(nowhere, "unschedulable")
    await _browse(b.get, f"{url}/console/allocations?tenant={tenant}")
    await _browse(_until, b, "the unschedulable one", lambda d: _row_state(d, nowhere) == "unschedulable")
    await _browse(b.get, f"{url}/console/allocations/{nowhere}")
    why = await _browse(_text, b, "its why-not", By.ID, "why-not")
    assert json.loads(why), why
    await _browse(b.save_screenshot, str(shots / "unschedulable.png"))

    # A message nobody can read is dead-lettered by its consumer; it arrives on the open page.
    await _browse(b.get, f"{url}/console/dead-letters")
    await _browse(_live, b)
    before = len(await _browse(b.find_elements, By.CSS_SELECTOR, "tr[data-dlq-seq]"))
    await portal.publish_raw(b"{not json at all")
    await _browse(
        _until, b, "the dead letter", lambda d: len(d.find_elements(By.CSS_SELECTOR, "tr[data-dlq-seq]")) > before
    )
    await _browse(b.save_screenshot, str(shots / "dead-letters.png"))

    for page, element in (("images", "images"), ("maas", "maas"), ("usage", "usage")):
        await _browse(b.get, f"{url}/console/{page}")
        await _browse(_until, b, f"the {page} page", lambda d, e=element: d.find_element(By.ID, e))
        await _browse(b.save_screenshot, str(shots / f"{page}.png"))
    assert tenant in await _browse(_text, b, "the usage records", By.ID, "usage")  # the released allocation's

    # Drain a slice host from the fleet page: the scheduler drains it, the fleet shows it.
    nodes = (await _scheduler(stack, "GET", "/v1/nodes"))["nodes"]
    node = next(n["node_id"] for n in nodes if n["kind"] == "slice_host" and not n["draining"])
    await _browse(b.get, f"{url}/console/fleet")
    await _browse(b.find_element(By.ID, "node-id").send_keys, node)
    await _browse(b.find_element(By.ID, "node-reason").send_keys, "console e2e: PSU swap")
    await _browse(b.find_element(By.ID, "drain-submit").click)
    await _browse(_until, b, "the drain's notice", lambda d: node in d.find_element(By.ID, "notice").text)
    await _browse(
        _until,
        b,
        "the node drained in the fleet",
        lambda d: d.find_element(By.CSS_SELECTOR, f'tr[data-node="{node}"]').get_attribute("data-drained") == "yes",
    )
    await _browse(b.save_screenshot, str(shots / "fleet-drained.png"))
    # Its page: the slots the streams described (those placements named) and the scheduler's mode, drained.
    await _browse(b.get, f"{url}/console/fleet/{node}")
    await _browse(_until, b, "its slots", lambda d: d.find_elements(By.CSS_SELECTOR, "#slots tr[data-slot]"))
    assert "drained" in await _browse(_text, b, "its mode", By.ID, "mode")
    await _browse(b.save_screenshot, str(shots / "host.png"))
    detail = await _scheduler(stack, "GET", f"/v1/nodes/{node}")
    assert detail["node"]["draining"] is True
    audit = await db.fetch(
        "SELECT actor, request_id, idempotency_key, status FROM scheduler.admin_requests WHERE path = $1",
        f"/v1/nodes/{node}/drain",
    )
    assert [(r["actor"], r["status"]) for r in audit] == [("console-e2e", 200)], audit
    assert audit[0]["idempotency_key"] and audit[0]["request_id"]
    # The same record reaches ops-view over the bus: the audit page shows who, what, why and which request.
    await _browse(b.get, f"{url}/console/audit?actor=console-e2e")
    row = f'tr[data-request="{audit[0]["request_id"]}"]'
    shown = await _browse(_text, b, "the drain's audit record", By.CSS_SELECTOR, row)
    assert f"/v1/nodes/{node}/drain" in shown and "console e2e: PSU swap" in shown and "200" in shown, shown
    await _browse(b.save_screenshot, str(shots / "audit.png"))

    # Undrained from the same form: schedulable again, in the fleet and in the scheduler.
    await _browse(b.get, f"{url}/console/fleet")
    await _browse(b.find_element(By.ID, "node-id").send_keys, node)
    await _browse(b.find_element(By.ID, "node-reason").send_keys, "console e2e: PSU replaced")
    await _browse(b.find_element(By.ID, "undrain-submit").click)
    await _browse(
        _until,
        b,
        "the node schedulable again",
        lambda d: d.find_element(By.CSS_SELECTOR, f'tr[data-node="{node}"]').get_attribute("data-drained") == "no",
    )
    assert (await _scheduler(stack, "GET", f"/v1/nodes/{node}"))["node"]["draining"] is False

    # The host's own forms. A waiver without reason or expiry is the scheduler's refusal, in its words, and no
    # waiver; with both it is listed on the page.
    await _browse(b.get, f"{url}/console/fleet/{node}")
    await _browse(_until, b, "its slots", lambda d: d.find_elements(By.CSS_SELECTOR, "#slots tr[data-slot]"))
    waivers = len(await _browse(b.find_elements, By.CSS_SELECTOR, "#waivers tr[data-waiver]"))
    await _browse(_click, b, "the host's forms", By.CSS_SELECTOR, "#host-actions summary")
    await _browse(_click, b, "the waiver's button", By.ID, "waiver-submit")
    refused = await _browse(_text, b, "the waiver's refusal", By.ID, "action-error")
    assert "waiver_refused" in refused and "reason" in refused and "expires_at" in refused, refused
    assert len(await _browse(b.find_elements, By.CSS_SELECTOR, "#waivers tr[data-waiver]")) == waivers
    until = (datetime.now(timezone.utc) + timedelta(days=1)).strftime("%Y-%m-%dT%H:%M:%SZ")
    await _browse(_fill, b, {"waiver-reason": "console e2e: parity probe flaky", "waiver-expires": until})
    await _browse(_click, b, "the waiver's button", By.ID, "waiver-submit")
    await _browse(_until, b, "the waiver's notice", lambda d: "waiver done" in d.find_element(By.ID, "notice").text)
    listed = await _browse(_text, b, "the waivers", By.ID, "waivers")
    assert "console e2e: parity probe flaky" in listed and "console-e2e" in listed, listed
    assert len([w for w in (await _scheduler(stack, "GET", f"/v1/nodes/{node}"))["waivers"] if w["active"]]) >= 1

    # A free slot disabled, repaired, and its candidate approved again, each from the page.
    free = [
        s for s in (await _scheduler(stack, "GET", f"/v1/nodes/{node}/slots"))["slots"] if s["status"] == "available"
    ]
    slot = free[0]["slot_id"]
    for action, status in (("disable", "disabled"), ("repair", "available")):
        await _browse(_select, b, "slot-id", slot)
        await _browse(_fill, b, {"slot-reason": f"console e2e: {action}"})
        await _browse(_click, b, f"the {action} button", By.ID, f"{action}-submit")
        await _browse(
            _until, b, f"the {action}'s notice", lambda d, a=action: f"{a} done" in d.find_element(By.ID, "notice").text
        )
        assert f"is {status}" in await _browse(_text, b, "the notice", By.ID, "notice")
        assert (await _scheduler(stack, "GET", f"/v1/slots/{slot}"))["slot"]["status"] == status
    candidates = (await _scheduler(stack, "GET", f"/v1/nodes/{node}/candidates"))["candidates"]
    candidate = next(
        c["candidate_id"]
        for c in candidates
        if c["candidate_id"] == slot or c.get("gpu_pci_address") == free[0].get("gpu_pci_address")
    )
    await _browse(_fill, b, {"approve-candidates": candidate, "approve-reason": "console e2e: re-approved"})
    await _browse(_click, b, "the approve button", By.ID, "approve-submit")
    approved = await _browse(_text, b, "the approval's notice", By.ID, "notice")
    assert f"{slot} available" in approved, approved
    await _browse(b.save_screenshot, str(shots / "host-acted.png"))

    # Quota and the site's wipe policy from their page; a quota that is no number is the API's refusal, nothing set.
    wipe = free[0].get("destructive_wipe_policy") or "blkdiscard"  # the one the slots have: the stack wipes as before
    await _browse(b.get, f"{url}/console/policies?tenant={tenant}")
    await _browse(_fill, b, {"quota-gpus": "8", "quota-reason": "console e2e: contract"})
    await _browse(_click, b, "the quota button", By.ID, "quota-submit")
    await _browse(_until, b, "the quota shown", lambda d: d.find_element(By.ID, "quota-max").text == "8")
    await _browse(_fill, b, {"quota-gpus": "lots", "quota-reason": "console e2e: typo"})
    await _browse(_click, b, "the quota button", By.ID, "quota-submit")
    assert "max_gpus" in await _browse(_text, b, "the quota's refusal", By.ID, "action-error")
    assert (await _scheduler(stack, "GET", f"/v1/tenants/{tenant}/quota"))["quota"]["max_gpus"] == 8
    await _browse(_select, b, "wipe-policy", wipe)
    await _browse(_fill, b, {"wipe-reason": "console e2e: audit finding"})
    await _browse(_click, b, "the wipe policy button", By.ID, "wipe-submit")
    await _browse(_until, b, "the wipe policy shown", lambda d: d.find_element(By.ID, "wipe-current").text == wipe)
    await _browse(b.save_screenshot, str(shots / "policies.png"))

    # Each change, and the refusals, is an audit record ops-view read off the bus.
    await _browse(b.get, f"{url}/console/audit?actor=console-e2e&limit=100")
    await _browse(_live, b)
    paths = {
        f"/v1/nodes/{node}/waivers": "422",
        f"/v1/slots/{slot}/disable": "200",
        f"/v1/slots/{slot}/repair": "200",
        f"/v1/nodes/{node}/candidates/approve": "200",
        f"/v1/tenants/{tenant}/quota": "422",
        "/v1/sites/default/wipe-policy": "200",
    }
    await _browse(
        _until,
        b,
        "every change's audit record",
        lambda d: all(p in d.find_element(By.ID, "audit").text for p in paths),
    )
    shown = await _browse(_text, b, "the audit", By.ID, "audit")
    assert "console e2e: parity probe flaky" in shown and "console e2e: audit finding" in shown, shown
    await _browse(b.save_screenshot, str(shots / "audit-actions.png"))

    # Force release from an active allocation's page: the page it is on turns it failed, with no reload.
    stuck = await portal.request("gpu_slice", gpus=1, tenant_id=tenant)
    await portal.wait_state(stuck, "active")
    await _browse(b.get, f"{url}/console/allocations/{stuck}")
    await _browse(_until, b, "the allocation active", lambda d: d.find_element(By.ID, "state").text == "active")
    await _browse(b.find_element(By.ID, "force-reason").send_keys, "console e2e: tenant VM wedged")
    await _browse(b.find_element(By.ID, "force-anyway").click)
    await _browse(b.find_element(By.ID, "force-release-submit").click)
    await _browse(_until, b, "the force release's notice", lambda d: d.find_element(By.ID, "notice").text)
    await _browse(b.execute_script, f"{MARK} = 'force released';")
    await _browse(_until, b, "the allocation failed", lambda d: d.find_element(By.ID, "state").text == "failed")
    assert await _browse(b.execute_script, f"return {MARK};") == "force released", "the page was reloaded"
    assert "force_released" in await _browse(_text, b, "the timeline", By.ID, "timeline")
    await _browse(b.save_screenshot, str(shots / "force-released.png"))

    # Signed out, the same pages are the refusal and nothing else.
    await _browse(b.delete_all_cookies)
    await _browse(b.get, f"{url}/console/allocations?tenant={tenant}")
    assert await _browse(_text, b, "the refusal", By.ID, "refusal") == "Sign-in refused"
    assert not await _browse(b.find_elements, By.ID, "live")
    assert tenant not in await _browse(lambda: b.page_source)
    await _browse(b.save_screenshot, str(shots / "refused.png"))
    print(f"console screenshots: {shots}")
