"""What a ReplicaSet create would refuse in spec.template.spec, refused at admission.

The pod spec is passed through unchanged (x-kubernetes-preserve-unknown-fields), so the
API server checked nothing in it and every ReplicaSet create failed at run time (issue
23: `spec.template.spec: {}` was admitted). The schema here types only what the pod spec
validation of apps/v1 ReplicaSets refuses and a schema or a cheap CEL rule can see:

- containers: at least one; each with a name (a DNS label, unique across containers and
  initContainers) and a non-empty image;
- resources.limits/requests: quantities, integers or strings (`isQuantity`, the API
  server's own parser; a JSON fraction such as 0.5 is refused: write "500m"), not
  negative, whole numbers for extended resources (`example.com/gpu`), and requests no
  larger than limits.

`check_pod_spec` is the same check on the parsed model (the API server and the operator
refuse the same objects); everything else in the pod spec stays Kubernetes' to check.
"""

from __future__ import annotations

from decimal import Decimal
from typing import Any

from weightship.api.base import DNS_LABEL_PATTERN, LABEL_KEY_PATTERN, cel, matches
from weightship.kube.quantity import parse_quantity

MAX_CONTAINERS = 16
MAX_RESOURCES = 16
MAX_QUANTITY_LENGTH = 64  # as spec.prefetch.bandwidthLimit: longer means nothing
_NAME_MESSAGE = "container names must be unique across containers and initContainers"
_QUANTITY_MESSAGE = "must be a non-negative quantity such as 500m, 2Gi or 1"
_INTEGER_MESSAGE = "extended resources (such as nvidia.com/gpu) must be whole numbers"
_REQUESTS_MESSAGE = "requests must be less than or equal to limits"


def _quantity_rule(value: str) -> str:
    """``value`` (an integer or a string, as CEL sees it) is a quantity of at least 0."""
    return (
        f"type({value}) == int ? {value} >= 0 : "
        f"isQuantity({value}) && quantity({value}).compareTo(quantity('0')) >= 0"
    )


def _as_quantity(value: str) -> str:
    return f"(type({value}) == int ? quantity(string({value})) : quantity({value}))"


def _extended(key: str) -> str:
    """An extended resource: a prefixed name outside kubernetes.io (IsExtendedResourceName)."""
    return f"({key}.contains('/') && !{key}.contains('kubernetes.io/'))"


# What a container may ask for: a standard container resource (IsStandardContainerResource
# Name) or an extended one whose name is a qualified name.
STANDARD_RESOURCES = ("cpu", "memory", "ephemeral-storage")
_RESOURCE_MESSAGE = (
    "resource names must be cpu, memory, ephemeral-storage, hugepages-<size> or an "
    "extended resource such as nvidia.com/gpu"
)


def _resource_name_rule() -> str:
    standard = ", ".join(f"'{n}'" for n in STANDARD_RESOURCES)
    return (
        f"self.all(k, k in [{standard}] || k.startsWith('hugepages-') || "
        f"({_extended('k')} && k.matches(r'{LABEL_KEY_PATTERN}')))"
    )


def _resource_list(what: str) -> dict[str, Any]:
    return {
        "type": "object",
        "description": f"Resource {what} (a core/v1 ResourceList): name to quantity.",
        "maxProperties": MAX_RESOURCES,
        "additionalProperties": {
            "description": "A quantity: a string such as 500m or 2Gi, or an integer.",
            "anyOf": [{"type": "integer"}, {"type": "string"}],
            "maxLength": MAX_QUANTITY_LENGTH,
            "x-kubernetes-validations": [cel(_quantity_rule("self"), _QUANTITY_MESSAGE)],
        },
        "x-kubernetes-validations": [
            cel(_resource_name_rule(), _RESOURCE_MESSAGE),
            cel(
                f"self.all(k, !{_extended('k')} || type(self[k]) == int || "
                f"(isQuantity(self[k]) && quantity(self[k]).isInteger()))",
                _INTEGER_MESSAGE,
            ),
        ],
    }


RESOURCES_SCHEMA: dict[str, Any] = {
    "type": "object",
    "description": "Compute resources (a core/v1 ResourceRequirements).",
    "additionalProperties": True,
    "properties": {"limits": _resource_list("limits"), "requests": _resource_list("requests")},
    "x-kubernetes-validations": [
        cel(
            "!has(self.limits) || !has(self.requests) || self.requests.all(k, "
            "!(k in self.limits) || "
            f"!({_quantity_rule('self.requests[k]')}) || "
            f"!({_quantity_rule('self.limits[k]')}) || "
            f"{_as_quantity('self.requests[k]')}.compareTo("
            f"{_as_quantity('self.limits[k]')}) <= 0)",
            _REQUESTS_MESSAGE,
            field_path=".requests",
        )
    ],
}


def _container(kind: str) -> dict[str, Any]:
    return {
        "type": "object",
        "description": f"A core/v1 Container of {kind}; fields not listed pass through.",
        "additionalProperties": True,
        "required": ["name", "image"],
        "properties": {
            "name": {
                "type": "string",
                "description": "Name of the container (a DNS label), unique in the pod.",
                "maxLength": 63,
                "pattern": DNS_LABEL_PATTERN,
            },
            "image": {
                "type": "string",
                "description": "Container image.",
                "minLength": 1,
            },
            "resources": RESOURCES_SCHEMA,
        },
    }


POD_SPEC_SCHEMA: dict[str, Any] = {
    "type": "object",
    "description": "A core/v1 PodSpec, passed through unchanged (see `kubectl explain "
    "pod.spec`). The API server checks its containers (names, images, resources) here.",
    "additionalProperties": True,
    "required": ["containers"],
    "properties": {
        "containers": {
            "type": "array",
            "description": "The pod's containers: at least one.",
            "minItems": 1,
            "maxItems": MAX_CONTAINERS,
            "items": _container("the pod"),
        },
        "initContainers": {
            "type": "array",
            "description": "The pod's init containers.",
            "maxItems": MAX_CONTAINERS,
            "items": _container("the pod's initialization"),
        },
    },
    "x-kubernetes-validations": [
        cel(
            "self.containers.all(c, self.containers.exists_one(d, d.name == c.name)) && "
            "(!has(self.initContainers) || self.initContainers.all(c, "
            "self.initContainers.exists_one(d, d.name == c.name) && "
            "!self.containers.exists(d, d.name == c.name)))",
            _NAME_MESSAGE,
            field_path=".containers",
        )
    ],
}


def _value(value: object) -> Decimal | None:
    """A resource value as the API server reads it; None when it is no quantity."""
    if isinstance(value, bool):
        return None
    if isinstance(value, int):
        return Decimal(value)
    if isinstance(value, str):
        try:
            return parse_quantity(value)
        except ValueError:
            return None
    return None


def _is_extended(key: str) -> bool:
    return "/" in key and "kubernetes.io/" not in key


def _resource_name(key: str) -> bool:
    if key in STANDARD_RESOURCES or key.startswith("hugepages-"):
        return True
    return _is_extended(key) and matches(LABEL_KEY_PATTERN, key)


def _check_resources(where: str, resources: object) -> None:
    if not isinstance(resources, dict):
        return
    parsed: dict[str, dict[str, Decimal]] = {}
    for what in ("limits", "requests"):
        values = resources.get(what)
        if values is None:
            continue
        if not isinstance(values, dict) or len(values) > MAX_RESOURCES:
            raise ValueError(f"{where}.resources.{what}: a map of at most {MAX_RESOURCES}")
        for key, value in values.items():
            if not _resource_name(key):
                raise ValueError(f"{where}.resources.{what}[{key[:80]}]: {_RESOURCE_MESSAGE}")
            amount = _value(value)
            too_long = isinstance(value, str) and len(value) > MAX_QUANTITY_LENGTH
            if amount is None or amount < 0 or too_long:
                raise ValueError(f"{where}.resources.{what}[{key}]: {_QUANTITY_MESSAGE}")
            if _is_extended(key):
                whole = isinstance(value, int) or (
                    isinstance(value, str)
                    and amount == amount.to_integral_value()
                    and abs(amount) < 2**63
                )
                if not whole:
                    raise ValueError(f"{where}.resources.{what}[{key}]: {_INTEGER_MESSAGE}")
            parsed.setdefault(what, {})[key] = amount
    limits, requests = parsed.get("limits"), parsed.get("requests")
    if limits is not None and requests is not None:
        for key, amount in requests.items():
            if key in limits and amount > limits[key]:
                raise ValueError(f"{where}.resources.requests[{key}]: {_REQUESTS_MESSAGE}")


def _check_containers(kind: str, containers: object, *, at_least_one: bool) -> list[str]:
    if not isinstance(containers, list) or (at_least_one and not containers):
        raise ValueError(f"spec.template.spec.{kind}: at least one container is required")
    if len(containers) > MAX_CONTAINERS:
        raise ValueError(f"spec.template.spec.{kind}: at most {MAX_CONTAINERS} containers")
    names = []
    for i, container in enumerate(containers):
        where = f"spec.template.spec.{kind}[{i}]"
        if not isinstance(container, dict):
            raise ValueError(f"{where}: must be an object")
        name, image = container.get("name"), container.get("image")
        if not isinstance(name, str) or len(name) > 63 or not matches(DNS_LABEL_PATTERN, name):
            raise ValueError(f"{where}.name: a container needs a name that is a DNS label")
        if not isinstance(image, str) or not image:
            raise ValueError(f"{where}.image: a container needs an image")
        _check_resources(where, container.get("resources"))
        names.append(name)
    return names


def check_pod_spec(spec: dict[str, Any]) -> dict[str, Any]:
    """POD_SPEC_SCHEMA's checks on a parsed pod spec; ValueError naming the field."""
    names = _check_containers("containers", spec.get("containers"), at_least_one=True)
    if spec.get("initContainers") is not None:
        names += _check_containers("initContainers", spec["initContainers"], at_least_one=False)
    if len(set(names)) != len(names):
        raise ValueError(f"spec.template.spec.containers: {_NAME_MESSAGE}")
    return spec
