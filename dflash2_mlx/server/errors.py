"""Errors in the called API's own shape: `{"error": {...}}` for OpenAI, `{"type": "error",
"error": {...}}` for Anthropic (routes under /v1/messages), with the field named where there is
one; and the app's exception handlers, which answer every failure so."""

from __future__ import annotations

from fastapi import FastAPI, HTTPException, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from .. import log as logs
from .. import settings as check

log = logs.get(__name__)


class APIError(HTTPException):
    """An error answered in the called API's own shape. kind: an OpenAI error type; the
    Anthropic type is derived from the status. An HTTPException, so that FastAPI passes it on
    unchanged from wherever it is raised (the body parser included)."""

    def __init__(self, status: int, message: str, *, param: str | None = None,
                 code: str | None = None, kind: str = "invalid_request_error"):
        super().__init__(status, message)
        self.status, self.message, self.param, self.code, self.kind = \
            status, message, param, code, kind

    def __str__(self) -> str:
        return self.message


ANTHROPIC_ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error",
                         403: "permission_error", 404: "not_found_error",
                         405: "invalid_request_error", 408: "timeout_error",
                         413: "request_too_large", 429: "rate_limit_error",
                         503: "overloaded_error"}


def is_anthropic(path: str) -> bool:
    return path.startswith("/v1/messages")


def error_body(err: APIError, anthropic: bool) -> dict:
    if anthropic:
        return {"type": "error", "error": {
            "type": ANTHROPIC_ERROR_TYPES.get(err.status, "api_error"), "message": err.message}}
    return {"error": {"message": err.message, "type": err.kind, "param": err.param,
                      "code": err.code}}


def error_response(err: APIError, path: str, headers: dict | None = None,
                   method: str = "POST") -> JSONResponse:
    """The error in the called API's shape; a refusal (4xx) is also one log line, with the
    route, the status and the reason (never the body)."""
    if 400 <= err.status < 500:
        log.warning(f"{method} {path} {err.status}: {err.message}")
    return JSONResponse(error_body(err, is_anthropic(path)), err.status, headers=headers)


# --------------------------------------------------------------------------- validation errors

_UNION_TAGS = {"str", "int", "float", "bool", "none", "dict", "list"}


def _field_path(loc: tuple) -> tuple:
    """A pydantic error location without its union-branch tags ('str', 'list[TextPart]') and
    FastAPI's 'body' prefix."""
    loc = loc[1:] if loc[:1] == ("body",) else loc
    return tuple(p for p in loc if not (isinstance(p, str) and (
        p in _UNION_TAGS or "[" in p or p[:1].isupper())))


def _complaint(error: dict) -> str:
    """pydantic's message, or a `settings` validator's own words (without pydantic's "Value
    error, " and the validator's default name: the field is named by the caller)."""
    cause = (error.get("ctx") or {}).get("error")
    return cause.problem if isinstance(cause, check.SettingError) else error["msg"]


def validation_error(e: ValidationError | RequestValidationError) -> APIError:
    """The first bad field, named; where it failed every branch of a union, the deepest
    complaint (an image part in `content`: "...content.0.type: Input should be 'text'")."""
    errors = list(e.errors())
    field0 = _field_path(errors[0]["loc"])
    same = [x for x in errors if _field_path(x["loc"])[:len(field0)] == field0]
    depth = max(len(_field_path(x["loc"])) for x in same)
    path = next(_field_path(x["loc"]) for x in same if len(_field_path(x["loc"])) == depth)
    deepest = [x for x in same if _field_path(x["loc"]) == path]
    where = ".".join(str(p) for p in path)
    msg = " or ".join(dict.fromkeys(_complaint(x) for x in deepest))
    return APIError(400, f"{where}: {msg}" if where else msg, param=where or None)


# --------------------------------------------------------------------------- handlers

def add_handlers(app: FastAPI) -> None:
    """Every error in the shape of the API that was called."""

    @app.exception_handler(APIError)
    async def _api_error(request: Request, err: APIError):
        return error_response(err, request.url.path, method=request.method)

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, exc: RequestValidationError):
        return error_response(validation_error(exc), request.url.path, method=request.method)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException):
        err = APIError(exc.status_code, str(exc.detail), kind="invalid_request_error")
        return error_response(err, request.url.path, method=request.method)

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception):
        # Starlette re-raises the exception after this answer, and the server then drops the
        # connection: say so, or a pooled client's next request on it fails with a reset
        log.exception("unexpected error")
        err = APIError(500, f"internal error: {type(exc).__name__}", kind="server_error")
        return error_response(err, request.url.path, headers={"Connection": "close"})
