"""The operator's side of the seeding token: one key Secret per rollout, owned and
labelled, and every rollout pod reading it by reference (issue 12, High 2)."""

from __future__ import annotations

import base64
import copy
import logging
from typing import Any

import pytest
from kubernetes.client.rest import ApiException

from weightship.api.env import ROLLOUT_UID_ENV, SEED_KEY_ENV
from weightship.api.models import ModelRollout
from weightship.controller.builders import replicaset_body
from weightship.controller.seedkey import ensure_seed_key, seed_key_secret
from weightship.core.seedtoken import parse_key
from weightship_testing.samples import VALID_MANIFEST

DIGEST = "sha256:" + "ab" * 32


def rollout(broadcast: bool = True) -> ModelRollout:
    body = copy.deepcopy(VALID_MANIFEST)
    body["metadata"] = {"name": "llm", "namespace": "serving", "uid": "u-1"}
    body["spec"]["seeding"] = {"broadcast": broadcast}
    return ModelRollout.from_body(body)


def container_env(r: ModelRollout) -> dict[str, dict[str, Any]]:
    assert r.spec.template is not None
    rs = replicaset_body(
        r,
        template=r.spec.template.to_k8s(),
        revision_hash="abc123",
        manifest_digest=DIGEST,
        replicas=1,
        require_staged=False,
    )
    (container, *_) = rs["spec"]["template"]["spec"]["containers"]
    return {e["name"]: e for e in container["env"]}


def test_every_rollout_pod_reads_the_key_by_reference_never_by_value() -> None:
    env = container_env(rollout())
    assert env[ROLLOUT_UID_ENV] == {"name": ROLLOUT_UID_ENV, "value": "u-1"}
    assert env[SEED_KEY_ENV] == {
        "name": SEED_KEY_ENV,
        "valueFrom": {"secretKeyRef": {"name": "llm-seed-key", "key": "key", "optional": True}},
    }
    off = container_env(rollout(broadcast=False))
    assert SEED_KEY_ENV not in off and ROLLOUT_UID_ENV not in off


def test_the_key_secret_is_owned_labelled_and_holds_32_random_bytes() -> None:
    body = seed_key_secret(rollout(), bytes(range(32)))
    meta = body["metadata"]
    assert (body["type"], meta["name"], meta["namespace"]) == ("Opaque", "llm-seed-key", "serving")
    assert meta["labels"] == {"weightship.io/rollout": "llm", "weightship.io/seeding-key": "true"}
    (owner,) = meta["ownerReferences"]
    assert (owner["kind"], owner["name"], owner["uid"]) == ("ModelRollout", "llm", "u-1")
    assert parse_key(base64.b64decode(body["data"]["key"]).decode()) == bytes(range(32))


class Core:
    """Records creates; answers with ``status`` (None: created)."""

    def __init__(self, status: int | None) -> None:
        self.status = status
        self.created: list[dict[str, Any]] = []

    def create_namespaced_secret(self, namespace: str, body: dict[str, Any]) -> None:
        self.created.append(body)
        if self.status is not None:
            raise ApiException(status=self.status, reason="Nope")


class FakeKube:
    def __init__(self, status: int | None) -> None:
        self.core = Core(status)


@pytest.mark.parametrize("status", [None, 409, 403])
def test_ensure_creates_a_fresh_key_and_never_logs_it(
    status: int | None, caplog: pytest.LogCaptureFixture
) -> None:
    kube: Any = FakeKube(status)
    with caplog.at_level(logging.DEBUG):
        ensure_seed_key(kube, rollout())
        ensure_seed_key(kube, rollout())
    first, second = kube.core.created
    assert first["data"]["key"] != second["data"]["key"]  # random, never derived
    for body in kube.core.created:
        value = base64.b64decode(body["data"]["key"]).decode()
        assert value not in caplog.text and body["data"]["key"] not in caplog.text
    assert ("403" in caplog.text) == (status == 403)  # a refusal is logged, an existing one not
    kube = FakeKube(None)
    ensure_seed_key(kube, rollout(broadcast=False))
    assert kube.core.created == []
