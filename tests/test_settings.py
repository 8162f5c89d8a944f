"""The one settings object: every variable declared once, every problem named by its variable and all
reported together, passwords from files for every URL that can carry one, numbers in the command line's
grammar, URLs a worker can build; what a worker and the command line make of them at start:
``tests/test_settings_at_start.py``.
"""

from __future__ import annotations

import os
import subprocess
import sys
from dataclasses import fields
from pathlib import Path

import pytest

import tasks.request_tasks  # noqa: F401  (declares the tasks each app binds)
from tasks import create_app
from tasks.app import SCHEDULED_RESULT_EXPIRES
from tasks.settings import PREFIX, VARIABLES, Settings, SettingsError, variable
from testing.celery_processes import worker_env
from testing.support import run


@pytest.fixture
def secret(tmp_path: Path) -> Path:
    path = tmp_path / "password"
    path.write_text("p@ss:w/rd%\n")  # a trailing newline, as `echo` or an editor leave it
    return path


# -- the table -------------------------------------------------------------------------------------------


def test_every_field_is_one_variable_with_its_help() -> None:
    settable = [f.name for f in fields(Settings) if f.name not in ("sources", "password_files")]
    assert [v.field for v in VARIABLES] == settable
    assert [v.name for v in VARIABLES] == [PREFIX + name.upper() for name in settable]
    assert all(v.help for v in VARIABLES)
    assert variable("lease_ttl").name == "RESERVATIONS_LEASE_TTL"
    assert variable("database_url").password_file == "RESERVATIONS_DATABASE_PASSWORD_FILE"
    assert variable("result_backend").password_file == "RESERVATIONS_RESULT_BACKEND_PASSWORD_FILE"


def test_an_empty_environment_is_the_defaults() -> None:
    settings = Settings.from_env({})
    assert settings == Settings()
    assert settings.lease_url == settings.database_url
    assert {v.field: settings.source(v.field) for v in VARIABLES} == {v.field: "default" for v in VARIABLES}
    assert settings.to_env() == {}


def test_every_problem_is_named_and_reported_at_once(tmp_path: Path) -> None:
    with pytest.raises(SettingsError) as caught:
        Settings.from_env(
            {
                "RESERVATIONS_LEASE_TTL": "abc",
                "RESERVATIONS_MAX_EPOCHS": "0",
                "RESERVATIONS_BATCH_SIZE": "2.5",
                "RESERVATIONS_BATCHING": "maybe",
                "RESERVATIONS_BROKER_PASSWORD_FILE": str(tmp_path / "missing"),
            }
        )
    assert caught.value.problems == [
        f"RESERVATIONS_BROKER_PASSWORD_FILE: cannot read {tmp_path / 'missing'}: No such file or directory",
        "RESERVATIONS_LEASE_TTL must be a number written with the digits 0-9, like 2 or 0.5, got 'abc'",
        "RESERVATIONS_MAX_EPOCHS must be between 1 and 100, got 0",
        "RESERVATIONS_BATCHING must be 1 or 0, got 'maybe'",
        "RESERVATIONS_BATCH_SIZE must be a whole number written with the digits 0-9, got '2.5'",
    ]
    assert "\n" not in str(caught.value)
    with pytest.raises(SettingsError, match=r"RESERVATIONS_VISIBILITY_TIMEOUT .* RESERVATIONS_LEASE_TTL"):
        Settings.from_env({"RESERVATIONS_LEASE_TTL": "100", "RESERVATIONS_VISIBILITY_TIMEOUT": "300"})


def test_to_env_reproduces_the_settings_and_masked_hides_passwords() -> None:
    settings = Settings(
        database_url="postgresql://app:s3cret@db/inv",
        lease_url="redis://:pw2@r:6379/2",
        lease_ttl=2.5,
        lease_renew_every=1.0,
        batching=False,
        max_epochs=5,
    )
    env = settings.to_env()
    assert env["RESERVATIONS_BATCHING"] == "0" and "RESERVATIONS_BROKER_URL" not in env
    again = Settings.from_env(env)
    assert again == settings
    assert again.source("lease_ttl") == "environment" and again.source("broker_url") == "default"
    shown = " ".join(settings.masked().values()) + repr(settings)
    assert "s3cret" not in shown and "pw2" not in shown and "***" in shown


def test_a_lease_url_left_to_default_follows_the_database() -> None:
    settings = Settings(database_url="sqlite:///a.sqlite3").with_(database_url="sqlite:///b.sqlite3")
    assert settings.lease_url == "sqlite:///b.sqlite3" and "RESERVATIONS_LEASE_URL" not in settings.to_env()
    own = Settings(lease_url="redis://r/2").with_(database_url="sqlite:///b.sqlite3")
    assert own.lease_url == "redis://r/2"


# -- passwords from files --------------------------------------------------------------------------------


def test_every_url_that_can_carry_a_password_takes_it_from_a_file(secret: Path) -> None:
    env = {
        "RESERVATIONS_DATABASE_URL": "postgresql://app@db:5432/inv",
        "RESERVATIONS_LEASE_URL": "postgresql://leases@db2:5432/inv",
        "RESERVATIONS_BROKER_URL": "amqp://app@mq:5672/",
        "RESERVATIONS_RESULT_BACKEND": "redis://r:6379/1",
        **{v.password_file: str(secret) for v in VARIABLES if v.url},
    }
    settings = Settings.from_env(env)
    quoted = "p%40ss%3Aw%2Frd%25"
    assert settings.database_url == f"postgresql://app:{quoted}@db:5432/inv"
    assert settings.lease_url == f"postgresql://leases:{quoted}@db2:5432/inv"
    assert settings.broker_url == f"amqp://app:{quoted}@mq:5672/"
    assert settings.result_backend == f"redis://:{quoted}@r:6379/1"
    assert {settings.source(v.field) for v in VARIABLES if v.url} == {"file"}
    assert quoted not in repr(settings)
    # The password stays in its file: the variables name the file, the URLs go without it.
    assert settings.to_env() == env
    assert Settings.from_env(settings.to_env()) == settings


def test_a_password_file_that_cannot_be_used_is_named(secret: Path, tmp_path: Path) -> None:
    with pytest.raises(SettingsError, match=r"^RESERVATIONS_LEASE_PASSWORD_FILE: cannot read"):
        Settings.from_env(
            {
                "RESERVATIONS_LEASE_URL": "redis://r/2",
                "RESERVATIONS_LEASE_PASSWORD_FILE": str(tmp_path / "missing"),
            }
        )
    # A URL that already has a password, or no host (the default SQLite file), takes none from a file.
    with pytest.raises(SettingsError, match="RESERVATIONS_RESULT_BACKEND_PASSWORD_FILE needs"):
        Settings.from_env(
            {
                "RESERVATIONS_RESULT_BACKEND": "redis://:other@r/1",
                "RESERVATIONS_RESULT_BACKEND_PASSWORD_FILE": str(secret),
            }
        )
    with pytest.raises(SettingsError, match="RESERVATIONS_DATABASE_PASSWORD_FILE needs"):
        Settings.from_env({"RESERVATIONS_DATABASE_PASSWORD_FILE": str(secret)})


@pytest.mark.parametrize("content", [b"\xff\xfepass\n", None], ids=["not-utf8", "directory"])
def test_a_password_file_that_is_no_text_file_is_named(tmp_path: Path, content: bytes | None) -> None:
    path = tmp_path / "password"
    if content is None:
        path.mkdir()
    else:
        path.write_bytes(content)
    env = {"RESERVATIONS_BROKER_URL": "redis://mq/0", "RESERVATIONS_BROKER_PASSWORD_FILE": str(path)}
    with pytest.raises(SettingsError, match=r"^RESERVATIONS_BROKER_PASSWORD_FILE: .*(UTF-8|regular file)"):
        Settings.from_env(env)


def test_a_password_file_that_is_a_fifo_without_a_writer_is_named_at_once(tmp_path: Path) -> None:
    """Reading a FIFO nobody writes to blocks forever: the settings are read in a child process, which
    must answer within the timeout instead of hanging a worker's start."""
    fifo = tmp_path / "password"
    os.mkfifo(fifo)
    env = worker_env({"RESERVATIONS_LEASE_URL": "redis://r/2", "RESERVATIONS_LEASE_PASSWORD_FILE": str(fifo)})
    program = (
        "from tasks.settings import Settings, SettingsError\n"
        "try:\n    Settings.from_env()\nexcept SettingsError as exc:\n    print(exc)\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", program], env=env, capture_output=True, text=True, timeout=30, check=False
    )
    assert done.stdout.strip() == f"RESERVATIONS_LEASE_PASSWORD_FILE: {fifo} is not a regular file"


# -- one grammar for numbers, URLs a worker can build ----------------------------------------------------

# What Python's int() or float() take and the command line refuses: spaces, underscores, other scripts'
# digits, exponents, signs, nan and inf.
NOT_WRITTEN_AS_A_COUNT = ["\u0661\u0660", "1_0", "1e3", " 3", "3 ", "+3", "-1", "nan", "inf", "0x10", "1.0"]


@pytest.mark.parametrize("raw", NOT_WRITTEN_AS_A_COUNT)
def test_a_count_is_written_as_the_command_line_takes_it(raw: str) -> None:
    with pytest.raises(SettingsError, match=r"^RESERVATIONS_MAX_RETRIES must be a whole number written"):
        Settings.from_env({"RESERVATIONS_MAX_RETRIES": raw})
    code, _, stderr = run("reserve", "--key", "k-1", "--", "WIDGET", raw, env={})
    assert code == 2 and "digits 0-9" in stderr


@pytest.mark.parametrize("raw", [r for r in NOT_WRITTEN_AS_A_COUNT if r != "1.0"])
def test_seconds_are_written_as_the_command_line_takes_them(raw: str) -> None:
    with pytest.raises(SettingsError, match=r"^RESERVATIONS_LEASE_TTL must be a number written"):
        Settings.from_env({"RESERVATIONS_LEASE_TTL": raw})
    assert Settings.from_env({"RESERVATIONS_LEASE_TTL": "2.5"}).lease_ttl == 2.5


def test_a_renewal_not_due_before_the_lease_runs_out_is_refused() -> None:
    for every in ("10", "12"):
        with pytest.raises(SettingsError, match=r"RESERVATIONS_LEASE_RENEW_EVERY \(.*\) must be shorter"):
            Settings.from_env({"RESERVATIONS_LEASE_TTL": "10", "RESERVATIONS_LEASE_RENEW_EVERY": every})
    assert Settings.from_env({"RESERVATIONS_LEASE_TTL": "10", "RESERVATIONS_LEASE_RENEW_EVERY": "9.5"})


def test_transaction_pooling_is_a_postgresql_setting_of_two_words() -> None:
    pooled = {"RESERVATIONS_DATABASE_URL": "postgresql://app@pgbouncer:6432/inv"}
    settings = Settings.from_env({**pooled, "RESERVATIONS_DATABASE_POOLING": "transaction"})
    assert settings.database_pooling == "transaction" and Settings().database_pooling == "session"
    with pytest.raises(SettingsError) as caught:
        Settings.from_env({**pooled, "RESERVATIONS_DATABASE_POOLING": "statement"})
    assert caught.value.problems == [
        "RESERVATIONS_DATABASE_POOLING must be session or transaction, got 'statement'"
    ]
    with pytest.raises(SettingsError, match=r"^RESERVATIONS_DATABASE_POOLING=transaction needs a PostgreSQL"):
        Settings.from_env({"RESERVATIONS_DATABASE_POOLING": "transaction"})  # the SQLite default


# Each URL or prefix a worker could not build its clients from, and the variable its problem names.
UNUSABLE = [
    ({"RESERVATIONS_LEASE_URL": "ftp://x"}, "RESERVATIONS_LEASE_URL: unsupported lease URL ftp://x"),
    (
        {"RESERVATIONS_LEASE_URL": "redis+sentinel://:pw@s1:26379,s2:26379"},
        "RESERVATIONS_LEASE_URL: not a usable Redis URL",
    ),
    ({"RESERVATIONS_LEASE_URL": "redis://r:port/2"}, "RESERVATIONS_LEASE_URL: not a usable Redis URL"),
    ({"RESERVATIONS_LEASE_PREFIX": "bad{prefix}"}, "RESERVATIONS_LEASE_PREFIX 'bad{prefix}'"),
    ({"RESERVATIONS_DATABASE_URL": "garbage"}, "RESERVATIONS_DATABASE_URL: not a database URL"),
    ({"RESERVATIONS_DATABASE_URL": "mysql://db/inv"}, "RESERVATIONS_DATABASE_URL: unsupported database"),
    ({"RESERVATIONS_BROKER_URL": "ftp://mq/0"}, "RESERVATIONS_BROKER_URL: unsupported URL"),
    ({"RESERVATIONS_BROKER_URL": "redis-on-port-6379"}, "RESERVATIONS_BROKER_URL: unsupported URL"),
    ({"RESERVATIONS_RESULT_BACKEND": "redis://r:x/1"}, "RESERVATIONS_RESULT_BACKEND: the URL's port"),
    ({"RESERVATIONS_RESULT_BACKEND": "mongodb://r/1"}, "RESERVATIONS_RESULT_BACKEND: unsupported URL"),
]


@pytest.mark.parametrize(("env", "problem"), UNUSABLE, ids=[next(iter(e)) for e, _ in UNUSABLE])
def test_a_url_a_worker_cannot_use_is_named(env: dict[str, str], problem: str) -> None:
    with pytest.raises(SettingsError) as caught:
        Settings.from_env(env)
    assert len(caught.value.problems) == 1 and caught.value.problems[0].startswith(problem)
    assert "pw@" not in str(caught.value)
    code, stdout, stderr = run("config", env=env)  # the command line reports the same
    assert code == 2 and stdout == "" and problem in stderr


# -- Sentinel: the broker and result backend's service, their URLs' parts; republishing -----------------

SENTINELS = "sentinel://s1:26379/{db};sentinel://s2:26380/{db};sentinel://s3:26381/{db}"


def test_a_sentinel_broker_and_result_backend_need_the_name_of_their_service() -> None:
    env = {
        "RESERVATIONS_BROKER_URL": SENTINELS.format(db=0),
        "RESERVATIONS_RESULT_BACKEND": SENTINELS.format(db=1),
    }
    with pytest.raises(SettingsError) as caught:
        Settings.from_env(env)
    assert caught.value.problems == [
        f"RESERVATIONS_{name} is a sentinel:// URL: RESERVATIONS_SENTINEL_MASTER must name the Sentinel "
        "service of its Redis"
        for name in ("BROKER_URL", "RESULT_BACKEND")
    ]
    code, stdout, stderr = run("config", env=env)  # the command line refuses it alike
    assert code == 2 and stdout == "" and "RESERVATIONS_SENTINEL_MASTER" in stderr
    settings = Settings.from_env({**env, "RESERVATIONS_SENTINEL_MASTER": "broker"})
    assert (settings.broker_url, settings.sentinel_master) == (SENTINELS.format(db=0), "broker")
    assert Settings.from_env(settings.to_env()) == settings


# Each sentinel:// URL a worker could not use, and what its problem says.
UNUSABLE_SENTINELS = [
    ("sentinel://:pw@s1:26379/0;redis://:pw@r:6379/0", "only a sentinel:// URL names several hosts"),
    ("redis://r1:6379/0;redis://r2:6379/0", "only a sentinel:// URL names several hosts"),
    ("sentinel://s1:26379/0;sentinel://s2:port/0", "the URL's port is not a number"),
    ("sentinel://:pw@s1:26379/0;", "unsupported URL sentinel://:***@s1:26379/0;"),
]


@pytest.mark.parametrize(("url", "problem"), UNUSABLE_SENTINELS)
def test_every_part_of_a_sentinel_url_is_checked(url: str, problem: str) -> None:
    env = {"RESERVATIONS_BROKER_URL": url, "RESERVATIONS_SENTINEL_MASTER": "broker"}
    with pytest.raises(SettingsError) as caught:
        Settings.from_env(env)
    assert caught.value.problems[0].startswith(f"RESERVATIONS_BROKER_URL: {problem}")
    assert len(caught.value.problems) == 1 and "pw@" not in str(caught.value)


def test_a_password_file_puts_the_password_in_every_sentinel_part(secret: Path) -> None:
    env = {
        "RESERVATIONS_BROKER_URL": SENTINELS.format(db=0),
        "RESERVATIONS_BROKER_PASSWORD_FILE": str(secret),
        "RESERVATIONS_RESULT_BACKEND": SENTINELS.format(db=1),
        "RESERVATIONS_RESULT_BACKEND_PASSWORD_FILE": str(secret),
        "RESERVATIONS_SENTINEL_MASTER": "broker",
    }
    settings = Settings.from_env(env)
    quoted = "p%40ss%3Aw%2Frd%25"
    # kombu reads the password from the part it connects through, Celery's result backend from the first.
    assert settings.broker_url == SENTINELS.format(db=0).replace("sentinel://", f"sentinel://:{quoted}@")
    assert settings.result_backend == SENTINELS.format(db=1).replace("sentinel://", f"sentinel://:{quoted}@")
    assert settings.masked()["broker_url"] == SENTINELS.format(db=0).replace(
        "sentinel://", "sentinel://:***@"
    )
    assert quoted not in repr(settings)
    assert settings.to_env() == env and Settings.from_env(settings.to_env()) == settings
    with pytest.raises(SettingsError, match=r"RESERVATIONS_BROKER_PASSWORD_FILE needs .* no password"):
        Settings.from_env(
            {**env, "RESERVATIONS_BROKER_URL": "sentinel://s1:26379/0;sentinel://:pw@s2:26380/0"}
        )


def test_the_relay_looks_after_10_seconds_every_5_and_caps_at_6_publications_by_default() -> None:
    assert (Settings().republish_after, Settings().relay_every, Settings().max_publishes) == (10.0, 5.0, 6)
    assert Settings.from_env({"RESERVATIONS_REPUBLISH_AFTER": "2.5"}).republish_after == 2.5
    assert Settings.from_env({"RESERVATIONS_RELAY_EVERY": "0"}).relay_every == 0.0  # no relay here
    with pytest.raises(SettingsError, match=r"RESERVATIONS_REPUBLISH_AFTER must be between 0\.05 and 3600"):
        Settings.from_env({"RESERVATIONS_REPUBLISH_AFTER": "0"})
    with pytest.raises(SettingsError, match="RESERVATIONS_MAX_PUBLISHES must be between 1 and 1000"):
        Settings.from_env({"RESERVATIONS_MAX_PUBLISHES": "0"})


def test_requests_keep_no_celery_result_by_default_and_whole_seconds_when_asked() -> None:
    assert Settings().result_expires == 0
    assert Settings.from_env({"RESERVATIONS_RESULT_EXPIRES": "3600"}).result_expires == 3600
    # Celery's Redis backend keeps whole seconds: a fraction would be cut to 0, which it takes as "forever".
    with pytest.raises(SettingsError, match=r"^RESERVATIONS_RESULT_EXPIRES must be a whole number written"):
        Settings.from_env({"RESERVATIONS_RESULT_EXPIRES": "0.5"})
    with pytest.raises(SettingsError, match="RESERVATIONS_RESULT_EXPIRES must be between 0 and 604800"):
        Settings.from_env({"RESERVATIONS_RESULT_EXPIRES": "604801"})


@pytest.mark.parametrize("expires", [0, 60])
def test_request_tasks_store_results_only_when_kept_and_the_schedule_always(expires: int) -> None:
    app = create_app(Settings(result_expires=expires))
    try:
        assert app.conf.result_expires == (expires or SCHEDULED_RESULT_EXPIRES)
        assert app.conf.result_extended is False
        requests = ("reserve", "reserve_order", "confirm", "release", "restock", "count", "replenish")
        assert {app.tasks[f"reservations.{name}"].ignore_result for name in requests} == {not expires}
        # The sweeps and the purge: a few results per interval, whatever the traffic.
        assert not app.tasks["reservations.serve_waiting"].ignore_result
        assert not app.tasks["reservations.purge"].ignore_result
    finally:
        app.close()


@pytest.mark.parametrize("ttl", ["1", "2.5"])
def test_an_etcd_lease_url_needs_a_ttl_etcd_can_keep(ttl: str) -> None:
    env = {"RESERVATIONS_LEASE_URL": "etcd://e1:2379,e2:2379,e3:2379/leases", "RESERVATIONS_LEASE_TTL": ttl}
    with pytest.raises(SettingsError, match=r"LEASE_TTL .* whole seconds, 2 or more, on etcd"):
        Settings.from_env(env)
    assert Settings.from_env({**env, "RESERVATIONS_LEASE_TTL": "2"}).lease_ttl == 2
