"""``reservations serve``: the HTTP front door under uvicorn.

The command imports nothing of the service: uvicorn imports the app factory by name in each of its
worker processes (``service:create_app``, or a deployment's own factory that passes a ``caller``), so this
floor and the service's stay apart. The settings given before the command reach every process through
the environment, as the Celery workers' do.
"""

from __future__ import annotations

import math
import os
import sys
from typing import Annotated

import typer

from admin.cli.context import config
from admin.cli.options import count
from admin.cli.render import err
from tasks.logs import dict_config, say
from tasks.settings import json_logs

DEFAULT_FACTORY = "service:create_app"
# After a stop signal uvicorn waits this long past the longest wait a request may be given (its answer
# then is the outcome or 202): every request in flight is answered before the process exits.
SHUTDOWN_MARGIN = 5.0


def serve_command(
    host: Annotated[str, typer.Option(help="Address to listen on (0.0.0.0: every interface).")] = "127.0.0.1",
    port: Annotated[int, count("--port", 1, 65535, "Port to listen on.")] = 8000,
    workers: Annotated[int, count("--workers", 1, 64, "uvicorn worker processes.")] = 1,
    factory: Annotated[
        str,
        typer.Option(
            help="module:function building the app (a deployment's own, to pass a caller dependency)."
        ),
    ] = DEFAULT_FACTORY,
    access_log: Annotated[bool, typer.Option(help="Log every request (uvicorn's access log).")] = True,
) -> None:
    """WRITES (through the workers): serve the HTTP front door. POST /reservations, confirm, release
    and count enqueue requests under their Idempotency-Key; GET reads outcomes and stock; /healthz,
    /readyz, /metrics, /docs (OpenAPI).

    On SIGTERM or Ctrl-C it stops accepting connections and answers every request in flight (its
    outcome, or 202 with its Location) before it exits.

    Example: reservations serve --host 0.0.0.0 --port 8000 --workers 2
    """
    import uvicorn

    settings = config.settings
    os.environ.update(settings.to_env())
    # A deployment's own factory is found as uvicorn's command finds an app: from the current directory
    # (uvicorn's worker processes inherit the path).
    if os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())
    if json_logs():
        say(f"serving {factory} on http://{host}:{port} ({workers} process(es))", logger="reservations.cli")
    else:
        err.print(f"serving {factory} on http://{host}:{port} ({workers} process(es))", highlight=False)
    uvicorn.run(
        factory,
        factory=True,
        host=host,
        port=port,
        workers=workers,
        loop="uvloop",
        http="httptools",
        access_log=access_log,
        timeout_graceful_shutdown=math.ceil(settings.http_max_wait + SHUTDOWN_MARGIN),
        # With RESERVATIONS_LOG_FORMAT=json uvicorn's lines and the service's are JSON objects too.
        log_config=dict_config() if json_logs() else uvicorn.config.LOGGING_CONFIG,
    )
