"""Slack: incident messages as Block Kit (blocks), posted through slack-sdk (notifier), and the check of
Slack's request signatures for interactive callbacks (signature)."""
