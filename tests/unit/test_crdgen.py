"""The generated CRDs: committed copies match the models, and the schemas are structural."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml

from weightship.api import crdgen

REPO = Path(__file__).resolve().parents[2]


def walk(node: Any, path: str = "") -> list[tuple[str, dict[str, Any]]]:
    """Every schema node with its path."""
    found = [(path, node)]
    for name, child in node.get("properties", {}).items():
        found += walk(child, f"{path}.{name}")
    if "items" in node:
        found += walk(node["items"], f"{path}[]")
    if isinstance(node.get("additionalProperties"), dict):
        found += walk(node["additionalProperties"], f"{path}{{}}")
    return found


def schema_of(kind: str) -> dict[str, Any]:
    resource = next(r for r in crdgen.RESOURCES if r.kind == kind)
    schema: dict[str, Any] = crdgen.crd(resource)["spec"]["versions"][0]["schema"]
    return schema["openAPIV3Schema"]


def test_committed_crds_match_models() -> None:
    """Drift test: run `python -m weightship.api.crdgen` after changing weightship/api."""
    assert crdgen.drift(REPO) == []


def test_check_flag_fails_on_drift(tmp_path: Path) -> None:
    assert crdgen.main(["--check", "--root", str(tmp_path)]) == 1
    assert crdgen.main(["--root", str(tmp_path)]) == 0
    assert crdgen.main(["--check", "--root", str(tmp_path)]) == 0
    (tmp_path / "crds" / "modelrollout.yaml").write_text("tampered\n")
    assert crdgen.main(["--check", "--root", str(tmp_path)]) == 1


def test_chart_and_crds_dir_hold_the_same_files() -> None:
    for name in ("modelrollout.yaml", "weightcache.yaml"):
        chart = REPO / "charts" / "weightship" / "crds" / name
        assert (REPO / "crds" / name).read_text() == chart.read_text()


@pytest.mark.parametrize("kind", ["ModelRollout", "WeightCache"])
def test_schema_is_structural(kind: str) -> None:
    for path, node in walk(schema_of(kind)):
        assert "$ref" not in node and "title" not in node and "const" not in node, path
        assert "allOf" not in node and "oneOf" not in node, path
        assert node.get("additionalProperties") not in (True, False), path
        if "anyOf" in node:
            assert node.get("x-kubernetes-int-or-string") is True, path
        else:
            assert "type" in node, path
        assert "default" not in node or node["default"] is not None, path
        is_property = path and not path.endswith(("[]", "{}"))
        if is_property and path != ".metadata":
            assert node.get("description"), f"{path} has no description"


@pytest.mark.parametrize("kind", ["ModelRollout", "WeightCache"])
def test_lists_are_bounded_for_cel_cost(kind: str) -> None:
    for path, node in walk(schema_of(kind)):
        if node.get("type") == "array":
            assert "maxItems" in node, path


def test_preserve_unknown_fields_only_where_intended() -> None:
    preserved = {
        path
        for path, node in walk(schema_of("ModelRollout"))
        if node.get("x-kubernetes-preserve-unknown-fields")
    }
    # The pod spec passes through; the parts the API server checks are typed (api.podspec).
    pod = {f".spec.template.spec{p}" for p in ("", ".containers[]", ".initContainers[]")}
    pod |= {f"{p}.resources" for p in pod if p.endswith("[]")}
    assert preserved == {*pod, ".spec.prefetch.tolerations[]"}


def test_cel_rules_have_messages() -> None:
    rules = [
        (path, rule)
        for path, node in walk(schema_of("ModelRollout"))
        for rule in node.get("x-kubernetes-validations", [])
    ]
    assert len(rules) >= 10
    for path, rule in rules:
        assert rule["message"], path
        assert set(rule) <= {"rule", "message", "fieldPath", "reason"}, path
    spec_rules = [r["rule"] for p, r in rules if p == ".spec"]
    assert "has(self.template) != has(self.workloadRef)" in spec_rules


def test_kubernetes_specific_markers() -> None:
    schema = schema_of("ModelRollout")
    status = schema["properties"]["status"]["properties"]
    conditions = status["conditions"]
    assert conditions["x-kubernetes-list-type"] == "map"
    assert conditions["x-kubernetes-list-map-keys"] == ["type"]
    assert conditions["items"]["required"] == ["type", "status", "reason", "lastTransitionTime"]
    bandwidth = schema["properties"]["spec"]["properties"]["prefetch"]["properties"]
    assert bandwidth["bandwidthLimit"]["x-kubernetes-int-or-string"] is True
    spec = schema["properties"]["spec"]["properties"]
    assert spec["prefetch"]["default"] == {}
    assert spec["model"]["properties"]["manifestDigest"]["pattern"] == r"^sha256:[0-9a-f]{64}$"
    assert status["observedGeneration"]["type"] == "integer"
    assert status["phase"]["enum"] == [
        "Pending",
        "Prefetching",
        "Progressing",
        "Paused",
        "Healthy",
        "Degraded",
    ]


def test_crd_metadata_and_printer_columns() -> None:
    documents = {
        r.kind: yaml.safe_load((REPO / "crds" / r.file_name).read_text()) for r in crdgen.RESOURCES
    }
    rollout = documents["ModelRollout"]["spec"]
    assert rollout["names"]["shortNames"] == ["mr"]
    assert rollout["names"]["categories"] == ["weightship"]
    assert rollout["scope"] == "Namespaced"
    version = rollout["versions"][0]
    assert version["subresources"] == {"status": {}}
    columns = {c["name"]: c["jsonPath"] for c in version["additionalPrinterColumns"]}
    assert columns["Weight"] == ".status.canaryWeight"
    assert columns["Canary"] == ".status.canaryRevision.revision"
    assert {"Phase", "Step", "Stable", "Age"} <= set(columns)
    cache = documents["WeightCache"]["spec"]
    assert cache["scope"] == "Cluster"
    assert cache["names"]["shortNames"] == ["wc"]
    assert [c["name"] for c in cache["versions"][0]["additionalPrinterColumns"]] == [
        "Node",
        "Staged",
        "Free",
        "Age",
    ]


def test_unsupported_unions_are_refused() -> None:
    with pytest.raises(crdgen.SchemaError):
        crdgen.to_structural({"anyOf": [{"type": "integer"}, {"type": "boolean"}]}, {})
