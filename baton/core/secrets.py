"""Reading secrets mounted as files (Kubernetes Secrets), shared by every Baton process."""

from __future__ import annotations

from pathlib import Path

__all__ = ["read_token"]


def read_token(path: str | Path) -> str:
    """The bearer token in ``path``, surrounding whitespace removed; ValueError if unusable."""
    try:
        token = Path(path).read_text().strip()
    except OSError as exc:
        raise ValueError(f"{path}: cannot read the token file ({exc.strerror})") from exc
    if not token:
        raise ValueError(f"{path}: the token file is empty")
    return token
