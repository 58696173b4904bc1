"""Reading configuration files into pydantic models, with errors that name file, field and fix.

Every Baton file (pool files, cluster files, profiles, the EPLB service's configuration,
manifests) is untrusted input read the same way; this module is that one way.
"""

from __future__ import annotations

from pathlib import Path
from typing import TypeVar

import yaml
from pydantic import BaseModel, ValidationError

__all__ = ["describe_errors", "load_yaml_model"]

M = TypeVar("M", bound=BaseModel)


def describe_errors(exc: ValidationError, what: str = "field") -> str:
    """One line naming every invalid field (dotted path) and what is wrong with it."""
    return "; ".join(
        f"{what} '{'.'.join(map(str, error['loc'])) or '(top)'}': {error['msg']}"
        for error in exc.errors()
    )


def load_yaml_model(path: str | Path, model: type[M], *, kind: str, fix: str) -> M:
    """Read ``path`` as YAML into ``model``; ValueError names the file, the fields and ``fix``."""
    try:
        data = yaml.safe_load(Path(path).read_text())
    except OSError as exc:
        raise ValueError(f"{path}: cannot read the {kind} ({exc.strerror})") from exc
    except UnicodeDecodeError as exc:
        raise ValueError(
            f"{path}: the {kind} is not UTF-8 text (byte {exc.start}: {exc.reason})"
        ) from exc
    except yaml.YAMLError as exc:
        raise ValueError(f"{path}: not valid YAML ({exc})") from exc
    try:
        return model.model_validate(data if data is not None else {})
    except ValidationError as exc:
        raise ValueError(f"{path}: {describe_errors(exc)}; {fix}") from exc
