"""The public wire contract (`spec/contract.md`): what Jev clients send and what they read back."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

JSON = Any
"""A description, instructions or state: null, string, number, object or array, kept as sent."""


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
    criteria: dict[str, JSON]

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
    criteria: list[JSON]

    @field_validator("criteria")
    @classmethod
    def _levels_are_described(cls, levels: list[JSON]) -> list[JSON]:
        if len(levels) < 2:
            raise ValueError("a score question needs at least two levels in `criteria`, lowest first")
        if any(level is None for level in levels):
            raise ValueError("score levels must not be null: the legend echoes each level")
        return levels


Question = Annotated[NoulQuestion | ChoiceQuestion | ScoreQuestion, Field(discriminator="type")]


class SystemOneRequest(_Lenient):
    """The body of `POST /v1/systemone` (and of `POST /v1/jobs`)."""

    model: str = Field(examples=["jev-latest"])
    state: JSON = Field(description="A string, a list of chat messages, `{messages: [...]}` or any JSON value.")
    questions: dict[str, Question] = Field(min_length=1)
    x_debias: bool | None = Field(
        default=None, description="openjev: average each choice/score answer over cyclic rotations of its options "
        "(label-order debiasing; costs one branch per rotation). Omitted: the server's `OPENJEV_DEBIAS`.")

    @field_validator("state")
    @classmethod
    def _state_present(cls, state: JSON) -> JSON:
        if state is None:
            raise ValueError("`state` must not be null: send the text or messages to evaluate")
        return state


class NoulAnswer(BaseModel):
    type: Literal["noul"] = "noul"
    noul: float


class ChoiceAnswer(BaseModel):
    type: Literal["choice"] = "choice"
    choice: str
    probabilities: dict[str, float]
    confidence: float


class ScoreAnswer(BaseModel):
    type: Literal["score"] = "score"
    score: float
    legend: dict[str, JSON]
    probabilities: dict[str, float]
    confidence: float


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
