"""The monitoring of compose.yaml's "monitoring" profile stays loadable and true to the code: every PromQL
expression of the Grafana dashboard parses (promtool) and names only metrics the workers and the database
exporter export (read from their real registries, not from a list kept here), as do the alert rules;
deploy/prometheus/prometheus.yml passes `promtool check config`; the Grafana provisioning files are what
the pinned Grafana reads, and every panel's data source is the provisioned one.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from admin.cli.metrics import PROBES, DatabaseCollector
from reservations import Inventory
from service import routes
from service.metrics import HttpMetrics

ROOT = Path(__file__).resolve().parent.parent
COMPOSE = ROOT / "compose.yaml"
PROMETHEUS = ROOT / "deploy" / "prometheus"
GRAFANA = ROOT / "deploy" / "grafana"
DASHBOARDS = GRAFANA / "dashboards"
PROVISIONING = GRAFANA / "provisioning"

# Grafana's own variables, which Prometheus does not know: each replaced by a duration of its kind.
GRAFANA_VARIABLES = {"$__rate_interval": "1m", "$__interval": "15s", "$__range": "6h"}
# Series Prometheus itself writes for every target it scrapes.
PROMETHEUS_SERIES = {"up"}
# The sample names a family of each type exposes (the exposition format's rules, not metric names): a
# family without a sample yet (the exporter's per-SKU ones on an empty database) still counts.
SAMPLE_SUFFIXES = {
    "counter": ("_total",),
    "gauge": ("",),
    "histogram": ("_bucket", "_count", "_sum"),
    "summary": ("", "_count", "_sum"),
    "unknown": ("",),
}
# The newest dashboard schemaVersion each Grafana release writes (and so reads without migrating);
# an older schema is migrated up when the dashboard loads. Extend it when the pinned image moves on.
GRAFANA_SCHEMA_VERSIONS = {
    (10, 0): 38, (10, 1): 38, (10, 2): 38, (10, 3): 39, (10, 4): 39,
    (11, 0): 39, (11, 1): 39, (11, 2): 39, (11, 3): 40, (11, 4): 40, (11, 5): 40, (11, 6): 41,
}  # fmt: skip

# PromQL's words that are not series: binary operators, grouping and modifiers.
KEYWORDS = {"and", "or", "unless", "by", "without", "on", "ignoring", "group_left", "group_right", "bool",
            "offset", "inf", "nan"}  # fmt: skip
_STRING = re.compile(r'"(?:[^"\\]|\\.)*"|\'(?:[^\'\\]|\\.)*\'')
_MATCHERS = re.compile(r"\{[^}]*\}")
_RANGE = re.compile(r"\[[^\]]*\]")
_LABEL_LIST = re.compile(r"\b(?:by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)")
_NAME = re.compile(r"(?<![\w.:])([a-zA-Z_:][a-zA-Z0-9_:]*)\s*(\(?)")


def tool(name: str) -> str:
    found = shutil.which(name)
    if found is None:
        pytest.skip(f"{name} is missing (Debian: apt-get install prometheus; .ci/run installs it)")
    return found


def promql(expr: str) -> str:
    """``expr`` as Prometheus reads it: Grafana's variables replaced."""
    for variable, value in GRAFANA_VARIABLES.items():
        expr = expr.replace(variable, value)
    assert "$" not in expr, f"a Grafana variable Prometheus cannot read in {expr!r}"
    return expr


def metric_names(expr: str) -> set[str]:
    """The series names ``expr`` reads: what is left once strings, label matchers, ranges, label lists and
    function calls are set aside."""
    text = _STRING.sub('""', promql(expr))
    text = _MATCHERS.sub("", text)
    text = _RANGE.sub("", text)
    text = _LABEL_LIST.sub("", text)
    return {name for name, call in _NAME.findall(text) if not call and name.lower() not in KEYWORDS}


def test_metric_names_are_read_from_an_expression_as_prometheus_would() -> None:
    expr = (
        'sum by (le) (rate(a_bucket{status="x", le=~"0.5|1"}[$__rate_interval])) '
        '/ on(job) group_left(instance) b_total offset 5m > bool 0.5 unless up{job="w"} == 1e3'
    )
    assert metric_names(expr) == {"a_bucket", "b_total", "up"}


def dashboard_files() -> list[Path]:
    found = sorted(DASHBOARDS.glob("*.json"))
    assert found, f"no dashboard in {DASHBOARDS}"
    return found


def all_panels(panels: list[dict[str, Any]]) -> Iterator[dict[str, Any]]:
    """Every panel, those inside collapsed rows too."""
    for panel in panels:
        yield panel
        yield from all_panels(panel.get("panels", []))


def expressions() -> list[tuple[str, str]]:
    """Every query of every dashboard: (where, PromQL as written)."""
    found = []
    for path in dashboard_files():
        board = json.loads(path.read_text())
        for panel in all_panels(board["panels"]):
            for target in panel.get("targets", []):
                found.append((f"{path.name}: {panel['title']} {target['refId']}", target["expr"]))
    return found


def exported_names(exposition: str) -> set[str]:
    """The sample names an exposition's families export."""
    names: set[str] = set()
    for family in text_string_to_metric_families(exposition):
        names.update(sample.name for sample in family.samples)
        names.update(family.name + suffix for suffix in SAMPLE_SUFFIXES[family.type])
    return names


# A worker's registry as its metrics listener serves it (tasks.metrics.serve), in a process of its own:
# switching metrics on registers them in prometheus_client's global registry and sets process state.
_WORKER_EXPOSITION = """
import os, sys
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.multiprocess import MultiProcessCollector
from tasks import metrics
metrics.switch_on()
registry = CollectorRegistry()
MultiProcessCollector(registry, path=os.environ[metrics.MULTIPROC_DIR])
sys.stdout.write(generate_latest(registry).decode())
"""


@pytest.fixture(scope="module")
def defined_metrics(migrated_sqlite: Path, tmp_path_factory: pytest.TempPathFactory) -> set[str]:
    """Every sample name the code exports: a worker's (all its series exist from its start) and the
    database exporter's, as ``reservations metrics`` registers it."""
    folder = tmp_path_factory.mktemp("metrics")
    done = subprocess.run(
        [sys.executable, "-c", _WORKER_EXPOSITION],
        env={**os.environ, "PROMETHEUS_MULTIPROC_DIR": str(folder / "multiproc")},
        cwd=ROOT, capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    worker = exported_names(done.stdout)
    database = folder / "inventory.sqlite3"
    shutil.copyfile(migrated_sqlite, database)
    with Inventory.from_url(f"sqlite:///{database}") as inventory:
        registry = CollectorRegistry(auto_describe=False)
        registry.register(DatabaseCollector(inventory, dict.fromkeys(PROBES, lambda: None)))
        exposition = generate_latest(registry).decode()
    assert "reservations_db_up 1.0" in exposition, exposition
    exporter = exported_names(exposition)
    assert {"reservations_outcomes_total", "reservations_request_latency_seconds_bucket"} <= worker
    assert {"reservations_db_up", "reservations_db_stale_writes_refused_total"} <= exporter
    api = exported_names(HttpMetrics(routes.measured()).exposition().decode())  # the front door's
    assert {"reservations_http_requests_total", "reservations_http_overloaded_total"} <= api
    return worker | exporter | api


def test_every_dashboard_expression_parses_with_promtool(tmp_path: Path) -> None:
    """Each query as a recording rule of one rules file: promtool parses every expression in one run."""
    found = expressions()
    rules = [{"record": f"dashboard:query_{i}", "expr": promql(expr)} for i, (_, expr) in enumerate(found)]
    path = tmp_path / "dashboard-rules.yml"
    path.write_text(json.dumps({"groups": [{"name": "dashboard", "rules": rules}]}))  # JSON is YAML
    command = [tool("promtool"), "check", "rules", str(path)]
    done = subprocess.run(command, capture_output=True, text=True, timeout=60, check=False)
    assert done.returncode == 0, "\n".join(
        [done.stdout + done.stderr, *(f"query_{i}: {where}: {expr}" for i, (where, expr) in enumerate(found))]
    )
    assert f"SUCCESS: {len(rules)} rules found" in done.stdout, done.stdout


def test_the_dashboard_names_only_metrics_the_code_defines(defined_metrics: set[str]) -> None:
    known = defined_metrics | PROMETHEUS_SERIES
    unknown = {}
    for where, expr in expressions():
        names = metric_names(expr)
        assert names, f"{where} reads no series: {expr}"
        if names - known:
            unknown[where] = sorted(names - known)
    assert not unknown, unknown


def test_the_alert_rules_name_only_metrics_the_code_defines(defined_metrics: set[str]) -> None:
    rules = yaml.safe_load((PROMETHEUS / "alerts.yml").read_text())
    exprs = {rule["alert"]: rule["expr"] for group in rules["groups"] for rule in group["rules"]}
    known = defined_metrics | PROMETHEUS_SERIES
    unknown = {name: sorted(metric_names(expr) - known) for name, expr in exprs.items()}
    assert not {name: names for name, names in unknown.items() if names}


def test_the_dashboard_shows_what_operators_watch() -> None:
    """Lost ownership and stale writes per operation, outcomes by status, lease acquisitions, hot-SKU batch
    sizes, enqueue-to-outcome latency, dead letters; the front door's answers by code and its latency."""
    exprs = [expr for _, expr in expressions()]
    read = set().union(*map(metric_names, exprs))
    assert {
        "reservations_stale_writes_refused_total",
        "reservations_leases_total",
        "reservations_outcomes_total",
        "reservations_batch_size_bucket",
        "reservations_request_latency_seconds_bucket",
        "reservations_http_request_seconds_bucket",
        "reservations_http_queue_depth",
    } <= read
    squeezed = [re.sub(r"\s+", "", expr) for expr in exprs]
    assert any("by(operation)" in e and "reservations_stale_writes_refused_total" in e for e in squeezed)
    assert any("by(status)" in e and "reservations_outcomes_total" in e for e in squeezed)
    assert any('result="lost"' in e for e in squeezed)
    assert any('status="dead_lettered"' in e for e in squeezed)
    assert any("by(code)" in e and "reservations_http_requests_total" in e for e in squeezed)


# -- Prometheus's configuration ----------------------------------------------------------------------------


def compose_service(name: str) -> dict[str, Any]:
    service: dict[str, Any] = yaml.safe_load(COMPOSE.read_text())["services"][name]
    return service


def mounts(service: dict[str, Any]) -> dict[Path, str]:
    """A service's bind mounts: the repository path -> where the container sees it."""
    found = {}
    for volume in service.get("volumes", []):
        source, target, *_ = volume.split(":")
        if source.startswith("./"):
            found[(ROOT / source).resolve()] = target
    return found


def test_the_prometheus_config_passes_promtool_and_scrapes_what_the_rules_read() -> None:
    config_file = PROMETHEUS / "prometheus.yml"
    done = subprocess.run(
        [tool("promtool"), "check", "config", str(config_file)],
        capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    assert "SUCCESS: 1 rule files found" in done.stdout, done.stdout

    config = yaml.safe_load(config_file.read_text())
    # The rules file is named relative to the config: in the container both sit in one directory.
    (rules,) = config["rule_files"]
    seen = mounts(compose_service("prometheus"))
    assert Path(seen[config_file]).parent / rules == Path(seen[(PROMETHEUS / rules).resolve()])
    jobs = {job["job_name"]: job for job in config["scrape_configs"]}
    # The job names the alert rules and the dashboard select on.
    assert 'job="reservations-workers"' in (PROMETHEUS / "alerts.yml").read_text()
    (workers,) = jobs["reservations-workers"]["dns_sd_configs"]
    assert workers["names"] == ["worker"] and workers["type"] == "A" and workers["port"] == 9808
    assert jobs["reservations-db"]["static_configs"] == [{"targets": ["metrics:9809"]}]
    # The ports the compose services serve their metrics on.
    assert compose_service("worker")["environment"]["RESERVATIONS_METRICS_PORT"] == "9808"
    command = compose_service("metrics")["command"]
    assert command[command.index("--port") + 1] == "9809"
    # Every member of the etcd profile, on the client port it advertises (where it serves /metrics).
    (members,) = jobs["etcd"]["static_configs"]
    advertised = [compose_service(f"etcd{n}")["environment"]["ETCD_ADVERTISE_CLIENT_URLS"] for n in (1, 2, 3)]
    assert [f"http://{target}" for target in members["targets"]] == advertised


# -- Grafana's provisioning ----------------------------------------------------------------------------------


def provisioned(kind: str) -> list[dict[str, Any]]:
    files = sorted((PROVISIONING / kind).glob("*.y*ml"))
    assert files, f"no {kind} provisioning file"
    loaded = [yaml.safe_load(path.read_text()) for path in files]
    for path, data in zip(files, loaded, strict=True):
        assert data["apiVersion"] == 1, path
    return loaded


def grafana_release() -> tuple[int, int]:
    image = compose_service("grafana")["image"]
    matched = re.fullmatch(r"grafana/grafana(?:-oss)?:(\d+)\.(\d+)\.\d+", image)
    assert matched, f"Grafana is not pinned to a release: {image}"
    return int(matched[1]), int(matched[2])


def test_grafana_provisioning_is_what_the_pinned_grafana_reads() -> None:
    grafana = compose_service("grafana")
    seen = mounts(grafana)
    assert seen[PROVISIONING.resolve()] == "/etc/grafana/provisioning"  # Grafana's default provisioning path

    (datasources,) = provisioned("datasources")
    sources = {source["uid"]: source for source in datasources["datasources"]}
    assert len(sources) == len(datasources["datasources"])
    assert [s["uid"] for s in sources.values() if s.get("isDefault")] == [next(iter(sources))]
    for source in sources.values():
        assert source["type"] == "prometheus" and source["access"] == "proxy", source
        assert source["url"] == "http://prometheus:9090", source  # the compose service
    assert "prometheus" in yaml.safe_load(COMPOSE.read_text())["services"]

    (providers,) = provisioned("dashboards")
    (provider,) = providers["providers"]
    assert provider["type"] == "file"
    assert seen[DASHBOARDS.resolve()] == provider["options"]["path"]

    newest = GRAFANA_SCHEMA_VERSIONS.get(grafana_release())
    assert newest, f"add the dashboard schemaVersion of Grafana {grafana_release()}"
    uids = set()
    for path in dashboard_files():
        board = json.loads(path.read_text())
        assert board["uid"] and board["uid"] not in uids and board["title"], path
        uids.add(board["uid"])
        assert isinstance(board["schemaVersion"], int) and 36 <= board["schemaVersion"] <= newest, path
        panels = list(all_panels(board["panels"]))
        ids = [panel["id"] for panel in panels]
        assert len(ids) == len(set(ids)) and all(isinstance(i, int) for i in ids), f"{path}: panel ids {ids}"
        for panel in panels:
            grid = panel["gridPos"]
            assert grid["x"] >= 0 and grid["x"] + grid["w"] <= 24 and grid["h"] > 0, panel["title"]
            if panel["type"] == "row":
                continue
            assert panel["datasource"]["uid"] in sources, panel["title"]
            refs = [target["refId"] for target in panel["targets"]]
            assert refs and len(refs) == len(set(refs)), panel["title"]
            for target in panel["targets"]:
                assert target.get("datasource", panel["datasource"])["uid"] in sources, panel["title"]
