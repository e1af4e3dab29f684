"""Integer settings read from the environment (``KTINJECT_*``) where they are used, with errors that name them."""
from __future__ import annotations

import os


def env_int(name: str, default: int, minimum: int | None = None) -> int:
    """``int($name)``, or ``default`` when it is unset or empty; a ValueError naming the variable when it is not an
    integer or is below ``minimum``."""
    raw = os.environ.get(name, "").strip()
    if not raw:
        return default
    try:
        value = int(raw)
    except ValueError:
        raise ValueError(f"{name}={raw!r} is not an integer (unset it for the default, {default})") from None
    if minimum is not None and value < minimum:
        raise ValueError(f"{name}={value} is below {minimum} (unset it for the default, {default})")
    return value
