# One image for every process of the project: workers, beat, migrations and the admin CLI.
# The project is built into a wheel and installed like any dependency (not editable): the image holds no
# source tree, only the installed packages and alembic.ini for the alembic CLI.
FROM python:3.11-slim AS wheel
WORKDIR /src
COPY requirements.lock ./
RUN python -m pip install --no-cache-dir --require-hashes -r requirements.lock
COPY pyproject.toml README.md ./
COPY fencing fencing
COPY reservations reservations
COPY tasks tasks
COPY admin admin
RUN python -m pip wheel --no-cache-dir --no-deps --no-build-isolation --wheel-dir /wheels .

FROM python:3.11-slim
WORKDIR /app
COPY requirements.lock ./
RUN python -m pip install --no-cache-dir --require-hashes -r requirements.lock
COPY --from=wheel /wheels /wheels
RUN python -m pip install --no-cache-dir --no-deps /wheels/*.whl && rm -rf /wheels
# `alembic upgrade head` / `alembic check` from /app, with RESERVATIONS_DATABASE_URL (see alembic.ini).
COPY alembic.ini ./
USER nobody
ENTRYPOINT ["reservations"]
