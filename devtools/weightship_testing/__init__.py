"""Test fixtures: programs (the tiny reference inference servers and their models) and data
(`samples`: ModelRollout manifests; `core`: builders for tests of the decision core)."""
