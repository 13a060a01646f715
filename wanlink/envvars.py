"""Reading wanlink's integer environment variables with clear errors."""
import os

from wanlink.errors import ConfigError


def env_int(name: str, default: int, *, minimum: int = 0) -> int:
    """``int(os.environ[name])`` or ``default``; ConfigError naming the variable when malformed or too small."""
    value = os.environ.get(name)
    if value is None:
        return default
    try:
        parsed = int(value)
    except ValueError:
        raise ConfigError(f"{name} must be an integer, got {value!r}") from None
    if parsed < minimum:
        raise ConfigError(f"{name} must be >= {minimum}, got {parsed}")
    return parsed
