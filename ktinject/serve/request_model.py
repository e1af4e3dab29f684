"""``RequestModel``: the pydantic base of every API's request bodies (OpenAI, Anthropic, Responses).

Strict mode (a number sent as a string is an error, as the APIs have it), unknown fields ignored, no inf / NaN, and
null for a field that has a default means that default: the APIs' schemas make such fields nullable (clients send
"stream": null, "n": null); a required field's null stays an error that names it."""
from __future__ import annotations

from pydantic import BaseModel, ConfigDict, model_validator


class RequestModel(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True, allow_inf_nan=False)

    @model_validator(mode="before")
    @classmethod
    def _null_is_absent(cls, data):
        if not isinstance(data, dict):
            return data
        optional = {key for name, f in cls.model_fields.items() if not f.is_required()
                    for key in (name, f.alias) if key}
        return {k: v for k, v in data.items() if v is not None or k not in optional}
