"""The API's names, defined once: its group, version, kinds and plurals.

Everything that names a weightship resource to the API server (the CRD generator, the
controller, the agent, the CLI, devtools and tests) takes these from here. Label and
annotation keys built on the group belong to whoever writes them (most to
`weightship.controller.builders`).
"""

from __future__ import annotations

GROUP = "weightship.io"
VERSION = "v1alpha1"
API_VERSION = f"{GROUP}/{VERSION}"

ROLLOUT_KIND = "ModelRollout"
ROLLOUT_PLURAL = "modelrollouts"
CACHE_KIND = "WeightCache"
CACHE_PLURAL = "weightcaches"
