"""Plugins that put weightship inside inference servers nobody here wrote (vLLM)."""
