"""Join tokens for broadcast seeding (pure: the clock is an argument, no I/O).

Every pod of a rollout holds the rollout's seeding key (32 random bytes the operator keeps
in a Secret of the rollout's namespace; any pod may become a root, so all hold it). A
receiver proves it is one of them by joining with

    token = "v1.<expires>.<hex HMAC-SHA256(key, [v1, rollout uid, manifest digest, group,
                                                 expires])>"

and the root recomputes the HMAC with its own rollout uid and digest and the group the
join names. So a token opens one group of one rollout's model, for minutes, and only a
holder of the key can make one. The token is a bearer credential: never log it.
"""

from __future__ import annotations

import hashlib
import hmac
import json
from dataclasses import dataclass

FORMAT_VERSION = "v1"  # the token format's version (not the API's: weightship.api.names)
KEY_BYTES = 32
# A receiver mints its token right before it joins; the root refuses one that expires later
# than this plus MAX_CLOCK_SKEW_S from its own clock, so a copied token dies within minutes.
TOKEN_LIFETIME_S = 120
MAX_CLOCK_SKEW_S = 120
MAX_TOKEN_CHARS = 96  # "v1." + up to 12 digits + "." + 64 hex digits


@dataclass(frozen=True)
class TokenRefusal:
    """Why a join is refused, as the HTTP answer says it (never with the token in it)."""

    status: int  # 401: no token; 403: a token that does not open this group
    reason: str
    message: str


def parse_key(text: str) -> bytes:
    """The key from its hex form (the Secret's ``key``); ValueError that never quotes it."""
    try:
        key = bytes.fromhex(text.strip())
    except ValueError:
        raise ValueError("the seeding key is not hex") from None
    if len(key) != KEY_BYTES:
        raise ValueError(f"the seeding key must be {KEY_BYTES} bytes, got {len(key)}")
    return key


def _mac(key: bytes, rollout_uid: str, digest: str, group: str, expires: int) -> str:
    message = json.dumps([FORMAT_VERSION, rollout_uid, digest, group, expires]).encode()
    return hmac.new(key, message, hashlib.sha256).hexdigest()


def join_token(key: bytes, rollout_uid: str, digest: str, group: str, expires: int) -> str:
    """The token that opens ``group`` at a root of this rollout holding ``digest``, until
    ``expires`` (epoch seconds)."""
    return f"{FORMAT_VERSION}.{expires}.{_mac(key, rollout_uid, digest, group, expires)}"


def mint(key: bytes, rollout_uid: str, digest: str, group: str, now: float) -> str:
    """A receiver's token for a join it makes now."""
    return join_token(key, rollout_uid, digest, group, int(now) + TOKEN_LIFETIME_S)


def check_token(
    key: bytes | None,
    rollout_uid: str,
    digest: str,
    group: str,
    token: str | None,
    now: float,
) -> TokenRefusal | None:
    """None when ``token`` opens ``group`` at this root (``key``, ``rollout_uid`` and
    ``digest`` are the root's own); else why not. The HMAC is checked before the expiry,
    with ``hmac.compare_digest``, so a forger learns nothing but "invalid"."""
    if key is None:
        return TokenRefusal(403, "NoSeedingKey", "this root has no seeding key: it seeds no one")
    if not token:
        return TokenRefusal(401, "TokenMissing", "a join needs the rollout's seeding token")
    parts = token.split(".") if len(token) <= MAX_TOKEN_CHARS else []
    if (
        len(parts) != 3
        or parts[0] != FORMAT_VERSION
        or not parts[1].isdigit()
        or len(parts[1]) > 12
    ):
        return TokenRefusal(403, "TokenInvalid", "the seeding token is malformed")
    expires = int(parts[1])
    expected = _mac(key, rollout_uid, digest, group, expires)
    if not hmac.compare_digest(expected.encode(), parts[2].encode()):
        return TokenRefusal(
            403, "TokenInvalid", "the seeding token is not for this rollout, model and group"
        )
    if expires < now:
        return TokenRefusal(403, "TokenExpired", "the seeding token expired")
    if expires > now + TOKEN_LIFETIME_S + MAX_CLOCK_SKEW_S:
        return TokenRefusal(403, "TokenInvalid", "the seeding token expires too far ahead")
    return None
