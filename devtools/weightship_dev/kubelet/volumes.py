"""Materialize a pod's volumes as host directories that the shim bind-mounts.

hostPath maps into the node's own root directory, so two process nodes have two disks.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Protocol

from weightship_dev.kubelet.podspec import Pod, PodSpecError, field_ref


class ObjectSource(Protocol):
    """What volumes need from the API, injected by the kubelet."""

    def configmap(self, namespace: str, name: str, optional: bool) -> Mapping[str, str]: ...
    def secret(self, namespace: str, name: str, optional: bool) -> Mapping[str, str]: ...
    def service_account_token(
        self, pod: Pod, audience: str | None, expiration_seconds: int
    ) -> str: ...
    def ca_bundle(self) -> str: ...


def _write(path: Path, data: str, mode: int) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(data)
    tmp.chmod(mode)
    tmp.replace(path)


def _items(
    data: Mapping[str, str], items: list[dict[str, Any]] | None, default_mode: int
) -> list[tuple[str, str, int]]:
    if not items:
        return [(k, v, default_mode) for k, v in data.items()]
    out = []
    for item in items:
        if item["key"] not in data:
            raise PodSpecError(f"key {item['key']!r} not found")
        out.append((item["path"], data[item["key"]], int(item.get("mode", default_mode))))
    return out


def _safe_join(base: Path, rel: str) -> Path:
    target = (base / rel).resolve()
    if not target.is_relative_to(base.resolve()):
        raise PodSpecError(f"volume item path {rel!r} escapes its volume")
    return target


def host_path(node_root: Path, path: str, kind: str) -> Path:
    """The node's own file for a hostPath volume, checked as the kubelet checks its type:
    `Directory` and `File` must exist as such (the pod waits until they do), the `OrCreate`
    types are created. Never outside the node's root, whatever `..` or links say."""
    root = node_root.resolve()
    target = (root / path.lstrip("/")).resolve()
    if not target.is_relative_to(root):
        raise PodSpecError(f"hostPath {path} leaves the node's root")
    if kind in ("", "DirectoryOrCreate"):
        target.mkdir(parents=True, exist_ok=True)
    elif kind == "FileOrCreate":
        target.parent.mkdir(parents=True, exist_ok=True)
        target.touch(exist_ok=True)
    elif kind == "Directory" and not target.is_dir():
        raise PodSpecError(f"hostPath type check failed: {path} is not a directory")
    elif kind == "File" and not target.is_file():
        raise PodSpecError(f"hostPath type check failed: {path} is not a file")
    elif not target.exists():
        raise PodSpecError(f"hostPath {path} does not exist on this node")
    return target


def materialize(
    pod: Pod,
    volume: Mapping[str, Any],
    *,
    pod_dir: Path,
    node_root: Path,
    source: ObjectSource,
    pod_ip: str,
    host_ip: str,
) -> Path:
    """Create or refresh one volume and return the host path that backs it."""
    name = str(volume["name"])
    namespace = str(pod["metadata"]["namespace"])
    target: Path = pod_dir / "volumes" / name
    if host := volume.get("hostPath"):
        return host_path(node_root, str(host["path"]), str(host.get("type") or ""))
    if "emptyDir" in volume:
        target.mkdir(parents=True, exist_ok=True)
        target.chmod(0o777)  # as kubelet does: any container user may write
        return target
    mode = 0o644
    files: list[tuple[str, str, int]] = []
    if cm := volume.get("configMap"):
        data = source.configmap(namespace, cm["name"], bool(cm.get("optional")))
        files = _items(data, cm.get("items"), int(cm.get("defaultMode", mode)))
    elif sec := volume.get("secret"):
        data = source.secret(namespace, sec["secretName"], bool(sec.get("optional")))
        files = _items(data, sec.get("items"), int(sec.get("defaultMode", mode)))
    elif dapi := volume.get("downwardAPI"):
        files = _downward(
            pod, dapi.get("items") or [], pod_ip, host_ip, int(dapi.get("defaultMode", mode))
        )
    elif proj := volume.get("projected"):
        files = _projected(pod, proj, source, pod_ip, host_ip, int(proj.get("defaultMode", mode)))
    else:
        kinds = sorted(k for k in volume if k != "name")
        raise PodSpecError(f"volume {name!r}: {', '.join(kinds)} is not supported on process nodes")
    target.mkdir(parents=True, exist_ok=True)
    # As the kubelet does for these read-only volumes: owned by the pod's fsGroup and
    # group-readable, so a non-root container reads a 0400 Secret.
    fs_group = (pod["spec"].get("securityContext") or {}).get("fsGroup")
    for rel, data_str, file_mode in files:
        path = _safe_join(target, rel)
        _write(path, data_str, file_mode if fs_group is None else file_mode | 0o440)
        if fs_group is not None:
            os.chown(path, -1, int(fs_group))
    return target


def _downward(
    pod: Pod, items: list[dict[str, Any]], pod_ip: str, host_ip: str, mode: int
) -> list[tuple[str, str, int]]:
    out = []
    for item in items:
        if "fieldRef" not in item:
            raise PodSpecError("downwardAPI: only fieldRef items are supported")
        value = field_ref(pod, item["fieldRef"]["fieldPath"], pod_ip, host_ip)
        out.append((item["path"], value, int(item.get("mode", mode))))
    return out


def _projected(
    pod: Pod, proj: Mapping[str, Any], source: ObjectSource, pod_ip: str, host_ip: str, mode: int
) -> list[tuple[str, str, int]]:
    namespace = pod["metadata"]["namespace"]
    out: list[tuple[str, str, int]] = []
    for src in proj.get("sources") or []:
        if tok := src.get("serviceAccountToken"):
            token = source.service_account_token(
                pod, tok.get("audience"), int(tok.get("expirationSeconds", 3607))
            )
            out.append((tok["path"], token, mode))
        elif cm := src.get("configMap"):
            if cm["name"] == "kube-root-ca.crt" and not cm.get("items"):
                out.append(("ca.crt", source.ca_bundle(), mode))
                continue
            data = source.configmap(namespace, cm["name"], bool(cm.get("optional")))
            out += _items(data, cm.get("items"), mode)
        elif sec := src.get("secret"):
            data = source.secret(namespace, sec["name"], bool(sec.get("optional")))
            out += _items(data, sec.get("items"), mode)
        elif dapi := src.get("downwardAPI"):
            out += _downward(pod, dapi.get("items") or [], pod_ip, host_ip, mode)
    return out


def container_mounts(
    container: Mapping[str, Any],
    backing: Mapping[str, Path],
) -> list[dict[str, Any]]:
    mounts = []
    for vm in container.get("volumeMounts") or []:
        if vm["name"] not in backing:
            raise PodSpecError(f"volumeMount {vm['name']!r} names no volume")
        src = backing[vm["name"]]
        if sub := vm.get("subPath"):
            src = _safe_join(src, sub)
            if not src.exists():
                src.mkdir(parents=True)
        mounts.append(
            {"src": str(src), "dst": vm["mountPath"], "readOnly": bool(vm.get("readOnly"))}
        )
    return mounts
