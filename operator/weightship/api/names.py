"""The API's names, defined once: its group, version, kinds and plurals, and every label,
annotation and condition the operator, the agent and the servers agree on.

Everything that names a weightship resource or key to the API server (the CRD generator,
the controller, the agent, the CLI, the plugins, devtools, tests and benches) takes these
from here. Plain strings, no imports: the vLLM plugin, installed without the operator's
dependencies, reads them too. The environment's names are in `weightship.api.env`.
"""

from __future__ import annotations

GROUP = "weightship.io"
VERSION = "v1alpha1"
API_VERSION = f"{GROUP}/{VERSION}"

ROLLOUT_KIND = "ModelRollout"
ROLLOUT_PLURAL = "modelrollouts"
CACHE_KIND = "WeightCache"
CACHE_PLURAL = "weightcaches"

# Labels.
ROLLOUT_LABEL = f"{GROUP}/rollout"
REVISION_LABEL = f"{GROUP}/revision-hash"
# updatePolicy InPlaceIfPossible: one ReplicaSet per pod template selects its pods by this
# label, so a pod that swaps its weights (its revision-hash label changes) stays in it.
TEMPLATE_LABEL = f"{GROUP}/template-hash"
SEEDING_KEY_LABEL = f"{GROUP}/seeding-key"  # on a rollout's seeding key Secret
# On a WeightCache: agents trade chunks only with agents of the same group (agent.kube).
PEER_GROUP_LABEL = f"{GROUP}/peer-group"


def staged_node_label(manifest_digest: str) -> str:
    """Node label set once a node has every chunk of `manifest_digest` staged."""
    return f"staged.{GROUP}/{manifest_digest.removeprefix('sha256:')[:16]}"


# Annotations.
DIGEST_ANNOTATION = f"{GROUP}/manifest-digest"
MODEL_REVISION_ANNOTATION = f"{GROUP}/model-revision"
# The record of a pod's last in-place swap (JSON; controller/builders.swap_record).
SWAP_ANNOTATION = f"{GROUP}/swap"
# The verifier's records on a pod (controller/verifier.py).
LOADED_ANNOTATION = f"{GROUP}/loaded"
FAILED_PROMPT_ANNOTATION = f"{GROUP}/failed-prompt"
# Container restarts when the verdict was written: a restarted server loads again, so its
# old verdict no longer says anything about what it serves.
RESTARTS_ANNOTATION = f"{GROUP}/verified-restarts"
# The ReplicaSet controller deletes the pods of lowest cost first: a drained pod's
# (core.drain) is the lowest there is, so a scale-down takes exactly the drained ones.
DELETION_COST_ANNOTATION = "controller.kubernetes.io/pod-deletion-cost"

# The pod readiness gate (and condition type) that holds traffic until weights verify.
VERIFIED_GATE = f"{GROUP}/weights-verified"
FINALIZER = f"{GROUP}/finalizer"  # kopf's; on a rollout only while it holds a workload
