# One image for every process of the project: workers, beat, migrations and the admin CLI.
# The project is built into a wheel and installed like any dependency (not editable): the image holds no
# source tree, only the installed packages and alembic.ini for the alembic CLI. Only the runtime lock
# (requirements.lock: the [project] dependencies, hash-pinned) is installed: no test runner, linter or
# type checker; `make lock` writes it beside the dev lock the virtual environment uses.
# An exact Python and Debian release: a rebuild months later installs onto the same interpreter.
ARG PYTHON_IMAGE=python:3.11.9-slim-bookworm

FROM ${PYTHON_IMAGE} AS wheel
WORKDIR /src
COPY pyproject.toml README.md ./
COPY fencing fencing
COPY reservations reservations
COPY tasks tasks
COPY admin admin
COPY service service
COPY testing testing
# The build backend (pyproject's [build-system]) is fetched into an isolated build environment of this
# stage only; the wheel it makes is pure Python, and nothing else of this stage reaches the image.
RUN python -m pip wheel --no-cache-dir --no-deps --wheel-dir /wheels .

FROM ${PYTHON_IMAGE}
WORKDIR /app
COPY requirements.lock ./
RUN python -m pip install --no-cache-dir --require-hashes -r requirements.lock
COPY --from=wheel /wheels /wheels
RUN python -m pip install --no-cache-dir --no-deps /wheels/*.whl && rm -rf /wheels
# `alembic upgrade head` / `alembic check` from /app, with RESERVATIONS_DATABASE_URL (see alembic.ini).
COPY alembic.ini ./
USER nobody
ENTRYPOINT ["reservations"]
