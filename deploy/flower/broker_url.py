"""Print the broker URL Flower is to use: RESERVATIONS_BROKER_URL with the password read from the file
RESERVATIONS_BROKER_PASSWORD_FILE names (when set and not empty), as tasks.settings gives it to the
workers. Flower's image holds Celery, not this project, so the few lines are here; tests/test_compose.py
checks that both give the same URL. A sentinel:// URL is not supported: Flower would also need the
Sentinel service name as a transport option; `reservations flower` (the flower extra) takes every broker.
"""

import os
import sys
from urllib.parse import quote, urlsplit

url = os.environ["RESERVATIONS_BROKER_URL"]
path = os.environ.get("RESERVATIONS_BROKER_PASSWORD_FILE", "")
if path:
    with open(path, encoding="utf-8") as file:
        password = file.read().removesuffix("\n").removesuffix("\r")
    parts = urlsplit(url)
    if not password or parts.password is not None or not parts.hostname or ";" in url:
        sys.exit(
            "RESERVATIONS_BROKER_PASSWORD_FILE needs a non-empty file, and a RESERVATIONS_BROKER_URL naming "
            "one host and no password"
        )
    user, _, host = parts.netloc.rpartition("@")
    url = parts._replace(netloc=f"{user}:{quote(password, safe='')}@{host}").geturl()
print(url)
