"""The public wire contract (the official Jev API's, as the README's "The API" describes it): what Jev
clients send and what they read back."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictInt, WithJsonSchema, field_validator
from pydantic_core import PydanticCustomError
from typing_extensions import TypeAliasType

JSON = Any
ECHO_CHARS = 64  # characters of a client's string quoted back in an error message


def echo(text: str) -> str:
    """`text` as an error message may quote it: its first `ECHO_CHARS` characters (then an ellipsis), with any
    lone surrogate written as `\\udxxx`. A 1 MiB model name is not sent back whole."""
    shown = text if len(text) <= ECHO_CHARS else text[:ECHO_CHARS] + "…"
    return shown.encode("utf-8", "backslashreplace").decode("utf-8")

"""A description, instructions or state: null, string, number, object or array, kept as sent."""

TEXT_ONLY = "the served model reads text only"
ASSETS_REFUSED = (f"`assets` (images) cannot be answered: {TEXT_ONLY}. Send the request without images, as "
                  "application/json, with what the image shows described in text")
BOX_REFUSED = (f"`box` questions locate things in an image: {TEXT_ONLY}, so this server answers only noul, choice "
               "and score questions")

INTEGER_RANGE = (-(2**63), 2**64 - 1)
"""Integers the job queue's JSON carries exactly; a score level is echoed, so its integers must fit."""

State = Annotated[JSON, WithJsonSchema({
    "anyOf": [{"type": "string"}, {"type": "object"}, {"type": "array"}],
    "description": "A string, a list of chat messages, `{messages: [...]}` or any JSON object or array."})]

_EchoedInt = Annotated[int, Field(ge=INTEGER_RANGE[0], le=INTEGER_RANGE[1])]
EchoedJson = TypeAliasType(  # type: ignore[misc]
    "EchoedJson", "str | bool | _EchoedInt | float | list[EchoedJson] | dict[str, EchoedJson] | None")
"""JSON that comes back exactly as sent (its integers fit in 64 bits)."""
ScoreLevel = TypeAliasType(  # type: ignore[misc]
    "ScoreLevel", "str | bool | _EchoedInt | float | list[EchoedJson] | dict[str, EchoedJson]")
"""One level of a score question: any JSON but null, echoed in the legend exactly."""


class _Lenient(BaseModel):
    # Clients add fields of their own (`x_trace_id`, `seed`, …): ignore them, never reject.
    model_config = ConfigDict(extra="ignore")


class NoulCriteria(_Lenient):
    """What `true` and `false` mean; either side may be missing or null."""

    true: JSON = None
    false: JSON = None


class NoulQuestion(_Lenient):
    """A yes/no question answered with P(true)."""

    type: Literal["noul"]
    instructions: JSON = None
    criteria: NoulCriteria | None = None


class ChoiceQuestion(_Lenient):
    """Pick one of the named options; option names round-trip byte for byte."""

    type: Literal["choice"]
    instructions: JSON = None
    criteria: dict[str, JSON] = Field(json_schema_extra={"minProperties": 1})

    @field_validator("criteria")
    @classmethod
    def _at_least_one_option(cls, criteria: dict[str, JSON]) -> dict[str, JSON]:
        if not criteria:
            raise ValueError("a choice question needs at least one option in `criteria`")
        return criteria


class ScoreQuestion(_Lenient):
    """An ordinal scale: `criteria` lists the levels, lowest first; level i is scored i."""

    type: Literal["score"]
    instructions: JSON = None
    criteria: list[ScoreLevel] = Field(json_schema_extra={"minItems": 2})

    @field_validator("criteria", mode="before")
    @classmethod
    def _levels_are_described(cls, levels: Any) -> Any:
        # Before validation: pydantic would turn a too-large integer into a float, not refuse it.
        if not isinstance(levels, list):
            return levels
        if len(levels) < 2:
            raise ValueError("a score question needs at least two levels in `criteria`, lowest first")
        if any(level is None for level in levels):
            raise ValueError("score levels must not be null: the legend echoes each level")
        for i, level in enumerate(levels):
            _require_echoable(level, f"level {i}")
        return levels


def _require_echoable(value: JSON, where: str) -> None:
    """Refuse integers the legend could not echo exactly (they would come back rounded)."""
    stack = [value]
    while stack:
        item = stack.pop()
        if isinstance(item, int) and not isinstance(item, bool) and not INTEGER_RANGE[0] <= item <= INTEGER_RANGE[1]:
            raise ValueError(f"{where} holds the integer {item}, beyond 64 bits: the legend echoes levels exactly, "
                             "so send such a number as a string")
        if isinstance(item, dict):
            stack.extend(item.values())
        elif isinstance(item, list):
            stack.extend(item)


Question = Annotated[NoulQuestion | ChoiceQuestion | ScoreQuestion, Field(discriminator="type")]


class SystemOneRequest(_Lenient):
    """The body of `POST /v1/systemone` (and of `POST /v1/jobs`)."""

    model: str = Field(examples=["jev-latest"])
    state: State
    questions: dict[str, Question] = Field(min_length=1)
    assets: Annotated[JSON, WithJsonSchema({"type": "null", "description": f"Refused unless null: {ASSETS_REFUSED}."})
                      ] = Field(default=None, exclude=True)
    x_debias: StrictBool | None = Field(
        default=None, description="openjev: average each choice/score answer over cyclic rotations of its options "
        "(label-order debiasing; costs one branch per rotation). Omitted: the server's `OPENJEV_DEBIAS`.")
    x_option_group_size: StrictInt | None = Field(
        default=None, ge=0, description="openjev: ask each choice question with more options than this in two "
        "rounds, groups of this many options and then the groups' winners (for models that lose the thread in a "
        "long list); 0: one branch per question; 1 is refused (a group holds at least 2 options). Omitted: the "
        "server's `OPENJEV_OPTION_GROUP_SIZE`.", json_schema_extra={"not": {"const": 1}})
    x_priority: Literal["interactive", "batch"] | None = Field(
        default=None, description="openjev: the lane the job queues in. `interactive` (someone is waiting) starts "
        "before queued `batch` work; batch work is passed for at most 30 s of fair-queue time, never starved. "
        "Omitted: interactive for /v1/systemone, batch for /v1/jobs.")

    @field_validator("x_option_group_size", mode="before")
    @classmethod
    def _integral_number(cls, size: Any) -> Any:
        # JSON Schema's integer is any number without a fraction: 26.0 is 26. Strings stay refused.
        return int(size) if isinstance(size, float) and size.is_integer() else size

    @field_validator("x_option_group_size")
    @classmethod
    def _group_of_two_or_more(cls, size: int | None) -> int | None:
        if size == 1:
            raise ValueError("a group needs at least 2 options; send 0 to ask each question in one branch")
        return size

    @field_validator("assets")
    @classmethod
    def _no_images(cls, assets: JSON) -> JSON:
        # The official API's images (typesafe-sdk sends them): refused rather than silently ignored.
        if assets is not None:
            raise PydanticCustomError("text_only", ASSETS_REFUSED)
        return assets

    @field_validator("state")
    @classmethod
    def _state_is_text_or_structure(cls, state: JSON) -> JSON:
        if not isinstance(state, str | dict | list):
            kind = "null" if state is None else "a boolean" if isinstance(state, bool) else "a number"
            raise ValueError(f"`state` must be a string, an object or an array, not {kind}: "
                             "send the text or messages to evaluate")
        return state


LABEL_MASS = Field(None, ge=0.0, le=1.0, description=(
    "openjev's extension: the share of the model's next-token probability that fell on this question's "
    "answer labels before the distribution was renormalised over them (1: the model answered with a label; "
    "near 0: the probabilities are mostly noise). Official clients ignore it."))


Probabilities = Annotated[dict[str, float], Field(description=(
    "Each option's (or level's) probability, renormalised over the answer labels; they sum to 1."))]
Confidence = Annotated[float, Field(description="How sure the model is of its answer, from 0 to 1.")]


class NoulAnswer(BaseModel):
    """A `noul` question's answer: the probability of yes."""

    type: Literal["noul"] = "noul"
    noul: float
    x_label_mass: float | None = LABEL_MASS


class ChoiceAnswer(BaseModel):
    """A `choice` question's answer: the likeliest option, with the distribution over every option."""

    type: Literal["choice"] = "choice"
    choice: str
    probabilities: Probabilities
    confidence: Confidence
    x_label_mass: float | None = LABEL_MASS


class ScoreAnswer(BaseModel):
    """A `score` question's answer: the expected level (0 for the legend's first), with its distribution."""

    type: Literal["score"] = "score"
    score: float
    legend: dict[str, JSON]
    probabilities: Probabilities
    confidence: Confidence
    x_label_mass: float | None = LABEL_MASS


Answer = Annotated[NoulAnswer | ChoiceAnswer | ScoreAnswer, Field(discriminator="type")]


class Usage(BaseModel):
    input_tokens: int
    output_tokens: int


class SystemOneResponse(BaseModel):
    """The body of a successful evaluation: `model`, `answers` keyed by question id, `usage`."""

    model: str
    answers: dict[str, Answer]
    usage: Usage


class ModelCard(BaseModel):
    name: str
    description: str
    release_date: str


class ModelList(BaseModel):
    models: list[ModelCard]
    x_accepted_names: list[str] = Field(
        default_factory=list, description="openjev: every name a request may send, all answered by the served "
        "model; a trailing `*` accepts every name it begins (`jev-*`: `jev-latest`, a pinned `jev-1.13.0`, ...)")


class ErrorDetail(BaseModel):
    error_type: str
    message: str


class ErrorBody(BaseModel):
    """Every non-validation error: `{"detail": {"error_type", "message"}}`."""

    detail: ErrorDetail


EXAMPLE_REQUEST: dict[str, Any] = {
    "model": "jev-latest",
    "state": "Hi, I was charged twice for my March invoice and I'd like the duplicate refunded.",
    "questions": {
        "refund": {"type": "noul", "instructions": "Is the customer asking for money back?"},
        "department": {
            "type": "choice",
            "instructions": "Which team should handle this?",
            "criteria": {
                "Billing": "Payments, invoices, refunds",
                "Technical": "Bugs, outages, integrations",
                "Sales": "Pricing, upgrades, new contracts",
            },
        },
        "urgency": {
            "type": "score",
            "instructions": "How urgent is this ticket?",
            "criteria": ["Low", "Medium", "High"],
        },
    },
}
