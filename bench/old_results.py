"""The project's worker app as it stored Celery results before ``RESERVATIONS_RESULT_EXPIRES``: every
result kept 24 hours with Celery's extended metadata (task name, arguments, worker, queue). The soak's
baseline runs its workers on it (``celery -A bench.old_results worker``); the settings are the project's.
"""

from __future__ import annotations

from tasks.app import app, settings_of

__all__ = ["EXPIRES", "app"]

EXPIRES = 24 * 3600

# Reading the settings configures the app from the environment first; the two changes then stand.
settings_of(app)
app.conf.update(result_expires=EXPIRES, result_extended=True)
