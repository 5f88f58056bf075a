"""The agents' S3 credential: install-time, read from files, never through the API.

Agents have no Secret access (a node's agent token could otherwise read every tenant's
Secrets). The chart mounts one Secret of the agents' own namespace (`agent.s3.existingSecret`)
at WEIGHTSHIP_S3_CREDENTIALS_DIR; its keys are the AWS_* names a credentialsSecretRef uses.
Files are read on every use, so a rotated Secret (the kubelet rewrites the volume) is
picked up without a restart. No directory: botocore's ambient chain (IRSA, instance role).
"""

from __future__ import annotations

from pathlib import Path

KEYS = ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN")
MAX_BYTES = 16 * 1024  # an STS session token is a few KiB


class CredentialsError(OSError):
    """The credentials directory is set but unreadable (never quotes a file's content)."""


def read_credentials(directory: Path | None) -> dict[str, str]:
    """The AWS_* values found in ``directory`` (missing keys are left out)."""
    if directory is None:
        return {}
    if not directory.is_dir():
        raise CredentialsError(
            f"S3 credentials directory {directory} is missing (chart agent.s3.existingSecret)"
        )
    out: dict[str, str] = {}
    for key in KEYS:
        path = directory / key
        try:
            with path.open("rb") as f:
                data = f.read(MAX_BYTES + 1)
        except FileNotFoundError:
            continue
        except OSError as e:
            raise CredentialsError(f"cannot read {path}: {e.strerror}") from None
        if len(data) > MAX_BYTES:
            raise CredentialsError(f"{path} is over {MAX_BYTES} bytes")
        out[key] = data.decode("utf-8", errors="replace")
    return out
