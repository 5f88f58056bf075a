"""Lanes: how `make test` runs the suite on pytest-xdist workers (`-n 2
--no-loadscope-reorder`, scheduled by `LaneScheduling`) over one local cluster, without
two tests fighting over what they share.

The e2e tests share one control plane, S3 and Prometheus. What must not overlap, and how
each rule is kept:

- **Process nodes.** Pods of one test must not die with another's: test_faults restarts
  a kubelet, which kills every pod on its node. So each worker has process nodes of its
  own: the cluster starts with `NODES_PER_LANE` per worker, each labelled
  `LANE_LABEL=gw<N>`, and a worker's tests see only theirs (`Cluster.process_nodes`) and
  place pods, agents and charts with `process_node_selector()`.
- **Node agents.** An agent takes every live agent of its peer group for a peer
  (`WEIGHTSHIP_PEER_GROUP`, chart `agent.peerGroup`): each worker's agents are a group of
  their own, named after its lane, so they never plan with another test's agents (which
  would own chunks they never fetch).
- **vLLM.** A vLLM pod takes ~3 GiB and most of both cores while it starts: the two
  modules that run vLLM pods on the cluster are one group (`VLLM_GROUP`), run one after
  another on one worker.
- **Whole-cluster changes.** test_upgrade installs the previous release's CRDs and
  test_apiserver_down stops the API server: they hold the cluster alone
  (`cluster_share`); every other e2e module holds it shared. They are one group
  (`EXCLUSIVE_GROUP`), run first, one after the other on one worker, while the other
  worker runs unit tests, which take no lock (as two groups, the worker done with the
  first took unit tests until the other had none left, then held the second while the
  other waited for its share: two minutes of a lane idle).
- **Extra KWOK nodes.** test_cluster_smoke counts every node a DaemonSet lands on and
  test_scale adds nodes: one group, `KWOK_NODE_GROUP`.
- Every other module is a group of its own, so that its module-scoped fixtures (an
  operator, a model bucket) are set up once, on one worker; so is each unit test module.

Groups are handed out in `ORDER`, and a worker takes the next group when it is almost done
with its last.
"""

from __future__ import annotations

import fcntl
import os
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
from xdist.scheduler import LoadScopeScheduling

from weightship_dev.nodes import NODE_KIND_LABEL

VLLM_GROUP = "vllm"
KWOK_NODE_GROUP = "kwok-nodes"
EXCLUSIVE_GROUP = "exclusive"
VLLM_MODULES = frozenset({"test_vllm", "test_inplace"})
KWOK_NODE_MODULES = frozenset({"test_cluster_smoke", "test_scale"})
EXCLUSIVE_MODULES = frozenset({"test_upgrade", "test_apiserver_down"})

# The order groups are handed out in, longest first but the modules that hold the cluster
# alone (EXCLUSIVE_GROUP, while the other worker runs unit tests); a module not named here
# goes last. Durations: in two lanes, on 2 cores (2026-12-07, WEIGHTSHIP_TEST_TIMELINE).
ORDER = (
    "test_upgrade",  # 113 s with the cluster's start, then
    "test_apiserver_down",  # 116 s: both the cluster alone (EXCLUSIVE_GROUP)
    "unit",  # 210 s of one lane in all
    "test_vllm",  # 285 s beside test_faults, with test_inplace (VLLM_GROUP)
    "test_inplace",  # 205 s beside test_agent
    "test_faults",  # 145-160 s
    "test_agent",  # 115-185 s
    "test_seeding",  # 115-125 s
    "test_rollout",  # 125 s
    "test_cluster_smoke",  # 60-130 s, with test_scale (KWOK_NODE_GROUP)
    "test_scale",  # 60-77 s
    "test_vllm_swap_engine",  # 80-100 s, vLLM on the host
    "test_blake3",  # 65-80 s
    "test_gates",  # 57-66 s
    "test_alerts",  # 30-65 s
    "test_staging_selector",  # 50 s
    "test_workload_ref",  # 48 s
    "test_pinned_views",  # 25-50 s
    "test_no_request_lost",  # 35-41 s
    "test_standby",  # 36 s
    "test_admission",  # 20-40 s
    "test_staging_failure",  # 26-29 s
    "test_chart",  # 20-68 s
    "test_cli",  # 15 s
    "test_policies",  # 13 s
    "test_workload_ref_chart",  # 10 s
)

LANE_LABEL = "weightship-e2e/lane"
NODES_PER_LANE = int(os.environ.get("WEIGHTSHIP_PROCESS_NODES", "3"))

LOCK_DIR = Path(tempfile.gettempdir()) / "weightship-e2e-locks"
# Set by the xdist controller, inherited by its workers: which run started the cluster.
RUN_ID_ENV = "WEIGHTSHIP_E2E_RUN_ID"


def module_name(item: pytest.Item) -> str:
    return Path(str(item.fspath)).stem


def is_e2e(item: pytest.Item) -> bool:
    return "/e2e/" in str(item.fspath)


def group_of_module(module: str, *, e2e: bool) -> str:
    """The group a test module's tests run in: one worker runs a group, one test after
    another. A unit test module is a group too, so that its module-scoped fixtures
    (servers, built models) are made once, on one worker."""
    if not e2e:
        return f"unit-{module}"
    if module in EXCLUSIVE_MODULES:
        return EXCLUSIVE_GROUP
    if module in VLLM_MODULES:
        return VLLM_GROUP
    if module in KWOK_NODE_MODULES:
        return KWOK_NODE_GROUP
    return module


def group_of_nodeid(nodeid: str) -> str:
    path = nodeid.split("::", 1)[0]
    return group_of_module(Path(path).stem, e2e=path.startswith("e2e/") or "/e2e/" in path)


def arrange(items: list[pytest.Item]) -> None:
    """Order the tests as `ORDER` says (the unit tests where "unit" stands), collection
    order within a module. `LaneScheduling` hands groups out in this order."""
    rank = {name: i for i, name in enumerate(ORDER)}

    def key(indexed: tuple[int, pytest.Item]) -> tuple[int, int]:
        index, item = indexed
        name = module_name(item) if is_e2e(item) else "unit"
        return (rank.get(name, len(rank)), index)

    items[:] = [item for _, item in sorted(enumerate(items), key=key)]


class LaneScheduling(LoadScopeScheduling):
    """xdist's scope scheduling with our groups (`group_of_nodeid`) as the scopes: a
    worker gets a whole group, the next when it is almost done with its last. (xdist's
    own `loadgroup` marks the node ids of `xdist_group` tests, which pytest 9.2's node
    ids no longer take.) Run with `--no-loadscope-reorder` so that groups go out in
    collection order, which `arrange` sets."""

    def _split_scope(self, nodeid: str) -> str:
        return group_of_nodeid(nodeid)


TIMELINE_ENV = "WEIGHTSHIP_TEST_TIMELINE"


class Timeline:
    """Where each test's time went, per worker: with `WEIGHTSHIP_TEST_TIMELINE=PREFIX`
    set, a worker appends `start end worker nodeid` lines (wall-clock seconds, the fixture
    setup and teardown included) to PREFIX.<worker>, to read which lane keeps `make test`
    long and what it waited for."""

    def __init__(self, prefix: str) -> None:
        self.worker = xdist_worker() or "main"
        self.path = Path(f"{prefix}.{self.worker}")

    @pytest.hookimpl(hookwrapper=True)
    def pytest_runtest_protocol(self, item: pytest.Item) -> Iterator[None]:
        start = time.time()
        yield
        with self.path.open("a") as out:
            out.write(f"{start:.1f} {time.time():.1f} {self.worker} {item.nodeid}\n")


def worker_count() -> int:
    return int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1")) if xdist_worker() else 1


def lane() -> str | None:
    """This worker's lane (its xdist id, gw0, gw1, ...); None without xdist."""
    return xdist_worker()


def process_node_selector() -> dict[str, str]:
    """Where this worker's pods, agents and charts go: its own process nodes."""
    selector = {NODE_KIND_LABEL: "process"}
    if lane():
        selector[LANE_LABEL] = str(lane())
    return selector


def peer_group() -> str:
    """This worker's agents' peer group: its lane ("" without xdist: every agent)."""
    return lane() or ""


def lane_of_node(index: int) -> str:
    return f"gw{index // NODES_PER_LANE}"


def _lock_file(name: str) -> int:
    LOCK_DIR.mkdir(parents=True, exist_ok=True)
    return os.open(LOCK_DIR / name, os.O_RDWR | os.O_CREAT, 0o600)


@contextmanager
def _flock(name: str, mode: int) -> Iterator[None]:
    fd = _lock_file(name)
    try:
        fcntl.flock(fd, mode)
        yield
    finally:
        os.close(fd)  # closing the descriptor releases the lock


@contextmanager
def cluster_share(*, exclusive: bool) -> Iterator[None]:
    """Hold the cluster shared (most modules) or alone (EXCLUSIVE_MODULES) for a module.

    A readers-writer lock on two files: every taker passes the turnstile first, so a
    module waiting to hold the cluster alone is not starved by shared holders that come
    and go; a shared holder leaves the turnstile as soon as it holds its share."""
    fd = _lock_file("cluster")
    try:
        with _flock("turnstile", fcntl.LOCK_EX):
            fcntl.flock(fd, fcntl.LOCK_EX if exclusive else fcntl.LOCK_SH)
        yield
    finally:
        os.close(fd)


@contextmanager
def cluster_startup() -> Iterator[None]:
    """One worker at a time checks whether the cluster is up and starts it."""
    with _flock("startup", fcntl.LOCK_EX):
        yield


def xdist_worker() -> str | None:
    return os.environ.get("PYTEST_XDIST_WORKER")


def run_id() -> str | None:
    return os.environ.get(RUN_ID_ENV)


def _started_marker(root: Path) -> Path:
    return root.parent / f"{root.name}.started-by-e2e-run"


def mark_started_by_run(root: Path) -> None:
    """Under xdist the cluster outlives the worker that started it: the controller stops it
    when the whole run ends (e2e/conftest.py, `pytest_sessionfinish`)."""
    if run_id():
        _started_marker(root).write_text(str(run_id()))


def started_by_this_run(root: Path) -> bool:
    marker = _started_marker(root)
    return marker.exists() and marker.read_text() == run_id()


def forget_started(root: Path) -> None:
    _started_marker(root).unlink(missing_ok=True)
