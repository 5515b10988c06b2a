"""langchain-openai against SmolLM2-135M served by iron-batch: ``with_structured_output``
with a pydantic model (both of its methods) and ``bind_tools`` with a forced call."""

from __future__ import annotations

from typing import Literal

import pytest
from conftest import ServerHandle
from langchain_core.tools import tool
from langchain_openai import ChatOpenAI
from pydantic import BaseModel, Field

MODEL = "smollm2-135m"


class Person(BaseModel):
    """A person."""

    name: str = Field(max_length=20)
    age: int = Field(ge=0, le=120)
    city: Literal["Paris", "London", "Tokyo"]


@tool
def get_weather(city: str, unit: Literal["celsius", "fahrenheit"]) -> str:
    """Current weather in a city."""
    return f"18 degrees {unit} in {city}"


@pytest.fixture(scope="module")
def llm(smol: ServerHandle) -> ChatOpenAI:
    return ChatOpenAI(model=MODEL, base_url=f"{smol.url}/v1", api_key="unused",  # type: ignore[arg-type]
                      temperature=0, max_tokens=48, max_retries=0, timeout=300)


@pytest.mark.parametrize("method", ["json_schema", "function_calling"])
def test_with_structured_output_returns_a_valid_pydantic_object(
    llm: ChatOpenAI, method: str
) -> None:
    structured = llm.with_structured_output(Person, method=method)  # type: ignore[arg-type]
    person = structured.invoke("Invent a person who lives in a big city.")
    assert isinstance(person, Person)  # pydantic validated it


def test_bind_tools_gets_a_call_with_valid_arguments(llm: ChatOpenAI) -> None:
    bound = llm.bind_tools([get_weather], tool_choice="get_weather")
    message = bound.invoke("What is the weather in Paris?")
    (call,) = message.tool_calls  # type: ignore[attr-defined]
    assert call["name"] == "get_weather"
    # The arguments are a valid call of the tool (its own schema checks them).
    assert "degrees" in get_weather.invoke(call["args"])
    # The call's result goes back through the tool role, and the model answers in text.
    answer = llm.bind_tools([get_weather]).invoke(
        ["What is the weather in Paris?", message, get_weather.invoke(call)]
    )
    assert isinstance(answer.content, str) and answer.content


@tool
def get_forecast(city: str) -> str:
    """Weather forecast for a city."""
    return f"sunny in {city}"


def test_forced_call_keeps_to_the_declared_arguments(llm: ChatOpenAI) -> None:
    """The tool's schema (pydantic's) lists ``city`` and says nothing of other properties;
    the forced call still carries only ``city``, and so parses (an undeclared argument
    would run on until the token limit cut the JSON)."""
    assert "additionalProperties" not in get_forecast.tool_call_schema.model_json_schema()
    bound = llm.bind_tools([get_forecast], tool_choice="get_forecast")
    for question in ("What is the weather in Paris?", "Tell me about the weather in Paris"):
        message = bound.invoke(question)
        assert not message.invalid_tool_calls  # type: ignore[attr-defined]
        (call,) = message.tool_calls  # type: ignore[attr-defined]
        assert set(call["args"]) == {"city"}
        assert message.response_metadata["finish_reason"] == "tool_calls"


def test_a_call_cut_by_the_token_limit_is_never_a_finished_call(llm: ChatOpenAI) -> None:
    bound = llm.bind_tools([get_weather], tool_choice="get_weather").bind(max_tokens=3)
    message = bound.invoke("What is the weather in Paris?")
    assert message.response_metadata["finish_reason"] == "length"
    assert message.tool_calls == []  # type: ignore[attr-defined]
    (partial,) = message.invalid_tool_calls  # type: ignore[attr-defined]
    assert partial["name"] == "get_weather"
