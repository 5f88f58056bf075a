"""bench/sim_fleet.py decides as the agent's fetcher does: the same owners, the same fetch
order, and the same node asked first for every chunk on every node, with every node
alive and after deaths. The simulator calls the product's schedule; this holds it to
the fetcher's own answers, so the two cannot drift apart."""

from __future__ import annotations

import dataclasses
import importlib.util
import sys
from pathlib import Path
from types import ModuleType

import numpy as np
import pytest
from prometheus_client import CollectorRegistry

from weightship.data.fetcher import ChunkFetcher, Peer, fetch_order
from weightship.data.metrics import DataPlaneMetrics
from weightship.data.schedule import origin_requests
from weightship.weightformat.entries import ChunkEntry

SCRIPT = Path(__file__).resolve().parents[2] / "bench" / "sim_fleet.py"
MiB = 1024 * 1024


@pytest.fixture(scope="module")
def sim() -> ModuleType:
    spec = importlib.util.spec_from_file_location("sim_fleet", SCRIPT)
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    sys.modules["sim_fleet"] = module
    spec.loader.exec_module(module)
    return module


class NoOrigin:
    def read_range(self, path: str, offset: int, size: int) -> bytes:
        raise AssertionError("nothing is fetched here")


class NoSink:
    def has(self, key: str) -> bool:
        return False

    def put(self, key: str, data: object, *, verified_digest: str | None = None) -> int:
        raise AssertionError("nothing is stored here")


def fetchers_for(fleet: object, chunks: list[ChunkEntry]) -> dict[str, ChunkFetcher]:
    names: list[str] = fleet.names  # type: ignore[attr-defined]
    peers = [Peer(n, f"127.0.0.{i + 1}:7000") for i, n in enumerate(names)]
    return {
        n: ChunkFetcher(
            node=n,
            peers=peers,
            origin=NoOrigin(),
            sink=NoSink(),
            metrics=DataPlaneMetrics.create(CollectorRegistry()),
            chunks=chunks,
            policy=fleet.policy,  # type: ignore[attr-defined]
        )
        for n in names
    }


# 48 nodes, 40 chunks: every node a fetcher, some owning none.
@pytest.mark.parametrize(
    ("nodes", "fetchers", "schedule"), [(12, 3, "tree"), (9, 16, "ring"), (48, 64, "ring")]
)
def test_the_simulator_asks_whom_the_agent_asks(
    sim: ModuleType, nodes: int, fetchers: int, schedule: str
) -> None:
    scenario = dataclasses.replace(
        sim.Scenario(nodes, 40 * MiB, MiB, 1e6, 1e6, schedule=schedule), fetchers=fetchers
    )
    fleet = sim.Fleet(scenario)
    chunks = [
        ChunkEntry(file="m", index=i, offset=i * MiB, size=MiB, blake3=f"{i:064x}")
        for i in range(fleet.k)
    ]
    agents = fetchers_for(fleet, chunks)
    for d, name in enumerate(fleet.names):
        agent = agents[name]
        assert [fleet.names[o] for o in fleet.owner] == [agent.owners[c.key] for c in chunks]
        # The origin requests in flight, as stage() sizes the lane from the fetcher's view.
        assert fleet.origin_lane == origin_requests(len(agent.nodes), len(agent.fetchers))
        order = fetch_order(chunks, name, agent.owner_of, lag=scenario.workers)
        own = [c.index for c in order if agent.owner_of(c.key) == name]
        others = [c.index for c in order if agent.owner_of(c.key) != name]
        assert list(fleet.origin_queue[d]) == own
        queued = sorted((seq, c) for lane in fleet.pending[d].values() for seq, c in lane)
        assert [c for _, c in queued] == others

    def first_asks() -> tuple[list[int | None], list[int | None]]:
        simulated, real = [], []
        avoided = {n for i, n in enumerate(fleet.names) if not fleet.alive[i]}
        for d, name in enumerate(fleet.names):
            if not fleet.alive[d]:
                continue
            agent = agents[name]
            for c in chunks:
                root = fleet.root(c.index)
                live = agent.live_ranking(c.key, avoided, 1)
                assert fleet.names[root] == live[0]
                if root == d:
                    continue
                simulated.append(fleet.parent(d, c.index, root))
                source = agent.relay_source(c.key, live[0], avoided)
                real.append(None if source is None else fleet.index[source])
        return simulated, real

    simulated, real = first_asks()
    assert simulated == real
    assert any(p is not None for p in real)
    # Kill a fetcher and two others: both rank, lay out trees and fall through alike.
    dead = np.array([fleet.owner[0], (fleet.owner[0] + 1) % nodes, (fleet.owner[0] + 5) % nodes])
    fleet.kill(dead)
    simulated, real = first_asks()
    assert simulated == real


def test_a_peer_at_its_transfer_cap_answers_busy_as_the_server_does(sim: ModuleType) -> None:
    """The peer server sends ``peer.MAX_TRANSFERS`` transfers at once and answers 503
    past them, a long-poll woken by the chunk too; the simulator lets no node send more
    (it let one node of 10,000 send hundreds of streams at once)."""
    fleet = sim.Fleet(sim.Scenario(12, 40 * MiB, MiB, 1e6, 1e6))
    src, c = 0, 3
    fleet.got[src, c] = fleet.sizes[c]  # a stream of it, were it landing; whole here
    fleet.done[src, c] = True
    fleet.keep([])  # no transfers yet: only those this test starts

    def ask(node: int) -> bool:
        """Whether node's ask of ``src`` started a transfer (else a 503, answered later)."""
        before, timers = len(fleet.f_dst), len(fleet.timers)
        fleet.ask(sim.Task(node, c, 10.0), src, 0.0)
        started = len(fleet.f_dst) == before + 1
        assert started != (len(fleet.timers) == timers + 1)
        return started

    fleet.uploads[src] = sim.MAX_TRANSFERS - 1
    assert ask(1)  # the 32nd
    assert int(fleet.uploads[src]) == sim.MAX_TRANSFERS
    assert not ask(2)  # the 33rd: busy
    fleet.done[src, c] = False  # a chunk still landing: held, then woken at the cap
    fleet.got[src, c] = 0
    held = sim.Task(4, c, 10.0)
    fleet.ask(held, src, 2.0)
    assert held.waiting == src
    fleet.got[src, c] = fleet.piece
    before = len(fleet.f_dst)
    fleet.wake(src, c)
    assert len(fleet.f_dst) == before and held.waiting is None  # answered 503
