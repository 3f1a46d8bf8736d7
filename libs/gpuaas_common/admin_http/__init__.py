"""The one admin HTTP stack of the services that have an admin API (scheduler, image pipeline).

A service declares `Route`s (method, path, pydantic request/response models, handler); this package owns
everything around them, identically for every service:

- bearer-token auth (constant-time; each token names a principal with named rights, `principals`: a route
  needs `read`, `write` or `usage`, refused 403 otherwise; the ops console's principal acts for a signed-in
  person through a signed assertion, and the audit names that person; a typed `X-Actor` is never read);
- one error shape, `{"error": {"code", "message", "details", "request_id"}}`, for handler refusals,
  validation, auth, unknown routes, wrong methods and unhandled failures alike;
- a request id per request (`X-Request-Id` taken when well formed, else minted; echoed on every answer);
- every mutation (POST/PUT/PATCH/DELETE) needs an `Idempotency-Key`: the change, the stored answer, the
  audit row and any events commit in one `UnitOfWork`; the same key with the same request replays the
  stored answer, with another request is a 409 `idempotency_conflict`;
- an `admin_requests` row per authenticated mutation (who, what, when, request id), refusals included;
- the OpenAPI document rendered from the same routes and models, so it cannot drift from the code, and
  served by the API itself without a token (`GET /openapi.json`, `/openapi.yaml`, and `/docs`: a page listing
  each route with its method, path, summary and schema names; see `api.PUBLIC_PATHS` for why they are public);
- optionally, browser pages under a prefix (`Pages`): a short-lived login link signed with the pages' own login
  secret, bound to a person and the rights they sign in with, opens a session cookie; without one a page shows
  nothing but the refusal (`login`, `pages`).

Tables `admin_idempotency` and `admin_requests` live in the service's own schema (its migrations).

Modules: `routes` (Route, Call, Reply), `headers` (header rules, body limit, request keys), `errors` (the
error shape, status texts), `bodies` (JSON bodies in and out), `api` (AdminApi: auth, request ids,
endpoints, mutations), `idempotency` and `audit` (their tables), `openapi_document` (openapi, render_yaml),
`docs_page` (the `/docs` page), `login` (signed login links and sessions), `pages` (Pages, the refusal page),
`principals` (rights per principal, the person assertion).
"""

from ..api_error import ApiError
from .api import AdminApi
from .errors import Error
from .headers import PERSON_HEADER, PRINCIPAL, REQUEST_ID, RIGHTS_KEY
from .login import login_link
from .openapi_document import openapi, render_yaml
from .pages import ACTING, Pages, plain_page
from .principals import READ, USAGE, WRITE, assert_person
from .routes import Call, Reply, Route

__all__ = [
    "ACTING",
    "PERSON_HEADER",
    "PRINCIPAL",
    "READ",
    "REQUEST_ID",
    "RIGHTS_KEY",
    "USAGE",
    "WRITE",
    "AdminApi",
    "ApiError",
    "Call",
    "Error",
    "Pages",
    "Reply",
    "Route",
    "assert_person",
    "login_link",
    "openapi",
    "plain_page",
    "render_yaml",
]
