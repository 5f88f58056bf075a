"""weightship: stage, verify and canary new model weights across GPU inference fleets."""

__version__ = "0.1.0"
