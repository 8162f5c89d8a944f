"""The operator's console (``/console/`` of ``reservations serve``) against a real front door, one real
worker, a private Redis broker and each database: the password and the form token are asked for and a
refused action changes nothing; breaking a lease, re-driving a dead letter and republishing a lost request
take effect and are kept in the action log with who and why. Then a real browser (Debian's chromium,
driven through its chromedriver) loads every page, uses a filter and takes each kind of action.
"""

from __future__ import annotations

import asyncio
import base64
import itertools
import json
import os
import random
import shutil
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest

from fencing import LeaseManager, LostOwnership
from reservations import Inventory
from reservations import validation as valid
from service.console import Mark, timeline_marks
from tasks import ReservationClient
from tasks.producer import request_of
from testing.harness import tls, wait_until
from testing.redis_servers import redis_server
from testing.service_process import ServiceProcess, front_door
from testing.support import run
from testing.workers import Cluster, cluster, migrated_database

pytestmark = pytest.mark.slow

PASSWORD = "console-pw-7"
AUTH = ("ann", PASSWORD)
OUTCOME_TIMEOUT = 30.0
_numbers = itertools.count()


@dataclass
class Consoled:
    kind: str
    service: ServiceProcess
    cluster: Cluster
    inventory: Inventory
    leases: LeaseManager

    def http(self, auth: tuple[str, str] | None = AUTH) -> httpx.Client:
        return httpx.Client(
            base_url=self.service.url, auth=auth, timeout=30, follow_redirects=False, verify=tls()
        )

    def form_token(self, http: httpx.Client, path: str) -> str:
        page = http.get(path)
        assert page.status_code == 200, page.text
        return page.text.split('<meta name="form-token" content="', 1)[1].split('"', 1)[0]

    def sku(self, stem: str, on_hand: int = 10) -> str:
        name = f"{stem}{next(_numbers)}{random.randrange(1 << 20):x}"
        self.inventory.add_sku(name, on_hand=on_hand)
        return name

    def dead_letter(self, sku: str) -> str:
        """A reservation dead-lettered for real: the SKU's lease is held here, and the worker retries a
        busy lease zero times. Returns its key as stored."""
        key = f"dead-{next(_numbers)}-{random.randrange(1 << 30):x}"
        held = self.leases.acquire(valid.scope_of(sku), ttl=60, holder="test")
        try:
            with self.http() as http:
                answer = http.post(
                    "/reservations",
                    json={"sku": sku, "quantity": 1},
                    headers={"Idempotency-Key": key, "Prefer": "wait=20"},
                )
        finally:
            self.leases.release(held)
        assert answer.status_code == 503 and answer.json()["type"].endswith("dead-lettered"), answer.text
        stored = f"*:{key}"  # the anonymous caller's space
        outcome = self.inventory.request_outcome(stored)
        assert outcome is not None and outcome.status == "dead_lettered"
        return stored

    def outcome_of(self, key: str) -> Any:
        found = wait_until(
            lambda: self.inventory.request_outcome(key), timeout=OUTCOME_TIMEOUT, what=f"the outcome of {key}"
        )
        return found


@pytest.fixture(scope="module", params=["sqlite", "postgresql"])
def consoled(
    request: pytest.FixtureRequest, migrated_sqlite: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Consoled]:
    kind: str = request.param
    workdir = tmp_path_factory.mktemp(f"console_{kind}")
    password_file = workdir / "console-password"
    password_file.write_text(PASSWORD + "\n")
    with (
        redis_server(workdir / "redis") as server,
        migrated_database(kind, workdir, migrated_sqlite) as url,
    ):
        settings = {
            "RESERVATIONS_BROKER_URL": server.url(0),
            "RESERVATIONS_RESULT_BACKEND": server.url(1),
            "RESERVATIONS_DATABASE_URL": url,
            "RESERVATIONS_MAX_RETRIES": "0",  # a busy lease dead-letters at once: real dead letters
            "RESERVATIONS_BATCHING": "0",
            "RESERVATIONS_CONSOLE_PASSWORD_FILE": str(password_file),
        }
        with cluster(workdir, settings, count=1, prefix=f"con{kind[:2]}") as running:
            service = front_door(running.settings, workdir / "service.log")
            service.start()
            try:
                service.wait_ready("/readyz")
                with Inventory.from_url(url) as inventory, LeaseManager.from_url(running.lease_url) as leases:
                    yield Consoled(kind, service, running, inventory, leases)
            finally:
                service.stop()


# -- the layout of a token timeline, without I/O ---------------------------------------------------------


def test_the_timeline_places_epochs_writes_refusals_and_breaks_on_one_axis() -> None:
    from reservations.timeline import TimelineEntry, epochs

    entries = [
        TimelineEntry(at=100.0, kind="acquired", token=1, holder="w:1:t"),
        TimelineEntry(at=101.0, kind="write", token=1, holder="w:1:t", operation="reserve", quantity=2),
        TimelineEntry(at=102.0, kind="broken", token=1, holder="w:1:t"),
        TimelineEntry(at=104.0, kind="acquired", token=2, holder="w:2:u"),
        TimelineEntry(
            at=105.0, kind="rejected", token=1, holder="w:1:t", operation="reserve", highest_token=2
        ),
    ]
    marks, start, end = timeline_marks(epochs(entries), now=110.0)
    assert (start, end) == (100.0, 110.0)
    by_kind: dict[str, list[Mark]] = {}
    for mark in marks:
        by_kind.setdefault(mark.kind, []).append(mark)
    first, second = by_kind["epoch"]
    # Token 1 from its acquire to token 2's; token 2 until now, on the other lane.
    assert (first.x, first.width, first.lane) == (0.0, 400.0, 0)
    assert (second.x, second.width, second.lane) == (400.0, 600.0, 1)
    assert [m.x for m in by_kind["write"]] == [100.0]
    assert [m.x for m in by_kind["broken"]] == [400.0]
    (refused,) = by_kind["rejected"]
    assert refused.x == 500.0 and "refused: the row had 2" in refused.title
    assert timeline_marks([], now=5.0) == ([], 5.0, 5.0)


# -- the door: password, form token, reason --------------------------------------------------------------


def test_every_page_asks_for_the_password_and_a_name(consoled: Consoled) -> None:
    for auth in (None, ("ann", "wrong"), ("  ", PASSWORD)):
        with consoled.http(auth) as http:
            for path in ("/console/requests", "/console/skus", "/console/actions"):
                refused = http.get(path)
                assert refused.status_code == 401, (auth, path, refused.text)
                assert refused.headers["www-authenticate"].startswith('Basic realm="reservations console"')
    with consoled.http() as http:
        assert http.get("/console/").headers["location"] == "/console/requests"
        assert http.get("/console/requests").status_code == 200
    # Not on the API's description: the console is for operators, not callers.
    assert "/console" not in httpx.get(consoled.service.url + "/openapi.json", verify=tls()).text


def test_a_refused_action_changes_nothing(consoled: Consoled) -> None:
    sku = consoled.sku("REF")
    scope = valid.scope_of(sku)
    held = consoled.leases.acquire(scope, ttl=60, holder="test")
    try:
        with consoled.http() as http, consoled.http(("bob", PASSWORD)) as bob:
            path = f"/console/skus/{sku}/break-lease"
            bobs = consoled.form_token(bob, f"/console/skus/{sku}")
            # Another operator's token (a form made for bob, sent as ann), an empty reason, none at all.
            for form in ({"form_token": bobs, "reason": "x"}, {"form_token": "0" * 64, "reason": "x"}):
                assert http.post(path, data=form).status_code == 403
            token = consoled.form_token(http, f"/console/skus/{sku}")
            blank = http.post(path, data={"form_token": token, "reason": "   "})
            assert blank.status_code == 400 and blank.json()["field"] == "reason"
            assert http.post(path, data={"form_token": token}).status_code in (400, 422)
            too_long = http.post(path, data={"form_token": token, "reason": "r" * 501})
            assert too_long.status_code == 400, too_long.text
        current = consoled.leases.current(scope)
        assert current is not None and current.token == held.token
        assert consoled.inventory.operator_actions(target=sku) == []
    finally:
        consoled.leases.release(held)


# -- the actions ------------------------------------------------------------------------------------------


def test_breaking_a_lease_ends_it_for_its_holder_and_is_logged(consoled: Consoled) -> None:
    sku = consoled.sku("BRK")
    held = consoled.leases.acquire(valid.scope_of(sku), ttl=60, holder="stuck-worker:1:t")
    with consoled.http() as http:
        page = f"/console/skus/{sku}"
        assert f"token {held.token} held by stuck-worker:1:t" in http.get(page).text
        done = http.post(
            f"{page}/break-lease",
            data={"form_token": consoled.form_token(http, page), "reason": "worker host is gone"},
        )
        assert done.status_code == 303 and done.headers["location"].startswith(page + "?done=")
        shown = http.get(done.headers["location"]).text
        assert f"lease with token {held.token} of stuck-worker:1:t broken" in shown
        assert "worker host is gone" in shown  # the page's own action log
    assert consoled.leases.current(valid.scope_of(sku)) is None
    with pytest.raises(LostOwnership):
        consoled.leases.renew(held)
    (entry,) = consoled.inventory.operator_actions(target=sku)
    assert (entry.action, entry.by, entry.reason) == ("break_lease", "ann", "worker host is gone")
    assert entry.detail == {"token": held.token, "holder": "stuck-worker:1:t"}
    (broken,) = [e for e in consoled.leases.history(valid.scope_of(sku)) if e.event == "broken"]
    assert broken.detail == "worker host is gone (by ann)"
    # The command line shows the same log.
    env = {"RESERVATIONS_DATABASE_URL": consoled.cluster.database_url}
    shown = run("actions", "--target", sku, "--json", env=env)
    assert shown.returncode == 0, shown.stderr
    (listed,) = json.loads(shown.stdout)
    assert (listed["action"], listed["by"], listed["reason"]) == ("break_lease", "ann", "worker host is gone")
    # On a narrow terminal the table fits, and wraps its values whole rather than cutting them.
    narrow = run("actions", "--target", sku, env=env, columns=60).stdout
    assert max(len(line) for line in narrow.splitlines()) <= 60 and "…" not in narrow, narrow
    # Nothing held: nothing to break, nothing logged.
    with consoled.http() as http:
        again = http.post(
            f"{page}/break-lease", data={"form_token": consoled.form_token(http, page), "reason": "again"}
        )
        assert "failed=" in again.headers["location"]
    assert len(consoled.inventory.operator_actions(target=sku)) == 1


def test_a_dead_letter_re_driven_from_the_console_is_served_and_logged(consoled: Consoled) -> None:
    sku = consoled.sku("RDV")
    key = consoled.dead_letter(sku)
    with consoled.http() as http:
        page = f"/console/requests/{key}"
        shown = http.get(page).text
        assert "dead_lettered" in shown and "/redrive" in shown
        done = http.post(
            f"{page}/redrive",
            data={"form_token": consoled.form_token(http, page), "reason": "lease was mine"},
        )
        assert done.status_code == 303, done.text
    served = consoled.outcome_of(f"{key}~redrive-1")
    assert served.status == "reserved"
    assert consoled.outcome_of(key).status == "reserved"  # the key answers its re-drive's outcome
    assert consoled.inventory.stock(sku).reserved == 1
    (entry,) = consoled.inventory.operator_actions(target=key)
    assert (entry.action, entry.by, entry.reason) == ("redrive", "ann", "lease was mine")
    assert entry.detail["as"] == f"{key}~redrive-1"
    (link,) = consoled.inventory.redrives_of(key)
    assert link.by == "ann"


def test_republish_hands_a_lost_request_to_the_relay(consoled: Consoled) -> None:
    sku = consoled.sku("REP")
    key = f"lost-{next(_numbers)}-{random.randrange(1 << 30):x}"
    # Recorded, its message never sent (lost before the broker had it), its next look an hour away.
    consoled.inventory.record_accepted([request_of("reserve", key, {"sku": sku, "quantity": 2})], 3600)
    with consoled.http() as http:
        page = f"/console/requests/{key}"
        assert "pending: no outcome yet" in http.get(page).text
        done = http.post(
            f"{page}/republish",
            data={"form_token": consoled.form_token(http, page), "reason": "lost in failover"},
        )
        assert done.status_code == 303 and "done=" in done.headers["location"], done.text
    assert consoled.outcome_of(key).status == "reserved"
    assert consoled.inventory.stock(sku).reserved == 2
    (entry,) = consoled.inventory.operator_actions(target=key)
    assert (entry.action, entry.reason) == ("republish", "lost in failover")
    with consoled.http() as http:  # ended: no republish offered, and one asked anyway does nothing
        assert "/republish" not in http.get(page).text
        late = http.post(
            f"{page}/republish",
            data={"form_token": consoled.form_token(http, "/console/actions"), "reason": "x"},
        )
        assert "failed=" in late.headers["location"]


def test_a_request_cancelled_from_the_console_stays_cancelled_when_a_worker_gets_it(
    consoled: Consoled,
) -> None:
    sku = consoled.sku("CNL")
    key = f"to-cancel-{next(_numbers)}-{random.randrange(1 << 30):x}"
    request = request_of("reserve", key, {"sku": sku, "quantity": 3})
    consoled.inventory.record_accepted([request], 3600)
    with consoled.http() as http:
        page = f"/console/requests/{key}"
        assert 'id="cancel"' in http.get(page).text
        done = http.post(
            f"{page}/cancel",
            data={"form_token": consoled.form_token(http, page), "reason": "order withdrawn"},
        )
        assert done.status_code == 303 and "done=" in done.headers["location"], done.text
        shown = http.get(page).text
        assert "cancelled" in shown and 'id="cancel"' not in shown
    # Its message reaches a worker anyway (a copy published before the cancel): nothing is reserved.
    with ReservationClient(consoled.cluster.app()) as client:
        asyncio.run(_published(client, request))
    marker = f"Task reservations.reserve[{request.task_id}] succeeded"
    wait_until(
        lambda: any(marker in worker.log() for worker in consoled.cluster.workers),
        timeout=OUTCOME_TIMEOUT,
        what="a worker to carry out the copy",
    )
    ended = consoled.inventory.request_outcome(key)
    assert ended is not None and ended.status == "cancelled"
    assert ended.detail == {"reason": "order withdrawn", "by": "ann"}
    assert consoled.inventory.stock(sku).reserved == 0
    (entry,) = consoled.inventory.operator_actions(target=key)
    assert (entry.action, entry.reason) == ("cancel", "order withdrawn")


async def _published(client: ReservationClient, request: Any) -> None:
    await client.publish_recorded(request)
    await client.aclose()


# -- a real browser ---------------------------------------------------------------------------------------

CHROMIUM, CHROMEDRIVER = shutil.which("chromium"), shutil.which("chromedriver")


@pytest.fixture(scope="module")
def browser() -> Iterator[Any]:
    if CHROMIUM is None or CHROMEDRIVER is None:
        pytest.skip("chromium and chromedriver are not installed (Debian: chromium chromium-driver)")
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for flag in ("--headless=new", "--no-sandbox", "--disable-gpu", "--window-size=1400,1000"):
        options.add_argument(flag)
    driver = webdriver.Chrome(service=Service(CHROMEDRIVER), options=options)
    # Basic credentials on every request the pages make, as a browser that was asked once sends them.
    token = base64.b64encode(f"{AUTH[0]}:{AUTH[1]}".encode()).decode()
    driver.execute_cdp_cmd("Network.enable", {})
    driver.execute_cdp_cmd("Network.setExtraHTTPHeaders", {"headers": {"Authorization": f"Basic {token}"}})
    driver.implicitly_wait(0)
    try:
        yield driver
    finally:
        driver.quit()


# The pages are the same whatever the database: shown once, on PostgreSQL.
@pytest.mark.parametrize("consoled", ["postgresql"], indirect=True)
def test_in_a_browser_every_page_loads_a_filter_works_and_each_action_takes_effect(
    consoled: Consoled, browser: Any
) -> None:
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import Select, WebDriverWait

    base = consoled.service.url + "/console"

    def text_of(selector: str) -> str:
        return str(browser.find_element(By.CSS_SELECTOR, selector).text)

    def loaded_after(click: Any, url_has: str) -> None:
        """Click, then wait (with a deadline) for the page it leads to."""
        click()
        WebDriverWait(browser, 20).until(lambda b: url_has in b.current_url)
        WebDriverWait(browser, 20).until(
            lambda b: b.execute_script("return document.readyState") == "complete"
        )

    # CONSOLE_SCREENSHOTS=docs/images takes the pictures of docs/operations.md from this very run.
    pictures = os.environ.get("CONSOLE_SCREENSHOTS")

    def picture(name: str) -> None:
        if pictures:
            Path(pictures).mkdir(parents=True, exist_ok=True)
            browser.save_screenshot(str(Path(pictures) / f"console-{name}.png"))

    def submit(form_selector: str, reason: str) -> None:
        form = browser.find_element(By.CSS_SELECTOR, form_selector)
        form.find_element(By.NAME, "reason").send_keys(reason)
        loaded_after(form.find_element(By.CSS_SELECTOR, "button[type=submit]").click, "?")

    # Requests: a dead letter and a served request; the state filter keeps only the dead letter.
    sku = consoled.sku("WEB")
    dead = consoled.dead_letter(sku)
    browser.get(f"{base}/requests")
    assert browser.find_element(By.ID, "requests").is_displayed()
    Select(browser.find_element(By.ID, "state")).select_by_value("dead_lettered")
    loaded_after(browser.find_element(By.ID, "filter").click, "state=dead_lettered")
    rows = browser.find_elements(By.CSS_SELECTOR, "#requests tr td:nth-child(4)")
    assert rows and {r.text for r in rows} == {"dead_lettered"}
    # One request: open it from the list, re-drive it.
    loaded_after(browser.find_element(By.LINK_TEXT, dead).click, "/console/requests/")
    assert text_of("#state") == "dead_lettered"
    submit("#redrive form", "browser re-drive")
    assert dead in text_of("#done") and "re-driven" in text_of("#done")
    assert consoled.outcome_of(f"{dead}~redrive-1").status == "reserved"
    browser.refresh()
    assert text_of("#state") == "reserved" and "browser re-drive" in text_of("#actions")
    # Two recorded requests whose messages never went out: one republished, one cancelled.
    lost, unwanted = (
        f"{stem}-{next(_numbers)}-{random.randrange(1 << 30):x}" for stem in ("lost", "unwanted")
    )
    consoled.inventory.record_accepted(
        [request_of("reserve", k, {"sku": sku, "quantity": 1}) for k in (lost, unwanted)], 3600
    )
    # The stuck view (no outcome past a bound, here 0 s) lists both; the lost one opens from there.
    browser.get(f"{base}/requests?state=stuck&stuck_after=0")
    listed = {a.text for a in browser.find_elements(By.CSS_SELECTOR, "#requests td a")}
    assert {lost, unwanted} <= listed, listed
    picture("stuck")
    loaded_after(browser.find_element(By.LINK_TEXT, lost).click, "/console/requests/")
    assert text_of("#state").startswith("pending")
    submit("#republish form", "lost in the failover")
    assert "handed to the relay" in text_of("#done")
    assert consoled.outcome_of(lost).status == "reserved"
    browser.refresh()
    assert text_of("#state") == "reserved"
    picture("request")
    browser.get(f"{base}/requests/{unwanted}")
    submit("#cancel form", "order withdrawn")
    assert "cancelled" in text_of("#done") and text_of("#state") == "cancelled"
    # Dead letters: choose one and re-drive the chosen.
    other = consoled.dead_letter(sku)
    browser.get(f"{base}/dead-letters")
    browser.find_element(By.CSS_SELECTOR, f'input[type=checkbox][value="{other}"]').click()
    picture("dead-letters")
    submit("#redrive-many", "bulk from the browser")
    assert f"{other} re-driven as {other}~redrive-1" in text_of("#done")
    assert consoled.outcome_of(f"{other}~redrive-1").status == "reserved"
    # SKUs: filter by prefix; a SKU's page draws its timeline; break its lease.
    browser.get(f"{base}/skus")
    browser.find_element(By.NAME, "prefix").send_keys(sku)
    loaded_after(browser.find_element(By.ID, "filter").click, "prefix=")
    assert [a.text for a in browser.find_elements(By.CSS_SELECTOR, "#skus td a")] == [sku]
    held = consoled.leases.acquire(valid.scope_of(sku), ttl=60, holder="frozen:7:task")
    loaded_after(browser.find_element(By.LINK_TEXT, sku).click, f"/console/skus/{sku}")
    assert f"token {held.token} held by frozen:7:task" in text_of("#lease")
    picture("sku")
    epochs_drawn = browser.find_elements(By.CSS_SELECTOR, "#timeline rect.epoch")
    writes_drawn = browser.find_elements(By.CSS_SELECTOR, "#timeline circle.write")
    assert len(epochs_drawn) >= 3 and len(writes_drawn) >= 2  # two re-drives wrote under their tokens
    submit("form.action", "frozen holder")
    assert f"lease with token {held.token} of frozen:7:task broken" in text_of("#done")
    assert browser.find_elements(By.CSS_SELECTOR, "#timeline line.broken")
    assert consoled.leases.current(valid.scope_of(sku)) is None
    # Leases and queues: a lease held now is listed under its worker.
    again = consoled.leases.acquire(valid.scope_of(sku), ttl=60, holder="host-b:42:task-9")
    try:
        browser.get(f"{base}/leases")
        assert "host-b:42" in text_of("#workers") and sku in text_of("#workers")
        assert text_of("#depth") != ""
        picture("leases")
    finally:
        consoled.leases.release(again)
    # The action log: every action above, with who and why; filtered by the SKU.
    browser.get(f"{base}/actions")
    log = text_of("#actions")
    picture("actions")
    for said in (
        "browser re-drive",
        "bulk from the browser",
        "frozen holder",
        "lost in the failover",
        "order withdrawn",
    ):
        assert said in log
    browser.find_element(By.NAME, "target").send_keys(sku)
    loaded_after(browser.find_element(By.ID, "filter").click, "target=")
    rows = browser.find_elements(By.CSS_SELECTOR, "#actions tr")[1:]
    assert len(rows) == 1 and "break_lease" in rows[0].text and "ann" in rows[0].text
