"""The `weightship` command line (also `kubectl weightship`)."""

from __future__ import annotations

import json
from typing import Any

import click
from rich.console import Console

from weightship import __version__
from weightship.agent.cli import agent_command


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="weightship")
def main() -> None:
    """Stage, verify and canary new model weights across GPU inference fleets."""


@main.command("operator")
@click.option(
    "-n",
    "--namespace",
    "namespaces",
    multiple=True,
    help="Watch only these namespaces (repeatable). Default: the whole cluster.",
)
@click.option(
    "--liveness",
    default="http://0.0.0.0:8080/healthz",
    show_default=True,
    help="Liveness endpoint URL, or '' to disable.",
)
@click.option("--standalone", is_flag=True, help="Skip peering (only one operator runs).")
@click.option(
    "--priority",
    type=int,
    default=None,
    help="Peering priority; the highest-priority replica is active "
    "(default: $WEIGHTSHIP_PEERING_PRIORITY, else 0).",
)
@click.option(
    "--leader-elect/--no-leader-elect",
    default=None,
    help="Run only while holding a Lease, so that more replicas are standbys "
    "(default: $WEIGHTSHIP_LEADER_ELECT, else off; settings: WEIGHTSHIP_LEADER_ELECT_* "
    "variables).",
)
@click.option(
    "--leader-elect-namespace",
    default=None,
    help="The Lease's namespace (default: $WEIGHTSHIP_LEADER_ELECT_NAMESPACE, else "
    "$POD_NAMESPACE).",
)
@click.option("-v", "--verbose", is_flag=True)
def operator_command(
    namespaces: tuple[str, ...],
    liveness: str,
    standalone: bool,
    priority: int | None,
    leader_elect: bool | None,
    leader_elect_namespace: str | None,
    verbose: bool,
) -> None:
    """Run the ModelRollout controller (kopf). Its settings are environment variables
    (docs/controller.md); an option given overrides its variable."""
    import logging
    import os

    import kopf

    import weightship.controller.handlers  # noqa: F401 - registers the handlers
    from weightship.controller.settings import ControllerSettings, SettingsError

    try:
        settings = ControllerSettings.from_env(os.environ)
    except SettingsError as error:
        raise click.ClickException(str(error)) from None
    settings = settings.with_options(
        peering_priority=priority,
        leader_elect=leader_elect,
        leader_elect_namespace=leader_elect_namespace,
    )

    kopf.configure(verbose=verbose)
    if not verbose:
        # kopf logs every watch-event handler call; the controller logs what matters.
        logging.getLogger("kopf.objects").setLevel(logging.WARNING)

    def run() -> None:
        kopf.run(
            clusterwide=not namespaces,
            namespaces=list(namespaces),
            liveness_endpoint=liveness or None,
            standalone=standalone,
            memo=kopf.Memo(controller_settings=settings),
        )

    if not settings.leader_elect:
        run()
        return
    from weightship.controller import leader

    leader.run_elected(
        run, settings.lease(), liveness or None, metrics_port=settings.metrics_port or None
    )


def _api() -> Any:
    from kubernetes import config

    from weightship.kube.client import load_client

    try:
        return load_client(kubeconfig_first=True)
    except config.ConfigException as e:
        raise click.ClickException(
            "no Kubernetes credentials: set KUBECONFIG (the local cluster's is "
            "/var/tmp/weightship-cluster/kubeconfig) or run inside a pod"
        ) from e


namespace_option = click.option("-n", "--namespace", default="default", show_default=True)


def _errors(api: Any, namespace: str, name: str) -> Any:
    from weightship.clierrors import api_errors

    return api_errors(f"modelrollout {namespace}/{name}", api.configuration.host)


@main.command("status")
@click.argument("name")
@namespace_option
@click.option("-w", "--watch", is_flag=True, help="Keep refreshing until interrupted.")
@click.option("-o", "--output", type=click.Choice(["rich", "json"]), default="rich")
def status_command(name: str, namespace: str, watch: bool, output: str) -> None:
    """Show a rollout: phase, steps, weights, replicas, gates and prefetch progress."""
    import time

    from rich.live import Live

    from weightship import rollouts, statusview

    api = _api()
    with _errors(api, namespace, name):
        if output == "json":
            summary = statusview.summary(rollouts.get_rollout(api, namespace, name))
            click.echo(json.dumps(summary, indent=2))
            return
        console = Console()
        if not watch:
            console.print(statusview.render(rollouts.get_rollout(api, namespace, name)))
            return
        with Live(console=console, refresh_per_second=2) as live:
            while True:
                live.update(statusview.render(rollouts.get_rollout(api, namespace, name)))
                time.sleep(1)


def _send(action: str, name: str, namespace: str, wait: bool, **fields: Any) -> None:
    import time

    from weightship import rollouts

    api = _api()
    with _errors(api, namespace, name):
        body = getattr(rollouts, action)(api, namespace, name, **fields)
        click.echo(f"{action} requested for {namespace}/{name} ({body['requestedAt']})")
        if not wait:
            return
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            rollout = rollouts.get_rollout(api, namespace, name)
            if rollouts.acknowledged(rollout, action, body["requestedAt"]):
                click.echo(f"acknowledged: {(rollout.get('status') or {}).get('message', '')}")
                return
            time.sleep(0.5)
    raise click.ClickException("the controller did not acknowledge within 60s: is it running?")


wait_option = click.option(
    "--wait/--no-wait",
    default=True,
    show_default=True,
    help="Wait until the controller acknowledges the request.",
)


@main.command("promote")
@click.argument("name")
@namespace_option
@click.option("--full", is_flag=True, help="Skip all remaining steps.")
@wait_option
def promote_command(name: str, namespace: str, full: bool, wait: bool) -> None:
    """Advance the canary one step (or all the way with --full)."""
    _send("promote", name, namespace, wait, full=full)


@main.command("abort")
@click.argument("name")
@namespace_option
@click.option("--reason", default=None, help="Shown in status, events and Slack.")
@wait_option
def abort_command(name: str, namespace: str, reason: str | None, wait: bool) -> None:
    """Abort the canary: stable back to full size first, then the canary goes."""
    _send("abort", name, namespace, wait, reason=reason)


@main.command("retry")
@click.argument("name")
@namespace_option
@wait_option
def retry_command(name: str, namespace: str, wait: bool) -> None:
    """Retry an aborted canary from its first step."""
    _send("retry", name, namespace, wait)


def _register_data_commands() -> None:
    from weightship.data.cli import manifest_command, publish_command, verify_files_command

    main.add_command(manifest_command, "manifest")
    main.add_command(publish_command, "publish")
    main.add_command(verify_files_command, "verify-files")


_register_data_commands()
main.add_command(agent_command, "agent")
