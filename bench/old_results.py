"""The project's worker app storing Celery results as the project did before ``RESERVATIONS_RESULT_EXPIRES``:
with Celery's extended metadata (task name, arguments, worker, queue, retries) beside every result, which
was then kept 24 hours (:data:`EXPIRES`). Workers run it with ``celery -A bench.old_results worker``; how
long results are kept is the settings' ``RESERVATIONS_RESULT_EXPIRES``, as for the project's app.

The soak's baseline runs on it with results kept :data:`EXPIRES`. The hot-SKU section runs its workers on it
too: it counts each task's Celery retries from that metadata (``AsyncResult.retries``), which results
without it do not carry. The tasks section times the project's own app instead.
"""

from __future__ import annotations

from tasks.app import app
from tasks.settings import settings_of

__all__ = ["EXPIRES", "app"]

EXPIRES = 24 * 3600

# Reading the settings configures the app from the environment first; the change then stands.
settings_of(app)
app.conf.update(result_extended=True)
