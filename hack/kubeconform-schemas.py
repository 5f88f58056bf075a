"""Make kubeconform's schemas from Kubernetes' own OpenAPI (api/openapi-spec/swagger.json of
the k8s.io/kubernetes module that hack/deps.sh builds the control plane from), offline.

kubeconform's default schemas are downloaded from a repository this machine cannot reach;
these are the same thing, made the way its openapi2jsonschema script makes its
`-standalone-strict` variant: one file per kind, `<kind>-<group>-<version>.json` (its
`{{ .ResourceKind }}{{ .KindSuffix }}.json`), holding every definition it refers to, with
`additionalProperties: false` on every object that lists its properties (a misspelled field
fails), and int-or-string and quantity fields accepting a number too.

    python3 hack/kubeconform-schemas.py swagger.json OUT_DIR
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

PREFIX = "#/definitions/"
LOOSE = {  # JSON Schema for what the OpenAPI calls a string with a format
    "io.k8s.apimachinery.pkg.util.intstr.IntOrString": {
        "oneOf": [{"type": "string"}, {"type": "integer"}]
    },
    "io.k8s.apimachinery.pkg.api.resource.Quantity": {
        "oneOf": [{"type": "string"}, {"type": "number"}]
    },
}


def strict(node: Any) -> Any:
    if isinstance(node, dict):
        out = {k: strict(v) for k, v in node.items()}
        if "properties" in out and "additionalProperties" not in out:
            out["additionalProperties"] = False
        return out
    if isinstance(node, list):
        return [strict(v) for v in node]
    return node


def refs(node: Any) -> set[str]:
    if isinstance(node, dict):
        ref = node.get("$ref")  # a string; JSONSchemaProps has a property named $ref too
        found = {ref[len(PREFIX) :]} if isinstance(ref, str) else set()
        return found.union(*(refs(v) for v in node.values()))
    if isinstance(node, list):
        return set().union(*(refs(v) for v in node))
    return set()


def closure(name: str, definitions: dict[str, Any]) -> dict[str, Any]:
    seen: dict[str, Any] = {}
    todo = [name]
    while todo:
        current = todo.pop()
        if current in seen:
            continue
        seen[current] = definitions[current]
        todo += refs(definitions[current]) - seen.keys()
    return seen


def main(swagger: Path, out: Path) -> None:
    spec = json.loads(swagger.read_text())
    definitions = {name: strict(d) for name, d in spec["definitions"].items()}
    definitions.update(LOOSE)
    out.mkdir(parents=True, exist_ok=True)
    written = 0
    for name, definition in definitions.items():
        for gvk in definition.get("x-kubernetes-group-version-kind", []):
            group = gvk["group"].split(".")[0]
            suffix = f"-{group}-{gvk['version']}" if group else f"-{gvk['version']}"
            schema = {
                "$schema": "http://json-schema.org/draft-04/schema#",
                "$ref": PREFIX + name,
                "definitions": closure(name, definitions),
            }
            path = out / f"{gvk['kind'].lower()}{suffix.lower()}.json"
            path.write_text(json.dumps(schema, sort_keys=True))
            written += 1
    print(f"{written} schemas in {out}", file=sys.stderr)


if __name__ == "__main__":
    main(Path(sys.argv[1]), Path(sys.argv[2]))
