"""Kubernetes' own grammars, parsed once for every caller (api, controller, agent, CLI).

`quantity` (resource.Quantity), `rfc3339` (metav1.Time) and `selector` (label selectors)
follow apimachinery's behaviour; the unit tests take their tables from it. This package
imports nothing from weightship, so it sits below every other package.
"""
