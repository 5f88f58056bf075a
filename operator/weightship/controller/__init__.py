"""The ModelRollout controller: kopf handlers (thin), observation and action adapters.

Decisions live in `weightship.core`; this package only observes, calls `decide`, and
applies its result.
"""
