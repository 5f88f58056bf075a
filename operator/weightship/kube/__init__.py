"""Kubernetes access for every caller (api, controller, agent, CLI, devtools).

Kubernetes' own grammars, parsed once: `quantity` (resource.Quantity), `rfc3339`
(metav1.Time) and `selector` (label selectors) follow apimachinery's behaviour; the unit
tests take their tables from it. And the access layer: `client` (loading the client, the
one retry policy) and `informer` (the list-then-watch cache). This package imports nothing
from weightship, so it sits below every other package (tests/unit/test_layering.py).
"""
