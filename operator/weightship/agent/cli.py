"""`weightship agent`: the node cache agent, run by the DaemonSet on every GPU node."""

from __future__ import annotations

import logging
import os
import signal
from pathlib import Path
from types import FrameType

import click


@click.command("agent")
@click.option("--node-name", default=None, help="This node's name. [env NODE_NAME]")
@click.option("--pod-ip", default=None, help="Address the peer server binds. [env POD_IP]")
@click.option(
    "--cache-dir",
    type=click.Path(path_type=Path),
    default=None,
    help="The node cache (a hostPath). [env WEIGHTSHIP_CACHE_DIR, /var/cache/weightship]",
)
@click.option(
    "--peer-port",
    type=int,
    default=None,
    help="Peer chunk server. [env WEIGHTSHIP_PEER_PORT, 8479]",
)
@click.option(
    "--metrics-port",
    type=int,
    default=None,
    help="Prometheus /metrics, 0 = off. [env WEIGHTSHIP_METRICS_PORT, 9101]",
)
@click.option(
    "-n",
    "--namespace",
    "namespaces",
    multiple=True,
    help="Only rollouts in these namespaces (globs, repeatable). Default: the whole cluster. "
    "[env WEIGHTSHIP_WATCH_NAMESPACES, comma-separated]",
)
@click.option("-v", "--verbose", is_flag=True)
def agent_command(
    node_name: str | None,
    pod_ip: str | None,
    cache_dir: Path | None,
    peer_port: int | None,
    metrics_port: int | None,
    namespaces: tuple[str, ...],
    verbose: bool,
) -> None:
    """Stage the weights rollouts want onto this node, and serve them to peers."""
    from prometheus_client import CollectorRegistry, start_http_server

    from weightship.agent.config import AgentConfig, ConfigError
    from weightship.agent.kube import AgentKube
    from weightship.agent.main import Agent
    from weightship.agent.metrics import AgentMetrics
    from weightship.api.env import (
        CACHE_DIR_ENV,
        METRICS_PORT_ENV,
        PEER_PORT_ENV,
        WATCH_NAMESPACES_ENV,
    )
    from weightship.kube.client import load_client

    logging.basicConfig(
        level=logging.DEBUG if verbose else logging.INFO,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    logging.getLogger("botocore").setLevel(logging.WARNING)
    # Three retry warnings per call while the API server is down: the agent says once what
    # failed, and what it does meanwhile.
    logging.getLogger("urllib3.connectionpool").setLevel(logging.ERROR)
    env = dict(os.environ)
    overrides = {
        "NODE_NAME": node_name,
        "POD_IP": pod_ip,
        CACHE_DIR_ENV: str(cache_dir) if cache_dir else None,
        PEER_PORT_ENV: None if peer_port is None else str(peer_port),
        METRICS_PORT_ENV: None if metrics_port is None else str(metrics_port),
        WATCH_NAMESPACES_ENV: ",".join(namespaces) or None,
    }
    env.update({k: v for k, v in overrides.items() if v is not None})
    try:
        config = AgentConfig.from_env(env)
    except ConfigError as e:
        raise click.ClickException(str(e)) from e

    registry = CollectorRegistry()
    metrics = AgentMetrics.create(registry)
    if config.metrics_port:
        start_http_server(config.metrics_port, addr="0.0.0.0", registry=registry)  # noqa: S104
    agent = Agent(config, AgentKube(load_client(), config.peer_group), metrics)

    def on_signal(signum: int, _frame: FrameType | None) -> None:
        logging.getLogger(__name__).info("signal %d: stopping", signum)
        agent.stop.set()
        agent.wake.set()

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    agent.run()
