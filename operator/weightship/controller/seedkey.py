"""The rollout's seeding key: a Secret the operator creates once per rollout, whose value
every pod of the rollout reads (a secretKeyRef) to make or check join tokens
(weightship.core.seedtoken). Any pod may become a seed root, so every pod gets it.

The operator creates the Secret (once per rollout: `SeedKeys`) and reads it back only to
sign in-place swap tokens (`swap_token`: the swapper's swap, the verifier's check of the
swapped weights); it never logs it or puts it in status or events. Its failure to create
one is no error of the rollout's: pods without the key simply load from their node cache
(the secretKeyRef is optional).
"""

from __future__ import annotations

import base64
import logging
import secrets
import threading
import time
from collections import OrderedDict
from typing import TYPE_CHECKING, Any

from kubernetes.client.rest import ApiException

from weightship.api.env import ROLLOUT_UID_ENV, SEED_KEY_ENV
from weightship.api.inference import SWAP_GROUP_PREFIX
from weightship.api.models import ModelRollout
from weightship.api.names import ROLLOUT_LABEL, SEEDING_KEY_LABEL
from weightship.core.seedtoken import KEY_BYTES, mint, parse_key

if TYPE_CHECKING:
    from weightship.controller.kube import Kube

log = logging.getLogger(__name__)

KEY_FIELD = "key"
SUFFIX = "-seed-key"


def seed_key_secret_name(rollout_name: str) -> str:
    return rollout_name[: 253 - len(SUFFIX)] + SUFFIX


def swap_group(pod: str) -> str:
    """The token group of a swap of one pod: a token opens that pod's swap only."""
    return f"{SWAP_GROUP_PREFIX}{pod}"


def swap_token(
    kube: Kube, namespace: str, rollout: str, rollout_uid: str, digest: str, pod: str
) -> str:
    """A token that opens ``pod``'s in-place swap to ``digest``, and lets the verifier
    reach those weights before they passed (api.inference); signed with the
    rollout's seeding key, read from its Secret (raises when it cannot be read)."""
    key = parse_key(kube.secret_data(namespace, seed_key_secret_name(rollout))[KEY_FIELD])
    return mint(key, rollout_uid, digest, swap_group(pod), time.time())


def needs_key(rollout: ModelRollout) -> bool:
    """Its pods seed by broadcast, or swap weights in place (the swapper's requests carry
    a token made with the key: controller/swapper.py)."""
    in_place = rollout.spec.strategy.canary.update_policy == "InPlaceIfPossible"
    return rollout.spec.seeding.broadcast or in_place


def seed_key_env(rollout: ModelRollout) -> list[dict[str, Any]]:
    """The key (by reference, never its value) and the rollout's uid, for a rollout that
    seeds by broadcast or swaps weights in place (the swapper's requests carry a token made
    with it: controller/swapper.py)."""
    if not needs_key(rollout):
        return []
    ref = {"name": seed_key_secret_name(rollout.metadata.name), "key": KEY_FIELD}
    return [
        {"name": ROLLOUT_UID_ENV, "value": rollout.metadata.uid or ""},
        {"name": SEED_KEY_ENV, "valueFrom": {"secretKeyRef": {**ref, "optional": True}}},
    ]


def seed_key_secret(rollout: ModelRollout, key: bytes) -> dict[str, Any]:
    """The Secret, owned by the rollout (garbage-collected with it) and labelled."""
    meta = rollout.metadata
    return {
        "apiVersion": "v1",
        "kind": "Secret",
        "type": "Opaque",
        "metadata": {
            "name": seed_key_secret_name(meta.name),
            "namespace": meta.namespace or "default",
            "labels": {ROLLOUT_LABEL: meta.name[:63], SEEDING_KEY_LABEL: "true"},
            "ownerReferences": [
                {
                    "apiVersion": rollout.api_version,
                    "kind": rollout.kind,
                    "name": meta.name,
                    "uid": meta.uid or "",
                    "controller": True,
                    "blockOwnerDeletion": True,
                }
            ],
        },
        "data": {KEY_FIELD: base64.b64encode(key.hex().encode()).decode()},
    }


class SeedKeys:
    """Creates each rollout's key Secret once per operator process: it remembers the
    rollouts (by uid) whose Secret it created or found there (409), so that a revision
    change makes no create that can only answer 409 (at 100 rollouts, 100 wasted writes
    and a round trip before each canary ReplicaSet). The operator may not list or watch
    Secrets (it could read them all), so this is what it knows. Nothing depends on the
    memory: a restart, or a uid pushed out of the bounded memory, costs one 409. A
    refusal (403: no admission policies) is not remembered; it is retried with the next
    ReplicaSet, as before."""

    def __init__(self, kube: Kube, capacity: int = 10_000) -> None:
        self.kube = kube
        self.capacity = capacity
        self.known: OrderedDict[str, None] = OrderedDict()
        self.lock = threading.Lock()  # the reconcile workers share it

    def ensure(self, rollout: ModelRollout) -> None:
        uid = rollout.metadata.uid
        if not needs_key(rollout) or not uid:
            return
        with self.lock:
            if uid in self.known:
                return
        if ensure_seed_key(self.kube, rollout):
            with self.lock:
                self.known[uid] = None
                while len(self.known) > self.capacity:
                    self.known.popitem(last=False)


def ensure_seed_key(kube: Kube, rollout: ModelRollout) -> bool:
    """Create the rollout's key Secret unless it exists (a fresh random key each time one
    is made: a key is never derived, so nothing outside the Secret can recompute it).
    Returns whether the Secret is there now."""
    if not needs_key(rollout) or not rollout.metadata.uid:
        return False
    body = seed_key_secret(rollout, secrets.token_bytes(KEY_BYTES))
    namespace = body["metadata"]["namespace"]
    try:
        kube.core.create_namespaced_secret(namespace, body)
    except ApiException as exc:
        if exc.status == 409:  # it exists, which is the steady state
            return True
        # Status and reason only: the answer's body may quote what was sent.
        log.warning(
            "cannot create the seeding key Secret %s/%s (%s %s): its pods will load "
            "from their node cache instead of by broadcast",
            namespace,
            body["metadata"]["name"],
            exc.status,
            exc.reason,
        )
        return False
    return True
