"""Pure Block Kit payloads for rollout notifications (no I/O)."""

from __future__ import annotations

from typing import Any

from weightship.core.decision import Notification

ICONS = {
    "Promoted": ":white_check_mark:",
    "RolledBack": ":rewind:",
    "Paused": ":pause_button:",
    "Failed": ":x:",
    "StepCompleted": ":arrow_forward:",
}
MAX_TEXT = 2900  # Slack caps a section's text at 3000 characters


def payload(note: Notification, channel: str | None = None) -> dict[str, Any]:
    details = dict(note.details)
    title = f"{ICONS.get(note.event, '')} {details.get('rollout', '')}: {note.event}".strip()
    fields = [
        {"type": "mrkdwn", "text": f"*{k}*\n{v or '-'}"} for k, v in note.details if k != "rollout"
    ]
    body: dict[str, Any] = {
        "text": f"{title} ({note.reason}): {note.message}"[:MAX_TEXT],
        "blocks": [
            {"type": "header", "text": {"type": "plain_text", "text": title[:150]}},
            {
                "type": "section",
                "text": {"type": "mrkdwn", "text": f"*{note.reason}*\n{note.message}"[:MAX_TEXT]},
            },
            *([{"type": "section", "fields": fields[:10]}] if fields else []),
            {"type": "context", "elements": [{"type": "mrkdwn", "text": "sent by weightship"}]},
        ],
    }
    if channel:
        body["channel"] = channel
    return body
