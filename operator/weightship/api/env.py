"""The environment's names, defined once: what the controller puts in a model server pod's
environment (and the servers, plugins and seeding read), and the settings that more than
one process reads or the chart sets for the operator.

Plain strings, no imports: the vLLM plugin, installed without the operator's
dependencies, reads them too. A name one process alone reads and the chart does not set
stays beside its reader (the agent's and the plugin's settings classes).
"""

from __future__ import annotations

# A model server pod's environment, set by the controller (controller/builders.py).
MODEL_URI_ENV = "WEIGHTSHIP_MODEL_URI"
MODEL_REVISION_ENV = "WEIGHTSHIP_MODEL_REVISION"
MANIFEST_DIGEST_ENV = "WEIGHTSHIP_MANIFEST_DIGEST"
# The node cache (or the rollout's view of it) as the pod mounts it; also the agent's and
# the operator's install-time setting (the chart's agent.cacheDir).
CACHE_DIR_ENV = "WEIGHTSHIP_CACHE_DIR"
# The pinned model's staged folder, for servers that read it themselves (`vllm serve
# $(WEIGHTSHIP_MODEL_DIR)`).
MODEL_DIR_ENV = "WEIGHTSHIP_MODEL_DIR"
S3_ENDPOINT_ENV = "WEIGHTSHIP_S3_ENDPOINT"
# Who this replica is and where peers reach it (downward API), for broadcast seeding.
POD_NAME_ENV = "WEIGHTSHIP_POD_NAME"
POD_IP_ENV = "WEIGHTSHIP_POD_IP"
# The rollout's seeding key (hex; a secretKeyRef to the operator's Secret) and uid: a
# receiver makes its join token with them, a root and a swap check tokens with them.
SEED_KEY_ENV = "WEIGHTSHIP_SEED_KEY"
ROLLOUT_UID_ENV = "WEIGHTSHIP_ROLLOUT_UID"
# A scale-up's broadcast seeding (core/seeding.py writes, seeding/config.py reads).
SEED_ROOT_ENV = "WEIGHTSHIP_SEED_ROOT"
SEED_GROUP_ENV = "WEIGHTSHIP_SEED_GROUP"
SEED_WORLD_SIZE_ENV = "WEIGHTSHIP_SEED_WORLD_SIZE"
SEED_BACKEND_ENV = "WEIGHTSHIP_SEED_BACKEND"
SEED_TIMEOUT_ENV = "WEIGHTSHIP_SEED_TIMEOUT_SECONDS"
SEED_BUCKET_BYTES_ENV = "WEIGHTSHIP_SEED_BUCKET_BYTES"
# Where a server that refuses its weights writes why before it exits (the vLLM plugin, the
# SGLang adapter; default api.inference.DEFAULT_TERMINATION_LOG).
TERMINATION_LOG_ENV = "WEIGHTSHIP_TERMINATION_LOG"

# Settings the chart gives more than one process (the operator, the agent).
METRICS_PORT_ENV = "WEIGHTSHIP_METRICS_PORT"
PEER_PORT_ENV = "WEIGHTSHIP_PEER_PORT"
WATCH_NAMESPACES_ENV = "WEIGHTSHIP_WATCH_NAMESPACES"

# The operator's settings, read once at its start (controller/settings.py); the chart sets
# them from its operator values (docs/controller.md lists them).
RECONCILE_WORKERS_ENV = "WEIGHTSHIP_RECONCILE_WORKERS"
VERIFY_WORKERS_ENV = "WEIGHTSHIP_VERIFY_WORKERS"
KOPF_MAX_WORKERS_ENV = "WEIGHTSHIP_MAX_WORKERS"  # kopf's executor, for sync handlers
PEERING_PRIORITY_ENV = "WEIGHTSHIP_PEERING_PRIORITY"
LEADER_ELECT_ENV = "WEIGHTSHIP_LEADER_ELECT"  # also `weightship operator --leader-elect`
# The Lease's namespace (also --leader-elect-namespace); unset: the pod's own.
LEADER_ELECT_NAMESPACE_ENV = "WEIGHTSHIP_LEADER_ELECT_NAMESPACE"
LEASE_NAME_ENV = "WEIGHTSHIP_LEADER_ELECT_LEASE"
LEASE_DURATION_ENV = "WEIGHTSHIP_LEADER_ELECT_LEASE_DURATION_S"
RENEW_DEADLINE_ENV = "WEIGHTSHIP_LEADER_ELECT_RENEW_DEADLINE_S"
RETRY_PERIOD_ENV = "WEIGHTSHIP_LEADER_ELECT_RETRY_PERIOD_S"
# The operator pod's namespace and name (downward API); POD_ID is kopf's peer identity too.
POD_NAMESPACE_ENV = "POD_NAMESPACE"
POD_ID_ENV = "POD_ID"
