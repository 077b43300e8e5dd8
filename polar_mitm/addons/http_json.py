"""JSON over HTTP as the addons speak it: the content type of every JSON answer made in a
hook and of the backend client's requests to vLLM, and the answer where the proxy itself
failed."""

from __future__ import annotations

import orjson
from mitmproxy import http

JSON_HEADERS = {"content-type": "application/json"}


def internal_error() -> http.Response:
    """The answer to a request a bug left unanswered: a 500 that names no detail (the
    details go to the log, not to the harness)."""
    return http.Response.make(500, orjson.dumps({"error": {"message": "polar-mitm internal error",
                                                           "type": "api_error"}}), JSON_HEADERS)
