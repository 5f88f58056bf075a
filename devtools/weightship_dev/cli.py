"""`weightship-dev`: the local cluster, its process kubelet and the demo (test rig only)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import click
from rich.console import Console
from rich.table import Table


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
def main() -> None:
    """weightship's developer and test tooling: the local cluster, its process kubelet and
    the demo. Not part of the operator: its image ships none of this."""


@main.group()
def cluster() -> None:
    """A real local control plane with KWOK GPU nodes and process nodes."""


@cluster.command("up")
@click.option("--kwok-nodes", default=4, show_default=True, help="Fake GPU nodes (KWOK).")
@click.option(
    "--process-nodes",
    default=3,
    show_default=True,
    help="Nodes whose pods run as real local processes.",
)
@click.option("--no-addons", is_flag=True, help="Skip the S3 server and Prometheus.")
def cluster_up(kwok_nodes: int, process_nodes: int, no_addons: bool) -> None:
    """Start the cluster (idempotent: parts already running are kept)."""
    from weightship_dev.cluster import ClusterConfig, ClusterError, up

    console = Console(stderr=True)
    try:
        with console.status("starting the local cluster"):
            up(
                ClusterConfig(
                    kwok_nodes=kwok_nodes, process_nodes=process_nodes, with_addons=not no_addons
                ),
                log=console.print,
            )
    except ClusterError as e:
        console.print(f"[red]cluster up failed:[/] {e}")
        sys.exit(1)


@cluster.command("down")
@click.option("--keep-state", is_flag=True, help="Keep etcd data, logs and the PKI.")
def cluster_down(keep_state: bool) -> None:
    """Stop every component and pod, and remove the pod network."""
    from weightship_dev.cluster import down
    from weightship_dev.layout import ClusterPaths

    down(ClusterPaths.default(), keep_state=keep_state, log=Console(stderr=True).print)


@cluster.command("status")
@click.option("-o", "--output", type=click.Choice(["table", "json"]), default="table")
def cluster_status(output: str) -> None:
    """Show each component's process and health. Exits 1 when the API server is down."""
    from weightship_dev.cluster import prometheus_url, s3_endpoint, status
    from weightship_dev.layout import ClusterPaths

    paths = ClusterPaths.default()
    rows = status(paths)
    if output == "json":
        click.echo(
            json.dumps(
                {
                    "components": [
                        {"name": r.name, "pid": r.pid, "healthy": r.healthy} for r in rows
                    ],
                    "kubeconfig": str(paths.admin_kubeconfig),
                    "s3": s3_endpoint(),
                    "prometheus": prometheus_url(),
                },
                indent=2,
            )
        )
    else:
        table = Table("component", "pid", "health")
        for r in rows:
            table.add_row(
                r.name, str(r.pid or "-"), "[green]healthy[/]" if r.healthy else "[red]down[/]"
            )
        console = Console()
        console.print(table)
        console.print(
            f"kubeconfig: {paths.admin_kubeconfig}\nS3: {s3_endpoint()}  "
            f"Prometheus: {prometheus_url()}"
        )
    if not any(r.name == "kube-apiserver" and r.healthy for r in rows):
        sys.exit(1)


@main.command("demo")
@click.option("--remove", is_flag=True, help="Take a demo left running off the cluster, and exit.")
def dev_demo(remove: bool) -> None:
    """A real rollout and a real rollback on the local cluster (what `make demo` runs)."""
    from weightship_dev.demo import main as demo_main
    from weightship_dev.demo import remove as remove_demo
    from weightship_dev.layout import ClusterPaths

    if remove:
        if not remove_demo(ClusterPaths.default(), log=Console(stderr=True).print):
            Console(stderr=True).print("no demo on the cluster")
        return
    demo_main()


@main.command("kubelet")
@click.option("--node", required=True, help="Node name to register.")
@click.option("--index", type=int, required=True, help="Node index: picks its IP range.")
@click.option(
    "--state", type=click.Path(path_type=Path), required=True, help="Cluster state directory."
)
def dev_kubelet(node: str, index: int, state: Path) -> None:
    """Run the process kubelet for one node (started by `cluster up`)."""
    from weightship_dev.kubelet.agent import main as kubelet_main

    kubelet_main(node, index, state)
