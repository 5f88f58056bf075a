"""Names inside a model folder (next to the weights, in S3 or on disk), and the check
every path of a manifest passes so that no entry can escape the folder."""

from __future__ import annotations

from weightship.weightformat.bounds import MAX_PATH_BYTES, MAX_SEGMENT_BYTES, excerpt

MANIFEST_NAME = "weightship-manifest.json"
PIECES_DIR = "weightship-pieces"  # the piece layer objects: <PIECES_DIR>/<blake3 hex>.bin
SAFETENSORS_SUFFIX = ".safetensors"


def validate_relative_path(path: str) -> str:
    """Accept only plain relative POSIX paths, so no entry can escape the model folder."""
    if len(path) > MAX_PATH_BYTES or len(path.encode("utf-8", "surrogatepass")) > MAX_PATH_BYTES:
        raise ValueError(f"invalid path {excerpt(path)}: longer than {MAX_PATH_BYTES} bytes")
    problems = []
    if not path:
        problems.append("is empty")
    if "\0" in path:
        problems.append("contains NUL")
    elif any(ord(ch) < 0x20 or 0x7F <= ord(ch) < 0xA0 for ch in path):
        problems.append("contains a control character")
    if "\\" in path:
        problems.append("contains a backslash")
    if path.startswith("/"):
        problems.append("is absolute")
    segments = path.split("/")
    if ".." in segments:
        problems.append("contains '..'")
    if "." in segments:
        problems.append("contains '.'")
    if path and not path.startswith("/") and "" in segments:
        problems.append("has an empty segment")
    if any(len(s.encode("utf-8", "surrogatepass")) > MAX_SEGMENT_BYTES for s in segments):
        problems.append(f"has a segment longer than {MAX_SEGMENT_BYTES} bytes")
    if problems:
        raise ValueError(f"invalid path {path!r}: {', '.join(problems)}")
    return path


def is_metadata_path(path: str) -> bool:
    """The manifest and the piece layer objects: next to the weights, not weights."""
    return path == MANIFEST_NAME or path.startswith(PIECES_DIR + "/")
