"""The clients people already use, against the server on the default model.

instructor and LangChain send pydantic schemas as pydantic writes them,
without ``additionalProperties: false``; the grammar keeps to the named keys
all the same, so the object closes instead of growing keys until
``max_tokens``. Every answer must come back as the client's parsed object.
"""

from __future__ import annotations

import instructor
import pytest
from langchain_core.messages import AIMessage
from langchain_core.tools import tool
from langchain_openai import ChatOpenAI
from openai import OpenAI
from pydantic import BaseModel, Field

pytestmark = pytest.mark.slow
MAX_TOKENS = 100
QUESTION = "Paris is the capital of France. Extract the city and its country."


class City(BaseModel):
    """A city and the country it is in."""

    city: str = Field(max_length=30)
    country: str = Field(max_length=30)


@tool
def get_weather(city: str) -> str:
    """The weather in a city."""
    return "sunny"


def test_city_schema_leaves_additional_properties_out() -> None:
    assert "additionalProperties" not in City.model_json_schema()


@pytest.mark.parametrize("mode", [instructor.Mode.TOOLS, instructor.Mode.JSON_SCHEMA])
def test_instructor_returns_the_object(server: str, mode: instructor.Mode) -> None:
    openai = OpenAI(base_url=f"{server}/v1", api_key="sk-local", max_retries=0, timeout=60)
    client = instructor.from_openai(openai, mode=mode)
    city = client.chat.completions.create(
        model="default",
        response_model=City,
        messages=[{"role": "user", "content": QUESTION}],
        max_tokens=MAX_TOKENS,
        temperature=0,
        max_retries=0,
    )
    assert isinstance(city, City)
    assert city.city == "Paris"


@pytest.fixture(scope="module")
def chat(server: str) -> ChatOpenAI:
    return ChatOpenAI(
        base_url=f"{server}/v1",
        api_key="sk-local",
        model="default",
        temperature=0,
        max_tokens=MAX_TOKENS,
        max_retries=0,
        timeout=60,
    )


@pytest.mark.parametrize("choice", ["get_weather", "required"])
def test_langchain_forced_tool_call(chat: ChatOpenAI, choice: str) -> None:
    message = chat.bind_tools([get_weather], tool_choice=choice).invoke("Weather in Oslo?")
    assert isinstance(message, AIMessage)
    assert message.tool_calls
    assert {call["name"] for call in message.tool_calls} == {"get_weather"}
    assert all(set(call["args"]) == {"city"} for call in message.tool_calls)


@pytest.mark.parametrize("method", ["json_schema", "function_calling"])
def test_langchain_structured_output(chat: ChatOpenAI, method: str) -> None:
    city = chat.with_structured_output(City, method=method).invoke(QUESTION)
    assert isinstance(city, City)
    assert city.city == "Paris"


def test_langchain_stream(chat: ChatOpenAI) -> None:
    pieces = [chunk.content for chunk in chat.stream("Say hello.")]
    assert len(pieces) > 2
    assert "".join(pieces).strip()
