"""Test fixtures that are real programs: the tiny reference inference server and its models."""
