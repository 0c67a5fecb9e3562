"""The rules every part of a request body follows, whatever the route (gateway/schema.py declares
the parts): a field it does not declare is refused by name, but those that change nothing here
(IGNORED) and those known and not implemented (REFUSED, with why, unless set to a value that asks
for nothing); and a whole body's strings must be valid Unicode before any field is read."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any, ClassVar

from pydantic import BaseModel, ConfigDict, ValidationError, model_validator
from pydantic_core import InitErrorDetails, PydanticCustomError

# No-op values of refused fields (what a client sends when it asks for nothing, as null does)
NOTHING: tuple[Any, ...] = (None,)


class UnsupportedField(ValueError):
    """A field set to something this server does not do, or beyond its limits; 400 naming `param`."""

    def __init__(self, param: str, message: str) -> None:
        super().__init__(message)
        self.param = param


def field_error(loc: tuple[str | int, ...], value: Any, kind: str, message: str) -> InitErrorDetails:
    # with no context the message is not a template: a field name's braces stay as they are
    return InitErrorDetails(type=PydanticCustomError(kind, message), loc=loc, input=value)


def _printable(key: str) -> str:
    """A dict key as it can appear in an error (one with a lone surrogate cannot be sent as JSON)."""
    return key.encode("utf-8", "backslashreplace").decode("utf-8")


def _only_numbers(values: list[Any]) -> bool:
    """Whether every item is an int or a float, at C speed (a Python loop over 4 M token ids cost the
    event loop seconds)."""
    return set(map(type, values)) <= {int, float}


def _lone_surrogates(data: Any) -> Iterator[tuple[tuple[str | int, ...], str]]:
    """(where, the string) for every string of a parsed JSON body, keys included, that is not valid
    Unicode. Iterative: a deeply nested body must not raise RecursionError here."""
    stack: list[tuple[tuple[str | int, ...], Any]] = [((), data)]
    while stack:
        loc, value = stack.pop()
        if isinstance(value, str):
            if not value.isascii():
                try:
                    value.encode("utf-8")
                except UnicodeEncodeError:
                    yield loc, value
        elif isinstance(value, dict):
            for k, v in value.items():
                if isinstance(k, str) and not k.isascii() and _printable(k) != k:
                    yield (*loc, _printable(k)), k
                stack.append(((*loc, _printable(k) if isinstance(k, str) else k), v))
        elif isinstance(value, list):
            if _only_numbers(value):  # token ids: millions of them, and nothing to look into
                continue
            stack.extend(((*loc, i), v) for i, v in enumerate(value))


class Fields(BaseModel):
    """A body part that refuses every field it does not declare, but those in IGNORED (accepted and
    dropped: they change nothing here) and those of REFUSED (known, not implemented: refused with why,
    unless set to a value that asks for nothing, as null does)."""

    model_config = ConfigDict(extra="ignore")  # only IGNORED's fields get past _check_fields undeclared

    IGNORED: ClassVar[frozenset[str]] = frozenset()
    REFUSED: ClassVar[dict[str, tuple[str, tuple[Any, ...]]]] = {}  # name -> (why, the values that ask nothing)

    @model_validator(mode="before")
    @classmethod
    def _check_fields(cls, data: Any) -> Any:
        if not isinstance(data, dict):
            return data  # pydantic's own error: the body is not an object
        errors = cls._refused_first(data)
        for key, value in data.items():
            if not isinstance(key, str) or key in cls.model_fields or key in cls.IGNORED:
                continue
            name = _printable(key)
            refused = cls.REFUSED.get(key)
            if refused is None:
                errors.append(
                    field_error(
                        (name,),
                        value,
                        "unknown_field",
                        f"{name} is not a field this server takes; docs/openai.md lists the fields it does",
                    )
                )
            elif not any(type(value) is type(v) and value == v for v in refused[1]):
                why = f"{name} is not supported: {refused[0]}"
                errors.append(field_error((name,), value, "unsupported_field", why))
        if errors:
            raise ValidationError.from_exception_data(cls.__name__, errors)
        return data

    @classmethod
    def _refused_first(cls, data: dict[str, Any]) -> list[InitErrorDetails]:
        """A refusal that explains the others (said first, in place of theirs)."""
        return []


class Body(Fields):
    """A whole request body: every string in it must be valid Unicode, before any field is read."""

    @model_validator(mode="before")
    @classmethod
    def _valid_unicode(cls, data: Any) -> Any:
        errors = [
            field_error(
                loc,
                None,  # not the string itself: it cannot be written into the JSON error
                "lone_surrogate",
                "not valid Unicode: it has a lone surrogate (an unpaired \\ud800-\\udfff escape), which "
                "cannot be encoded as UTF-8",
            )
            for loc, _ in _lone_surrogates(data)
        ]
        if errors:
            raise ValidationError.from_exception_data(cls.__name__, errors[:1])
        return data
