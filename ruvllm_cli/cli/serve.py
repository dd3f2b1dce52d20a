"""`ruvllm serve`: an OpenAI-compatible HTTP server on the shared engine."""

from __future__ import annotations

import asyncio
import errno
import logging
import os
import re
import signal
import socket
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Sequence, TypeVar

import click
from click.core import ParameterSource

from ruvllm_cli.cli.completion import complete_model
from ruvllm_cli.cli.context import AppContext, app_context, global_options
from ruvllm_cli.cli.engine_setup import locate_adapters
from ruvllm_cli.cli.serve_models import check_models, pool_options, pooled
from ruvllm_cli.cli.options import (FiniteFloatRange, device_option, load_quantization_option, lora_options,
                                    prefix_cache_option, weight_cache_option, compile_option,
                                    threads_option)
from ruvllm_cli.cli.serve_backend import Pending, load_cluster, load_local
from ruvllm_cli.engine.reasoning import PARSER_NAMES as REASONING_PARSERS
from ruvllm_cli.errors import ModelLoadError, RuvllmError, UsageError
from ruvllm_cli.registry.locate import check_readable, locate_model

# Where an option's value comes from when the user did not set it.
DEFAULT_SOURCES = (ParameterSource.DEFAULT, ParameterSource.DEFAULT_MAP)

if TYPE_CHECKING:
    from ruvllm_cli.server.state import ServerConfig

T = TypeVar("T")
LOOPBACK = {"127.0.0.1", "localhost", "::1"}
WILDCARD = {"0.0.0.0", "::", ""}


class ByteSize(click.ParamType):
    """Sizes like 512MiB, 2GiB, 1.5G (binary), 500MB (decimal) or plain bytes."""

    name = "SIZE"
    UNITS = {"": 1, "b": 1, "k": 1024, "m": 1024**2, "g": 1024**3, "t": 1024**4,
             "kib": 1024, "mib": 1024**2, "gib": 1024**3, "tib": 1024**4,
             "kb": 1000, "mb": 1000**2, "gb": 1000**3, "tb": 1000**4}

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> int:
        if isinstance(value, int):
            return value
        match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*", str(value))
        unit = match.group(2).lower() if match else ""
        if not match or unit not in self.UNITS:
            self.fail(f"{value!r} is not a size (examples: 512MiB, 2GiB, 1048576)", param, ctx)
        size = int(float(match.group(1)) * self.UNITS[unit])
        if size < 1:
            self.fail(f"{value!r} must be at least one byte", param, ctx)
        return size


BYTE_SIZE = ByteSize()


@click.command("serve")
@click.argument("model", nargs=-1, required=True, shell_complete=complete_model)
@click.option("--host", default="127.0.0.1", show_default=True, help="Address to bind.")
@click.option("-p", "--port", type=click.IntRange(0, 65535), default=8080, show_default=True,
              help="Port to listen on (0: any free port).")
@click.option("--max-concurrent", type=click.IntRange(min=1), default=16, show_default=True,
              help="Sequences decoded together.")
@click.option("--max-queue", type=click.IntRange(min=0), default=64, show_default=True,
              help="Sequences allowed to wait beyond --max-concurrent; more get 429 at once.")
@click.option("--max-sequences-per-request", type=click.IntRange(min=1), default=16, show_default=True,
              help="Sequences one request may ask for (prompts x n); more get 400.")
@click.option("--max-prompts-per-request", type=click.IntRange(min=1), default=16, show_default=True,
              help="Prompts one /v1/completions request may list; more get 400.")
@click.option("--max-context", type=click.IntRange(min=16), default=4096, show_default=True,
              help="Longest prompt plus reply, in tokens.")
@click.option("--max-tokens-default", type=click.IntRange(min=1), default=1024, show_default=True,
              help="Longest chat reply when a request sets no max_tokens (completions keep OpenAI's 16).")
@click.option("--max-num-batched-tokens", type=click.IntRange(min=1), default=None,
              help="Token budget of one engine step (default: 1024 on CPU, 8192 on GPU).")
@click.option("--kv-cache-memory", type=BYTE_SIZE, default=None,
              help="Memory for the KV cache, e.g. 2GiB or 512MiB (default: a share of free memory). A pool "
                   "smaller than the context caps it; one under 256 tokens (or --max-context) is refused.")
@prefix_cache_option()
@weight_cache_option()
@compile_option()
@threads_option()
@load_quantization_option()
@click.option("--tool-call-parser", type=click.Choice(["auto", "hermes", "llama3_json", "mistral"]),
              default="auto", show_default=True,
              help="How the model writes tool calls; auto reads it from the chat template or architecture.")
@click.option("--reasoning-parser", type=click.Choice(REASONING_PARSERS), default="auto", show_default=True,
              help="How the model marks its reasoning (think: <think>...</think>, as DeepSeek-R1, QwQ and Qwen3 "
                   "write it; mistral: [THINK]...[/THINK]); auto reads it from the chat template; none leaves "
                   "reasoning in the content. Reasoning is returned as `reasoning` / `reasoning_content`.")
@click.option("--generation-config", type=click.Choice(["auto", "ignore"]), default="auto", show_default=True,
              help="auto: a request that leaves temperature, top_p, top_k, min_p or repetition_penalty out gets "
                   "the model's recommendation from its generation_config.json (as vLLM's), else the API's "
                   "default; ignore: always the API's default.")
@click.option("--served-model-name", multiple=True,
              help="Extra name clients may use as `model` (repeatable; the first one is reported).")
@click.option("--api-key", envvar="RUVLLM_API_KEY", default=None,
              help="Require the key as `Authorization: Bearer KEY` or `x-api-key: KEY` (env RUVLLM_API_KEY).")
@click.option("--cors-origins", default=None, help="Comma-separated origins allowed by CORS (off by default).")
@click.option("--no-web-ui", is_flag=True,
              help="Do not serve the chat page at / (a static page that uses this API; with --api-key it "
                   "asks for the key).")
@click.option("--max-body-size", type=BYTE_SIZE, default="4MiB", show_default=True,
              help="Largest request body; bigger ones get 413.")
@click.option("--shutdown-timeout", type=FiniteFloatRange(min=0), default=10.0, show_default=True,
              help="Seconds in-flight requests may finish after SIGINT/SIGTERM; what is left then gets a "
                   "503 (a stream: an error event and [DONE]) and the server exits.")
@click.option("--scheduling-policy", type=click.Choice(["fcfs", "priority"]), default="fcfs", show_default=True,
              help="fcfs: first come, first served. priority: requests' `priority` field orders admission and "
                   "preemption (lower first; waiting improves it by 0.1 per second, so none starves).")
@click.option("--preemption-mode", type=click.Choice(["recompute", "swap"]), default="recompute", show_default=True,
              help="When the KV cache is full: free a request's blocks and recompute them later, or copy them to "
                   "a swap pool in host memory and back (recompute when the pool is full).")
@click.option("--swap-space", type=BYTE_SIZE, default="1GiB", show_default=True,
              help="Size of the swap pool for --preemption-mode swap.")
@lora_options("Requests name it as their model (docs/design.md, section 11).")
@click.option("--allow-runtime-lora", is_flag=True,
              help="Accept POST /v1/load_lora_adapter and /v1/unload_lora_adapter (off: they load files a "
                   "request names; behind --api-key when one is set).")
@device_option()
@pool_options()
@click.option("--replicas", type=click.IntRange(min=1), default=None,
              help="Run N engines as Ray Serve replicas behind this server, with prefix-aware routing "
                   "(needs: pip install \"ruvllm-cli[cluster]\"; docs/scale-out.md).")
@click.option("--min-replicas", type=click.IntRange(min=1), default=None,
              help="With --max-replicas: autoscale between them on queue length (Ray Serve's autoscaler).")
@click.option("--max-replicas", type=click.IntRange(min=1), default=None, help="See --min-replicas.")
@click.option("--ray-address", default=None,
              help="Join this Ray cluster (e.g. auto, or HOST:6379) instead of starting a local one.")
@click.option("--threads-per-replica", type=click.IntRange(min=1), default=None,
              help="CPU threads (and Ray CPUs) per replica (default: this machine's cores / replicas).")
@click.option("--gpus-per-replica", type=FiniteFloatRange(min=0), default=0.0, show_default=True,
              help="GPUs per replica on a CUDA cluster (fractions share a GPU).")
@global_options
def command(**options: Any) -> None:
    """Serve MODELs over an OpenAI-compatible API (/v1/chat/completions, /v1/completions, ...).

    Binds 127.0.0.1 unless --host says otherwise. / is a chat page in the browser
    (--no-web-ui: none). /health answers 503 while the model loads, then 200;
    /metrics is in Prometheus format; /openapi.json describes the API.
    Ctrl+C or SIGTERM stops accepting, lets running requests finish (--shutdown-timeout),
    then exits; a second Ctrl+C ends them at once.

    With several MODELs (or --models-max or --keep-alive) a request's `model` picks
    one, loaded on its first request (which waits for it); at most --models-max stay
    loaded, and one idle for --keep-alive is unloaded. /health answers 200 at once,
    and /v1/models gives each model's status. -q and the engine options apply to every
    model, --lora to the first.

    \b
    Examples:
      ruvllm serve qwen
      ruvllm serve qwen --port 8080 --api-key secret
      ruvllm serve ./my-model --max-concurrent 32 --kv-cache-memory 2GiB
      ruvllm serve qwen --lora sql=./sql-lora --lora chat=user/chat-lora
      ruvllm serve qwen llama --models-max 1 --keep-alive 10m
      ruvllm serve qwen --replicas 4 --threads-per-replica 2
    """
    app = app_context()
    configure_logging(app.verbose)
    options["models"], options["model"] = options["model"], options["model"][0]
    check_models(options)
    ctx = click.get_current_context()
    if options["preemption_mode"] != "swap" and ctx.get_parameter_source("swap_space") not in DEFAULT_SOURCES:
        raise UsageError("--swap-space sizes the pool of --preemption-mode swap",   # it had been ignored
                         "add --preemption-mode swap, or leave --swap-space out")
    # A missing or undownloaded model fails here, before the port is bound or announced.
    located = [locate_model(model, app.cache_dir, options["quantization"]) for model in options["models"]]
    for model in located:
        try:
            check_readable(model)   # a broken config.json or GGUF header too
        except ModelLoadError as error:
            if not pooled(options):
                raise
            # One of several, each loaded on first use: the others serve, its requests get
            # the error as a 503 (and a look at it now says so here).
            app.output().warn(f"{model.served_name} will not load: {error.message}")
    names = {name for model, where in zip(options["models"], located)
             for name in served_names(where, model, options["served_model_name"])}
    check_adapter_names(options["lora"], names)
    options["adapters"] = locate_adapters(app, options["lora"])
    options["cluster"] = cluster_options(options)
    options["api_key_from_flag"] = ctx.get_parameter_source("api_key") is ParameterSource.COMMANDLINE
    options["max_context_from_flag"] = ctx.get_parameter_source("max_context") is ParameterSource.COMMANDLINE
    options["located"] = located
    asyncio.run(serve(app, options))
    exit_now()


def check_adapter_names(specs: Sequence[str], model_names: set[str]) -> None:
    """A --lora adapter named as a model would be unreachable (the model takes the name)."""
    from ruvllm_cli.registry.adapters import parse_lora_specs

    for name, _ in parse_lora_specs(specs):
        if name in model_names:
            raise UsageError(f"--lora {name}: {name} is also a name of a MODEL (its alias, hub id or the name "
                             "as typed), which requests naming it would reach",
                             f"give the adapter another name: --lora OTHER={name}'s path")


def exit_now() -> None:
    """Exit at once, skipping the interpreter's teardown: with torch and transformers
    loaded it takes about a second, and --shutdown-timeout promises the timeout plus
    at most one. Nothing is left to clean up: the server and the engine have stopped."""
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def configure_logging(verbose: bool) -> None:
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("%(message)s"))
    for name in ("ruvllm.server", "aiohttp.access"):
        logger = logging.getLogger(name)
        logger.addHandler(handler)
        logger.setLevel(logging.INFO if verbose else logging.WARNING)
        logger.propagate = False


async def serve(app: AppContext, options: dict[str, Any]) -> None:
    """Listen first (health 503), load, fill the engine slot, serve until a signal."""
    from ruvllm_cli.server import create_app, start_server

    web_app = create_app(None, server_config(options, app.verbose, app.cache_dir))
    try:
        server = await start_server(web_app, options["host"], options["port"],
                                    shutdown_timeout=options["shutdown_timeout"], access_log=app.verbose)
    except socket.gaierror as error:   # its errno is getaddrinfo's, which os.strerror does not know
        raise RuvllmError(f"cannot listen on {options['host']}:{options['port']}: the host does not resolve "
                          f"to an address of this machine ({error.strerror})",
                          "give --host an address or name of this machine (127.0.0.1, 0.0.0.0, ::1)") from error
    except OSError as error:
        reason = os.strerror(error.errno).lower() if error.errno else str(error)
        hint = ("pick another --port, or stop whatever uses it" if error.errno == errno.EADDRINUSE
                else "give --host an address of this machine, or pick another --port")
        raise RuvllmError(f"cannot listen on {options['host']}:{options['port']}: {reason}", hint) from error
    stop = asyncio.Event()
    install_signal_handlers(stop.set)
    if pooled(options):
        from ruvllm_cli.cli.serve_models import serve_models

        return await serve_models(app, options, web_app, server, stop)
    from ruvllm_cli.registry.in_use import register

    # Before the load, which reads the files (a minute at 7B): `ruvllm rm` had removed them meanwhile.
    unregister = register([options["located"][0].path], server.url, app.cache_dir)
    try:
        await serve_one(app, options, web_app, server, stop)
    finally:
        unregister()


async def serve_one(app: AppContext, options: dict[str, Any], web_app: Any, server: Any,
                    stop: asyncio.Event) -> None:
    """Load the one model (or its replicas) while listening, then serve until a signal."""
    from ruvllm_cli.server import attach_engine
    from ruvllm_cli.server.models import in_daemon_thread

    from rich.markup import escape

    out = app.output()
    waiting_for = "the replicas" if options["cluster"] else "the model"
    out.info(f"[dim]Listening on {escape(server.url)}; loading {waiting_for} (/health answers 503 until it is "
             "ready)[/dim]")
    pending = Pending(on_connected=take_back_signals(stop.set))
    try:
        backend = await until_stopped(in_daemon_thread(lambda: load(app, options, pending)), stop)
    except BaseException:
        await server.stop()
        pending.stop()
        raise
    if backend is None:
        await server.stop()
        pending.stop()
        out.info("Stopped before the model finished loading.")
        return
    failures: list[BaseException] = []
    try:
        names = served_names(backend.located, options["model"], options["served_model_name"])
        attach_engine(web_app, backend.start(stop_on_failure(stop, failures)), names, backend.located.path)
        print_banner(app, server.url, backend.describe(), names, options, backend.kv_summary(),
                     backend.replicas_line(), formats=formats_line(web_app),
                     sampling=sampling_line(web_app))
        note = backend.context_note(options["max_context"])
        if note and options.get("max_context_from_flag"):
            out.warn(note)
        await stop.wait()
        out.info(f"Shutting down: in-flight requests may finish for up to {options['shutdown_timeout']:g} s "
                 "(Ctrl+C again: end them now) ...")
        install_signal_handlers(lambda: end_now(server, out))
        await server.stop()
    finally:
        backend.stop()
    if failures:
        # Exit non-zero, so a supervisor (systemd, Kubernetes) restarts the server.
        raise RuvllmError(f"the engine failed: {type(failures[0]).__name__}: {failures[0]}",
                          "restart the server; --verbose shows the traceback") from failures[0]
    out.info("Stopped.")


def stop_on_failure(stop: asyncio.Event, failures: list[BaseException]) -> Callable[[BaseException], None]:
    """EngineLoop's on_failure: remember the error and stop the server (engine thread)."""
    loop = asyncio.get_running_loop()

    def fail(error: BaseException) -> None:
        failures.append(error)
        loop.call_soon_threadsafe(stop.set)

    return fail


def server_config(options: dict[str, Any], verbose: bool, cache_dir: Path | None = None) -> "ServerConfig":
    """The app's ServerConfig from the command's options."""
    from ruvllm_cli.server import ServerConfig
    from ruvllm_cli.server.protocol import RequestLimits

    origins = tuple(o.strip() for o in (options["cors_origins"] or "").split(",") if o.strip())
    limits = RequestLimits(max_prompts=options["max_prompts_per_request"],
                           max_sequences=options["max_sequences_per_request"])
    return ServerConfig(api_key=(options["api_key"] or "").strip() or None, cors_origins=origins, max_queue=options["max_queue"],
                        max_body_size=options["max_body_size"], limits=limits,
                        chat_max_tokens=options["max_tokens_default"], verbose=verbose,
                        tool_call_parser=None if options["tool_call_parser"] == "auto" else options["tool_call_parser"],
                        reasoning_parser=options["reasoning_parser"],
                        model_sampling=options["generation_config"] == "auto",
                        allow_runtime_lora=options["allow_runtime_lora"], cache_dir=cache_dir,
                        web_ui=not options["no_web_ui"])


def load(app: AppContext, options: dict[str, Any], pending: Pending) -> Any:
    """The backend: the model loaded here, or replicas on Ray with --replicas."""
    if options["cluster"] is None:
        return load_local(app, options)
    return load_cluster(app, options, options["cluster"], pending)


def cluster_options(options: dict[str, Any]) -> Any:
    """--replicas and friends as ClusterOptions (None without them); a missing Ray is an error here."""
    from ruvllm_cli.cluster.spec import cluster_options as parse

    parsed = parse(options)
    if parsed is not None:
        from ruvllm_cli.cluster.deploy import import_ray

        import_ray(parsed)
    return parsed


def served_names(located: Any, model_arg: str, extra: tuple[str, ...]) -> list[str]:
    """Names clients may send as `model`: --served-model-name first, then the alias or
    directory name, the repo id, and the MODEL argument exactly as typed (a path too:
    clients copy it from the command line, and vLLM serves it under that name)."""
    names = [*extra, located.served_name]
    if located.ref.repo_id:
        names.append(located.ref.repo_id)
    names.append(model_arg)
    return list(dict.fromkeys(names))


def install_signal_handlers(handler: Callable[[], None]) -> None:
    """Call `handler` on the event loop at SIGINT or SIGTERM (replacing any earlier one)."""
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        try:
            loop.add_signal_handler(sig, handler)
        except (NotImplementedError, RuntimeError):  # pragma: no cover - Windows
            signal.signal(sig, lambda *_: loop.call_soon_threadsafe(handler))


def take_back_signals(handler: Callable[[], None]) -> Callable[[], None]:
    """A callable for another thread that installs `handler` again on this event loop.
    Ray's driver, as it connects, puts abseil's failure handler on SIGTERM: it prints a
    stack dump, then arms a 3-second alarm that aborts the process (SIGABRT), cutting
    a graceful stop short. Called once Ray is up, it gives SIGTERM back to the server."""
    loop = asyncio.get_running_loop()
    return lambda: loop.call_soon_threadsafe(install_signal_handlers, handler)


def end_now(server: Any, out: Any) -> None:
    """A second signal while draining: end what is still in flight (each gets a clean
    503 or error event) and exit, without waiting out the shutdown timeout."""
    if not server.ending:
        out.info("Stopping now: requests still in flight get a 503.")
        server.end_now()


async def until_stopped(work: "asyncio.Future[T]", stop: asyncio.Event) -> T | None:
    """The result of `work`, or None if `stop` is set first."""
    stopper = asyncio.ensure_future(stop.wait())
    done, _ = await asyncio.wait({work, stopper}, return_when=asyncio.FIRST_COMPLETED)
    stopper.cancel()
    if work in done:
        return work.result()
    return None


def formats_line(web_app: Any) -> str | None:
    """What the one served model's replies are parsed for: its tool calls' format and its
    reasoning markers (--tool-call-parser, --reasoning-parser, else its chat template)."""
    from ruvllm_cli.server.state import get_state

    served = get_state(web_app).models.entries[0].served
    if served is None:
        return None
    parts = [f"tool calls {served.tool_parser.name}" if served.tool_parser else "tool calls: format not known",
             f"reasoning {served.reasoning.format.start}...{served.reasoning.format.end}"
             if served.reasoning else "no reasoning markers"]
    return ", ".join(parts)


def sampling_line(web_app: Any) -> str | None:
    """The one served model's sampling defaults, where its generation_config.json sets
    some and --generation-config takes them."""
    from ruvllm_cli.engine.sampling import describe_defaults
    from ruvllm_cli.server.state import get_state

    served = get_state(web_app).models.entries[0].served
    if served is None or not served.sampling_defaults:
        return None
    return f"{describe_defaults(served.sampling_defaults)} where a request sets none (generation_config.json)"


def print_banner(app: AppContext, url: str, described: str, names: list[str], options: dict[str, Any],
                 kv_cache: str | None = None, replicas: str | None = None, models: Sequence[str] = (),
                 formats: str | None = None, sampling: str | None = None) -> None:
    from rich.markup import escape

    out = app.output()
    host = options["host"]
    curl_url = url.replace(f"//{host}:", "//127.0.0.1:") if host in WILDCARD else url
    # The key itself never goes to the log: the example reads it from the environment.
    auth = ' -H "Authorization: Bearer $RUVLLM_API_KEY"' if options["api_key"] else ""
    body = '{"model": "%s", "messages": [{"role": "user", "content": "Hello!"}]}' % names[0]
    out.info(f"[bold]ruvllm serve[/bold] · {escape(described)}")
    out.info(escape(f"  OpenAI API  {url}/v1   (model: {', '.join(names)})"))
    for position, line in enumerate(models):   # several models: each one's state
        out.info(escape(f"  {'Models' if position == 0 else '':<10}  {line}"))
    if not options.get("no_web_ui"):
        out.info(escape(f"  Web chat    {curl_url}/"))
    out.info(escape(f"  Ollama API  {url}   (/api/chat, /api/generate, /api/tags: Ollama's clients as they are)"))
    out.info(escape(f"  Health      {url}/health"))
    out.info(escape(f"  Metrics     {url}/metrics"))
    if kv_cache:
        out.info(escape(f"  KV cache    {kv_cache}"))
    if formats:
        out.info(escape(f"  Parsing     {formats}"))
    if sampling:
        out.info(escape(f"  Sampling    {sampling}"))
    if replicas:
        out.info(escape(f"  Replicas    {replicas}"))
    if options.get("scheduling_policy", "fcfs") != "fcfs" or options.get("preemption_mode", "recompute") != "recompute":
        swap = (f" ({options['swap_space'] / 2**30:.2f} GiB pool)" if options["preemption_mode"] == "swap" else "")
        out.info(escape(f"  Scheduling  {options['scheduling_policy']}, preemption by {options['preemption_mode']}{swap}"))
    adapters = [name for name, _ in options.get("adapters") or ()]
    if adapters or options.get("allow_runtime_lora"):
        runtime = "; loaded at run time via /v1/load_lora_adapter" if options.get("allow_runtime_lora") else ""
        out.info(escape(f"  LoRA        {', '.join(adapters) or 'none yet'} (as model names){runtime}"))
    curl = f"curl {curl_url}/v1/chat/completions -H \"Content-Type: application/json\"{auth} -d '{body}'"
    if options["api_key"] and options.get("api_key_from_flag"):
        # $RUVLLM_API_KEY is unset in the user's shell when the key came as a flag.
        out.info(escape("  Try:        export RUVLLM_API_KEY=<your --api-key>"))
        out.info(escape(f"              {curl}"))
    else:
        out.info(escape(f"  Try:        {curl}"))
    if host not in LOOPBACK and not options["api_key"]:
        out.warn(f"listening on {host} without an API key: anyone who can reach this port can use the model "
                 "(set --api-key or RUVLLM_API_KEY)")
    out.info("[dim]Press Ctrl+C to stop.[/dim]")
