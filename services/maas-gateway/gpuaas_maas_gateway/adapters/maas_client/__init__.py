"""Async client of the MAAS REST API 2.0 for the gateway.

Every call is OAuth 1.0 PLAINTEXT signed and bounded by a per-call timeout. Failures surface as
the `maas_errors` hierarchy, whose `outcome_unknown` tells the caller whether a mutation might
have been committed anyway (then: poll `read_machine`, do not resubmit blindly).

The API key is held in a private object that never renders itself, is never bound into a log,
and is scrubbed from any error body MAAS echoes back (a 401 names the token it rejected).

One module per concern: auth (the key), wire (URL and form encoding), transport (the signed call),
machines, tags_scripts, boot_resources and results (the operations); `MaasClient` combines them.
"""

from __future__ import annotations

from ..maas_errors import MaasError
from .boot_resources import BootResourceCalls
from .machines import Filter, MachineCalls
from .results import ScriptResultCalls, decode_output
from .tags_scripts import TagScriptCalls
from .wire import api_root


class MaasClient(MachineCalls, TagScriptCalls, BootResourceCalls, ScriptResultCalls):
    """Async client of the MAAS REST API 2.0: every operation of the gateway over one signed transport."""


__all__ = ["Filter", "MaasClient", "MaasError", "api_root", "decode_output"]
