"""Notifications: Slack Block Kit messages built purely, sent off the reconcile path."""
