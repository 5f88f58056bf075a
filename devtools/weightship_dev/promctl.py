"""The local cluster's Prometheus, driven by tests: rule files, host-process targets,
reloads, and what its alerting says.

Prometheus reads `<prometheus>/rules/*.yaml` (rule_files) and scrapes the targets listed in
`<prometheus>/targets/*.json` (file-based discovery, picked up without a reload); see
components.prometheus_config. A cluster started before those lines were in its config gets
them from `ensure_config`, which rewrites the config and reloads (`--web.enable-lifecycle`).
"""

from __future__ import annotations

import json
import re
import time
import urllib.parse
import urllib.request
from datetime import datetime
from pathlib import Path
from typing import Any

import yaml

from weightship_dev import components
from weightship_dev.cluster import prometheus_url
from weightship_dev.layout import ClusterPaths


def _get(path: str, **params: str) -> Any:
    url = f"{prometheus_url()}{path}"
    if params:
        url += "?" + urllib.parse.urlencode(params)
    with urllib.request.urlopen(url, timeout=10) as answer:  # noqa: S310 (our own Prometheus)
        body = json.loads(answer.read())
    if body.get("status") != "success":
        raise RuntimeError(f"Prometheus {path}: {body}")
    return body["data"]


def _write(path: Path, text: str) -> None:
    """Whole or not at all: Prometheus may read the file at any moment."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(text)
    tmp.replace(path)


def reload() -> None:
    request = urllib.request.Request(f"{prometheus_url()}/-/reload", method="POST")  # noqa: S310
    with urllib.request.urlopen(request, timeout=30) as answer:  # noqa: S310
        if answer.status != 200:
            raise RuntimeError(f"Prometheus reload: HTTP {answer.status}")


def ensure_config(paths: ClusterPaths) -> None:
    """The running Prometheus has today's config (rules and target folders included)."""
    for folder in ("rules", "targets"):
        (paths.prometheus / folder).mkdir(parents=True, exist_ok=True)
    config = paths.prometheus / "prometheus.yml"
    wanted = components.prometheus_config(paths)
    if not config.exists() or config.read_text() != wanted:
        _write(config, wanted)
        reload()


def load_rules(paths: ClusterPaths, name: str, text: str, timeout: float = 30) -> Path:
    """Write a rules file, reload, and return once Prometheus lists its groups."""
    ensure_config(paths)
    path = paths.prometheus / "rules" / f"{name}.yaml"
    _write(path, text)
    reload()
    names = {g["name"] for g in yaml.safe_load(text)["groups"]}
    deadline = time.monotonic() + timeout
    while {g["name"] for g in rule_groups(path)} != names:
        if time.monotonic() > deadline:
            raise TimeoutError(f"Prometheus did not load {sorted(names)} from {path}")
        time.sleep(0.5)
    return path


def remove_rules(paths: ClusterPaths, name: str) -> None:
    (paths.prometheus / "rules" / f"{name}.yaml").unlink(missing_ok=True)
    reload()


def add_target(paths: ClusterPaths, name: str, address: str, labels: dict[str, str]) -> None:
    """Scrape a process on the host (job `processes` unless labels say otherwise)."""
    ensure_config(paths)
    _write(
        paths.prometheus / "targets" / f"{name}.json",
        json.dumps([{"targets": [address], "labels": labels}]),
    )


def remove_target(paths: ClusterPaths, name: str) -> None:
    (paths.prometheus / "targets" / f"{name}.json").unlink(missing_ok=True)


def rule_groups(file: Path | None = None) -> list[dict[str, Any]]:
    """The rule groups Prometheus evaluates (those of one file, if given)."""
    groups = _get("/api/v1/rules")["groups"]
    return [g for g in groups if file is None or g["file"] == str(file)]


def query(expr: str) -> list[dict[str, Any]]:
    return list(_get("/api/v1/query", query=expr)["result"])


def target_health(scrape_url: str) -> str | None:
    """`up`, `down` or `unknown` for the active target scraping this URL; None if none."""
    for target in _get("/api/v1/targets", state="active")["activeTargets"]:
        if target["scrapeUrl"] == scrape_url:
            return str(target["health"])
    return None


_RFC3339 = re.compile(r"^(.+T\d\d:\d\d:\d\d)(?:\.(\d+))?(Z|[+-]\d\d:\d\d)$")


def evaluated_since(rule: dict[str, Any], since: float) -> bool:
    """Whether the rule's last evaluation came after `since` (Unix time, host clock)."""
    match = _RFC3339.match(rule.get("lastEvaluation") or "")
    if match is None or match[1].startswith("0001-"):  # never evaluated
        return False
    seconds, fraction, zone = match.groups()
    stamp = f"{seconds}.{(fraction or '0')[:6]}{'+00:00' if zone == 'Z' else zone}"
    return datetime.fromisoformat(stamp).timestamp() > since
