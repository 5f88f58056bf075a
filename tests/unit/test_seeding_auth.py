"""Who may join a seed root: the join token (core.seedtoken), the root's checks over real
HTTP on loopback, the open-group limit, and the store keys a stranger cannot guess."""

from __future__ import annotations

import hashlib
import hmac
import json
import logging
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import save_file

from weightship.core.seedtoken import (
    MAX_CLOCK_SKEW_S,
    TOKEN_LIFETIME_S,
    check_token,
    join_token,
    mint,
    parse_key,
)
from weightship.loader.load import load_model
from weightship.seeding import JOIN_PATH, SeedConfig, SeedRoot, serve
from weightship.seeding.config import RootSettings
from weightship.seeding.protocol import START_KEY, store_prefix
from weightship.seeding.transport import client_store, prefixed
from weightship.weightformat.build import LocalFolder, build_manifest
from weightship.weightformat.manifest import Manifest

HOST = "127.0.0.1"
KEY = bytes(range(32))
OTHER_KEY = bytes(range(1, 33))
UID = "7f0c-rollout-uid"
DIGEST = "sha256:" + "ab" * 32
NOW = 1_800_000_000.0


# -- the token, pure -----------------------------------------------------------------------


def test_a_token_is_the_hmac_of_uid_digest_group_and_expiry() -> None:
    expires = int(NOW) + 60
    message = json.dumps(["v1", UID, DIGEST, "g-1", expires]).encode()
    mac = hmac.new(KEY, message, hashlib.sha256).hexdigest()
    assert join_token(KEY, UID, DIGEST, "g-1", expires) == f"v1.{expires}.{mac}"
    assert mint(KEY, UID, DIGEST, "g-1", NOW) == join_token(
        KEY, UID, DIGEST, "g-1", int(NOW) + TOKEN_LIFETIME_S
    )


GOOD = join_token(KEY, UID, DIGEST, "g-1", int(NOW) + 60)
MAC = GOOD.rsplit(".", 1)[1]


@pytest.mark.parametrize(
    ("key", "uid", "digest", "group", "token", "now", "want"),
    [
        (KEY, UID, DIGEST, "g-1", GOOD, NOW, None),
        (KEY, UID, DIGEST, "g-1", GOOD, NOW + 60, None),  # the last second it is valid
        (KEY, UID, DIGEST, "g-1", GOOD, NOW + 61, (403, "TokenExpired")),
        (KEY, UID, DIGEST, "g-2", GOOD, NOW, (403, "TokenInvalid")),  # another group
        (KEY, "other-uid", DIGEST, "g-1", GOOD, NOW, (403, "TokenInvalid")),  # rollout
        (KEY, UID, "sha256:" + "cd" * 32, "g-1", GOOD, NOW, (403, "TokenInvalid")),  # model
        (OTHER_KEY, UID, DIGEST, "g-1", GOOD, NOW, (403, "TokenInvalid")),  # key
        (None, UID, DIGEST, "g-1", GOOD, NOW, (403, "NoSeedingKey")),
        (KEY, UID, DIGEST, "g-1", None, NOW, (401, "TokenMissing")),
        (KEY, UID, DIGEST, "g-1", "", NOW, (401, "TokenMissing")),
        (KEY, UID, DIGEST, "g-1", "v1.x." + MAC, NOW, (403, "TokenInvalid")),
        (KEY, UID, DIGEST, "g-1", "v2." + GOOD[3:], NOW, (403, "TokenInvalid")),
        (KEY, UID, DIGEST, "g-1", GOOD + "0", NOW, (403, "TokenInvalid")),
        (KEY, UID, DIGEST, "g-1", GOOD.upper(), NOW, (403, "TokenInvalid")),
        (KEY, UID, DIGEST, "g-1", GOOD + "." + "0" * 900, NOW, (403, "TokenInvalid")),
        (KEY, UID, DIGEST, "g-1", "v1.1.-" + MAC[1:], NOW, (403, "TokenInvalid")),
        (KEY, UID, DIGEST, "g-1", "v1.1é." + MAC, NOW, (403, "TokenInvalid")),
        # a correct HMAC that expires too far ahead: a key holder cannot mint a long one
        (
            KEY,
            UID,
            DIGEST,
            "g-1",
            join_token(KEY, UID, DIGEST, "g-1", int(NOW) + TOKEN_LIFETIME_S + MAX_CLOCK_SKEW_S + 1),
            NOW,
            (403, "TokenInvalid"),
        ),
    ],
)
def test_check_token(
    key: bytes | None,
    uid: str,
    digest: str,
    group: str,
    token: str | None,
    now: float,
    want: tuple[int, str] | None,
) -> None:
    refused = check_token(key, uid, digest, group, token, now)
    got = None if refused is None else (refused.status, refused.reason)
    assert got == want
    if refused is not None and token:
        assert token not in refused.message


def test_parse_key_never_quotes_the_key() -> None:
    assert parse_key(KEY.hex() + "\n") == KEY
    for bad in ("zz" * 32, KEY.hex()[:-2], KEY.hex() + "00"):
        with pytest.raises(ValueError) as caught:
            parse_key(bad)
        assert bad not in str(caught.value) and KEY.hex()[:16] not in str(caught.value)


# -- settings from the pod's env -----------------------------------------------------------

POD_ENV = {
    "WEIGHTSHIP_SEED_ROOT": "http://10.0.0.7:8000",
    "WEIGHTSHIP_SEED_GROUP": "g-1",
    "WEIGHTSHIP_POD_NAME": "llm-abc",
    "WEIGHTSHIP_POD_IP": "10.0.0.9",
    "WEIGHTSHIP_SEED_BACKEND": "gloo",
    "WEIGHTSHIP_SEED_TIMEOUT_SECONDS": "45",
    "WEIGHTSHIP_SEED_BUCKET_BYTES": "4096",
    "WEIGHTSHIP_SEED_KEY": KEY.hex(),
    "WEIGHTSHIP_ROLLOUT_UID": UID,
}


def test_a_receiver_makes_its_token_from_the_rollout_key() -> None:
    config = SeedConfig.from_env(POD_ENV)
    assert config is not None and config.key == KEY and config.rollout_uid == UID
    token = config.token(DIGEST)
    assert token is not None
    assert check_token(KEY, UID, DIGEST, "g-1", token, time.time()) is None
    assert KEY.hex() not in repr(config)
    keyless = SeedConfig.from_env({**POD_ENV, "WEIGHTSHIP_SEED_KEY": ""})
    assert keyless is not None and keyless.token(DIGEST) is None


def test_root_settings_come_from_the_env_and_hide_the_key(
    caplog: pytest.LogCaptureFixture,
) -> None:
    settings = RootSettings.from_env(POD_ENV)
    assert settings == RootSettings(
        host="10.0.0.9",
        name="llm-abc",
        backend="gloo",
        timeout_s=45.0,
        bucket_bytes=4096,
        key=KEY,
        rollout_uid=UID,
    )
    assert KEY.hex() not in repr(settings)
    assert RootSettings.from_env({}) == RootSettings(host=None, name="local")
    with caplog.at_level(logging.WARNING):
        bad = RootSettings.from_env({**POD_ENV, "WEIGHTSHIP_SEED_KEY": "nothex" + KEY.hex()})
    assert bad.key is None  # a root that admits no one, never a crash
    assert KEY.hex() not in caplog.text


# -- a real root over HTTP -----------------------------------------------------------------


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Manifest]:
    folder = tmp_path_factory.mktemp("model")
    save_file({"w": torch.arange(1024, dtype=torch.float32)}, str(folder / "m.safetensors"))
    return folder, build_manifest(LocalFolder(folder), chunk_size=4096)


def start_root(model: tuple[Path, Manifest], **kw: Any) -> tuple[SeedRoot, str, Any]:
    folder, manifest = model
    root = SeedRoot(load_model(folder, manifest).tensors, manifest, host=HOST, name="root-0", **kw)
    server = serve(root, HOST)
    return root, f"http://{HOST}:{server.server_address[1]}", server


@pytest.fixture
def root(model: tuple[Path, Manifest]) -> Iterator[tuple[SeedRoot, str]]:
    seed_root, url, server = start_root(
        model, key=KEY, rollout_uid=UID, join_window_s=0.5, timeout_s=1, max_concurrent=2
    )
    yield seed_root, url
    server.stop()
    seed_root.close()


def post_join(url: str, body: dict[str, Any]) -> tuple[int, dict[str, Any]]:
    request = urllib.request.Request(url + JOIN_PATH, data=json.dumps(body).encode(), method="POST")
    try:
        with urllib.request.urlopen(request, timeout=10) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as err:
        return err.code, json.loads(err.read())


def join_body(group: str, token: str | None, manifest: Manifest) -> dict[str, Any]:
    return {
        "group": group,
        "worldSize": 3,
        "member": "m",
        "digest": manifest.digest,
        "backend": "gloo",
        "token": token,
    }


def test_the_root_refuses_joins_without_a_token_that_opens_the_group(
    root: tuple[SeedRoot, str], model: tuple[Path, Manifest], caplog: pytest.LogCaptureFixture
) -> None:
    seed_root, url = root
    digest = model[1].digest
    now = time.time()
    cases = {
        "no token": (None, 401, "TokenMissing"),
        "another group's": (mint(KEY, UID, digest, "other", now), 403, "TokenInvalid"),
        "another rollout's": (mint(KEY, "uid-2", digest, "g", now), 403, "TokenInvalid"),
        "another key's": (mint(OTHER_KEY, UID, digest, "g", now), 403, "TokenInvalid"),
        "expired": (join_token(KEY, UID, digest, "g", int(now) - 1), 403, "TokenExpired"),
        "forged": ("v1.9999999999." + "0" * 64, 403, "TokenInvalid"),
    }
    with caplog.at_level(logging.DEBUG):
        for case, (token, status, reason) in cases.items():
            got, doc = post_join(url, join_body("g", token, model[1]))
            assert (got, doc["reason"], doc["accepted"]) == (status, reason, False), case
            assert "storePort" not in doc and "storePrefix" not in doc, case
            assert "\n" not in doc["message"], case
            if token:
                assert token not in json.dumps(doc), case
    assert seed_root.status_json()["active"] == []  # nothing opened, no store started
    assert seed_root._store is None
    good = mint(KEY, UID, digest, "g", time.time())
    status, doc = post_join(url, join_body("g", good, model[1]))
    assert status == 200 and doc["accepted"] and doc["rank"] == 1
    assert good not in caplog.text and KEY.hex() not in caplog.text


def test_a_root_without_a_key_admits_no_one(model: tuple[Path, Manifest]) -> None:
    seed_root, url, server = start_root(model)
    try:
        token = mint(KEY, "", model[1].digest, "g", time.time())
        status, doc = post_join(url, join_body("g", token, model[1]))
        assert (status, doc["reason"]) == (403, "NoSeedingKey")
    finally:
        server.stop()
        seed_root.close()


def test_twenty_groups_cannot_open_more_than_the_limit_and_open_groups_end(
    root: tuple[SeedRoot, str], model: tuple[Path, Manifest]
) -> None:
    """The finding: 20 joins with distinct groups started 20 broadcasts against a limit
    of 2. Open groups now hold a slot, and one nobody fills ends within its join window
    plus the rendezvous timeout, which frees the slot."""
    seed_root, url = root
    digest = model[1].digest
    answers = [
        post_join(url, join_body(f"g{i}", mint(KEY, UID, digest, f"g{i}", time.time()), model[1]))
        for i in range(20)
    ]
    accepted = [i for i, (status, doc) in enumerate(answers) if status == 200]
    assert accepted == [0, 1]
    assert all(s == 409 and d["reason"] == "Busy" for s, d in answers[2:])
    assert len(seed_root.status_json()["active"]) == 2
    # The two never fill (their members never connect): they start after the 0.5 s
    # window and fail their 1 s rendezvous; then the slots are free again.
    deadline = time.monotonic() + 20
    while len(seed_root.history()) < 2 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert sorted(r.group for r in seed_root.history()) == ["g0", "g1"]
    secret_prefixes = [doc["storePrefix"] for _, doc in answers[:2]]
    assert not any(p in json.dumps(seed_root.status_json()) for p in secret_prefixes)
    assert not any(r.ok for r in seed_root.history())
    assert seed_root.status_json()["active"] == []
    token = mint(KEY, UID, digest, "g2", time.time())
    assert post_join(url, join_body("g2", token, model[1]))[0] == 200


def test_store_keys_are_under_a_prefix_only_joiners_learn(
    root: tuple[SeedRoot, str], model: tuple[Path, Manifest]
) -> None:
    """A process that reaches the root's store but was never admitted cannot find a
    group's keys: neither read its start signal nor write a rank's address there, which
    the root and the other ranks would connect to."""
    seed_root, url = root
    digest = model[1].digest
    status, first = post_join(
        url, join_body("g", mint(KEY, UID, digest, "g", time.time()), model[1])
    )
    assert status == 200
    guessable = store_prefix("g", first["generation"])
    assert first["storePrefix"].startswith(guessable)
    assert len(first["storePrefix"]) >= len(guessable) + 32
    store = client_store(HOST, first["storePort"], 5)
    secret_ctl = prefixed(first["storePrefix"] + "ctl/", store)
    secret_ctl.wait([START_KEY], timedelta(seconds=10))  # the 0.5 s window starts the group
    assert not prefixed(guessable + "ctl/", store).check([START_KEY])
    assert first["storePrefix"] not in json.dumps(seed_root.status_json())  # status is open
    # The next generation of the same group gets a new secret prefix.
    deadline = time.monotonic() + 20
    while not seed_root.history() and time.monotonic() < deadline:
        time.sleep(0.05)
    _, second = post_join(url, join_body("g", mint(KEY, UID, digest, "g", time.time()), model[1]))
    assert second["generation"] == 2
    assert second["storePrefix"] != first["storePrefix"]


def test_both_servers_build_their_root_from_the_same_settings() -> None:
    """The vLLM plugin and the reference server read one RootSettings (SeedRoot.from_settings)."""
    from weightship.integrations.vllm.settings import PluginSettings
    from weightship_testing.tinyllm.settings import Settings

    want = RootSettings.from_env(POD_ENV)
    assert PluginSettings.from_env(POD_ENV).root == want
    assert Settings.from_env(POD_ENV).root == want
    assert want.key == KEY
