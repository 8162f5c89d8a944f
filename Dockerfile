# One image for every process of the project: workers, migrations and the admin CLI.
FROM python:3.11-slim
WORKDIR /app
COPY requirements.lock pyproject.toml README.md ./
RUN python -m pip install --no-cache-dir --require-hashes -r requirements.lock
COPY fencing fencing
COPY reservations reservations
COPY tasks tasks
COPY admin admin
RUN python -m pip install --no-cache-dir --no-deps --no-build-isolation -e .
USER nobody
ENTRYPOINT ["reservations"]
