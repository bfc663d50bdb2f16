"""A model named on a command line: a preset, a JSON file of `ModelConfig` fields, or a Hugging Face config.json.

`mistjax plan` / `explain` and `scripts/pretrain.py --model` read it the same way (`load_config`).
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

from models.config import ModelConfig


class ModelSpecError(ValueError):
    """``--model`` names no preset, or its file is not a usable model config (the message says why)."""


def load_config(spec: str) -> ModelConfig:
    """A preset name (`python -m models --list`), a JSON file of `ModelConfig` fields, or a Hugging Face
    ``config.json`` (it names a ``model_type`` or ``architectures``; mapped by `models.from_hf_config`, whose
    warnings are `models.HFConfigWarning`).

    Raises:
        ModelSpecError: an unknown preset, a missing or malformed file, or a config that maps to no model.
    """
    import models

    path = Path(spec)
    if path.suffix == ".json" or path.is_file():
        if not path.is_file():
            raise ModelSpecError(f"model config file {spec!r} does not exist")
        try:
            fields = json.loads(path.read_text())
        except json.JSONDecodeError as e:
            raise ModelSpecError(f"model config file {spec!r} is not valid JSON: {e}") from e
        if not isinstance(fields, dict):
            raise ModelSpecError(f"model config file {spec!r} holds a JSON {type(fields).__name__}, not an object "
                                 "of models.ModelConfig fields or a Hugging Face config")
        if "model_type" in fields or "architectures" in fields:
            try:
                return models.from_hf_config(spec)
            except models.HFConfigError as e:
                raise ModelSpecError(f"model config file {spec!r}: {e}") from e
        return _zoo_config(spec, fields)
    try:
        return models.get_config(spec)
    except ValueError as e:
        raise ModelSpecError(str(e)) from e


def _zoo_config(spec: str, fields: dict) -> ModelConfig:
    known = [f.name for f in dataclasses.fields(ModelConfig)]
    required = [f.name for f in dataclasses.fields(ModelConfig) if f.default is dataclasses.MISSING]
    unknown = [k for k in fields if k not in known]
    if unknown:
        raise ModelSpecError(f"model config file {spec!r}: unknown field {unknown[0]!r} of models.ModelConfig "
                             f"(fields: {', '.join(known)}); a Hugging Face config.json names its model_type")
    missing = [k for k in required if k not in fields]
    if missing:
        raise ModelSpecError(f"model config file {spec!r}: missing field {missing[0]!r} of models.ModelConfig "
                             f"(required: {', '.join(required)})")
    try:
        return ModelConfig(**fields)
    except ValueError as e:
        raise ModelSpecError(f"model config file {spec!r} is not a valid ModelConfig JSON: {e}") from e


__all__ = ["ModelSpecError", "load_config"]
