"""What the stack reads off every request: which methods mutate, the header rules, the body limit, the keys."""

from __future__ import annotations

import re

from aiohttp import web

MUTATIONS = frozenset({"POST", "PUT", "PATCH", "DELETE"})
KEY_RE = re.compile(r"^[\x21-\x7e]{1,200}$")
REQUEST_ID_RE = re.compile(r"^[A-Za-z0-9._:-]{1,128}$")
ACTOR_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._:@-]{0,127}$")
MAX_BODY = 1 << 20
# A delegate's signed assertion of the person it acts for (principals.py).
PERSON_HEADER = "X-Gpuaas-Person"
REQUEST_ID = web.RequestKey("request_id", str)
PRINCIPAL = web.RequestKey("principal", str)
# What the request's principal (or the person its delegate asserted) may do, and who the audit names.
RIGHTS_KEY = web.RequestKey("rights", frozenset)
ACTOR = web.RequestKey("actor", str)
