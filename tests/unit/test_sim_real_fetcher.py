"""The fleet simulator's re-creation of the fetcher (``Task`` in bench/sim_fleet.py) stages
as the agent's real ``ChunkFetcher`` does, run through the simulator's clock at small N
(bench/sim_fetcher.py): the same network, lanes and deaths, with each fetch either the
simulator's rounds or the product's code. Where they part, one of them changed a rule the
other did not: the simulator's figures at thousands of nodes are only as good as this."""

from __future__ import annotations

import importlib.util
import sys
import time
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

from weightship.data.fetcher import ChunkFetcher

BENCH = Path(__file__).resolve().parents[2] / "bench"
MiB = 1024 * 1024
LINK = 4e6  # bytes/s each way, and the origin's: 32 MiB take 8.4 s of virtual time
# Per-node finish times, real against simulated, and the requests made to peers (asks).
# Both were measured 0.0 % apart in every scenario below: both sides are deterministic,
# so this is room for a rounding, not for noise. The asks catch a rule that costs
# requests before it costs time at this size (the owner polled, not long-polled: 1.4-10x
# the asks, 0.7-1.5 % later).
TOLERANCE = 0.02
ASKS_TOLERANCE = 0.05


def load(name: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location(name, BENCH / f"{name}.py")
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # sim_fetcher imports sim_fleet by name
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def sim() -> tuple[ModuleType, ModuleType]:
    return load("sim_fleet"), load("sim_fetcher")


def scenario(sim: tuple[ModuleType, ModuleType], nodes: int, chunks: int, **extra: Any) -> Any:
    return sim[0].Scenario(nodes, chunks * MiB, MiB, LINK, LINK, **extra)


def assert_same_stage(simulated: Any, real: Any) -> None:
    apart = finish_apart(simulated, real)
    assert apart is None, apart
    asks = f"requests to peers: {real.asks} by the real fetcher, {simulated.asks} simulated"
    assert real.asks == pytest.approx(simulated.asks, rel=ASKS_TOLERANCE), asks


def finish_apart(simulated: Any, real: Any) -> str | None:
    """The node whose finish times are furthest apart, when past TOLERANCE."""
    apart = {d: real.finish[d] / t - 1 for d, t in simulated.finish.items()}
    d = max(apart, key=lambda n: abs(apart[n]))
    if abs(apart[d]) <= TOLERANCE:
        return None
    return (
        f"node {d} finished at {real.finish[d]:.2f} s with the real fetcher, "
        f"{simulated.finish[d]:.2f} s simulated ({apart[d]:+.1%}; slowest "
        f"{real.ratio(1.0):.3f}x against {simulated.ratio(1.0):.3f}x S/B)"
    )


@pytest.mark.parametrize(
    ("nodes", "chunks", "extra"),
    [
        pytest.param(4, 32, {}, id="4 nodes, every one a fetcher"),
        # Relays matter where some nodes fetch nothing from the origin.
        pytest.param(8, 32, {"fetchers": 4}, id="8 nodes, 4 fetchers"),
        pytest.param(16, 32, {}, id="16 nodes, the policy's 8 fetchers"),
        pytest.param(8, 32, {"schedule": "ring"}, id="8 nodes, ring"),
    ],
)
def test_the_real_fetcher_stages_as_the_simulator_does(
    sim: tuple[ModuleType, ModuleType], nodes: int, chunks: int, extra: dict[str, Any]
) -> None:
    s = scenario(sim, nodes, chunks, **extra)
    simulated = sim[0].Fleet(s).run()
    fleet = sim[1].RealFleet(s)
    real = fleet.run()
    # Every chunk on every node came through the real fetcher, once from the origin.
    assert fleet.sources == {"origin": chunks, "peer": (nodes - 1) * chunks}
    assert fleet.stranded == 0
    assert sorted(real.finish) == sorted(simulated.finish) == list(range(nodes))
    assert real.origin_bytes == pytest.approx(s.size, rel=1e-3)
    assert simulated.origin_bytes == pytest.approx(s.size, rel=1e-3)
    assert real.not_relaying == simulated.not_relaying == frozenset()
    assert_same_stage(simulated, real)


def test_slow_nodes_stop_relaying_alike(sim: tuple[ModuleType, ModuleType]) -> None:
    """Two of 8 nodes at a quarter of the link, both origin fetchers: they fall behind
    their tree parents, take notices of it (slowrelay.py) and stop relaying, on both
    sides at the same moments; the others then take the chunks from above them, and the
    chunks the two had not fetched from the origin yet come from their stand-ins, to
    them too. The others are done at 3.64x S/B (5.2x while the slow nodes relayed; 3.4-
    3.5x before their children took whole chunks past the whole-upload cap of the nodes
    above them, ``peer.BELOW_HEADER``: at this size a little slower, at 1,000 and 5,000
    nodes much faster), the origin sending each chunk once."""
    s = scenario(sim, 8, 32, slow_fraction=0.25, slow_factor=0.25)
    simulated = sim[0].Fleet(s).run()
    fleet = sim[1].RealFleet(s)
    real = fleet.run()
    assert real.slowed == simulated.slowed == {3, 4}
    assert real.not_relaying == simulated.not_relaying == {3, 4}
    assert fleet.sources == {"origin": 32, "peer": 7 * 32} and fleet.stranded == 0
    assert real.origin_bytes == pytest.approx(s.size, rel=1e-3)
    assert simulated.origin_bytes == pytest.approx(s.size, rel=1e-3)
    assert real.unstaged == simulated.unstaged == 0
    assert_same_stage(simulated, real)
    assert real.ratio(1.0, healthy=True) < 3.7


# Two of 8 killed at S/B / 2: a fetcher (node-3, its chunks then fetched by its stand-in)
# and a node that only relays (node-4).
KILLED = {"fetchers": 4, "kill_fraction": 0.25}


def test_a_node_killed_mid_stage(sim: tuple[ModuleType, ModuleType]) -> None:
    s = scenario(sim, 8, 32, **KILLED)
    simulated = sim[0].Fleet(s).run()
    fleet = sim[1].RealFleet(s)
    real = fleet.run()
    assert real.dead == simulated.dead == {3, 4}
    assert "node-3" in fleet.fetchers and "node-4" not in fleet.fetchers
    survivors = set(range(8)) - real.dead
    assert set(real.finish) == set(simulated.finish) == survivors
    assert real.unstaged == 0 and fleet.stranded == 0
    # What the dead fetcher had in flight leaves the origin again, on both sides alike.
    assert real.origin_bytes / s.size == pytest.approx(simulated.origin_bytes / s.size, abs=0.02)
    assert real.origin_bytes <= 1.05 * s.size
    # The survivors learn of the deaths alike, and the stand-in takes over at once: no
    # stream stalls on what the dead fetcher left half sent (1.30x S/B; 15 stalled
    # streams and 1.71x while a round went on past its dead root: round_goes_on).
    assert real.stalled == simulated.stalled == 0
    assert_same_stage(simulated, real)


def test_nobody_stalls_on_the_chunks_a_dead_fetcher_had_in_flight(
    sim: tuple[ModuleType, ModuleType],
) -> None:
    """One of 16 nodes killed at S/B / 2, a fetcher (of the policy's 8) with chunks in
    flight, as the dead fetcher of 200 nodes in docs/data-plane.md: its first child,
    cut off, finds it dead and, standing in for it, fetches the rest from the origin at
    once, and the nodes below stream on from it. A round that went on past its dead root
    (schedule.round_goes_on) left the stand-in stalling on the others' half copies, and
    them on one another's: 52 stalled streams, 1.93x S/B against 1.13x."""
    s = scenario(sim, 16, 32, kill_fraction=0.1)
    simulated = sim[0].Fleet(s).run()
    fleet = sim[1].RealFleet(s)
    real = fleet.run()
    assert real.dead == simulated.dead == {7} and "node-07" in fleet.fetchers
    assert real.unstaged == 0 and fleet.stranded == 0
    assert real.stalled == simulated.stalled == 0
    assert real.ratio(1.0) < 1.2
    assert real.origin_bytes <= 1.05 * s.size
    assert_same_stage(simulated, real)


def test_runs_repeat_exactly(sim: tuple[ModuleType, ModuleType]) -> None:
    """One thread runs at a time, in the fleet's order: the run is deterministic."""
    s = scenario(sim, 8, 32, **KILLED)
    first, second = sim[1].RealFleet(s).run(), sim[1].RealFleet(s).run()
    assert (first.finish, first.asks) == (second.finish, second.asks)


def test_a_changed_rule_in_the_fetcher_is_caught(
    sim: tuple[ModuleType, ModuleType], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Without relays the real fetcher stages otherwise than the simulator says."""
    monkeypatch.setattr(ChunkFetcher, "relay_source", lambda self, key, root, avoided: None)
    s = scenario(sim, 8, 32, fetchers=4)
    simulated = sim[0].Fleet(s).run()
    real = sim[1].RealFleet(s).run()
    assert finish_apart(simulated, real) is not None


def test_a_fetch_that_never_blocks_fails_the_run(sim: tuple[ModuleType, ModuleType]) -> None:
    """A fetch waiting in real time (not on the fleet's clock) fails the run, it never
    hangs it."""
    fleet = sim[1].RealFleet(scenario(sim, 4, 8), lockstep=sim[1].Lockstep(stall_s=0.2))
    fleet.agents[0].fetch = lambda chunk: time.sleep(1.0)
    started = time.monotonic()
    with pytest.raises(sim[1].LockstepError, match="neither blocked nor returned"):
        fleet.run()
    assert time.monotonic() - started < 1.0
