"""What admission now allows at the edges is accepted by the controller's model, and the
one regex dialect is RE2 (issue 12, admission/run-time parity)."""

from __future__ import annotations

import copy
from typing import Any

import pytest
from pydantic import ValidationError

from weightship.api.models import ModelRollout
from weightship.api.regex import compile_re2
from weightship.kube.quantity import quantity_value
from weightship_testing.samples import VALID_MANIFEST


def with_changes(**paths: Any) -> dict[str, Any]:
    doc = copy.deepcopy(VALID_MANIFEST)
    for path, value in paths.items():
        node = doc["spec"]
        *parents, last = path.split("__")
        for part in parents:
            node = node[int(part)] if part.isdigit() else node[part]
        if last.isdigit():
            node[int(last)] = value
        else:
            node[last] = value
    return doc


@pytest.mark.parametrize(
    "changes",
    [
        {"strategy__canary__steps__1": {"pause": {"duration": "8760h"}}},
        {"strategy__canary__steps__1": {"pause": {"duration": "1h30m0.5s"}}},
        {"strategy__canary__analysis__metrics__0__interval": "24h"},
        {"strategy__canary__analysis__metrics__0__interval": "1s"},
        {"prefetch__bandwidthLimit": 1},
        {"prefetch__bandwidthLimit": "1"},
        {"prefetch__bandwidthLimit": "1.5Gi"},
        {"prefetch__bandwidthLimit": "1e3"},
        {"prefetch__nodeSelector": {"example.com/gpu-class": "h100", "kubernetes.io/os": ""}},
        {"validation__goldenPrompts__0__expect": {"regex": r"\pL+\z"}},
        {"validation__goldenPrompts__0__expect": {"regex": r"\Qa.b\E"}},
        {"strategy__canary__analysis__metrics__0__query": "up{ns='{{namespace}}'} {  }"},
    ],
)
def test_edges_admission_allows_are_accepted(changes: dict[str, Any]) -> None:
    ModelRollout.model_validate(with_changes(**changes))


@pytest.mark.parametrize(
    "changes",
    [
        {"strategy__canary__steps__1": {"pause": {"duration": "9" * 40 + "h"}}},  # overflow
        {"strategy__canary__analysis__prometheus__address": "http://prom\u2028x"},
        {"model__source__endpoint": "http://minio\u00a0x:9000"},
        {"prefetch__nodeSelector": {("x" * 254) + "/a": "b"}},
        {"prefetch__nodeSelector": {"a" * 64: "b"}},
        {"validation__goldenPrompts__0__expect": {"regex": r"(a)\1"}},
        {"strategy__canary__analysis__metrics__0__query": "up{x='{{\u00a0bogus }}'}"},
    ],
)
def test_run_time_refuses_what_admission_refuses(changes: dict[str, Any]) -> None:
    with pytest.raises(ValidationError):
        ModelRollout.model_validate(with_changes(**changes))


def test_quantities_have_their_kubernetes_values() -> None:
    assert quantity_value("100Mi") == 100 * 1024**2
    assert quantity_value("1.5k") == 1500
    assert quantity_value("1m") * 1000 == 1
    assert quantity_value("2e3") == 2000
    # The API server admits these; the model once refused them (parity test findings).
    assert quantity_value("1E") == 10**18 and quantity_value("1Ei") == 2**60
    assert quantity_value("1e308") >= 1 and quantity_value("1e-308") < 1
    with pytest.raises(ValueError):
        quantity_value("fast")


def test_re2_is_the_dialect() -> None:
    assert compile_re2(r"\pL+\z").search("Paris") is not None
    with pytest.raises(ValueError, match="RE2"):
        compile_re2("(?=Paris)")
