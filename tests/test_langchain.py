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
