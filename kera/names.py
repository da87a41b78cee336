"""Stream name rules, checked wherever a name enters the system."""

import re

from .errors import InvalidName

MAX_NAME = 249
_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*")


def check_stream_name(name) -> str:
    if not isinstance(name, str) or not name:
        raise InvalidName("stream name must be a non-empty string")
    if len(name) > MAX_NAME:
        raise InvalidName(f"stream name longer than {MAX_NAME} characters")
    if not _NAME.fullmatch(name) or ".." in name:
        raise InvalidName(
            f"invalid stream name {name!r}: use letters, digits, '.', '_' and '-', "
            "starting with a letter or digit")
    return name


def is_internal(name: str) -> bool:
    """kera's own streams (``kera.group_positions``): a user's stream name cannot start so."""
    return name.startswith("__")
