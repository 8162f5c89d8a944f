"""Every error under the app answered as a problem document (service.problems): the problems routes
raise, malformed requests, values the domain refuses, what the framework or a caller dependency raises
(unknown paths and methods, 401, 403), and a database or broker that does not answer.
"""

from __future__ import annotations

from fastapi import FastAPI, Request, Response
from fastapi.exceptions import RequestValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from reservations import InvalidRequest
from service.answers import Answer, problem_answer
from service.door import UNANSWERED, unavailable
from service.problems import PROBLEM_MEDIA_TYPE, TYPES, Problem, problem
from service.routes import respond

# The problem types of the statuses the framework or a caller dependency raises.
_BY_STATUS = {401: "unauthorized", 403: "forbidden", 404: "not-found", 405: "method-not-allowed"}


def install(app: FastAPI) -> None:
    @app.exception_handler(Problem)
    async def _problem(request: Request, exc: Problem) -> Response:
        return respond(problem_answer(exc, request.url.path))

    @app.exception_handler(RequestValidationError)
    async def _malformed(request: Request, exc: RequestValidationError) -> Response:
        errors = [
            {"where": ".".join(str(p) for p in error.get("loc", ())), "message": error.get("msg", "")}
            for error in exc.errors()
        ]
        found = problem("invalid-request", "the request is malformed", errors=errors)
        return respond(problem_answer(found, request.url.path))

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException) -> Response:
        # Unknown paths and methods, and what a caller dependency raises (HTTPException(401), ...): the
        # same problem documents as every other error, their headers (Allow, WWW-Authenticate) kept.
        name = _BY_STATUS.get(exc.status_code)
        if name is None:
            body = {"type": "about:blank", "title": exc.detail, "status": exc.status_code}
            return respond(Answer(exc.status_code, body, dict(exc.headers or {}), PROBLEM_MEDIA_TYPE))
        detail = exc.detail if isinstance(exc.detail, str) else TYPES[name].title
        found = problem(name, detail, headers=dict(exc.headers or {}))
        return respond(problem_answer(found, request.url.path))

    @app.exception_handler(InvalidRequest)
    async def _invalid(request: Request, exc: InvalidRequest) -> Response:
        # A path value the domain refuses (a SKU too long or of odd characters): nothing was read.
        found = problem("invalid-request", str(exc), field=exc.field)
        return respond(problem_answer(found, request.url.path))

    for unanswered in UNANSWERED:

        @app.exception_handler(unanswered)
        async def _unanswered(request: Request, exc: Exception) -> Response:
            return respond(unavailable("database", exc))
