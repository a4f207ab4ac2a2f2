"""The FastAPI plumbing the routes share: the service and the key as dependencies, the body's
JSON parsed with this server's own errors, the body-size and body-time limits as an ASGI
middleware, and server-sent events with keep-alive pings."""

from __future__ import annotations

import asyncio
import hmac
import json
from typing import Annotated, AsyncIterator, Callable

from fastapi import Depends, Request
from fastapi.responses import StreamingResponse
from fastapi.routing import APIRoute
from fastapi.security import APIKeyHeader, HTTPAuthorizationCredentials, HTTPBearer

from .errors import APIError, error_response
from .service import Service


def get_service(request: Request) -> Service:
    return request.app.state.service


_bearer = HTTPBearer(auto_error=False)
_x_api_key = APIKeyHeader(name="x-api-key", auto_error=False)


def authorize(service: Annotated[Service, Depends(get_service)],
              bearer: Annotated[HTTPAuthorizationCredentials | None, Depends(_bearer)],
              x_api_key: Annotated[str | None, Depends(_x_api_key)]) -> None:
    """The key of `Authorization: Bearer KEY` or `x-api-key: KEY` (that one first; an empty
    header counts as none)."""
    key = service.config.api_key
    if key is None:
        return
    given = x_api_key or (bearer.credentials if bearer is not None else None)
    # constant time: the comparison does not leak how much of the key matched
    if not given or not hmac.compare_digest(given.encode(), key.encode()):
        raise APIError(401, "invalid or missing API key (Authorization: Bearer KEY or "
                       "x-api-key: KEY)", kind="authentication_error", code="invalid_api_key")


Authorized = Depends(authorize)
ServiceDep = Annotated[Service, Depends(get_service)]


# --------------------------------------------------------------------------- the JSON body

def _reject_constant(name: str):
    raise ValueError(f"{name} is not valid JSON")


def _lone_surrogate(data) -> str | None:
    """The path of the first string (key or value) holding a lone surrogate ("\\ud800"), which
    JSON escapes allow and no tokenizer or UTF-8 encoder takes; None if there is none."""
    todo = [((), data)]
    while todo:                       # not recursive: the nesting may be as deep as json allows
        path, x = todo.pop()
        items = (x.items() if isinstance(x, dict) else enumerate(x) if isinstance(x, list)
                 else ())
        for k, v in items:
            for s in (k, v):
                if isinstance(s, str):
                    try:
                        s.encode("utf-8")
                    except UnicodeEncodeError:
                        return ".".join(map(str, path + (k,)))
            if isinstance(v, (dict, list)):
                todo.append((path + (k,), v))
    return None


def parse_body(body: bytes) -> dict:
    """The request body: a JSON object of valid Unicode, or an APIError 400 that says why."""
    try:
        data = json.loads(body, parse_constant=_reject_constant)
    except RecursionError:
        raise APIError(400, "the request body is not valid JSON: it is nested too deeply") \
            from None
    except (ValueError, UnicodeDecodeError) as e:
        raise APIError(400, f"the request body is not valid JSON: {e}") from None
    if not isinstance(data, dict):
        raise APIError(400, "the request body must be a JSON object")
    if (where := _lone_surrogate(data)) is not None:
        raise APIError(400, f"{where}: the text holds a lone surrogate escape (such as "
                       "\\ud800), which is not valid Unicode", param=where)
    return data


class JSONRequest(Request):
    """A request whose `json()` is `parse_body`'s: FastAPI calls it to fill the route's body
    parameter, and passes the APIError it raises on unchanged."""

    async def json(self):
        if not hasattr(self, "_json"):
            self._json = parse_body(await self.body())
        return self._json


class JSONRoute(APIRoute):
    """The routers' route class (FastAPI's documented way to customise the request)."""

    def get_route_handler(self) -> Callable:
        handler = super().get_route_handler()

        async def route_handler(request: Request):
            return await handler(JSONRequest(request.scope, request.receive))
        return route_handler


class BodyLimit:
    """ASGI middleware: reads a request's body before the app sees it, answering 413 past
    `limit` bytes and 408 when the client sends nothing for `timeout` seconds; the body is then
    replayed to the app (which sees later messages, e.g. a disconnect, as they come). Every
    body is taken as JSON, whatever its content type (curl -d sends a form type)."""

    def __init__(self, app, limit: int, timeout: float):
        self.app, self.limit, self.timeout = app, limit, timeout

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or scope["method"] in ("GET", "HEAD", "OPTIONS"):
            return await self.app(scope, receive, send)
        path = scope["path"]
        declared = next((v for k, v in scope["headers"] if k == b"content-length"),
                        b"").decode("latin-1")
        if declared.isdigit() and int(declared) > self.limit:
            return await self._refuse(APIError(413, f"the request body is {declared} bytes; "
                                               f"the limit is {self.limit}"), path, scope, send)
        body, more = bytearray(), True
        while more:
            try:
                message = await asyncio.wait_for(receive(), self.timeout)
            except asyncio.TimeoutError:
                return await self._refuse(APIError(408, "the request body did not arrive "
                                                   f"within {self.timeout:g} s"), path,
                                          scope, send)
            if message["type"] == "http.disconnect":
                return                                  # nobody to answer
            body += message.get("body", b"")
            more = message.get("more_body", False)
            if len(body) > self.limit:
                return await self._refuse(APIError(
                    413, f"the request body is over the limit of {self.limit} bytes"),
                    path, scope, send)
        replayed = False

        async def replay():
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": bytes(body), "more_body": False}
            return await receive()

        headers = [(k, v) for k, v in scope["headers"] if k != b"content-type"]
        scope = {**scope, "headers": headers + [(b"content-type", b"application/json")]}
        await self.app(scope, replay, send)

    @staticmethod
    async def _refuse(err: APIError, path: str, scope, send):
        # the rest of the body is not read: the connection cannot serve another request
        response = error_response(err, path, headers={"Connection": "close"},
                                  method=scope["method"])
        await response(scope, None, send)


# --------------------------------------------------------------------------- server-sent events

def sse(data: dict | str, event: str | None = None) -> str:
    body = data if isinstance(data, str) else json.dumps(data, ensure_ascii=False)
    return (f"event: {event}\n" if event else "") + f"data: {body}\n\n"


# a comment line, which SSE clients ignore: sent while no event came for a while (a long
# prefill sends nothing, and clients and proxies close a silent connection)
PING = ": ping\n\n"


def event_stream(chunks: AsyncIterator[str], headers: dict | None = None) -> StreamingResponse:
    return StreamingResponse(chunks, media_type="text/event-stream",
                             headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no",
                                      **(headers or {})})
