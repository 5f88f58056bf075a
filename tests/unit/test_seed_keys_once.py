"""The seeding key Secret is created once per rollout, not once per ReplicaSet: at 100
rollouts a revision change made 100 creates that could only answer 409."""

from __future__ import annotations

import copy
from typing import Any

import pytest
from kubernetes.client.rest import ApiException

from weightship.api.models import ModelRollout
from weightship.controller.seedkey import SeedKeys
from weightship_testing.samples import VALID_MANIFEST


def rollout(uid: str = "u-1", broadcast: bool = True) -> ModelRollout:
    body = copy.deepcopy(VALID_MANIFEST)
    body["metadata"] = {"name": "llm", "namespace": "serving", "uid": uid}
    body["spec"]["seeding"] = {"broadcast": broadcast}
    return ModelRollout.from_body(body)


class FakeKube:
    """Answers each Secret create with the next of ``answers`` (None: created)."""

    def __init__(self, *answers: int | None) -> None:
        self.answers = list(answers)
        self.creates = 0
        self.core = self

    def create_namespaced_secret(self, namespace: str, body: dict[str, Any]) -> None:
        self.creates += 1
        status = self.answers.pop(0) if self.answers else None
        if status is not None:
            raise ApiException(status=status, reason="Nope")


@pytest.mark.parametrize(
    ("answer", "creates"),
    [
        (None, 1),  # created: known from then on
        (409, 1),  # it was there (e.g. made before a restart): known too
        (403, 3),  # refused: not remembered, tried again with the next ReplicaSet
    ],
)
def test_a_rollout_s_key_is_created_once_unless_refused(answer: int | None, creates: int) -> None:
    kube: Any = FakeKube(answer, answer, answer)
    keys = SeedKeys(kube)
    for _ in range(3):
        keys.ensure(rollout())
    assert kube.creates == creates


def test_each_rollout_uid_is_its_own_and_the_memory_is_bounded() -> None:
    kube: Any = FakeKube()
    keys = SeedKeys(kube, capacity=2)
    for uid in ("a", "b", "c"):
        keys.ensure(rollout(uid))
    assert kube.creates == 3 and list(keys.known) == ["b", "c"]
    keys.ensure(rollout("a"))  # pushed out: one more create (a 409 in a cluster)
    keys.ensure(rollout("c"))
    assert kube.creates == 4


def test_no_key_without_broadcast_or_uid() -> None:
    kube: Any = FakeKube()
    keys = SeedKeys(kube)
    keys.ensure(rollout(broadcast=False))
    keys.ensure(rollout(uid=""))
    assert kube.creates == 0
