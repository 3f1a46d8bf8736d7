"""One service's admin API: auth and rights (principals.py), request ids, the error shape around every route,
and mutations under an Idempotency-Key in one unit of work with their audit row."""

from __future__ import annotations

import hashlib
import hmac
import json
import uuid
from collections.abc import Awaitable, Callable, Mapping, Sequence
from typing import Any

import asyncpg
from aiohttp import web
from pydantic import SecretStr

from ..api_error import ApiError
from ..logging import bound_context, get_logger
from ..unit_of_work import UnitOfWork, no_repositories
from .audit import announce, audit, audit_refusal, reason_of
from .bodies import jsonable, parse_body, unstorable
from .docs_page import render_docs_page
from .errors import error_response
from .headers import (
    ACTOR,
    ACTOR_RE,
    KEY_RE,
    MAX_BODY,
    PERSON_HEADER,
    PRINCIPAL,
    REQUEST_ID,
    REQUEST_ID_RE,
    RIGHTS_KEY,
)
from .idempotency import lock_key, store_answer, stored_answer
from .login import LOGIN, LOGIN_PATH, SESSION, SIGN_IN_AS, USED, mint, verify
from .openapi_document import openapi, render_yaml
from .pages import ACTING, SESSION_COOKIE, Pages, plain_page
from .principals import DELEGATES, READ, RIGHTS, WRITE, rights_of, verify_person
from .routes import Call, Reply, Route

log = get_logger(__name__)

# The API's description, served without a token: it says what the routes take and answer, never what the service
# holds, and it is the same document the repository publishes (openapi.yaml); a browser following a link to the
# docs page cannot send a bearer token. Everything else still wants one.
PUBLIC_PATHS = frozenset({"/openapi.json", "/openapi.yaml", "/docs"})


def _same_origin(request: web.Request) -> bool:
    """A change a session cookie signs must come from a page of this site (the SameSite cookie already keeps
    another site's from being signed in; this names the refusal). A browser names the page's origin on every
    POST; a request naming none is not one of this console's forms (a client replaying a cookie), so it is
    refused too. A bearer token's request is no browser's and does not come here."""
    origin = request.headers.get("Origin")
    if origin is None:
        return request.headers.get("Sec-Fetch-Site") == "same-origin"
    return origin.split("://", 1)[-1] == request.host


def _static(body: bytes, content_type: str) -> Callable[[web.Request], Awaitable[web.Response]]:
    async def handler(_request: web.Request) -> web.Response:
        return web.Response(body=body, content_type=content_type, charset="utf-8")

    return handler


class AdminApi:
    """One service's admin API: its routes behind the shared auth, errors, idempotency and audit."""

    def __init__(
        self,
        *,
        service: str,
        schema: str,
        pool: asyncpg.Pool,
        tokens: Mapping[str, SecretStr | None],
        routes: Sequence[Route],
        repositories: Callable[[asyncpg.Connection], Any] = no_repositories,
        document: Callable[[], dict[str, Any]] | None = None,
        pages: Pages | None = None,
        audit_event: str | None = None,
    ) -> None:
        """`document`: the service's OpenAPI document (its title and description over these routes); by default
                one rendered from the routes alone. `pages`: browser pages signed in by a login link minted from one of
                `tokens` (login.py), refused with a page of their own. `audit_event`: the message type that carries each
        audited mutation to the bus (audit.announce); None keeps the audit in the service's own table only."""
        usable = {actor: t for actor, t in tokens.items() if t is not None and t.get_secret_value()}
        if not usable:
            raise ValueError(
                f"the {service} admin API needs a bearer token (set GPUAAS_ADMIN_TOKEN); it does not listen without one"
            )
        for actor in usable:
            if not ACTOR_RE.match(actor):
                raise ValueError(f"token actor name {actor!r} is not an identifier")
            if actor not in RIGHTS:
                raise ValueError(f"token principal {actor!r} has no rights (principals.RIGHTS names them)")
        if len({t.get_secret_value() for t in usable.values()}) != len(usable):
            raise ValueError(f"the {service} admin API was given one token for two principals")
        self.service, self.schema, self.pool = service, schema, pool
        self._tokens = [(actor, t.get_secret_value().encode()) for actor, t in usable.items()]
        self._secrets: dict[str, SecretStr] = {actor: t for actor, t in usable.items() if t is not None}
        # Login links and session cookies are signed with the pages' own secret, never with a bearer token.
        login = pages.login_secret if pages is not None else None
        if login is not None and login.get_secret_value() in {t.get_secret_value() for t in usable.values()}:
            raise ValueError(f"the {service} pages' login secret must not be one of its bearer tokens")
        self._signing: dict[str, SecretStr | str] = (
            dict.fromkeys(SIGN_IN_AS, login) if login is not None and login.get_secret_value() else {}
        )
        self._pages = pages
        self._audit_event = audit_event
        if pages is not None and not LOGIN_PATH.startswith(pages.prefix + "/"):
            raise ValueError(f"pages must be mounted where their login is ({LOGIN_PATH})")
        self.routes = list(routes)
        self._repositories = repositories
        self._document = document
        self._runner: web.AppRunner | None = None
        self.port: int | None = None

    # --- the aiohttp application ----------------------------------------------------------------

    def app(self) -> web.Application:
        app = web.Application(middlewares=[self._middleware], client_max_size=MAX_BODY)
        for route in self.routes:
            app.router.add_route(route.method, route.path, self._endpoint(route))
        doc = self.document()
        as_json = json.dumps(doc, indent=2).encode()
        as_yaml, page = render_yaml(doc).encode(), render_docs_page(doc).encode()
        for path, body, kind in (
            ("/openapi.json", as_json, "application/json"),
            ("/openapi.yaml", as_yaml, "application/yaml"),
            ("/docs", page, "text/html"),
        ):
            app.router.add_get(path, _static(body, kind))
        if self._pages is not None:
            # GET only: a HEAD (a link preview, a prefetch) would spend the link without signing anyone in.
            app.router.add_get(LOGIN_PATH, self._login, allow_head=False)
            app.router.add_post(self._pages.prefix + "/logout", self._logout)
            self._pages.install(app)
        return app

    def document(self) -> dict[str, Any]:
        if self._document is not None:
            return self._document()
        return openapi(self.routes, title=f"gpuaas {self.service} admin API", version="1", description="")

    async def start(self, host: str, port: int) -> int:
        self._runner = web.AppRunner(self.app(), access_log=None)
        await self._runner.setup()
        site = web.TCPSite(self._runner, host, port)
        await site.start()
        self.port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
        log.info("admin_api_listening", service=self.service, admin_host=host, admin_port=self.port)
        return self.port

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None

    def _principal(self, request: web.Request) -> str | None:
        given = request.headers.get("Authorization", "")
        token = given[7:].encode() if given.startswith("Bearer ") else b""
        found = None
        for actor, expected in self._tokens:  # every token compared: the time says nothing about which matched
            if hmac.compare_digest(token, expected) and token:
                found = actor
        return found

    @web.middleware
    async def _middleware(self, request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]):
        given = request.headers.get("X-Request-Id", "")
        request_id = given if REQUEST_ID_RE.match(given) else uuid.uuid4().hex
        request[REQUEST_ID] = request_id
        principal = self._principal(request)
        if self._pages is not None and self._pages.holds(request.path):
            return await self._page(request, handler, request_id, principal)
        if principal is None and not (request.path in PUBLIC_PATHS and request.method in ("GET", "HEAD")):
            return error_response(
                401,
                "unauthorized",
                "a valid bearer token is required",
                request_id,
                headers={"WWW-Authenticate": "Bearer"},
            )
        request[PRINCIPAL] = principal
        request[RIGHTS_KEY], request[ACTOR] = (rights_of(principal), principal) if principal else (frozenset(), "")
        if principal in DELEGATES and PERSON_HEADER in request.headers:
            person = await self._person(request, principal)
            if person is None:
                log.info("admin_person_refused", principal=principal, admin_path=request.path)
                return error_response(
                    403, "forbidden", "the person assertion is not valid for this request", request_id
                )
            request[ACTOR], request[RIGHTS_KEY] = person[0], rights_of(person[1])
        with bound_context(
            request_id=request_id, admin_method=request.method, admin_path=request.path, principal=principal
        ):
            try:
                resp = await handler(request)
            except ApiError as exc:
                log.info("admin_rejected", code=exc.code, status=exc.status)
                return error_response(exc.status, exc.code, exc.message, request_id, exc.details)
            except web.HTTPException as exc:
                # The router's 404/405 and aiohttp's 413, in the same shape as everything else.
                code = {404: "not_found", 405: "method_not_allowed", 413: "body_too_large"}.get(
                    exc.status, "http_error"
                )
                headers = {"Allow": exc.headers["Allow"]} if "Allow" in exc.headers else None
                return error_response(exc.status, code, exc.reason, request_id, headers=headers)
            except Exception as exc:  # the client gets the error shape, the log the traceback
                log.error("admin_failed", error=repr(exc), exc_info=True)
                return error_response(500, "internal", "internal error", request_id)
            resp.headers["X-Request-Id"] = request_id
            return resp

    async def _person(self, request: web.Request, principal: str) -> tuple[str, str] | None:
        """The person a delegate's assertion names and the rights they signed in with, when it was signed with the
        delegate's own token for exactly this request (method, path, body, Idempotency-Key) and is still fresh."""
        return verify_person(
            self._secrets[principal],
            request.headers[PERSON_HEADER],
            method=request.method,
            path=request.rel_url.raw_path,
            body=await request.read(),
            idempotency_key=request.headers.get("Idempotency-Key", ""),
        )

    @staticmethod
    def _allow(route: Route, request: web.Request) -> None:
        """The owner's check: the route's right is among the principal's (or its person's)."""
        if route.needs not in request[RIGHTS_KEY]:
            raise ApiError(
                403,
                "forbidden",
                f"{request[ACTOR] or 'this principal'} ({request[PRINCIPAL]}) may not {route.needs} here",
                {"needs": route.needs},
            )

    # --- browser pages -----------------------------------------------------------------------------

    async def _page(
        self,
        request: web.Request,
        handler: Callable[[web.Request], Awaitable[web.StreamResponse]],
        request_id: str,
        principal: str | None,
    ) -> web.StreamResponse:
        assert self._pages is not None
        acting = principal
        rights = rights_of(principal) if principal else frozenset()
        if request.path != LOGIN_PATH:
            by_cookie = False
            session, _ = verify(self._signing, request.cookies.get(SESSION_COOKIE, ""), purpose=SESSION)
            if principal is None and session is not None:
                principal, acting, by_cookie = session.principal, session.actor, True
                rights = rights_of(principal)
            if principal is None:
                log.info("page_refused", admin_path=request.path, request_id=request_id)
                return self._refusal(request_id, "no session: this console opens from a login link")
            if request.method not in ("GET", "HEAD"):
                if by_cookie and not _same_origin(request):
                    return plain_page(403, "Refused", "a change must come from this console's own pages", request_id)
                # The owner of the pages checks: a change needs the write right (signing out needs none).
                if WRITE not in rights and request.path != self._pages.prefix + "/logout":
                    log.info("page_change_refused", actor=acting, principal=principal, admin_path=request.path)
                    return plain_page(
                        403,
                        "Refused",
                        f"{acting} is signed in with {principal} rights, which change nothing here",
                        request_id,
                    )
            elif READ not in rights:
                return plain_page(403, "Refused", f"{principal} rights do not open these pages", request_id)
        request[PRINCIPAL] = principal or ""
        request[ACTING] = acting or ""
        request[RIGHTS_KEY] = rights
        with bound_context(request_id=request_id, admin_method=request.method, admin_path=request.path, actor=acting):
            try:
                resp = await handler(request)
            except ApiError as exc:
                return plain_page(exc.status, exc.code, exc.message, request_id)
            except web.HTTPException as exc:
                if exc.status in (301, 302, 303, 307, 308):
                    raise
                return plain_page(exc.status, str(exc.status), exc.reason, request_id)
            except Exception as exc:
                log.error("page_failed", error=repr(exc), exc_info=True)
                return plain_page(500, "Internal error", "the page failed; its log has the details", request_id)
            resp.headers["X-Request-Id"] = request_id
            # No other site frames these pages (a click on a form would be theirs).
            resp.headers.setdefault("X-Frame-Options", "DENY")
            resp.headers.setdefault("Content-Security-Policy", "frame-ancestors 'none'")
            return resp

    def _refusal(self, request_id: str, why: str) -> web.Response:
        assert self._pages is not None
        return plain_page(401, "Sign-in refused", f"{why}. To sign in: {self._pages.how_to_sign_in}.", request_id)

    async def _login(self, request: web.Request) -> web.StreamResponse:
        """The login link: a valid login token used for the first time opens a session (an HttpOnly cookie for the
        pages' path only) and goes to the pages; anything else, the same link again included, is the refusal. The
        token itself is never logged."""
        assert self._pages is not None
        signed, why = verify(self._signing, request.query.get("token", ""), purpose=LOGIN)
        if signed is not None and not await self._pages.spend_login(signed.nonce, signed.expires_at):
            signed, why = None, USED
        if signed is None:
            log.info("login_refused", why=why)
            return self._refusal(request[REQUEST_ID], why)
        cookie = mint(
            self._signing[signed.principal],
            signed.principal,
            signed.actor,
            purpose=SESSION,
            ttl_s=self._pages.session_ttl_s,
        )
        resp = web.HTTPSeeOther(self._pages.prefix + "/")
        resp.set_cookie(
            SESSION_COOKIE,
            cookie,
            path=self._pages.prefix,
            httponly=True,
            samesite="Strict",
            secure=request.secure,
            max_age=int(self._pages.session_ttl_s),
        )
        resp.headers["Cache-Control"] = "no-store"
        log.info("login", actor=signed.actor, principal=signed.principal)
        raise resp

    async def _logout(self, request: web.Request) -> web.StreamResponse:
        assert self._pages is not None
        resp = web.HTTPSeeOther(self._pages.prefix + "/")
        resp.del_cookie(SESSION_COOKIE, path=self._pages.prefix)
        raise resp

    # --- one route --------------------------------------------------------------------------------

    def _inputs(self, route: Route, request: web.Request) -> tuple[dict[str, str], dict[str, str | None]]:
        params = {p: request.match_info[p] for p in route.path_params}
        query = {q: request.query.get(q) for q in route.query}
        bad = unstorable(params) or unstorable(query)
        if bad:
            raise ApiError(
                422,
                "invalid_request",
                "a path or query parameter holds text that cannot be stored",
                {"errors": [{"loc": bad, "msg": "NUL or invalid unicode"}]},
            )
        return params, query

    @staticmethod
    def _actor(request: web.Request) -> str:
        """Who the audit names: the authenticated principal, or the person its delegate's assertion names. A name
        the caller types (X-Actor) is not read: it would let anyone holding a token act under someone else's."""
        return request[ACTOR]

    def _endpoint(self, route: Route) -> Callable[[web.Request], Awaitable[web.Response]]:
        async def endpoint(request: web.Request) -> web.Response:
            if route.mutation:
                return await self._mutate(route, request)
            self._allow(route, request)
            params, query = self._inputs(route, request)
            # One snapshot for all of a read's queries (REPEATABLE READ): an answer never pairs rows from before
            # a commit with rows from after it (a walk already re-approved beside its host still converting).
            async with self.pool.acquire() as conn, conn.transaction(isolation="repeatable_read", readonly=True):
                # Reads are not audited, so X-Actor means nothing here and is not checked.
                call = Call(
                    request, params, query, None, request[PRINCIPAL], request[PRINCIPAL], request[REQUEST_ID], conn
                )
                return self._answer(route, await route.handler(call))

        return endpoint

    def _answer(self, route: Route, result: Any) -> web.Response:
        status = route.statuses[0]
        if isinstance(result, Reply):
            result, status = result.body, result.status
        return web.json_response(jsonable(result), status=status)

    async def _mutate(self, route: Route, request: web.Request) -> web.Response:
        request_id, principal = request[REQUEST_ID], request[PRINCIPAL]
        key = request.headers.get("Idempotency-Key")
        raw = await request.read()
        digest = hashlib.sha256(b"\0".join([request.method.encode(), request.path.encode(), raw])).hexdigest()
        record = {
            "request_id": request_id,
            "principal": principal,
            "actor": principal,
            "method": request.method,
            "path": request.path,
            "body_sha256": hashlib.sha256(raw).hexdigest(),
            "idempotency_key": key,
            "reason": reason_of(raw),
        }
        try:
            record["actor"] = actor = self._actor(request)
            self._allow(route, request)
            if key is None or not KEY_RE.match(key):
                raise ApiError(
                    400,
                    "idempotency_key_required",
                    "mutations need an Idempotency-Key header (1-200 printable ASCII characters)",
                )
            params, query = self._inputs(route, request)
            body = parse_body(route.body, raw) if route.body is not None else None
            if principal in DELEGATES and body is not None and "actor" in type(body).model_fields:
                # The body's actor is what the handler records as who acted: for a delegate, its person.
                body = body.model_copy(update={"actor": actor})
            return await self._apply(route, request, key, digest, record, params, query, body, actor)
        except ApiError as exc:
            await audit_refusal(self.pool, self.schema, self.service, record, exc.status, exc.code, self._audit_event)
            raise
        except Exception:
            await audit_refusal(self.pool, self.schema, self.service, record, 500, "internal", self._audit_event)
            raise

    async def _apply(
        self,
        route: Route,
        request: web.Request,
        key: str,
        digest: str,
        record: dict,
        params: dict,
        query: dict,
        body: Any,
        actor: str,
    ) -> web.Response:
        uow = UnitOfWork(
            self.pool, self.schema, self.service, self._repositories, correlation_id=f"admin:{record['request_id']}"
        )
        async with uow:
            # Requests with one key run one at a time: the second waits, then replays or conflicts.
            await lock_key(uow.conn, key)
            prior = await stored_answer(uow.conn, key)
            if prior is not None:
                if prior["request_hash"] != digest:
                    raise ApiError(
                        409,
                        "idempotency_conflict",
                        "this Idempotency-Key was used for another request",
                        {"method": prior["method"], "path": prior["path"]},
                    )
                await audit(uow.conn, record, prior["status_code"], replayed=True)
                await announce(uow, self._audit_event, self.service, record, prior["status_code"], replayed=True)
                await uow.commit()
                log.info("admin_replayed", actor=actor)
                return web.json_response(
                    json.loads(prior["response"]), status=prior["status_code"], headers={"Idempotent-Replayed": "true"}
                )
            call = Call(request, params, query, body, record["principal"], actor, record["request_id"], uow.conn, uow)
            result = await route.handler(call)
            status = route.statuses[0]
            if isinstance(result, Reply):
                result, status = result.body, result.status
            payload = jsonable(result)
            await store_answer(
                uow.conn, key, request.method, request.path, digest, status, payload, record["request_id"], actor
            )
            await audit(uow.conn, record, status)
            await announce(uow, self._audit_event, self.service, record, status)
            await uow.commit()
        for hook in call.after_commit:
            hook()
        log.info("admin_mutation", actor=actor, status=status)
        return web.json_response(payload, status=status)
