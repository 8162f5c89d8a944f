"""A deployment's own app factory for the front door's tests: callers name themselves in ``X-Caller`` (a
stand-in for real authentication), so each caller's idempotency keys are its own. Served with
``reservations serve --factory tests.service_callers:app``.
"""

from typing import Annotated

from fastapi import FastAPI, Header, HTTPException

from service import create_app


async def caller(x_caller: Annotated[str | None, Header()] = None) -> str:
    if not x_caller:
        raise HTTPException(401, "name yourself in X-Caller", headers={"WWW-Authenticate": "X-Caller"})
    return x_caller


def app() -> FastAPI:
    return create_app(caller=caller)
