"""Pure translations of a pod spec (as a camelCase dict) into what a process needs."""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from typing import Any

from weightship_dev.layout import APISERVER_PORT, BRIDGE_IP

Pod = dict[str, Any]
# (namespace, name, key, optional) -> value, or None when optional and absent
KeyLookup = Callable[[str, str, str, bool], str | None]
# (namespace, name, optional) -> whole data map
MapLookup = Callable[[str, str, bool], Mapping[str, str]]


class PodSpecError(ValueError):
    """The pod asks for something this kubelet cannot give; shown as a container error."""


def field_ref(pod: Pod, path: str, pod_ip: str, host_ip: str) -> str:
    meta = pod.get("metadata", {})
    simple = {
        "metadata.name": meta.get("name", ""),
        "metadata.namespace": meta.get("namespace", ""),
        "metadata.uid": meta.get("uid", ""),
        "spec.nodeName": pod.get("spec", {}).get("nodeName", ""),
        "spec.serviceAccountName": pod.get("spec", {}).get("serviceAccountName", "default"),
        "status.podIP": pod_ip,
        "status.podIPs": pod_ip,
        "status.hostIP": host_ip,
        "status.hostIPs": host_ip,
    }
    if path in simple:
        return str(simple[path])
    m = re.fullmatch(r"metadata\.(labels|annotations)\['([^']+)'\]", path)
    if m:
        return str(meta.get(m.group(1), {}).get(m.group(2), ""))
    raise PodSpecError(f"unsupported fieldRef.fieldPath {path!r}")


_VAR = re.compile(r"\$\$|\$\(([A-Za-z_][A-Za-z0-9_.-]*)\)")


def expand(text: str, env: Mapping[str, str]) -> str:
    """Kubernetes' $(VAR) expansion: unknown references stay as written, $$ escapes."""

    def sub(m: re.Match[str]) -> str:
        if m.group(0) == "$$":
            return "$"
        name = m.group(1)
        return env.get(name, m.group(0))

    return _VAR.sub(sub, text)


def service_env() -> dict[str, str]:
    # No kube-proxy on process nodes: point in-cluster clients at the API server itself.
    return {
        "KUBERNETES_SERVICE_HOST": BRIDGE_IP,
        "KUBERNETES_SERVICE_PORT": str(APISERVER_PORT),
        "KUBERNETES_SERVICE_PORT_HTTPS": str(APISERVER_PORT),
        "KUBERNETES_PORT": f"tcp://{BRIDGE_IP}:{APISERVER_PORT}",
    }


def container_env(
    pod: Pod,
    container: Mapping[str, Any],
    *,
    pod_ip: str,
    host_ip: str,
    configmap_key: KeyLookup,
    secret_key: KeyLookup,
    configmap_data: MapLookup,
    secret_data: MapLookup,
) -> dict[str, str]:
    namespace = pod["metadata"]["namespace"]
    env: dict[str, str] = {"HOSTNAME": pod["metadata"]["name"], **service_env()}
    for source in container.get("envFrom") or []:
        prefix = source.get("prefix", "")
        if ref := source.get("configMapRef"):
            data = configmap_data(namespace, ref["name"], bool(ref.get("optional")))
        elif ref := source.get("secretRef"):
            data = secret_data(namespace, ref["name"], bool(ref.get("optional")))
        else:
            continue
        env.update({prefix + k: v for k, v in data.items()})
    for var in container.get("env") or []:
        name = var["name"]
        if "value" in var:
            env[name] = expand(str(var.get("value") or ""), env)
            continue
        source = var.get("valueFrom") or {}
        value: str | None
        if ref := source.get("fieldRef"):
            value = field_ref(pod, ref["fieldPath"], pod_ip, host_ip)
        elif ref := source.get("configMapKeyRef"):
            value = configmap_key(namespace, ref["name"], ref["key"], bool(ref.get("optional")))
        elif ref := source.get("secretKeyRef"):
            value = secret_key(namespace, ref["name"], ref["key"], bool(ref.get("optional")))
        elif "resourceFieldRef" in source:
            raise PodSpecError(f"env {name}: resourceFieldRef is not supported on process nodes")
        else:
            value = ""
        if value is not None:
            env[name] = value
    return env


def hosts_file(pod: Pod, pod_ip: str) -> str:
    hostname = pod.get("spec", {}).get("hostname") or pod["metadata"]["name"]
    return (
        f"127.0.0.1\tlocalhost\n::1\tlocalhost ip6-localhost ip6-loopback\n{pod_ip}\t{hostname}\n"
    )


# Point the resolver at loopback in the pod's namespace: lookups fail at once instead
# of waiting on the host's resolver, which the namespace cannot reach.
RESOLV_CONF = "nameserver 127.0.0.1\noptions timeout:1 attempts:1\n"


def port_number(container: Mapping[str, Any], port: int | str) -> int:
    if isinstance(port, int) or str(port).isdigit():
        return int(port)
    for p in container.get("ports") or []:
        if p.get("name") == port:
            return int(p["containerPort"])
    raise PodSpecError(f"container {container.get('name')}: no port named {port!r}")
