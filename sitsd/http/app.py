"""The OpenAI-compatible ASGI app: routes, API keys, and every error in OpenAI's shape.

    GET  /v1/models            the served model (one entry per model, later per adapter)
    POST /v1/completions       `sitsd.http.handlers`
    POST /v1/chat/completions  `sitsd.http.handlers`
    GET  /health               200 once the model is warm; 503 while loading or draining
    GET  /version              sitsd's version and the weights version serving

With API keys every `/v1/*` call needs `Authorization: Bearer <key>` (401 otherwise);
`/health` and `/version` stay open, as load balancers probe them. FastAPI's own answers (422
for a body that does not parse, its 404 and 405) are rewritten into OpenAI's error JSON with
the status clients expect (`sitsd.http.errors`). Serving the app is `sitsd.http.server`'s.
"""

from __future__ import annotations

import hmac
import time
from collections.abc import Sequence

from fastapi import Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.responses import JSONResponse, Response

from sitsd import __version__
from sitsd.api.inference import EngineRef
from sitsd.http.errors import HttpError, bad_request, not_found, unauthorized
from sitsd.http.handlers import GenerationHandlers, GrammarCheck
from sitsd.http.protocol import ChatCompletionRequest, CompletionRequest, ModelCard, ModelList
from sitsd.http.telemetry import HttpTelemetry


class ApiKeys:
    """The keys `/v1/*` calls must present; none = open."""

    def __init__(self, keys: Sequence[str] = ()) -> None:
        self._keys = [f"Bearer {k}".encode() for k in keys if k]

    @property
    def required(self) -> bool:
        return bool(self._keys)

    async def check(self, request: Request) -> None:
        """Raise 401 unless the request carries one of the keys (compared in constant time)."""
        if not self._keys:
            return
        header = request.headers.get("authorization")
        if header is None:
            raise unauthorized("an API key is needed: send 'Authorization: Bearer <key>'")
        scheme, _, key = header.strip().encode().partition(b" ")
        normalized = b"Bearer " + key.strip() if scheme.lower() == b"bearer" else b""
        # Every key is compared, so the time taken does not tell which one nearly matched.
        matched = [hmac.compare_digest(normalized, expected) for expected in self._keys]
        if not any(matched):
            raise unauthorized(
                "the API key is not valid for this server: send 'Authorization: Bearer <key>'"
                " with one of the keys of its --api-key-file"
            )


def read_api_keys(path: str) -> list[str]:
    """The keys in `path`, one a line (blank lines and `#` comments skipped).

    Raises:
        OSError: the file cannot be read.
        ValueError: it holds no key.
    """
    with open(path) as f:
        keys = [line.strip() for line in f if line.strip() and not line.startswith("#")]
    if not keys:
        raise ValueError(f"the API key file {path} holds no key")
    return keys


def create_app(
    engines: EngineRef,
    *,
    telemetry: HttpTelemetry,
    api_keys: ApiKeys,
    max_tokens_default: int,
    retry_after_s: int = 1,
    check_grammar: GrammarCheck | None = None,
) -> FastAPI:
    """The ASGI app on the engine in `engines` (attached by the daemon once warm)."""
    app = FastAPI(title="sitsd", version=__version__, docs_url=None, redoc_url=None)
    handlers = GenerationHandlers(
        engines, telemetry, max_tokens_default=max_tokens_default,
        retry_after_s=retry_after_s, check_grammar=check_grammar,
    )  # fmt: skip
    authorized = [Depends(api_keys.check)]
    started = int(time.time())

    @app.get("/v1/models", dependencies=authorized)
    async def list_models() -> ModelList:
        info = engines.get().model_info
        card = ModelCard(id=info.name, created=started, root=info.path,
                         max_model_len=info.max_model_len)  # fmt: skip
        return ModelList(data=[card])

    @app.post("/v1/completions", dependencies=authorized)
    async def completions(body: CompletionRequest, request: Request) -> Response:
        return await handlers.completions(body, request)

    @app.post("/v1/chat/completions", dependencies=authorized)
    async def chat_completions(body: ChatCompletionRequest, request: Request) -> Response:
        return await handlers.chat(body, request)

    @app.get("/health")
    async def health() -> Response:
        state = engines.state
        return JSONResponse({"status": state}, status_code=200 if state == "serving" else 503)

    @app.get("/version")
    async def version() -> dict[str, str]:
        engine = engines.engine
        weights = engine.status().weights_version if engine is not None else ""
        return {"version": __version__, "weights_version": weights}

    _install_error_handlers(app, telemetry, retry_after_s)
    return app


def _install_error_handlers(app: FastAPI, telemetry: HttpTelemetry, retry_after_s: int) -> None:
    @app.exception_handler(HttpError)
    async def on_http_error(request: Request, exc: HttpError) -> Response:
        # The handler that raised it has counted the request already.
        return _error_response(exc)

    @app.exception_handler(RequestValidationError)
    async def on_invalid_body(request: Request, exc: RequestValidationError) -> Response:
        error = _validation_error(exc)
        telemetry.count(request.url.path, "", error)
        return _error_response(error)

    @app.exception_handler(StarletteHTTPException)
    async def on_starlette_error(request: Request, exc: StarletteHTTPException) -> Response:
        if exc.status_code == 404:
            return _error_response(not_found(request.url.path))
        return _error_response(HttpError(exc.status_code, str(exc.detail)))


def _error_response(error: HttpError) -> Response:
    return JSONResponse(
        error.body().model_dump(), status_code=error.status, headers=error.headers()
    )


def _validation_error(exc: RequestValidationError) -> HttpError:
    """FastAPI's 422 as OpenAI's 400, naming the first field that failed."""
    errors = exc.errors()
    if not errors:
        return bad_request("body", "the request body is not valid")
    first = errors[0]
    if first.get("type") == "json_invalid":
        return bad_request("body", "the request body is not valid JSON")
    return bad_request(_param(first.get("loc", ())), str(first.get("msg", "is not valid")))


_TYPE_TAGS = frozenset({"str", "int", "float", "bool", "list", "dict", "none"})


def _param(location: Sequence[object]) -> str:
    """`messages[0].role` from pydantic's ("body", "messages", 0, "role"); the union member a
    location names after the field (`str`, `list[int]`) is left out."""
    param = ""
    for part in location:
        if part == "body" and not param:
            continue
        if isinstance(part, int):
            param += f"[{part}]"
        elif isinstance(part, str) and (part in _TYPE_TAGS or "[" in part or "-" in part):
            break
        else:
            param += f".{part}" if param else str(part)
    return param or "body"
