"""The settings object lives in the domain package (:mod:`reservations.settings`, which lists every variable);
re-exported here, where workers and producers have always imported it from.
"""

from reservations.settings import (
    PREFIX,
    Settings,
    SettingsError,
    unknown_name_warnings,
    unknown_names,
    url_with_password_file,
)

__all__ = [
    "PREFIX",
    "Settings",
    "SettingsError",
    "unknown_name_warnings",
    "unknown_names",
    "url_with_password_file",
]
