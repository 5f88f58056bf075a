"""Loading verified weights inside inference pods.

``layout`` and ``checksum`` need only the standard library and numpy (the manifest builder
uses them); ``load`` needs torch (the ``[torch]`` extra) and is imported on its own.
"""
