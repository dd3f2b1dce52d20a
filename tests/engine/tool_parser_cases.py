"""One table of tool-call replies for every format, read by test_tool_parsers.py.

Each case gives the reply text and what `parse` makes of it: the content and the
calls as (name, arguments text). `streamed` is set only where a stream must end
differently: a call whose name went out before the text broke (or stopped) stays a
call, with the argument text it had, and its text is not content.
"""

from __future__ import annotations

from dataclasses import dataclass

Calls = tuple[tuple[str, str], ...]


@dataclass(frozen=True)
class Case:
    id: str
    parser: str
    text: str
    content: str = ""
    calls: Calls = ()
    ids: tuple[str, ...] = ()               # ids the model wrote, which parse keeps
    streamed: tuple[str, Calls] | None = None


WEATHER = ("get_weather", '{"city": "Paris"}')
TIME = ("get_time", '{"tz": "UTC"}')

H_WEATHER = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
H_TIME = '<tool_call>\n{"name": "get_time", "arguments": {"tz": "UTC"}}\n</tool_call>'
L_WEATHER = '{"name": "get_weather", "parameters": {"city": "Paris"}}'
L_TIME = '{"name": "get_time", "parameters": {"tz": "UTC"}}'
M_WEATHER = '{"name": "get_weather", "arguments": {"city": "Paris"}}'
M_TIME = '{"name": "get_time", "arguments": {"tz": "UTC"}}'

NESTED_ARGS = ('{"filter": {"tags": ["a", "b"], "range": {"min": 1, "max": [2, 3.5e-1]}},'
               ' "exact": true, "page": null, "offset": -10}')
ESCAPED_ARGS = r'{"text": "say \"hi\" {not: json} ]}</tool_call> <tool_call>", "path": "C:\\tmp\\"}'
CODE_ARGS = r'{"code": "print(\"}{\"); x = {\"a\": [1]}", "opts": {"a": [1, {"b": null}], "c": false}}'
MISTRAL_STRING_ARGS = r'{"text": "[TOOL_CALLS] [ARGS] \"q\" }]", "items": [{"k": [1, 2]}, {}]}'

HERMES = [
    Case("plain", "hermes", "The weather in Paris is sunny.", "The weather in Paris is sunny."),
    # arguments as a JSON string holding the object (its arguments had been lost: "")
    Case("arguments-as-a-string", "hermes", '<tool_call>\n{"name": "get_weather", "arguments": '
         '"{\\"city\\": \\"Paris\\"}"}\n</tool_call>', "", (WEATHER,)),
    Case("only-call", "hermes", H_WEATHER, "", (WEATHER,)),
    Case("text-before", "hermes", "Let me check.\n" + H_WEATHER, "Let me check.", (WEATHER,)),
    Case("text-before-after", "hermes", "Let me check.\n" + H_WEATHER + "\nAnything else?",
         "Let me check.\n\nAnything else?", (WEATHER,)),
    Case("parallel", "hermes", H_WEATHER + "\n" + H_TIME, "", (WEATHER, TIME)),
    Case("text-between", "hermes", "First:\n" + H_WEATHER + "\nThen:\n" + H_TIME + "\nDone.",
         "First:\n\nThen:\n\nDone.", (WEATHER, TIME)),
    Case("three-adjacent", "hermes", H_WEATHER + H_TIME + '<tool_call>{"name": "noop", "arguments": {}}</tool_call>',
         "", (WEATHER, TIME, ("noop", "{}"))),
    Case("nested", "hermes", '<tool_call>\n{"name": "search", "arguments": ' + NESTED_ARGS + '}\n</tool_call>',
         "", (("search", NESTED_ARGS),)),
    Case("escapes-and-markers-in-strings", "hermes",
         '<tool_call>{"name": "echo", "arguments": ' + ESCAPED_ARGS + "}</tool_call>", "", (("echo", ESCAPED_ARGS),)),
    Case("unicode", "hermes", '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Zürich", '
         '"note": "\\u00e9t\\u00e9 ☀️"}}\n</tool_call>', "",
         (("get_weather", '{"city": "Zürich", "note": "\\u00e9t\\u00e9 ☀️"}'),)),
    Case("empty-arguments", "hermes", '<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>',
         "", (("get_time", "{}"),)),
    Case("no-arguments-key", "hermes", '<tool_call>\n{"name": "get_time"}\n</tool_call>', "", (("get_time", "{}"),)),
    Case("arguments-before-name", "hermes",
         '<tool_call>\n{"arguments": {"city": "Oslo"}, "name": "get_weather"}\n</tool_call>',
         "", (("get_weather", '{"city": "Oslo"}'),)),
    Case("parameters-key", "hermes", '<tool_call>{"name": "f", "parameters": {"x": [1, 2]}}</tool_call>',
         "", (("f", '{"x": [1, 2]}'),)),
    Case("compact", "hermes", '<tool_call>{"name":"f","arguments":{"a":1}}</tool_call>', "", (("f", '{"a":1}'),)),
    Case("no-end-marker", "hermes", H_WEATHER[:-len("\n</tool_call>")], "", (WEATHER,)),
    Case("no-end-marker-then-text", "hermes", H_WEATHER[:-len("</tool_call>")] + "Looking it up.",
         "Looking it up.", (WEATHER,)),
    Case("partial-end-marker-at-end", "hermes", H_WEATHER[:-3], "", (WEATHER,)),
    Case("surrounding-whitespace", "hermes", "  \n" + H_WEATHER + "\n\n", "", (WEATHER,)),
    Case("malformed-after-name", "hermes",
         '<tool_call>\n{"name": "get_weather", "arguments": {"city": }}\n</tool_call>',
         '<tool_call>\n{"name": "get_weather", "arguments": {"city": }}\n</tool_call>',
         streamed=("", (("get_weather", '{"city": '),))),
    Case("malformed-not-json", "hermes", 'Calling.\n<tool_call>\nget_weather(city="Paris")\n</tool_call>',
         'Calling.\n<tool_call>\nget_weather(city="Paris")\n</tool_call>'),
    Case("malformed-name-type", "hermes", '<tool_call>{"name": 42, "arguments": {}}</tool_call>',
         '<tool_call>{"name": 42, "arguments": {}}</tool_call>'),
    Case("malformed-then-call", "hermes", "<tool_call>oops</tool_call>\n" + H_WEATHER,
         "<tool_call>oops</tool_call>", (WEATHER,)),
    Case("broken-until-next-start", "hermes", '<tool_call>{"nam\n' + H_WEATHER, '<tool_call>{"nam', (WEATHER,)),
    Case("unfinished-in-arguments", "hermes", '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Par',
         '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Par',
         streamed=("", (("get_weather", '{"city": "Par'),))),
    # cut inside a call's opening: `parse` keeps the text, a reply (streamed or settled) drops the markup
    Case("unfinished-before-name", "hermes", 'Sure.\n<tool_call>\n{"na', 'Sure.\n<tool_call>\n{"na',
         streamed=("Sure.", ())),
    Case("partial-start-marker-at-end", "hermes", "Hello <tool_", "Hello <tool_"),
    Case("angle-brackets", "hermes", "if a < b then <tool> or </tool_call> appears",
         "if a < b then <tool> or </tool_call> appears"),
    Case("marker-word-in-prose", "hermes", "Use the <tool_call> tag to call tools.",
         "Use the <tool_call> tag to call tools."),
]

LLAMA3 = [
    Case("single", "llama3_json", L_WEATHER, "", (WEATHER,)),
    Case("python-tag-arguments-key", "llama3_json",
         '<|python_tag|>{"name": "get_weather", "arguments": {"city": "Paris"}}', "", (WEATHER,)),
    Case("two-calls-semicolon", "llama3_json", L_WEATHER + "; " + L_TIME, "", (WEATHER, TIME)),
    Case("two-calls-newline", "llama3_json", L_WEATHER + '\n{"name": "get_time", "parameters": {}}', "",
         (WEATHER, ("get_time", "{}"))),
    Case("plain", "llama3_json", "Paris is the capital of France.", "Paris is the capital of France."),
    Case("leading-whitespace", "llama3_json", "\n\n " + L_WEATHER, "", (WEATHER,)),
    Case("json-answer", "llama3_json", '{"answer": 42}', '{"answer": 42}'),
    Case("nested-escapes-braces", "llama3_json", '{"name": "run_code", "parameters": ' + CODE_ARGS + "}", "",
         (("run_code", CODE_ARGS),)),
    Case("nested", "llama3_json", '{"name": "search", "parameters": ' + NESTED_ARGS + "}", "",
         (("search", NESTED_ARGS),)),
    Case("empty-arguments", "llama3_json", '{"name": "get_time", "parameters": {}}', "", (("get_time", "{}"),)),
    Case("text-after", "llama3_json", L_WEATHER + "\nI asked for the weather.", "I asked for the weather.",
         (WEATHER,)),
    Case("malformed-after-name", "llama3_json", '{"name": "get_weather", "parameters": {"city": "Paris",}}',
         '{"name": "get_weather", "parameters": {"city": "Paris",}}',
         streamed=("", (("get_weather", '{"city": "Paris",'),))),
    Case("unfinished", "llama3_json", '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Pa',
         '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Pa',
         streamed=("", (("get_weather", '{"city": "Pa'),))),
    Case("braces-in-prose", "llama3_json", "Use {braces} like this: {x}", "Use {braces} like this: {x}"),
    Case("python-tag-code", "llama3_json", '<|python_tag|>brave_search.call(query="weather Paris")',
         '<|python_tag|>brave_search.call(query="weather Paris")'),
    Case("second-not-a-call", "llama3_json", L_WEATHER + '; {"nome": "x"}', '{"nome": "x"}', (WEATHER,)),
    Case("partial-tag-at-end", "llama3_json", "<|python_ta", "<|python_ta"),
]

MISTRAL = [
    Case("v3-single", "mistral", "[TOOL_CALLS][" + M_WEATHER + "]", "", (WEATHER,)),
    Case("v3-model-id", "mistral",
         '[TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Paris"}, "id": "a1B2c3D4e"}]', "",
         (WEATHER,), ids=("a1B2c3D4e",)),
    Case("v3-two", "mistral", "[TOOL_CALLS][" + M_WEATHER + ", " + M_TIME + "]", "", (WEATHER, TIME)),
    Case("v3-text-before", "mistral", 'Let me look.[TOOL_CALLS][{"name": "get_time", "arguments": {}}]',
         "Let me look.", (("get_time", "{}"),)),
    Case("v3-text-after", "mistral", "[TOOL_CALLS][" + M_TIME + "] Checking now.", "Checking now.", (TIME,)),
    Case("v3-markers-in-strings", "mistral", '[TOOL_CALLS][{"name": "note", "arguments": ' + MISTRAL_STRING_ARGS + "}]",
         "", (("note", MISTRAL_STRING_ARGS),)),
    Case("v3-nested", "mistral", '[TOOL_CALLS][{"name": "search", "arguments": ' + NESTED_ARGS + "}]", "",
         (("search", NESTED_ARGS),)),
    Case("v3-no-arguments", "mistral", '[TOOL_CALLS][{"name": "get_time"}]', "", (("get_time", "{}"),)),
    Case("v3-malformed-after-name", "mistral",
         '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": tru}}]',
         '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": tru}}]',
         streamed=("", (("get_weather", '{"city": tru'),))),
    Case("v3-not-json", "mistral", "[TOOL_CALLS] [get_weather(city=Paris)]", "[TOOL_CALLS] [get_weather(city=Paris)]"),
    Case("v3-empty-list", "mistral", "[TOOL_CALLS][]", ""),
    Case("named", "mistral", '[TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}', "", (WEATHER,)),
    Case("named-two", "mistral", '[TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}[TOOL_CALLS]get_time[ARGS]{}',
         "", (WEATHER, ("get_time", "{}"))),
    Case("named-call-id", "mistral", '[TOOL_CALLS]get_time[CALL_ID]Xy12345ab[ARGS]{"tz": "UTC"}', "", (TIME,),
         ids=("Xy12345ab",)),
    Case("named-text-around", "mistral", "Sure.[TOOL_CALLS]get_time[ARGS]{} Done.", "Sure. Done.",
         (("get_time", "{}"),)),
    Case("named-unfinished-name", "mistral", "[TOOL_CALLS]get_wea", "[TOOL_CALLS]get_wea"),
    Case("named-bad-name", "mistral", "[TOOL_CALLS]get weather[ARGS]{}", "[TOOL_CALLS]get weather[ARGS]{}"),
    Case("named-unfinished-arguments", "mistral", '[TOOL_CALLS]get_weather[ARGS]{"city": "Par',
         '[TOOL_CALLS]get_weather[ARGS]{"city": "Par', streamed=("", (("get_weather", '{"city": "Par'),))),
    Case("brackets-in-prose", "mistral", "Use [brackets] and [TOOL_ like this", "Use [brackets] and [TOOL_ like this"),
    Case("plain", "mistral", "Bonjour !", "Bonjour !"),
]

CASES = HERMES + LLAMA3 + MISTRAL
