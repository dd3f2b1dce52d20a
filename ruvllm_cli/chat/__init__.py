"""The `ruvllm chat` REPL: conversation state, slash commands, the prompt loop, output.

`session` and `commands` need no terminal and no model (tests drive them directly);
`repl` owns the prompt-toolkit session; `render` owns what the user sees; `reply`
streams one reply from the engine loop.
"""
