"""The base of every configuration model (`Section`: unknown keys refused, values not coerced) and the
project's one-line problem reports: `problem_lines` turns a pydantic ValidationError into one line per
problem, each naming the key's full path (`actors.trainer.cout: unknown key (did you mean 'count'?)`).
topology.experiment, topology.schema and topology.settings build their models on it."""
from __future__ import annotations

import difflib
import types
import typing
from typing import Any

from pydantic import BaseModel, ConfigDict, ValidationError


class Section(BaseModel):
    """Base of every configuration model. Unknown keys are errors (a misspelt key would otherwise be silently
    ignored); values are not coerced (strict: `count: "4"` or `gdr: 1` is refused, not guessed); floats are
    finite. Validating assignments keeps a model that an override changed as checked as one read from a file."""

    model_config = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False, validate_assignment=True,
                              populate_by_name=True)


def when_missing(message: str) -> dict[str, Any]:
    """A required key's ``json_schema_extra``: the message it gives when it is left out."""
    return {"missing": message}


# ---------------------------------------------------------------------------------------------
# errors: one line per problem, naming the key's full path
# ---------------------------------------------------------------------------------------------

def key_path(prefix: str, loc: tuple[Any, ...]) -> str:
    """`actors.reward.cpus[1]`: dots between keys, brackets around list indices."""
    out = prefix
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        else:
            out = f"{out}.{part}" if out else str(part)
    return out


def _unwrap(annotation: Any) -> Any:
    """The model inside Optional[M], dict[str, M] or list[M] (one level); the annotation itself otherwise."""
    origin = typing.get_origin(annotation)
    if origin in (typing.Union, types.UnionType):
        arms = [a for a in typing.get_args(annotation) if a is not type(None)]
        return arms[0] if len(arms) == 1 else annotation
    return annotation


def model_at(model: type[BaseModel], loc: tuple[Any, ...]) -> type[BaseModel] | None:
    """The model class that holds the key at ``loc`` inside ``model`` (None past a free-form mapping)."""
    current: Any = model
    for part in loc:
        current = _unwrap(current)
        if isinstance(current, type) and issubclass(current, BaseModel):
            field = _field(current, str(part))
            if field is None:
                return None
            current = field.annotation
        elif typing.get_origin(current) is dict:
            current = typing.get_args(current)[1]
        elif typing.get_origin(current) is list:
            current = typing.get_args(current)[0]
        else:
            return None
    current = _unwrap(current)
    return current if isinstance(current, type) and issubclass(current, BaseModel) else None


def _field(model: type[BaseModel], key: str) -> Any:
    for name, field in model.model_fields.items():
        if key in (name, field.alias):
            return field
    return None


def _keys(model: type[BaseModel]) -> list[str]:
    return [field.alias or name for name, field in model.model_fields.items()]


def _unknown_key_hint(model: type[BaseModel] | None, key: str) -> str:
    """Where a misspelt or misplaced key probably belongs: a close key of the same section, or the same key one
    section down (`mem_fraction_static` at the top of a rollout's settings belongs in `sglang`)."""
    if model is None:
        return ""
    close = difflib.get_close_matches(key, _keys(model), n=1, cutoff=0.6)
    if close:
        return f" (did you mean {close[0]!r}?)"
    for name, field in model.model_fields.items():
        inner = _unwrap(field.annotation)
        if isinstance(inner, type) and issubclass(inner, BaseModel) and _field(inner, key) is not None:
            return f" (did you mean '{field.alias or name}.{key}'?)"
    return ""


def problem_lines(exc: ValidationError, prefix: str, model: type[BaseModel]) -> list[str]:
    """One line per error of validating ``model``: `<full key path>: <what is wrong>`."""
    lines = []
    for err in exc.errors():
        loc = tuple(err["loc"])
        path = key_path(prefix, loc)
        if err["type"] == "areal_key":   # topology.experiment.with_our_names: the AReaL key's own path
            lines.append(f"{key_path(prefix, loc + tuple(err['ctx']['key'].split('.')))}: {err['ctx']['why']}")
        elif err["type"] == "extra_forbidden":
            holder = model_at(model, loc[:-1])
            allowed = f"; allowed: {', '.join(sorted(_keys(holder)))}" if holder is not None else ""
            lines.append(f"{path}: unknown key{_unknown_key_hint(holder, str(loc[-1]))}{allowed}")
        elif err["type"] == "missing":
            holder = model_at(model, loc[:-1])
            field = _field(holder, str(loc[-1])) if holder is not None else None
            extra = (field.json_schema_extra or {}) if field is not None else {}
            lines.append(f"{path}: {extra.get('missing', 'missing')}")
        elif err["type"] == "value_error" and isinstance(err.get("input"), dict):
            # a section's own check (a model validator): its message names the keys; the section is not repeated
            lines.append(f"{path}: {err['msg'][0].lower() + err['msg'][1:]}")
        else:
            msg = err["msg"][0].lower() + err["msg"][1:]
            lines.append(f"{path}: {msg} (value: {err.get('input')!r})")
    return lines
