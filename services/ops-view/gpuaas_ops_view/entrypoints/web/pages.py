"""The ops console: server-rendered pages over the read models (the same queries as the ops API), kept live by
server-sent events (live.py), mounted on the ops API under /console behind its login link
(gpuaas_common.admin_http.Pages). Its changes (drain and undrain on the fleet; slot approval, disable, repair and
waivers on a host's page; quotas and site wipe policies on the policies page; force release on an allocation's
page) go to the scheduler's admin API as the CLI sends them (actions.py), under the console's own principal and
the signed assertion of the person signed in; only a person signed in with `ops-admin` rights sees the forms, and
the stack refuses any change of one signed in with `ops` rights before the scheduler hears of it."""

from __future__ import annotations

import uuid
from datetime import datetime, timezone
from importlib import resources
from typing import Any
from urllib.parse import quote, urlencode

import asyncpg
from aiohttp import web
from pydantic import SecretStr

from gpuaas_common.admin_http import ACTING, REQUEST_ID, RIGHTS_KEY, WRITE, ApiError, Pages
from gpuaas_common.contract import WipePolicy
from gpuaas_common.logging import get_logger

from ...adapters import login_links
from ...adapters.changes import Changes
from ...adapters.queries import ReadModels
from ...adapters.scheduler_admin import SchedulerAdmin, SchedulerUnavailable
from ...domain.filters import ALLOCATION_STATES, AUDITED_SERVICES
from ...service_layer import queries
from ...service_layer.fleet import fleet as fleet_view
from . import actions, live
from .render import page

log = get_logger(__name__)

PREFIX = "/console"
STATIC = {
    name: (resources.files(__package__).joinpath("static", name).read_bytes(), kind)
    for name, kind in (("console.js", "text/javascript"), ("console.css", "text/css"))
}
NAV = (
    ("fleet", "Fleet"),
    ("allocations", "Allocations"),
    ("images", "Images"),
    ("maas", "MAAS operations"),
    ("dead-letters", "Dead letters"),
    ("usage", "Usage"),
    ("policies", "Quotas & wipe"),
    ("audit", "Audit"),
)
WIPE_POLICIES = tuple(WipePolicy)
GATES = ("parity", "preflight")


class Console:
    def __init__(self, pool: asyncpg.Pool, changes: Changes, scheduler: SchedulerAdmin) -> None:
        self.pool, self.changes, self.scheduler = pool, changes, scheduler

    def pages(self, how_to_sign_in: str, login_secret: SecretStr | None = None) -> Pages:
        return Pages(
            install=self.install,
            spend_login=self.spend_login,
            login_secret=login_secret,
            prefix=PREFIX,
            how_to_sign_in=how_to_sign_in,
        )

    def can_act(self, request: web.Request) -> bool:
        """The forms are shown to a person who may change things, when the console can reach the scheduler."""
        return self.scheduler.configured and WRITE in request[RIGHTS_KEY]

    async def spend_login(self, nonce: str, expires_at: float) -> bool:
        """A login link opens one session: its nonce recorded in this service's database (any replica's sign-in
        finds it), True only at its first use."""
        return await login_links.spend(self.pool, nonce, expires_at)

    def install(self, app: web.Application) -> None:
        live.install(app, self.changes, PREFIX + "/events")
        r = app.router
        r.add_get(PREFIX, self.home)
        r.add_get(PREFIX + "/", self.home)
        r.add_get(PREFIX + "/static/{name}", self.static)
        r.add_get(PREFIX + "/fleet", self.fleet)
        r.add_post(PREFIX + "/fleet/{action:drain|undrain}", self.node_action)
        r.add_get(PREFIX + "/fleet/{node_id}", self.host)
        r.add_post(PREFIX + "/fleet/{node_id}/{action:approve|waiver|disable|repair}", self.host_action)
        r.add_get(PREFIX + "/policies", self.policies)
        r.add_post(PREFIX + "/policies/{action:quota|wipe-policy}", self.policy_action)
        r.add_post(PREFIX + "/allocations/{allocation_id}/force-release", self.force_release)
        r.add_get(PREFIX + "/allocations", self.allocations)
        r.add_get(PREFIX + "/allocations/{allocation_id}", self.allocation)
        r.add_get(PREFIX + "/images", self.images)
        r.add_get(PREFIX + "/images/{slug}", self.image)
        r.add_get(PREFIX + "/maas", self.maas)
        r.add_get(PREFIX + "/dead-letters", self.dead_letters)
        r.add_get(PREFIX + "/usage", self.usage)
        r.add_get(PREFIX + "/audit", self.audit)

    # --- common --------------------------------------------------------------------------------------

    def _context(self, request: web.Request, section: str, **more: Any) -> dict[str, Any]:
        return {
            "prefix": PREFIX,
            "nav": NAV,
            "section": section,
            "actor": request[ACTING],
            "request_id": request[REQUEST_ID],
            "query": dict(request.query),
            "now": datetime.now(timezone.utc),
            "error": None,
            # A form's refusal is rendered in answer to its POST; the page it belongs to (the action's path less
            # its last segment) is where the page's script reads its live part, and the address it shows.
            "page_url": request.path.rsplit("/", 1)[0] if request.method == "POST" else None,
            **more,
        }

    @staticmethod
    def _query(request: web.Request, *names: str) -> dict[str, str | None]:
        return {n: request.query.get(n) for n in names}

    @staticmethod
    def _next(request: web.Request, cursor: str | None) -> str | None:
        if cursor is None:
            return None
        return f"{request.path}?{urlencode({**request.query, 'cursor': cursor})}"

    async def _list(self, request: web.Request, template: str, section: str, fetch, **more: Any) -> web.Response:
        """A list page: its rows, or, for a filter that does not parse, the page with the error naming the
        field (400) and no rows."""
        try:
            async with self.pool.acquire() as conn:
                data = await fetch(ReadModels(conn))
        except ApiError as exc:
            if exc.status != 400:
                raise
            ctx = self._context(request, section, items=[], next_url=None, error=exc.message, **more)
            return page(request, template, 400, **ctx, field=(exc.details or {}).get("field"), data={})
        ctx = self._context(request, section, items=data["items"], next_url=self._next(request, data["next_cursor"]))
        return page(request, template, **ctx, **more, field=None, data=data)

    async def home(self, _request: web.Request) -> web.StreamResponse:
        raise web.HTTPSeeOther(PREFIX + "/fleet")

    async def static(self, request: web.Request) -> web.Response:
        found = STATIC.get(request.match_info["name"])
        if found is None:
            raise web.HTTPNotFound()
        return web.Response(body=found[0], content_type=found[1], charset="utf-8")

    # --- pages ---------------------------------------------------------------------------------------

    async def fleet(self, request: web.Request, *, action_error: str | None = None, status: int = 200):
        admin, admin_error = None, None
        try:
            admin = await self.scheduler.nodes()
        except SchedulerUnavailable as exc:
            admin_error = str(exc)
        query = self._query(request, "node", "kind", "limit", "cursor")
        resp = await self._list(
            request,
            "fleet.html",
            "fleet",
            lambda reads: fleet_view(reads, query, admin),
            admin_error=admin_error,
            action_error=action_error,
            acted=request.query.get("acted"),
            acted_on=request.query.get("on"),
            action_key=uuid.uuid4().hex,
            can_act=self.can_act(request),
        )
        if status != 200:
            resp.set_status(status)
        return resp

    @staticmethod
    def _acting(request: web.Request, action_error: str | None, can_act: bool) -> dict[str, Any]:
        """What a page with forms shows around them: the last change done or refused, a fresh key per form."""
        return {
            "action_error": action_error,
            "acted": request.query.get("acted"),
            "acted_detail": request.query.get("detail"),
            "action_key": uuid.uuid4().hex,
            "can_act": can_act,
        }

    async def host(self, request: web.Request, *, action_error: str | None = None, status: int = 200) -> web.Response:
        """A host: its slots as the streams described them (status, health, holder, drift; a slot never placed too)
        and its live claims, beside the scheduler's admin detail (mode history, waivers, actions asked of it), and
        the forms that change it."""
        node_id = request.match_info["node_id"]
        admin, admin_error = None, None
        try:
            admin = await self.scheduler.node(node_id)
        except SchedulerUnavailable as exc:
            admin_error = str(exc)
        more = {
            "admin": admin,
            "admin_error": admin_error,
            "node_id": node_id,
            "gates": GATES,
            "wipe_policies": WIPE_POLICIES,
            **self._acting(request, action_error, self.can_act(request)),
        }
        async with self.pool.acquire() as conn:
            try:
                found = await queries.get_host(ReadModels(conn), node_id)
            except ApiError as exc:
                ctx = self._context(request, "fleet", host=None, error=exc.message, **more)
                return page(request, "host.html", exc.status, **ctx)
        return page(request, "host.html", status, **self._context(request, "fleet", host=found, **more))

    async def host_action(self, request: web.Request) -> web.StreamResponse:
        """A host page's forms: approve candidates, add a waiver, disable or repair a slot. Done goes back to the
        host's page (a reload does not post again); a refusal is shown there in the scheduler's words, with a 4xx."""
        node_id, action = request.match_info["node_id"], request.match_info["action"]
        # A waiver's missing reason is the API's to refuse: its refusal names every problem at once.
        fields, problem = await actions.read_form(request, reason_required=action != "waiver")
        problem = actions.node_problem(node_id) or problem
        body: dict[str, Any] = {"reason": fields["reason"] or None}
        method_path = ""
        if action == "approve":
            body["candidate_ids"] = actions.words(fields.get("candidate_ids", ""))
            body["destructive_wipe_policy"] = fields.get("destructive_wipe_policy") or None
            method_path = self.scheduler.approve_path(node_id)
        elif action == "waiver":
            body["gate"] = fields.get("gate", "")
            body["expires_at"] = fields.get("expires_at") or None
            method_path = self.scheduler.node_path(node_id, "waivers")
        else:
            slot_id = fields.get("slot_id", "")
            problem = problem or actions.id_problem("slot_id", slot_id)
            # A repair sends no proof: the scheduler asks the slot's host for its wipe and frees the slot on the
            # host's own report (a proof typed here would be refused, 422 typed_wipe_proof_refused).
            method_path = self.scheduler.slot_path(slot_id, action)
        if problem is not None:
            return await self.host(request, action_error=problem, status=400)
        body = {k: v for k, v in body.items() if v is not None}
        done = await actions.ask(request, self.scheduler, self.changes, action, method_path, body, fields["key"])
        if done.error is not None:
            return await self.host(request, action_error=done.error, status=done.status)
        shown = {"acted": action, "detail": _detail(action, fields, done.body or {})}
        raise web.HTTPSeeOther(f"{PREFIX}/fleet/{quote(node_id, safe='')}?{urlencode(shown)}")

    async def policies(
        self,
        request: web.Request,
        *,
        action_error: str | None = None,
        status: int = 200,
        shown: dict[str, str] | None = None,
    ) -> web.Response:
        """A tenant's quota and a site's wipe policy as the scheduler answers for them, and the forms that set
        them. `shown`: the tenant and site a refused form's page shows (its query is the form's)."""
        where = shown if shown is not None else request.query
        tenant, region = where.get("tenant", "").strip(), where.get("region", "").strip() or "default"
        views: dict[str, Any] = {"quota": None, "quota_error": None, "wipe": None, "wipe_error": None}
        for name, field, value, path in (
            ("quota", "tenant", tenant, self.scheduler.quota_path),
            ("wipe", "region", region, self.scheduler.wipe_policy_path),
        ):
            if not value:
                continue
            problem = actions.id_problem(field, value)
            if problem is not None:
                views[f"{name}_error"] = problem
                continue
            try:
                answer = await self.scheduler.read(path(value))
            except SchedulerUnavailable as exc:
                views[f"{name}_error"] = str(exc)
                continue
            views[name], views[f"{name}_error"] = (answer.body, None) if answer.error is None else (None, answer.error)
        ctx = self._context(
            request,
            "policies",
            tenant=tenant,
            region=region,
            wipe_policies=WIPE_POLICIES,
            **views,
            **self._acting(request, action_error, self.can_act(request)),
        )
        if shown is not None:
            ctx["page_url"] = f"{PREFIX}/policies?{urlencode({'tenant': tenant, 'region': region})}"
        return page(request, "policies.html", status, **ctx)

    async def policy_action(self, request: web.Request) -> web.StreamResponse:
        """The policies page's forms: a tenant's quota, a site's wipe policy (PUT, as the CLI sends them)."""
        action = request.match_info["action"]
        fields, problem = await actions.read_form(request)
        if action == "quota":
            target = fields.get("tenant", "")
            problem = actions.id_problem("tenant", target) or problem
            body: dict[str, Any] = {
                "reason": fields["reason"],
                "max_gpus": actions.number_or_text(fields.get("max_gpus", "")),
            }
            path = self.scheduler.quota_path(target)
        else:
            target = fields.get("region", "") or "default"
            problem = actions.id_problem("region", target) or problem
            body = {"reason": fields["reason"], "destructive_wipe_policy": fields.get("destructive_wipe_policy", "")}
            path = self.scheduler.wipe_policy_path(target)
        # The page goes on showing the tenant and site it showed (each form carries the other's as hidden).
        shown = {"tenant": fields.get("tenant", ""), "region": fields.get("region", "")}
        if problem is not None:
            return await self.policies(request, action_error=problem, status=400, shown=shown)
        done = await actions.ask(request, self.scheduler, self.changes, action, path, body, fields["key"], method="PUT")
        if done.error is not None:
            return await self.policies(request, action_error=done.error, status=done.status, shown=shown)
        after = {**shown, "acted": action, "detail": _detail(action, fields, done.body or {})}
        raise web.HTTPSeeOther(f"{PREFIX}/policies?{urlencode(after)}")

    async def node_action(self, request: web.Request) -> web.StreamResponse:
        """The fleet's form (drain, undrain): done goes back to the fleet (a reload does not post it again), a
        refusal is shown on the fleet page in the scheduler's words."""
        action = request.match_info["action"]
        fields, problem = await actions.read_form(request)
        problem = actions.node_problem(fields["node_id"]) or problem
        if problem is not None:
            return await self.fleet(request, action_error=problem, status=400)
        body: dict[str, Any] = {"reason": fields["reason"]}
        if action == "drain":
            body["maintenance"] = fields["maintenance"]
        path = self.scheduler.node_path(fields["node_id"], action)
        done = await actions.ask(request, self.scheduler, self.changes, action, path, body, fields["key"])
        if done.error is not None:
            return await self.fleet(request, action_error=done.error, status=done.status)
        raise web.HTTPSeeOther(f"{PREFIX}/fleet?{urlencode({'acted': action, 'on': fields['node_id']})}")

    async def force_release(self, request: web.Request) -> web.StreamResponse:
        """The allocation page's force release: the scheduler frees its claims (the allocator then ends it)."""
        allocation_id = request.match_info["allocation_id"]
        fields, problem = await actions.read_form(request)
        if problem is None:
            path = self.scheduler.force_release_path(allocation_id)
            body = {"reason": fields["reason"], "force": fields["force"]}
            done = await actions.ask(request, self.scheduler, self.changes, "force-release", path, body, fields["key"])
            if done.error is None:
                raise web.HTTPSeeOther(f"{PREFIX}/allocations/{allocation_id}?acted=force-release")
            problem, status = done.error, done.status
        else:
            status = 400
        return await self.allocation(request, action_error=problem, status=status)

    async def allocations(self, request: web.Request) -> web.Response:
        query = self._query(request, "tenant", "state", "node", "since", "until", "limit", "cursor")
        return await self._list(
            request,
            "allocations.html",
            "allocations",
            lambda reads: queries.list_allocations(reads, query),
            states=ALLOCATION_STATES,
        )

    async def allocation(
        self, request: web.Request, *, action_error: str | None = None, status: int = 200
    ) -> web.Response:
        actions_ctx = {
            "action_error": action_error,
            "acted": request.query.get("acted"),
            "action_key": uuid.uuid4().hex,
            "can_act": self.can_act(request),
        }
        async with self.pool.acquire() as conn:
            try:
                found = await queries.get_allocation(ReadModels(conn), request.match_info["allocation_id"])
            except ApiError as exc:
                ctx = self._context(request, "allocations", alloc=None, error=exc.message, **actions_ctx)
                return page(request, "allocation.html", exc.status, **ctx)
        ctx = self._context(request, "allocations", alloc=found, **actions_ctx)
        return page(request, "allocation.html", status, **ctx)

    async def images(self, request: web.Request) -> web.Response:
        return await self._list(request, "images.html", "images", queries.list_images)

    async def image(self, request: web.Request) -> web.Response:
        async with self.pool.acquire() as conn:
            try:
                found = await queries.get_image(ReadModels(conn), request.match_info["slug"])
            except ApiError as exc:
                ctx = self._context(request, "images", image=None, error=exc.message)
                return page(request, "image.html", exc.status, **ctx)
        return page(request, "image.html", **self._context(request, "images", image=found))

    async def maas(self, request: web.Request) -> web.Response:
        query = self._query(request, "status", "node", "since", "until", "limit", "cursor")
        return await self._list(request, "maas.html", "maas", lambda reads: queries.list_maas(reads, query))

    async def dead_letters(self, request: web.Request) -> web.Response:
        query = self._query(request, "consumer", "reason_code", "since", "until", "limit", "cursor")
        return await self._list(
            request, "dead_letters.html", "dead-letters", lambda reads: queries.list_dead_letters(reads, query)
        )

    async def usage(self, request: web.Request) -> web.Response:
        query = self._query(request, "tenant", "month", "limit", "cursor", "as_of")
        if not query["month"]:
            query["month"] = datetime.now(timezone.utc).strftime("%Y-%m")
        return await self._list(
            request, "usage.html", "usage", lambda reads: queries.usage(reads, query), month=query["month"]
        )

    async def audit(self, request: web.Request) -> web.Response:
        query = self._query(request, "actor", "service", "request_id", "since", "until", "limit", "cursor")
        return await self._list(
            request, "audit.html", "audit", lambda reads: queries.list_audit(reads, query), services=AUDITED_SERVICES
        )


def _detail(action: str, fields: dict[str, Any], answer: dict[str, Any]) -> str:
    """One line on what the scheduler did, for the notice after the redirect (an approval's per-candidate outcome
    above all: a candidate that breaks a rule is approved disabled, with its problems)."""
    if action == "approve":
        said = [
            f"{r.get('slot_id')} {r.get('status')}"
            + (f" ({'; '.join(map(str, r['problems']))})" if r.get("problems") else "")
            for r in answer.get("results") or []
            if isinstance(r, dict)
        ]
        text = "approved: " + (", ".join(said) or "nothing")
    elif action == "waiver":
        text = f"{fields.get('gate')} waived until {fields.get('expires_at')}"
    elif action in ("disable", "repair"):
        slot = answer.get("slot") if isinstance(answer.get("slot"), dict) else answer
        text = f"slot {fields.get('slot_id')} is {slot.get('status', 'changed')}"
    elif action == "quota":
        text = f"{fields.get('tenant')} may hold {fields.get('max_gpus')} GPUs"
    else:
        text = f"site {fields.get('region') or 'default'} wipes by {fields.get('destructive_wipe_policy')}"
    return text[:500]
