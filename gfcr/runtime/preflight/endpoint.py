"""Is a server there? A bounded probe of an ``http(s)://`` endpoint, before a run depends on it.

MLflow's client waits 120 s per request and retries with backoff, and Prefect's retries its
API for tens of seconds, so a store or API that is down used to cost minutes of silence (or a
traceback). ``probe`` answers in at most about ``timeout`` seconds a step:

- the TCP connection is refused, dropped or not answered: a ``GfcrError`` naming the URL;
- plain http: one ``GET`` of ``path``; any HTTP answer, even an error status, passes (the
  client's own first call then says what is wrong); no answer in time is an error;
- https: only the connection is probed (TLS settings are the client's to apply);
- a URL an environment proxy would carry (``HTTP(S)_PROXY``, not bypassed by ``NO_PROXY``)
  is not probed, since a direct connection would say nothing about it.

>>> probe("sqlite:///mlflow.db", "/", "MLflow store", "fix it")  # not http: nothing to probe
"""

from __future__ import annotations

import http.client
import socket
import urllib.request
from urllib.parse import urlsplit

from gfcr.errors import GfcrError

TIMEOUT_S = 5.0


def probe(url: str, path: str, what: str, fix: str, timeout: float = TIMEOUT_S) -> None:
    """A GfcrError (``cannot reach the <what> <url>: <reason>``, with ``fix``) within about
    ``2 * timeout`` seconds if the ``http(s)://`` server at ``url`` cannot be reached; ``path``
    is appended to the URL's own path for the http request."""
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        return
    if parts.scheme in urllib.request.getproxies() and not urllib.request.proxy_bypass(parts.hostname):
        return
    try:
        port = parts.port or (443 if parts.scheme == "https" else 80)
    except ValueError as exc:
        raise GfcrError(f"the {what} {url} has a bad port: {exc}", fix) from None
    try:
        if parts.scheme == "https":
            socket.create_connection((parts.hostname, port), timeout=timeout).close()
            return
        conn = http.client.HTTPConnection(parts.hostname, port, timeout=timeout)
        try:
            conn.request("GET", parts.path.rstrip("/") + path)
            conn.getresponse().read(0)
        finally:
            conn.close()
    except (socket.timeout, TimeoutError):
        raise GfcrError(f"cannot reach the {what} {url}: no answer within {timeout:g} s", fix) from None
    except (OSError, http.client.HTTPException) as exc:
        reason = getattr(exc, "strerror", None) or str(exc) or type(exc).__name__
        raise GfcrError(f"cannot reach the {what} {url}: {reason}", fix) from None
