"""Plain HTTP requests (urllib) as a client without an SDK sends them: importable without the
HTTP app's own dependencies, so that tests of the real daemon on machines without them (the GPU
machine) can call its HTTP API too."""

from __future__ import annotations

import json
import urllib.error
import urllib.request


def request(
    base_url: str,
    path: str,
    body: dict | None = None,
    headers: dict[str, str] | None = None,
    raw: bytes | None = None,
) -> tuple[int, dict[str, str], bytes]:
    """(status, headers, body) of a GET (no body) or POST; error statuses do not raise."""
    data = raw if raw is not None else (None if body is None else json.dumps(body).encode())
    req = urllib.request.Request(
        base_url + path, data=data, headers={"content-type": "application/json", **(headers or {})}
    )
    try:
        with urllib.request.urlopen(req, timeout=30) as response:
            return response.status, dict(response.headers), response.read()
    except urllib.error.HTTPError as exc:
        return exc.code, dict(exc.headers), exc.read()
