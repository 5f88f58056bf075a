"""A scoped operator (operator.watchNamespaces) may list and watch namespaces: kopf
matches its --namespace names and globs against them, and refused it retried for about
54 s at every start before its first reconcile (found by e2e/test_upgrade.py). Read-only,
and not granted when the operator watches the whole cluster (kopf lists none then)."""

from __future__ import annotations

from tests.unit.test_helm_chart import DEFAULT, SCOPED, allows, render, rules


def test_a_scoped_operator_may_list_and_watch_namespaces_and_nothing_more() -> None:
    scoped = rules(render(SCOPED), "ClusterRole", "-operator")
    for verb in ("list", "watch"):
        assert any(allows(r, "", "namespaces", verb) for r in scoped), verb
    for verb in ("get", "create", "update", "patch", "delete"):
        assert not any(allows(r, "", "namespaces", verb) for r in scoped), verb
    cluster_wide = rules(render(DEFAULT), "ClusterRole", "-operator")
    assert not any(allows(r, "", "namespaces", "list") for r in cluster_wide)
