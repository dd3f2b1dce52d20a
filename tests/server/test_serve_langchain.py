"""LangChain's ChatOpenAI, unchanged, against the server (no client-side token
counting: that would make tiktoken fetch its encodings from the internet)."""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.timeout(60)


@pytest.fixture
def llm(server):
    from langchain_openai import ChatOpenAI

    return ChatOpenAI(model=server.model, base_url=server.base_url, api_key="unused", max_tokens=12,
                      temperature=0, max_retries=0, timeout=30)


def test_invoke_returns_a_message(llm):
    from langchain_core.messages import AIMessage, HumanMessage, SystemMessage

    reply = llm.invoke([SystemMessage("Be brief."), HumanMessage("Hello there")])
    assert isinstance(reply, AIMessage)
    assert isinstance(reply.content, str) and reply.content
    assert reply.response_metadata["finish_reason"] in ("stop", "length")
    assert reply.usage_metadata["output_tokens"] <= 12


def test_stream_yields_the_same_text(llm):
    whole = llm.invoke("Tell me about tea").content
    chunks = list(llm.stream("Tell me about tea"))
    assert len(chunks) > 1
    assert "".join(chunk.content for chunk in chunks) == whole


WEATHER = {"type": "object", "additionalProperties": False, "required": ["city"],
           "properties": {"city": {"type": "string", "minLength": 1, "maxLength": 8}}}


def _tools():
    from langchain_core.tools import StructuredTool

    calls = []

    def get_weather(city: str) -> str:
        calls.append(("get_weather", city))
        return f"sunny in {city}"

    def add(a: int, b: int) -> int:
        calls.append(("add", a + b))
        return a + b

    add_schema = {"type": "object", "additionalProperties": False, "required": ["a", "b"],
                  "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 9},
                                 "b": {"type": "integer", "minimum": 0, "maximum": 9}}}
    tools = [StructuredTool.from_function(get_weather, name="get_weather", description="Weather in a city",
                                          args_schema=WEATHER),
             StructuredTool.from_function(add, name="add", description="Add two numbers", args_schema=add_schema)]
    return tools, calls


def test_bind_tools_required_returns_parsed_tool_calls(server):
    from langchain_openai import ChatOpenAI

    tools, _ = _tools()
    llm = ChatOpenAI(model=server.model, base_url=server.base_url, api_key="unused", max_tokens=200,
                     temperature=1.0, seed=4, max_retries=0, timeout=60)
    reply = llm.bind_tools(tools, tool_choice="required").invoke("What is the weather in Oslo?")
    assert reply.tool_calls and all(c["name"] in ("get_weather", "add") for c in reply.tool_calls)
    assert all(isinstance(c["args"], dict) and c["id"] for c in reply.tool_calls)


@pytest.mark.filterwarnings("ignore:create_react_agent has been moved")
def test_langgraph_react_agent_runs_to_its_end(server):
    from langchain_core.messages import ToolMessage
    from langchain_openai import ChatOpenAI
    from langgraph.prebuilt import create_react_agent

    tools, calls = _tools()
    llm = ChatOpenAI(model=server.model, base_url=server.base_url, api_key="unused", max_tokens=40,
                     temperature=1.0, seed=2, max_retries=0, timeout=60)

    def pick_model(state, runtime):
        # The first step must call a tool; after a tool result the model decides.
        if any(isinstance(m, ToolMessage) for m in state["messages"]):
            return llm.bind_tools(tools, tool_choice="none")
        return llm.bind_tools(tools, tool_choice="required", parallel_tool_calls=False)

    agent = create_react_agent(pick_model, tools)
    result = agent.invoke({"messages": [("user", "Add 2 and 3, please.")]}, {"recursion_limit": 10})
    kinds = [type(m).__name__ for m in result["messages"]]
    assert kinds[:3] == ["HumanMessage", "AIMessage", "ToolMessage"] and kinds[-1] == "AIMessage"
    assert len(calls) == 1 and not result["messages"][-1].tool_calls
