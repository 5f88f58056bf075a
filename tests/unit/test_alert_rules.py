"""weightship's alerting rules (charts/weightship/files/alerts.yaml) and their runbook.

- promtool (built by `hack/deps.sh promtool`, like Prometheus) checks the rules and runs
  their unit tests in tests/alerts; every alert has a case that fires and one that does not.
- Every alert follows kube-prometheus' conventions (a `severity` label, `summary`,
  `description` and `runbook_url` annotations), and its runbook_url is an anchor of
  docs/runbook.md, whose entries are exactly the alerts, each with the same four parts.
- Every expression names only series the operator or the agent exports (or `up`), and
  only their labels or the scrape's.
- The chart renders the same rules as a PrometheusRule where the CRD is served, and as a
  plain rules file in a ConfigMap; its values add labels, move the runbook links, leave
  alerts out and change `for`.
Without promtool or helm these tests fail rather than skip.
"""

from __future__ import annotations

import os
import re
import subprocess
from functools import cache
from pathlib import Path
from typing import Any

import pytest
import yaml
from tests.unit.test_grafana_dashboard import PROMQL_WORDS, SCRAPE_LABELS, exported
from tests.unit.test_helm_chart import CHART, KUBE_VERSION, helm, of_kind, one

ROOT = Path(__file__).resolve().parents[2]
RULES_FILE = CHART / "files" / "alerts.yaml"
RUNBOOK = ROOT / "docs" / "runbook.md"
RULE_TESTS = sorted((ROOT / "tests" / "alerts").glob("*.yaml"))
CACHE = Path(os.environ.get("WEIGHTSHIP_CACHE", Path.home() / ".cache" / "weightship"))
PROMTOOL = CACHE / "bin" / "promtool"
RUNBOOK_BASE = "https://github.com/weightship/weightship/blob/main/docs/runbook.md"
SEVERITIES = {"critical", "warning", "info"}
ANNOTATIONS = {"summary", "description", "runbook_url"}
ENTRY_PARTS = (
    "**What it means.**",
    "**How to look.**",
    "**What to do.**",
    "**How to tell it is over.**",
)
PROMETHEUS_RULE_API = "monitoring.coreos.com/v1/PrometheusRule"
WORDS = PROMQL_WORDS | {
    "time", "absent", "clamp_min", "max_over_time", "min_over_time", "offset", "on",
    "group_left", "group_right", "bool",
}  # fmt: skip
PROMETHEUS_SERIES = {"up"}  # what Prometheus itself writes for every target


def promtool(*args: str) -> subprocess.CompletedProcess[str]:
    if not PROMTOOL.is_file():
        pytest.fail(f"promtool not found at {PROMTOOL}: run `bash hack/deps.sh promtool`")
    return subprocess.run(
        [str(PROMTOOL), *args], capture_output=True, text=True, timeout=120, cwd=ROOT
    )


def groups(text: str | None = None) -> list[dict[str, Any]]:
    doc = yaml.safe_load(RULES_FILE.read_text() if text is None else text)
    return list(doc["groups"])


def alerts(text: str | None = None) -> list[dict[str, Any]]:
    return [rule for group in groups(text) for rule in group["rules"]]


def anchor(heading: str) -> str:
    """GitHub's anchor for a Markdown heading."""
    slug = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return slug.replace(" ", "-")


def runbook_entries() -> dict[str, str]:
    """`## Heading` -> its text, for the runbook's alert entries."""
    text = RUNBOOK.read_text()
    parts = re.split(r"^## (.+)$", text, flags=re.M)
    return {head.strip(): body for head, body in zip(parts[1::2], parts[2::2], strict=True)}


def convention_problems(rule: dict[str, Any], anchors: set[str]) -> list[str]:
    name = rule.get("alert", "")
    problems = []
    if not re.fullmatch(r"Weightship[A-Z][A-Za-z]+", name):
        problems.append(f"{name}: not a Weightship* CamelCase name")
    if (rule.get("labels") or {}).get("severity") not in SEVERITIES:
        problems.append(f"{name}: severity must be one of {sorted(SEVERITIES)}")
    annotations = rule.get("annotations") or {}
    missing = ANNOTATIONS - annotations.keys()
    if missing:
        problems.append(f"{name}: no {sorted(missing)} annotation")
    url = annotations.get("runbook_url", "")
    if url != f"{RUNBOOK_BASE}#{name.lower()}":
        problems.append(f"{name}: runbook_url {url!r} is not its runbook entry")
    if name.lower() not in anchors:
        problems.append(f"{name}: docs/runbook.md has no entry #{name.lower()}")
    return problems


def series_problems(expr: str, series: dict[str, set[str]]) -> list[str]:
    bare = re.sub(r'"[^"]*"', '""', expr)
    bare = re.sub(r"\[[^\]]*\]", "", bare)
    bare = re.sub(r"\boffset\s+\w+", "", bare)
    grouped = {
        label.strip()
        for group in re.findall(r"\b(?:by|without|on|ignoring)\s*\(([^)]*)\)", bare)
        for label in group.split(",")
        if label.strip()
    }
    bare = re.sub(r"\b(?:by|without|on|ignoring)\s*\([^)]*\)", "", bare)
    matched = set(re.findall(r"([a-zA-Z_][a-zA-Z0-9_]*)\s*(?:=~|!~|!=|=)\s*\"", expr))
    bare = re.sub(r"\{[^}]*\}", "", bare)
    words = set(re.findall(r"[a-zA-Z_:][a-zA-Z0-9_:]*", bare)) - WORDS
    problems = [f"{w}: not a series the project exports" for w in words - series.keys()]
    problems = [p for p in problems if p.split(":")[0] not in PROMETHEUS_SERIES]
    known = set(SCRAPE_LABELS)
    for word in words & series.keys():
        known |= series[word]
    problems += [
        f"label {label}: none of {sorted(words)} has it" for label in (grouped | matched) - known
    ]
    return problems


def test_promtool_checks_the_rules() -> None:
    result = promtool("check", "rules", str(RULES_FILE))
    assert result.returncode == 0, result.stdout + result.stderr
    assert f"SUCCESS: {len(alerts())} rules found" in result.stdout


def test_promtool_rule_unit_tests_pass() -> None:
    assert RULE_TESTS
    result = promtool("test", "rules", *map(str, RULE_TESTS))
    assert result.returncode == 0, result.stdout + result.stderr
    assert "SUCCESS" in result.stdout


def test_every_alert_has_a_case_that_fires_and_one_that_does_not() -> None:
    firing: set[str] = set()
    quiet: set[str] = set()
    for path in RULE_TESTS:
        doc = yaml.safe_load(path.read_text())
        assert doc["rule_files"] == ["../../charts/weightship/files/alerts.yaml"], path
        for case in doc["tests"]:
            for check in case.get("alert_rule_test") or []:
                (firing if check.get("exp_alerts") else quiet).add(check["alertname"])
    names = {rule["alert"] for rule in alerts()}
    assert names - firing == set(), "alerts never tested firing"
    assert names - quiet == set(), "alerts never tested quiet"
    assert (firing | quiet) - names == set(), "tests of alerts that do not exist"


def test_every_alert_follows_the_conventions_and_links_its_runbook_entry() -> None:
    anchors = {anchor(h) for h in runbook_entries()}
    problems = [p for rule in alerts() for p in convention_problems(rule, anchors)]
    assert problems == []
    assert len({rule["alert"] for rule in alerts()}) == len(alerts()), "duplicate alert names"
    assert all("record" not in rule for rule in alerts())


def test_the_convention_check_catches_a_broken_rule() -> None:
    rule = {
        "alert": "WeightshipSomething",
        "labels": {"severity": "page"},
        "annotations": {"summary": "s", "runbook_url": f"{RUNBOOK_BASE}#other"},
    }
    problems = convention_problems(rule, {"weightshipelse"})
    assert len(problems) == 4, problems  # severity, description, runbook_url, no entry


def test_every_runbook_entry_is_an_alert_with_the_four_parts() -> None:
    entries = {h: body for h, body in runbook_entries().items() if h.startswith("Weightship")}
    assert set(entries) == {rule["alert"] for rule in alerts()}
    for heading, body in entries.items():
        missing = [part for part in ENTRY_PARTS if part not in body]
        assert not missing, f"{heading}: no {missing}"


def test_the_runbook_table_says_what_the_rules_say() -> None:
    rows = re.findall(
        r"^\| \[(Weightship\w+)\]\(#(\w+)\) \| (\w+) \| [^|]+ \| ([^|]+) \|$",
        RUNBOOK.read_text(),
        flags=re.M,
    )
    table = {name: (link, severity, for_.strip()) for name, link, severity, for_ in rows}
    assert set(table) == {rule["alert"] for rule in alerts()}
    for rule in alerts():
        link, severity, for_ = table[rule["alert"]]
        assert link == rule["alert"].lower()
        assert severity == rule["labels"]["severity"], rule["alert"]
        assert for_ == rule.get("for", "none"), rule["alert"]


def test_every_expression_names_exported_series_and_their_labels() -> None:
    series = exported()
    problems = [f"{r['alert']}: {p}" for r in alerts() for p in series_problems(r["expr"], series)]
    assert problems == []


def test_the_series_check_catches_a_misspelled_metric_and_label() -> None:
    series = exported()
    assert series_problems("weightship_agent_failing_model > 0", series)
    assert series_problems('max by (rollout) (weightship_rollout_aborted{reason="x"})', series)
    assert not series_problems("up == 0 and on (job, instance) weightship_workqueue_depth", series)


# ---- the chart -----------------------------------------------------------------------
@cache
def rendered(*args: str) -> tuple[dict[str, Any], ...]:
    out = helm(
        "template", "ws", str(CHART), "--namespace", "weightship-system",
        "--kube-version", KUBE_VERSION, *args,
    ).stdout  # fmt: skip
    return tuple(doc for doc in yaml.safe_load_all(out) if doc)


WITH_CRD = ("--api-versions", PROMETHEUS_RULE_API)


def test_a_prometheus_rule_where_the_prometheus_operator_is_installed() -> None:
    assert not of_kind(rendered(), "PrometheusRule")  # no CRD, no PrometheusRule
    rule = one(rendered(*WITH_CRD), "PrometheusRule", "-alerts")
    assert rule["apiVersion"] == "monitoring.coreos.com/v1"
    assert rule["metadata"]["namespace"] == "weightship-system"
    assert rule["spec"]["groups"] == groups()  # by default, the file as it is
    assert not of_kind(rendered(*WITH_CRD, "--set", "alerts.enabled=false"), "PrometheusRule")
    assert not of_kind(rendered(*WITH_CRD), "ConfigMap")


def test_a_plain_rules_file_in_a_configmap_that_promtool_accepts(tmp_path: Path) -> None:
    docs = rendered(
        "--set", "alerts.configMap.enabled=true",
        "--set-string", "alerts.configMap.labels.prometheus_rules=1",
    )  # fmt: skip
    config_map = one(docs, "ConfigMap", "-alerts")
    assert config_map["metadata"]["labels"]["prometheus_rules"] == "1"
    text = config_map["data"]["weightship-alerts.yaml"]
    assert groups(text) == groups()
    path = tmp_path / "weightship-alerts.yaml"
    path.write_text(text)
    result = promtool("check", "rules", str(path))
    assert result.returncode == 0, result.stdout + result.stderr


def test_values_add_labels_move_runbooks_leave_alerts_out_and_change_for() -> None:
    base = "https://wiki.example.com/weightship/runbook"
    docs = rendered(
        *WITH_CRD,
        "--set", f"alerts.runbookBaseURL={base}",
        "--set", "alerts.labels.team=ml-platform",
        "--set", "alerts.labels.severity=info",
        "--set", "alerts.ruleLabels.release=kps",
        "--set", "alerts.disabled={WeightshipOperatorWorkQueueBacklog}",
        "--set", "alerts.for.WeightshipStagingFailing=15m",
    )  # fmt: skip
    rule = one(docs, "PrometheusRule", "-alerts")
    assert rule["metadata"]["labels"]["release"] == "kps"
    got = {r["alert"]: r for g in rule["spec"]["groups"] for r in g["rules"]}
    want = {r["alert"]: r for r in alerts()}
    assert set(got) == set(want) - {"WeightshipOperatorWorkQueueBacklog"}
    for name, r in got.items():
        assert r["labels"]["team"] == "ml-platform"
        assert r["labels"]["severity"] == want[name]["labels"]["severity"]  # its own wins
        assert r["annotations"]["runbook_url"] == f"{base}#{name.lower()}"
        assert r["expr"] == want[name]["expr"]
        for_ = "15m" if name == "WeightshipStagingFailing" else want[name].get("for")
        assert r.get("for") == for_, name
    bogus = helm(
        "template", "ws", str(CHART), "--kube-version", KUBE_VERSION,
        "--set", "alerts.for.WeightshipStagingFailing=soon", check=False,
    )  # fmt: skip
    assert bogus.returncode != 0 and "/alerts/for/" in bogus.stderr, bogus.stderr
