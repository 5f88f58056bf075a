"""One thread per pod: sandbox, containers, probes, status, graceful termination."""

from __future__ import annotations

import contextlib
import json
import logging
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, Protocol

from weightship_dev import network
from weightship_dev.kubelet import images, podspec, probes, volumes
from weightship_dev.kubelet.podstatus import (
    ContainerState,
    PodObservation,
    compute_status,
    restart_wanted,
)

log = logging.getLogger("weightship.kubelet")

# The "image" of every process container is this machine with the project's virtualenv
# first on PATH, so `python3` and `weightship` are the project's own.
CONTAINER_PATH = os.pathsep.join(
    [str(Path(sys.executable).parent), os.environ.get("PATH", "/usr/bin:/bin")]
)
# What stands in for the container image: kept visible even under a volume's mountPath.
IMAGE_PATHS = sorted(
    {
        str(Path(sys.prefix)),
        str(Path(sys.base_prefix)),
        str(Path(__file__).resolve().parents[3]),  # the checkout holding this package
    }
)
BACKOFF_START = 1.0
BACKOFF_MAX = 20.0  # kubelet uses 10 s .. 5 min; tests need faster restarts
# Kubernetes' limits on a termination message: the file's first 4096 bytes, or with
# FallbackToLogsOnError the log's last 80 lines (at most 2048 bytes) of a failed container.
TERMINATION_MESSAGE_BYTES = 4096
FALLBACK_LOG_LINES = 80
FALLBACK_LOG_BYTES = 2048
DEFAULT_TERMINATION_MESSAGE_PATH = "/dev/termination-log"


def now_iso() -> str:
    return datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


@dataclass
class Container:
    spec: dict[str, Any]
    state: ContainerState
    proc: subprocess.Popen[bytes] | None = None
    started_mono: float = 0.0
    next_start: float = 0.0
    backoff: float = BACKOFF_START
    readiness: probes.ProbeState | None = None
    liveness: probes.ProbeState | None = None
    startup: probes.ProbeState | None = None
    config_error: str | None = None
    history: list[int] = field(default_factory=list)


class PodHost(Protocol):
    """What a worker needs from its kubelet; implemented by `agent.Kubelet`."""

    node_name: str
    host_ip: str
    node_dir: Path
    objects: volumes.ObjectSource

    def patch_pod_status(self, pod: dict[str, Any], status: dict[str, Any]) -> bool: ...
    def finalize_deletion(self, pod: dict[str, Any]) -> None: ...
    def release_ip(self, ip: str) -> None: ...
    def event(
        self, pod: dict[str, Any], reason: str, message: str, kind: str = "Normal"
    ) -> None: ...


class PodWorker(threading.Thread):
    def __init__(self, host: PodHost, pod: dict[str, Any], pod_ip: str) -> None:
        uid = pod["metadata"]["uid"]
        super().__init__(name=f"pod-{pod['metadata']['name']}", daemon=True)
        self.host = host
        self.pod = pod
        self.pod_ip = pod_ip
        self.uid = uid
        self.netns = network.namespace_name(uid)
        self.pod_dir = host.node_dir / "pods" / uid
        self.logs_dir = host.node_dir / "logs"
        self.wake = threading.Event()
        self.lock = threading.Lock()
        self.deleted = False  # the API object is gone
        self.shutdown = False  # the kubelet is stopping
        self.done = threading.Event()
        self.backing: dict[str, Path] = {}
        self.sandbox_ready = False
        self.initialized = not pod["spec"].get("initContainers")
        self.start_time = (pod.get("status") or {}).get("startTime") or now_iso()
        self.last_status: dict[str, Any] | None = None
        self.last_token_refresh = 0.0
        self.containers = [self._container(c) for c in pod["spec"]["containers"]]
        self.init_containers = [self._container(c) for c in pod["spec"].get("initContainers") or []]
        self.init_index = 0

    # ---- called from the kubelet's watch thread -------------------------------------
    def update(self, pod: dict[str, Any]) -> None:
        with self.lock:
            self.pod = pod
        self.wake.set()

    def mark_deleted(self) -> None:
        self.deleted = True
        self.wake.set()

    def stop(self) -> None:
        self.shutdown = True
        self.wake.set()

    # ---- lifecycle -------------------------------------------------------------------
    def _container(self, spec: dict[str, Any]) -> Container:
        return Container(spec=spec, state=ContainerState(name=spec["name"], image=spec["image"]))

    @property
    def terminating(self) -> bool:
        return self.deleted or self.shutdown or bool(self.pod["metadata"].get("deletionTimestamp"))

    @property
    def restart_policy(self) -> str:
        return str(self.pod["spec"].get("restartPolicy", "Always"))

    def run(self) -> None:
        try:
            self._loop()
        except Exception:
            log.exception("pod worker %s crashed", self.name)
        finally:
            self._terminate()
            self.done.set()

    def _loop(self) -> None:
        while not self.terminating:
            if not self.sandbox_ready:
                self._setup_sandbox()
            if self.sandbox_ready:
                if not self.initialized:
                    self._step_init()
                else:
                    self._step_containers()
            self._sync_status()
            if self._finished():
                self._teardown_sandbox()
                self._sync_status()
                self._wait_for_deletion()
                return
            self.wake.wait(0.25)
            self.wake.clear()

    def _wait_for_deletion(self) -> None:
        # A finished pod keeps its object (Succeeded/Failed) until someone deletes it.
        while not self.terminating:
            self.wake.wait(1.0)
            self.wake.clear()

    def _finished(self) -> bool:
        return bool(self.containers) and all(
            c.state.state == "terminated" and not c.state.will_restart for c in self.containers
        )

    # ---- sandbox ---------------------------------------------------------------------
    def _setup_sandbox(self) -> None:
        pod = self.pod
        try:
            self.pod_dir.mkdir(parents=True, exist_ok=True)
            self.logs_dir.mkdir(parents=True, exist_ok=True)
            network.create_pod_network(self.netns, self.pod_ip)
            network.write_netns_etc(
                self.netns, podspec.hosts_file(pod, self.pod_ip), podspec.RESOLV_CONF
            )
            self._materialize_volumes()
        except (podspec.PodSpecError, network.NetworkError, OSError) as e:
            self._config_error_all(str(e))
            return
        self.sandbox_ready = True
        for c in self.containers:
            c.config_error = None

    def _materialize_volumes(self) -> None:
        for volume in self.pod["spec"].get("volumes") or []:
            self.backing[volume["name"]] = self._materialize(volume)
        self.last_token_refresh = time.monotonic()

    def _materialize(self, volume: dict[str, Any]) -> Path:
        return volumes.materialize(
            self.pod,
            volume,
            pod_dir=self.pod_dir,
            node_root=self.host.node_dir / "root",
            source=self.host.objects,
            pod_ip=self.pod_ip,
            host_ip=self.host.host_ip,
        )

    def _refresh_projected(self) -> None:
        # Tokens expire: rewrite projected volumes well before they do.
        if time.monotonic() - self.last_token_refresh < 1800:
            return
        with contextlib.suppress(podspec.PodSpecError, OSError):
            for volume in self.pod["spec"].get("volumes") or []:
                if "projected" in volume:
                    self._materialize(volume)
        self.last_token_refresh = time.monotonic()

    def _config_error_all(self, message: str) -> None:
        log.warning("pod %s: %s", self.pod["metadata"]["name"], message)
        for c in [*self.init_containers, *self.containers]:
            c.state.state, c.state.reason, c.state.message = (
                "waiting",
                "CreateContainerConfigError",
                message,
            )
        self.wake.wait(2.0)

    def _teardown_sandbox(self) -> None:
        network.delete_pod_network(self.netns)
        network.delete_netns_etc(self.netns)
        self.sandbox_ready = False

    # ---- containers ------------------------------------------------------------------
    def _security(self, spec: dict[str, Any], default_uid: int | None) -> dict[str, Any]:
        pod_sc = self.pod["spec"].get("securityContext") or {}
        sc = spec.get("securityContext") or {}
        uid = sc.get("runAsUser", pod_sc.get("runAsUser", default_uid))
        gid = sc.get("runAsGroup", pod_sc.get("runAsGroup", uid))
        non_root = sc.get("runAsNonRoot", pod_sc.get("runAsNonRoot"))
        if non_root and not uid:
            raise podspec.PodSpecError(
                "container has runAsNonRoot and image will run as root: set runAsUser"
            )
        groups = list(pod_sc.get("supplementalGroups") or [])
        if fs_group := pod_sc.get("fsGroup"):
            groups.append(fs_group)
        return {
            "uid": uid,
            "gid": gid,
            "supplementalGroups": groups if uid else None,
            "readOnlyRootFilesystem": bool(sc.get("readOnlyRootFilesystem")),
        }

    def _start(self, c: Container) -> None:
        spec = c.spec
        try:
            entry = images.resolve(spec["image"], spec.get("command"), spec.get("args"))
            env = podspec.container_env(
                self.pod,
                spec,
                pod_ip=self.pod_ip,
                host_ip=self.host.host_ip,
                configmap_key=self._cm_key,
                secret_key=self._secret_key,
                configmap_data=self.host.objects.configmap,
                secret_data=self.host.objects.secret,
            )
            env.setdefault("PATH", CONTAINER_PATH)
            argv = [podspec.expand(a, env) for a in entry.argv]
            mounts = volumes.container_mounts(spec, self.backing)
            security = self._security(spec, entry.default_uid)
            mounts.append(self._termination_log_mount(spec, security["uid"], security["gid"]))
        except (images.ImageNotMapped, podspec.PodSpecError, OSError) as e:
            c.state.state, c.state.reason, c.state.message = (
                "waiting",
                "CreateContainerConfigError",
                str(e),
            )
            c.next_start = time.monotonic() + 2.0
            return
        if security["uid"]:
            for m in mounts:
                src = Path(m["src"])
                if src.is_relative_to(self.pod_dir) and not m["readOnly"]:
                    with contextlib.suppress(OSError):
                        os.chown(src, security["uid"], security["gid"] or -1)
        spec_file = self.pod_dir / "containers" / f"{spec['name']}.json"
        spec_file.parent.mkdir(parents=True, exist_ok=True)
        spec_file.touch(mode=0o600)
        spec_file.write_text(
            json.dumps(
                {
                    "hostname": self.pod["spec"].get("hostname") or self.pod["metadata"]["name"],
                    "mounts": mounts,
                    "argv": argv,
                    "env": env,
                    "keep": IMAGE_PATHS,
                    "workingDir": spec.get("workingDir"),
                    **security,
                }
            )
        )
        log_path = self._log_path(spec)
        shim = [sys.executable, "-m", "weightship_dev.kubelet.shim", str(spec_file)]
        with open(log_path, "ab") as out:
            c.proc = subprocess.Popen(
                ["ip", "netns", "exec", self.netns, "unshare", "--uts", "--", *shim],
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        now = time.monotonic()
        c.started_mono = now
        if c.state.state == "terminated":
            c.state.last_terminated = c.state.terminated_status()
        c.state.state, c.state.reason, c.state.message = "running", "", ""
        c.state.started_at, c.state.finished_at, c.state.exit_code = now_iso(), None, None
        c.state.started = not spec.get("startupProbe")
        c.state.ready = False
        c.readiness = (
            probes.ProbeState(spec["readinessProbe"], now) if spec.get("readinessProbe") else None
        )
        c.liveness = (
            probes.ProbeState(spec["livenessProbe"], now) if spec.get("livenessProbe") else None
        )
        c.startup = (
            probes.ProbeState(spec["startupProbe"], now) if spec.get("startupProbe") else None
        )
        self.host.event(self.pod, "Started", f"Started container {spec['name']}")

    def _log_path(self, spec: dict[str, Any]) -> Path:
        meta = self.pod["metadata"]
        return self.logs_dir / f"{meta['namespace']}_{meta['name']}_{spec['name']}.log"

    def _termination_log(self, spec: dict[str, Any]) -> Path:
        return Path(self.pod_dir, "containers", f"{spec['name']}.termination-log")

    def _termination_log_mount(
        self, spec: dict[str, Any], uid: int | None, gid: int | None
    ) -> dict[str, Any]:
        """A fresh file the container may write its termination message to, bound at its
        terminationMessagePath, as Kubernetes does."""
        path = self._termination_log(spec)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(b"")
        if uid:
            os.chown(path, uid, gid or -1)
        dst = spec.get("terminationMessagePath") or DEFAULT_TERMINATION_MESSAGE_PATH
        return {"src": str(path), "dst": dst, "readOnly": False}

    def _termination_message(self, spec: dict[str, Any], exit_code: int) -> str:
        try:
            with open(self._termination_log(spec), "rb") as f:
                data = f.read(TERMINATION_MESSAGE_BYTES)
        except OSError:
            data = b""
        fallback = spec.get("terminationMessagePolicy") == "FallbackToLogsOnError"
        if not data and exit_code != 0 and fallback:
            data = _log_tail(self._log_path(spec))
        return data.decode(errors="replace")

    def _cm_key(self, ns: str, name: str, key: str, optional: bool) -> str | None:
        data = self.host.objects.configmap(ns, name, optional)
        if key not in data and not optional:
            raise podspec.PodSpecError(f"couldn't find key {key} in ConfigMap {ns}/{name}")
        return data.get(key)

    def _secret_key(self, ns: str, name: str, key: str, optional: bool) -> str | None:
        data = self.host.objects.secret(ns, name, optional)
        if key not in data and not optional:
            raise podspec.PodSpecError(f"couldn't find key {key} in Secret {ns}/{name}")
        return data.get(key)

    def _reap(self, c: Container, policy: str) -> None:
        if c.proc is None:
            return
        code = c.proc.poll()
        if code is None:
            return
        c.proc = None
        if code < 0:  # killed by a signal: report as the shell would
            code = 128 - code
        c.state.state = "terminated"
        c.state.exit_code = code
        c.state.reason = "Completed" if code == 0 else "Error"
        c.state.message = self._termination_message(c.spec, code)
        c.state.finished_at = now_iso()
        c.state.ready = False
        c.state.will_restart = restart_wanted(policy, code)
        if c.state.will_restart:
            ran = time.monotonic() - c.started_mono
            c.backoff = BACKOFF_START if ran > 30 else min(c.backoff * 2, BACKOFF_MAX)
            c.next_start = time.monotonic() + c.backoff
            self.host.event(
                self.pod, "BackOff", f"Back-off restarting container {c.spec['name']}", "Warning"
            )

    def _step_init(self) -> None:
        c = self.init_containers[self.init_index]
        policy = "OnFailure" if self.restart_policy != "Never" else "Never"
        if c.proc is None and c.state.state != "terminated" and time.monotonic() >= c.next_start:
            self._start(c)
            return
        self._reap(c, policy)
        if c.state.state == "terminated":
            if c.state.exit_code == 0:
                self.init_index += 1
                if self.init_index == len(self.init_containers):
                    self.initialized = True
            elif c.state.will_restart and time.monotonic() >= c.next_start:
                c.state.restart_count += 1
                self._start(c)
            elif not c.state.will_restart:
                for main in self.containers:
                    main.state.state, main.state.reason = "terminated", "Init:Error"
                    main.state.exit_code, main.state.will_restart = 1, False

    def _step_containers(self) -> None:
        now = time.monotonic()
        self._refresh_projected()
        for c in self.containers:
            self._reap(c, self.restart_policy)
            if c.proc is None:
                first = c.state.state == "waiting"
                if (first or c.state.will_restart) and now >= c.next_start:
                    if not first:
                        c.state.restart_count += 1
                    self._start(c)
                continue
            self._probe(c, now)

    def _probe(self, c: Container, now: float) -> None:
        if c.startup and not c.state.started:
            if c.startup.due(now):
                ok, msg = probes.run_probe(c.startup.spec, c.spec, self.pod_ip, self.netns)
                c.startup.record(ok, msg, now)
                if ok:
                    c.state.started = True
                elif c.startup.failed_out:
                    self._kill_container(c, "Startup probe failed: " + msg)
            return
        if c.liveness and c.liveness.due(now):
            ok, msg = probes.run_probe(c.liveness.spec, c.spec, self.pod_ip, self.netns)
            c.liveness.record(ok, msg, now)
            if not ok and c.liveness.failed_out:
                self._kill_container(c, "Liveness probe failed: " + msg)
                return
        if c.readiness is None:
            c.state.ready = True
            return
        if c.readiness.due(now):
            ok, msg = probes.run_probe(c.readiness.spec, c.spec, self.pod_ip, self.netns)
            c.readiness.record(ok, msg, now)
            if not ok and c.readiness.failures == 1:
                self.host.event(self.pod, "Unhealthy", f"Readiness probe failed: {msg}", "Warning")
        c.state.ready = c.readiness.passing

    def _kill_container(self, c: Container, why: str) -> None:
        self.host.event(self.pod, "Killing", f"Container {c.spec['name']}: {why}", "Warning")
        self._signal_all([c], grace=2.0)

    def _signal_all(self, containers: list[Container], grace: float) -> None:
        alive = [c for c in containers if c.proc is not None and c.proc.poll() is None]
        for c in alive:
            assert c.proc is not None
            with contextlib.suppress(ProcessLookupError):
                os.killpg(c.proc.pid, signal.SIGTERM)
        deadline = time.monotonic() + grace
        while time.monotonic() < deadline and any(
            c.proc is not None and c.proc.poll() is None for c in alive
        ):
            time.sleep(0.05)
        for c in alive:
            assert c.proc is not None
            with contextlib.suppress(ProcessLookupError):
                os.killpg(c.proc.pid, signal.SIGKILL)
            c.proc.wait()

    # ---- status ----------------------------------------------------------------------
    def _sync_status(self) -> None:
        obs = PodObservation(
            containers=[c.state for c in self.containers],
            init_containers=[c.state for c in self.init_containers],
            initialized=self.initialized,
            sandbox_ready=self.sandbox_ready,
            pod_ip=self.pod_ip,
            host_ip=self.host.host_ip,
            start_time=self.start_time,
        )
        with self.lock:
            pod = self.pod
        status = compute_status(pod, obs, now_iso())
        if status == self.last_status:
            return
        if self.host.patch_pod_status(pod, status):
            self.last_status = status

    # ---- termination -----------------------------------------------------------------
    def _terminate(self) -> None:
        meta = self.pod["metadata"]
        if self.shutdown:
            grace = 2.0
        else:
            grace = float(
                meta.get("deletionGracePeriodSeconds")
                or self.pod["spec"].get("terminationGracePeriodSeconds", 30)
                or 0
            )
        running = [c for c in [*self.init_containers, *self.containers] if c.proc is not None]
        if running:
            self.host.event(self.pod, "Killing", "Stopping containers")
        self._signal_all(running, grace)
        self._teardown_sandbox()
        shutil.rmtree(self.pod_dir, ignore_errors=True)
        self.host.release_ip(self.pod_ip)
        if not self.deleted and not self.shutdown and meta.get("deletionTimestamp"):
            self.host.finalize_deletion(self.pod)


def wait_all(
    workers: list[PodWorker], timeout: float, on_timeout: Callable[[PodWorker], None] | None = None
) -> None:
    deadline = time.monotonic() + timeout
    for w in workers:
        if not w.done.wait(max(0.0, deadline - time.monotonic())) and on_timeout:
            on_timeout(w)


def _log_tail(path: Path) -> bytes:
    """The last lines of a container's log, as FallbackToLogsOnError reports them."""
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            f.seek(max(0, f.tell() - 16 * FALLBACK_LOG_BYTES))
            lines = f.read().splitlines(keepends=True)[-FALLBACK_LOG_LINES:]
    except OSError:
        return b""
    return b"".join(lines)[-FALLBACK_LOG_BYTES:]
