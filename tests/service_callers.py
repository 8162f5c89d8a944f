"""A deployment's own app factories for the front door's tests: callers name themselves in ``X-Caller`` (a
stand-in for real authentication), so each caller's idempotency keys are its own. Served with
``reservations serve --factory tests.service_callers:app`` (a caller must name itself: 401 otherwise) or
``tests.service_callers:open_app`` (a caller that names nobody is anonymous; a name is passed on as sent,
so a test can send one the service must refuse).
"""

from typing import Annotated

from fastapi import FastAPI, Header, HTTPException

from service import create_app


async def caller(x_caller: Annotated[str | None, Header()] = None) -> str:
    if not x_caller:
        raise HTTPException(401, "name yourself in X-Caller", headers={"WWW-Authenticate": "X-Caller"})
    return x_caller


async def named_or_anonymous(x_caller: Annotated[str | None, Header()] = None) -> str | None:
    return x_caller or None


def app() -> FastAPI:
    return create_app(caller=caller)


def open_app() -> FastAPI:
    return create_app(caller=named_or_anonymous)
