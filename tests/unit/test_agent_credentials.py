"""The agents' S3 credential comes from files, never from the API (issue 12, High 4)."""

from __future__ import annotations

from pathlib import Path

import pytest

from weightship.agent.config import AgentConfig
from weightship.agent.credentials import MAX_BYTES, CredentialsError, read_credentials
from weightship.data.s3 import S3Settings


def test_a_mounted_secret_is_read_as_files(tmp_path: Path) -> None:
    (tmp_path / "AWS_ACCESS_KEY_ID").write_text("AKIA\n")  # kubectl --from-file keeps it
    (tmp_path / "AWS_SECRET_ACCESS_KEY").write_text("s3cr3t")
    (tmp_path / "unrelated").write_text("ignored")
    creds = read_credentials(tmp_path)
    assert creds == {"AWS_ACCESS_KEY_ID": "AKIA\n", "AWS_SECRET_ACCESS_KEY": "s3cr3t"}
    settings = S3Settings.from_secret("http://s3:9000", None, creds)
    assert (settings.access_key_id, settings.secret_access_key) == ("AKIA", "s3cr3t")
    assert settings.session_token is None


def test_no_directory_means_the_ambient_chain(tmp_path: Path) -> None:
    assert read_credentials(None) == {}
    with pytest.raises(CredentialsError, match=r"agent\.s3\.existingSecret"):
        read_credentials(tmp_path / "absent")


def test_a_huge_file_is_refused_without_quoting_it(tmp_path: Path) -> None:
    (tmp_path / "AWS_SESSION_TOKEN").write_bytes(b"x" * (MAX_BYTES + 1))
    with pytest.raises(CredentialsError) as caught:
        read_credentials(tmp_path)
    assert "xxx" not in str(caught.value)


def test_the_directory_is_configured_by_env() -> None:
    env = {"NODE_NAME": "n1", "POD_IP": "10.0.0.1"}
    assert AgentConfig.from_env(env).s3_credentials_dir is None
    env["WEIGHTSHIP_S3_CREDENTIALS_DIR"] = "/etc/weightship/s3"
    assert AgentConfig.from_env(env).s3_credentials_dir == Path("/etc/weightship/s3")
