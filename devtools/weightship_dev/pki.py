"""A throwaway PKI for the local cluster, made with the openssl command line.

One CA signs the API server's serving certificate and every client certificate
(admin, controllers, each process node as system:node:<name>), so Node authorization
and RBAC apply to every component as they would in a real cluster.
"""

from __future__ import annotations

import subprocess
from pathlib import Path

import yaml

from weightship_dev.layout import APISERVER_PORT, BRIDGE_IP


def _openssl(*args: str, cwd: Path) -> None:
    subprocess.run(["openssl", *args], cwd=cwd, check=True, capture_output=True)


def ensure_ca(pki: Path) -> None:
    pki.mkdir(parents=True, exist_ok=True)
    if (pki / "ca.crt").exists():
        return
    _openssl(
        "req",
        "-x509",
        "-newkey",
        "rsa:2048",
        "-nodes",
        "-days",
        "365",
        "-subj",
        "/CN=weightship-local-ca",
        "-keyout",
        "ca.key",
        "-out",
        "ca.crt",
        cwd=pki,
    )
    # The service-account signing key is separate from every TLS key.
    _openssl("genrsa", "-out", "sa.key", "2048", cwd=pki)
    _openssl("rsa", "-in", "sa.key", "-pubout", "-out", "sa.pub", cwd=pki)


def issue_cert(pki: Path, name: str, subject: str, *, server_sans: list[str] | None = None) -> None:
    """Issue `<name>.crt`/`<name>.key`, a client cert (and a serving cert if SANs given)."""
    if (pki / f"{name}.crt").exists():
        return
    ext = pki / f"{name}.ext"
    lines = ["basicConstraints=CA:FALSE", "keyUsage=digitalSignature,keyEncipherment"]
    if server_sans:
        lines.append("extendedKeyUsage=serverAuth,clientAuth")
        lines.append("subjectAltName=" + ",".join(server_sans))
    else:
        lines.append("extendedKeyUsage=clientAuth")
    ext.write_text("\n".join(lines) + "\n")
    _openssl(
        "req",
        "-newkey",
        "rsa:2048",
        "-nodes",
        "-subj",
        subject,
        "-keyout",
        f"{name}.key",
        "-out",
        f"{name}.csr",
        cwd=pki,
    )
    _openssl(
        "x509",
        "-req",
        "-in",
        f"{name}.csr",
        "-CA",
        "ca.crt",
        "-CAkey",
        "ca.key",
        "-CAcreateserial",
        "-days",
        "365",
        "-out",
        f"{name}.crt",
        "-extfile",
        ext.name,
        cwd=pki,
    )
    (pki / f"{name}.csr").unlink()


def apiserver_sans(service_ip: str) -> list[str]:
    dns = [
        "localhost",
        "kubernetes",
        "kubernetes.default",
        "kubernetes.default.svc",
        "kubernetes.default.svc.cluster.local",
    ]
    return [f"DNS:{d}" for d in dns] + [f"IP:{ip}" for ip in ("127.0.0.1", BRIDGE_IP, service_ip)]


def write_kubeconfig(path: Path, pki: Path, user_cert: str, *, server: str | None = None) -> None:
    """A kubeconfig that embeds no secrets itself, only paths to the PKI files."""
    server = server or f"https://{BRIDGE_IP}:{APISERVER_PORT}"
    config = {
        "apiVersion": "v1",
        "kind": "Config",
        "clusters": [
            {
                "name": "weightship-local",
                "cluster": {"server": server, "certificate-authority": str(pki / "ca.crt")},
            }
        ],
        "users": [
            {
                "name": user_cert,
                "user": {
                    "client-certificate": str(pki / f"{user_cert}.crt"),
                    "client-key": str(pki / f"{user_cert}.key"),
                },
            }
        ],
        "contexts": [
            {
                "name": "weightship-local",
                "context": {"cluster": "weightship-local", "user": user_cert},
            }
        ],
        "current-context": "weightship-local",
    }
    path.write_text(yaml.safe_dump(config, sort_keys=False))
