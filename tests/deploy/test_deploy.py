"""deploy/ parses, and its monitoring speaks the sidecar's language.

Every YAML and JSON file parses; the Grafana dashboard and the Prometheus rules name only samples
the sidecar exports (``kvstore.service.metrics.METRIC_NAMES``, histograms as _bucket/_sum/_count)
or rules defined here; promtool accepts the configuration and fires the alerts on synthetic
series (tests/deploy/rules_test.yml); the PrometheusRule carries the same groups as rules.yml.
"""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

from tests.deploy.helpers import (COMPOSE, DEPLOY, GRAFANA, K8S, RULES, dashboard, metric_names,
                                  recorded_names, rule_entries, yaml_document, yaml_documents)

PROMTOOL = shutil.which("promtool")
needs_promtool = pytest.mark.skipif(PROMTOOL is None, reason="promtool is not installed (Debian package prometheus)")
PROMETHEUS_BUILTIN = {"up"}  # series Prometheus writes itself, per target


def promtool(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([PROMTOOL, *args], capture_output=True, text=True, timeout=60)


def dashboard_expressions() -> list[tuple[str, str]]:
    """(panel title, expr) of every panel target."""
    return [(panel["title"], target["expr"]) for panel in dashboard()["panels"] for target in panel["targets"]]


# --- every file parses ----------------------------------------------------------------------------

YAML_FILES = sorted([*DEPLOY.rglob("*.yaml"), *DEPLOY.rglob("*.yml")])
JSON_FILES = sorted(DEPLOY.rglob("*.json"))


def test_deploy_has_the_expected_files():
    names = {p.relative_to(DEPLOY).as_posix() for p in [*YAML_FILES, *JSON_FILES]}
    assert {"compose/compose.yaml", "compose/prometheus.yml", "compose/rules.yml", "k8s/kustomization.yaml",
            "k8s/daemonset.yaml", "k8s/service.yaml", "k8s/servicemonitor.yaml", "k8s/prometheusrule.yaml",
            "grafana/dashboards/kvstore.json"} <= names
    assert list((GRAFANA / "provisioning" / "datasources").glob("*.yaml"))
    assert list((GRAFANA / "provisioning" / "dashboards").glob("*.yaml"))


@pytest.mark.parametrize("path", YAML_FILES, ids=lambda p: p.relative_to(DEPLOY).as_posix())
def test_yaml_parses(path):
    docs = yaml_documents(path)
    assert docs and all(isinstance(doc, dict) for doc in docs), f"{path}: expected mappings"


@pytest.mark.parametrize("path", JSON_FILES, ids=lambda p: p.relative_to(DEPLOY).as_posix())
def test_json_parses(path):
    assert isinstance(json.loads(path.read_text(encoding="utf-8")), dict)


# --- the checker itself ---------------------------------------------------------------------------

def test_metric_names_finds_selectors_and_skips_functions_labels_and_variables():
    expr = ('histogram_quantile(0.99, sum by (path, le) (rate(kvstore_load_duration_seconds_bucket'
            '{instance=~"$instance", tier="host"}[$__rate_interval]))) / ignoring (tier) group_left () '
            'kvstore:lookup_tokens:rate5m > bool 0 or vector(0) offset 5m and on (job) up')
    assert metric_names(expr) == {"kvstore_load_duration_seconds_bucket", "kvstore:lookup_tokens:rate5m", "up"}
    assert metric_names("topk(10, sum(increase(no_such_metric_total[1h]))) by (namespace)") == {"no_such_metric_total"}


def test_exported_names_match_the_registry(metric_families, exported):
    """METRIC_NAMES, which the checks below trust, lists exactly what the registry exports."""
    from kvstore.service.metrics import METRIC_NAMES

    expected = {name + "_total" if kind == "counter" else name for name, kind in metric_families.items()}
    assert set(METRIC_NAMES) == expected
    assert "kvstore_load_duration_seconds_bucket" in exported
    assert "kvstore_load_duration_seconds" not in exported  # a histogram has no bare sample


# --- Grafana ----------------------------------------------------------------------------------------

def test_dashboard_names_only_exported_metrics_and_recorded_rules(exported):
    known = exported | recorded_names(yaml_document(RULES)["groups"])
    unknown = sorted((title, name) for title, expr in dashboard_expressions() for name in metric_names(expr) - known)
    assert not unknown, f"panels select metrics the sidecar does not export: {unknown}"


def test_dashboard_variables_query_exported_metrics(exported):
    for variable in dashboard()["templating"]["list"]:
        if variable["type"] == "query":
            metric = variable["query"]["query"].removeprefix("label_values(").split(",")[0].split("{")[0]
            assert metric in exported, variable["name"]


def test_every_panel_has_a_title_a_prometheus_datasource_and_queries():
    board = dashboard()
    variables = {v["name"] for v in board["templating"]["list"]
                 if v["type"] == "datasource" and v["query"] == "prometheus"}
    provisioned = {ds["uid"] for path in (GRAFANA / "provisioning" / "datasources").glob("*.yaml")
                   for ds in yaml_document(path)["datasources"]}
    assert board["panels"]
    for panel in board["panels"]:
        assert panel.get("title"), panel
        for source in [panel["datasource"], *(t["datasource"] for t in panel["targets"])]:
            assert source["type"] == "prometheus", panel["title"]
            assert source["uid"].removeprefix("${").removesuffix("}") in variables or source["uid"] in provisioned, \
                f"{panel['title']}: datasource {source['uid']} is neither a variable nor provisioned"
        assert panel["targets"] and all(t["expr"].strip() for t in panel["targets"]), panel["title"]
    assert len({p["id"] for p in board["panels"]}) == len(board["panels"])


def test_dashboard_has_the_panels_of_the_built_in_page():
    selected = {}
    for title, expr in dashboard_expressions():
        selected.setdefault(title, set()).update(metric_names(expr))
    needs = {  # what the page shows -> the samples its panel must select
        "token hit rate": {"kvstore_hit_tokens_total", "kvstore_lookup_tokens_total"},
        "prefill tokens saved": {"kvstore_prefill_tokens_saved_total"},
        "bytes used vs capacity": {"kvstore_tier_used_bytes", "kvstore_tier_capacity_bytes"},
        "evictions and demotions": {"kvstore_tier_evictions_total", "kvstore_tier_demotions_total"},
        "load latency": {"kvstore_load_duration_seconds_bucket"},
        "top namespaces by looked-up tokens": {"kvstore_lookup_tokens_total"},
        "errors by code": {"kvstore_grpc_errors_total"},
        "checksum failures": {"kvstore_checksum_failures_total"},
    }
    titles = {title.lower(): title for title in selected}
    for wanted, metrics in needs.items():
        assert wanted in titles, f"no panel {wanted!r}; panels: {sorted(selected)}"
        assert metrics <= selected[titles[wanted]], wanted
    quantiles = [expr for title, expr in dashboard_expressions() if title == titles["load latency"]]
    assert [q.split(",")[0] for q in quantiles] == [f"histogram_quantile({q}" for q in ("0.5", "0.9", "0.99")]


@needs_promtool
def test_dashboard_expressions_parse_as_promql(tmp_path):
    """promtool parses each panel query (Grafana's variables replaced by what Grafana sends)."""
    substitutions = {"$__rate_interval": "1m", "$__range": "3h", "$__interval": "15s", '"$instance"': '".*"'}
    rules = []
    for i, (_, expr) in enumerate(dashboard_expressions()):
        for variable, value in substitutions.items():
            expr = expr.replace(variable, value)
        assert "$" not in expr, f"unhandled Grafana variable in {expr}"
        rules.append({"record": f"panel:query_{i}", "expr": expr})
    path = tmp_path / "panels.yml"
    path.write_text(yaml.safe_dump({"groups": [{"name": "panels", "rules": rules}]}))
    result = promtool("check", "rules", str(path))
    assert result.returncode == 0, result.stdout + result.stderr


# --- Prometheus rules ---------------------------------------------------------------------------------

def test_rules_name_only_exported_metrics_and_their_own_records(exported):
    groups = yaml_document(RULES)["groups"]
    known = exported | recorded_names(groups) | PROMETHEUS_BUILTIN
    for rule in rule_entries(groups):
        unknown = metric_names(str(rule["expr"])) - known
        assert not unknown, f"{rule.get('record') or rule.get('alert')} selects unknown metrics {sorted(unknown)}"


def test_recording_rules_follow_the_naming_convention_and_alerts_say_what_to_do():
    groups = yaml_document(RULES)["groups"]
    for name in recorded_names(groups):
        assert name.startswith("kvstore:") and name.count(":") == 2, name  # level:metric:operations
    alerts = {rule["alert"]: rule for rule in rule_entries(groups) if "alert" in rule}
    assert {"KVStoreDown", "KVStoreChecksumFailures", "KVStoreTierAlmostFull", "KVStoreHighErrorRatio"} <= set(alerts)
    for name, rule in alerts.items():
        assert rule["labels"]["severity"] in {"critical", "warning", "info"}, name
        assert rule["annotations"]["summary"] and rule["annotations"]["description"], name


def test_prometheusrule_carries_the_compose_rules():
    (rule,) = yaml_documents(K8S / "prometheusrule.yaml")
    assert rule["kind"] == "PrometheusRule" and rule["apiVersion"] == "monitoring.coreos.com/v1"
    assert rule["spec"]["groups"] == yaml_document(RULES)["groups"]


@needs_promtool
def test_promtool_accepts_the_prometheus_config_and_its_rules():
    result = promtool("check", "config", str(COMPOSE / "prometheus.yml"))
    assert result.returncode == 0, result.stdout + result.stderr
    assert "1 rule files found" in result.stdout + result.stderr  # rules.yml is found beside it


@needs_promtool
def test_promtool_accepts_the_rules():
    result = promtool("check", "rules", str(RULES))
    assert result.returncode == 0, result.stdout + result.stderr


@needs_promtool
def test_rules_fire_and_record_what_rules_test_expects():
    result = promtool("test", "rules", str(Path(__file__).with_name("rules_test.yml")))
    assert result.returncode == 0, result.stdout + result.stderr
