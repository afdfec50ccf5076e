"""Third-party Jev clients, as their users run them: pinned to a model version, pointed at our root."""

from __future__ import annotations

from harness.stacks import Stack

STATE = "Hi, I was charged twice for my March invoice and I'd like the duplicate refunded."
PINNED = "jev-1.13.0"


def test_the_official_sdk_pinned_to_a_version_is_answered(scripted_stack: Stack) -> None:
    from typesafe_sdk import Choice, Noul, TypeSafeClient

    questions = {"refund": Noul(instructions="Money back?"),
                 "team": Choice(instructions="Which team?", criteria={"Billing": "invoices", "Technical": None})}
    with TypeSafeClient(api_key="unused", base_url=scripted_stack.url, timeout=60) as client:
        result = client.system_one(state=STATE, questions=questions, model=PINNED)
    assert 0.0 <= result.nouls["refund"].noul <= 1.0
    assert result.choices["team"].choice in ("Billing", "Technical")


def test_jev_lite_pinned_to_a_version_is_answered(scripted_stack: Stack) -> None:
    from jev_lite import Noul, Score, TypeSafe

    with TypeSafe(api_key="unused", base_url=scripted_stack.url, model=PINNED, timeout=60, max_retries=0) as client:
        result = client.system_one.create(state=STATE, questions={
            "refund": Noul(instructions="Money back?"),
            "anger": Score(instructions="How angry?", criteria=["Calm", "Annoyed", "Furious"])})
    assert result.model == "HuggingFaceTB/SmolLM2-135M-Instruct"
    assert set(result.answers) == {"refund", "anger"}
