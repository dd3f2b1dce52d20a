"""`ruvllm chat`: an interactive REPL on the shared engine."""

from __future__ import annotations

import sys
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import click

from ruvllm_cli.cli.completion import complete_model
from ruvllm_cli.cli.context import AppContext, app_context, global_options
from ruvllm_cli.cli.options import (FiniteFloatRange, device_option, load_quantization_option, lora_options,
                                    prefix_cache_option, prefix_caching, weight_cache_option, compile_option,
                                    threads_option)
from ruvllm_cli.cli.schema_option import SchemaFile, json_schema_option, validate_structured
from ruvllm_cli.engine.sampling import SEED_RANGE
from ruvllm_cli.engine.request import FinishReason
from ruvllm_cli.errors import RuvllmError, UsageError

if TYPE_CHECKING:
    from ruvllm_cli.chat.conversation import Conversation
    from ruvllm_cli.chat.session import ChatSettings
    from ruvllm_cli.cli.engine_setup import OpenedEngine
    from ruvllm_cli.registry.locate import LocatedModel
    from ruvllm_cli.engine.grammar import GrammarSpec


def utf8_text(value: str | None) -> str | None:
    """An argument that must reach the tokenizer: UTF-8 text (a shell in another encoding
    passes bytes Python holds as surrogate escapes, which failed every message with the
    tokenizer's own words)."""
    if value is not None:
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:
            raise click.BadParameter("not UTF-8 text") from None
    return value


@click.command("chat")
@click.argument("model", shell_complete=complete_model)
@click.option("-s", "--system", help="System prompt.", callback=lambda ctx, param, value: utf8_text(value))
@click.option("--max-tokens", type=click.IntRange(min=1), default=512, show_default=True,
              help="Most tokens per reply.")
@click.option("-t", "--temperature", type=FiniteFloatRange(0.0, 2.0), default=None,
              help="Sampling temperature (0 is greedy).  [default: the model's recommendation (its registry entry's "
                   "or generation_config.json's), else 0.7]")
@click.option("--top-p", type=FiniteFloatRange(0.0, 1.0, min_open=True), default=None,
              help="Nucleus sampling: draw only from the most likely tokens whose probabilities add up to P "
                   "(1 keeps them all).  [default: the model's recommendation, else 1]")
@click.option("--seed", type=click.IntRange(*SEED_RANGE), default=None,
              help="Sampling seed, for reproducible replies.")
@json_schema_option("Every reply is JSON valid against the JSON Schema in FILE.")
@click.option("--json", "json_object", is_flag=True, help="Every reply is a JSON object.")
@click.option("--think/--no-think", default=None,
              help="A reasoning model whose chat template takes enable_thinking (Qwen3): reason before "
                   "answering, or not.  [default: the template's]")
@click.option("--hide-thinking", is_flag=True,
              help="Do not show a reasoning model's reasoning (shown dim before the answer; piped, on stderr).")
@load_quantization_option()
@prefix_cache_option()
@weight_cache_option()
@compile_option()
@threads_option()
@lora_options("--adapter or /adapter picks the one replies come from.")
@click.option("--adapter", metavar="NAME", default=None,
              help="The --lora adapter replies come from at the start (/adapter switches; base: the base "
                   "model).  [default: the base model]")
@device_option()
@global_options
def command(**options: Any) -> None:
    """Chat with MODEL in the terminal, streaming each reply as it is generated.

    With stdin not a terminal, the whole input is one message: only the reply is
    printed on stdout, and the command exits.

    --json-schema FILE and --json constrain every reply (constrained decoding): piped,
    stdout is one compact JSON document; if the reply hits --max-tokens before the
    JSON is complete, stdout stays empty, the partial reply goes to stderr, and the
    exit status is 1.

    --lora NAME=PATH loads PEFT LoRA adapters beside the model: replies come from the
    base model, or from the adapter --adapter names, and /adapter switches between them.

    A reasoning model's reasoning (DeepSeek-R1, QwQ, Qwen3: <think>...</think>) is
    shown dim before its answer and is not kept in the conversation; piped, it goes to
    stderr and stdout holds the answer alone.

    \b
    Examples:
      ruvllm chat qwen
      ruvllm chat qwen -s "You are terse." -t 0.2
      echo "hello" | ruvllm chat qwen --max-tokens 32
      echo "Ada Lovelace, born 1815" | ruvllm chat qwen --json-schema person.json
      ruvllm chat qwen --lora sql=./sql-lora --adapter sql
    """
    app = app_context()
    schema_file = options.pop("json_schema")
    options["schema_path"] = schema_file.path if schema_file is not None else None
    options["structured"] = structured_spec(schema_file, options.pop("json_object"))
    options["adapter"] = starting_adapter(options["lora"], options["adapter"])
    interactive = sys.stdin.isatty()
    if interactive and not sys.stdout.isatty():   # the prompt's redraws would fill the file, none on screen
        raise UsageError("the interactive chat needs a terminal on stdout, and stdout is piped",
                         "pipe the message in for one reply: echo hi | ruvllm chat MODEL > reply.txt")
    message = None if interactive else read_stdin_message()
    from ruvllm_cli.cli.engine_setup import locate_adapters, open_engine
    from ruvllm_cli.engine.loop import EngineLoop

    adapters = locate_adapters(app, options["lora"])
    # One reply at a time: one sequence's worth of KV blocks, which the prefix cache
    # keeps between turns.
    opened = open_engine(app, options["model"], quantization=options["quantization"],
                         device=options["device"], max_num_seqs=1,
                         enable_prefix_caching=prefix_caching(options["no_prefix_cache"]),
                         weight_cache=not options["no_weight_cache"], adapters=adapters,
                         max_loras=options["max_loras"], max_lora_rank=options["max_lora_rank"],
                         kernels=not options["no_compile"], threads=options["threads"],
                         before_load=lambda located: check_max_tokens_before_load(located, options["max_tokens"]))
    if options["structured"] is not None:
        validate_structured(opened.engine, options["structured"], options["schema_path"])
    if interactive:   # while the prompt waits for the first message
        from ruvllm_cli.engine.tokenizer import warm_up

        warm_up(opened.engine.tokenizer)
    loop = EngineLoop(opened.engine)
    try:
        conversation = build_conversation(app, opened, loop, options, interactive)
        if interactive:
            run_interactive(app, opened, conversation)
        else:
            assert message is not None
            answer_once(conversation, message)
    finally:
        loop.shutdown()


def structured_spec(schema: SchemaFile | None, json_object: bool) -> "GrammarSpec | None":
    """What --json-schema / --json constrain replies to (None: free text)."""
    if schema is not None and json_object:
        raise UsageError("--json and --json-schema cannot be used together",
                         "--json-schema already makes every reply JSON")
    if json_object:
        from ruvllm_cli.engine.grammar import GrammarSpec

        return GrammarSpec.json_object()
    return schema.spec if schema is not None else None


def starting_adapter(specs: Sequence[str], adapter: str | None) -> str | None:
    """The adapter --adapter names (None: the base model), checked against the --lora
    names before anything is fetched or loaded."""
    from ruvllm_cli.chat.conversation import BASE_MODEL_WORDS, adapter_choice, check_adapter
    from ruvllm_cli.registry.adapters import parse_lora_specs

    names = [name for name, _ in parse_lora_specs(specs)]
    for name in names:
        if name.lower() in BASE_MODEL_WORDS:
            raise UsageError(f"--lora: in chat the name {name} stands for the base model (/adapter {name}); "
                             "give the adapter another name")
    chosen = adapter_choice(adapter) if adapter is not None else None
    if chosen is not None:
        try:
            check_adapter(chosen, names)
        except UsageError as error:
            raise UsageError(f"--adapter: {error.message}") from None
    return chosen


def check_max_tokens_before_load(located: "LocatedModel", max_tokens: int) -> None:
    """--max-tokens past the context chat runs with, said before the load rather than
    after it (a minute for a 7B model): the default context, or the model's
    max_position_embeddings where config.json gives a shorter one. What this cannot
    read (a GGUF file, a config.json the load will refuse) is checked after the load."""
    from ruvllm_cli.chat.commands import check_fits_context
    from ruvllm_cli.engine.config import DEFAULT_CONTEXT
    from ruvllm_cli.registry.model_config import read_model_dir_config

    limit = DEFAULT_CONTEXT
    if located.path.is_dir():
        try:
            context = read_model_dir_config(located.path).get("max_position_embeddings")
        except RuvllmError:
            context = None
        if isinstance(context, int) and not isinstance(context, bool) and context > 0:
            limit = min(limit, context)
    check_fits_context(limit, max_tokens, "--max-tokens")


def read_stdin_message() -> str:
    hint = "convert it first, e.g. iconv -f latin1 -t utf-8"
    try:
        text = sys.stdin.read().strip()
    except UnicodeDecodeError as error:   # stdin decoded strictly (PYTHONIOENCODING=utf-8)
        raise UsageError(f"stdin is not UTF-8 text: byte 0x{error.object[error.start]:02x}", hint) from None
    # Else undecodable bytes arrive as lone surrogates (surrogateescape), which the
    # tokenizer would refuse with a message about its own input types.
    bad = next((c for c in text if "\udc80" <= c <= "\udcff"), None)
    if bad is not None:
        raise UsageError(f"stdin is not UTF-8 text: byte 0x{ord(bad) - 0xDC00:02x}", hint)
    if not text:
        raise UsageError("no message on stdin", 'pipe one in: echo "hello" | ruvllm chat MODEL')
    return text


def resolve_settings(options: dict[str, Any], recommended: dict[str, Any] | None) -> "ChatSettings":
    """CLI options given on the command line, else the model's recommended sampling
    (`recommended`: its registry entry's or generation_config.json's), else the
    defaults. `options["temperature"]` is None when the option was not given."""
    from ruvllm_cli.chat.session import ChatSettings

    settings = ChatSettings().replace(**(recommended or {}))
    changes = {"max_tokens": options["max_tokens"]}
    for name in ("temperature", "top_p", "seed"):
        if options[name] is not None:
            changes[name] = options[name]
    return settings.replace(**changes)


def recommended_sampling(opened: "OpenedEngine") -> dict[str, Any] | None:
    """A registry alias's sampling (models.toml, read off the model's card), else what
    the model's generation_config.json recommends (None: neither sets any)."""
    ref = opened.located.ref
    if ref.kind == "registry" and ref.entry is not None and ref.entry.sampling_given:
        return ref.entry.sampling.to_dict()
    return opened.engine.sampling_defaults or None


def build_conversation(app: AppContext, opened: "OpenedEngine", loop: Any, options: dict[str, Any],
                       interactive: bool) -> "Conversation":
    from ruvllm_cli.chat.commands import check_fits_context
    from ruvllm_cli.chat.conversation import Conversation
    from ruvllm_cli.chat.render import PipeRenderer, TerminalRenderer
    from ruvllm_cli.chat.session import ChatSession, ChatTemplate
    from ruvllm_cli.engine.reasoning import model_reasoning
    from ruvllm_cli.paths import chats_dir

    engine = opened.engine
    think = options.get("think")
    if think is not None and "enable_thinking" not in (getattr(engine.tokenizer, "chat_template", None) or ""):
        app.output().warn(f"--{'' if think else 'no-'}think changes nothing: this model's chat template has no "
                          "enable_thinking switch")
    check_fits_context(engine.max_model_len, options["max_tokens"], "--max-tokens")   # as /max refuses it
    template = ChatTemplate(engine.tokenizer, None if think is None else {"enable_thinking": think})
    session = ChatSession(template, engine.max_model_len,
                          model=opened.located.served_name, system_prompt=options["system"] or None,
                          settings=resolve_settings(options, recommended_sampling(opened)),
                          structured=options["structured"], adapter=options["adapter"])
    out = app.output()
    if (warning := session.system_prompt_warning()) is not None:
        out.warn(warning)
    show = not options.get("hide_thinking", False)
    renderer = (TerminalRenderer(out.out, show_reasoning=show) if interactive
                else PipeRenderer(out.err, whole=options["structured"] is not None, show_reasoning=show))
    return Conversation(session, loop, renderer, chats_dir=chats_dir(), adapters=tuple(engine.lora.names()),
                        reasoning=model_reasoning(engine.tokenizer), more_turns=interactive)


def run_interactive(app: AppContext, opened: "OpenedEngine", conversation: "Conversation") -> None:
    from ruvllm_cli.chat.render import TerminalRenderer
    from ruvllm_cli.chat.repl import ChatRepl

    assert isinstance(conversation.renderer, TerminalRenderer)
    conversation.renderer.banner(opened.describe(), conversation.session, conversation.adapters)
    ChatRepl(conversation, app.cache_dir / "chat_history").run()


def answer_once(conversation: "Conversation", message: str) -> None:
    """The scripted mode: one message in, the reply alone on stdout."""
    reply = conversation.send(message)
    if reply.finish_reason is FinishReason.ERROR:
        raise click.exceptions.Exit(1)  # the renderer has printed the error
    if reply.interrupted:
        raise click.exceptions.Exit(130)
    if reply.thinking_only:
        raise click.exceptions.Exit(1)   # the renderer has said why there is no answer
    session = conversation.session
    if session.structured is not None and reply.finish_reason is FinishReason.LENGTH:
        raise RuvllmError(f"the reply reached the {session.settings.max_tokens}-token limit before its JSON "
                          "was complete", "raise --max-tokens")
