"""`ruvllm serve MODEL [MODEL ...]`: several models in one server, each loaded on the
first request that names it, at most --models-max at once (the least recently used
idle one makes room), idle ones unloaded after --keep-alive (docs/design.md, section 17).

One MODEL without --models-max or --keep-alive is served as before (cli/serve.py):
loaded at start, never unloaded."""

from __future__ import annotations

import asyncio
import re
import threading
from collections import Counter
from typing import TYPE_CHECKING, Any, Callable, Sequence

import click

from ruvllm_cli.errors import RuvllmError, UsageError

if TYPE_CHECKING:
    from ruvllm_cli.cli.context import AppContext
    from ruvllm_cli.engine.loop import EngineLoop
    from ruvllm_cli.server import ModelSpec, PoolSettings, RunningServer

# Several models without --keep-alive: Ollama's default, so idle models give memory back.
DEFAULT_KEEP_ALIVE_S = 300.0
NEVER = -1.0
# One load at a time: two compete for memory and cores, and the console shows one spinner.
LOAD_LOCK = threading.Lock()


class Duration(click.ParamType):
    """Ollama's keep-alive values: 5m, 30s, 1h30m, 500ms, plain seconds; 0 (at once);
    a negative number (never), returned as NEVER."""

    name = "DURATION"
    UNITS = {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0}
    PART = re.compile(r"(\d+(?:\.\d+)?)(ms|s|m|h)")

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> float:
        if isinstance(value, (int, float)):
            return NEVER if value < 0 else float(value)
        text = str(value).strip().lower()
        seconds = self._seconds(text.removeprefix("-"))
        if seconds is None:
            self.fail(f"{value!r} is not a duration (examples: 5m, 30s, 1h, 0, -1)", param, ctx)
        return NEVER if text.startswith("-") else seconds

    def _seconds(self, text: str) -> float | None:
        if re.fullmatch(r"\d+(?:\.\d+)?", text):
            return float(text)
        if text and re.fullmatch(rf"(?:{self.PART.pattern})+", text):
            return sum(float(number) * self.UNITS[unit] for number, unit in self.PART.findall(text))
        return None


DURATION = Duration()


def pool_options() -> Callable[[Any], Any]:
    """--models-max and --keep-alive."""

    def decorate(command: Any) -> Any:
        command = click.option(
            "--keep-alive", type=DURATION, default=None,
            help="Unload a model idle this long: 5m, 30s, 1h, 0 (after its last request), -1 (never); it loads "
                 "again on the next request naming it.  [default: 5m with several MODELs, -1 with one]")(command)
        return click.option(
            "--models-max", type=click.IntRange(min=1), default=None,
            help="Models loaded at once; loading another first unloads the least recently used idle one.  "
                 "[default: all MODELs]")(command)

    return decorate


def pooled(options: dict[str, Any]) -> bool:
    """Whether the models load on demand (several MODELs, or one with --models-max or --keep-alive)."""
    return len(options["models"]) > 1 or options["models_max"] is not None or options["keep_alive"] is not None


def check_models(options: dict[str, Any]) -> None:
    """Refuse what would be ambiguous with several MODELs, in one line each."""
    models = options["models"]
    twice = [name for name, count in Counter(models).items() if count > 1]
    if twice:
        raise UsageError(f"MODEL {twice[0]} is given twice", "name each model once")
    if len(models) > 1 and options["served_model_name"]:
        raise UsageError("--served-model-name names one model, and several MODELs are given",
                         "with several, each is served as its alias, hub id and the MODEL as typed")
    if pooled(options) and clustered(options):
        # Each replica runs one engine; a pool of models per replica is not built (design section 17).
        raise UsageError("--replicas serves one MODEL, without --models-max or --keep-alive",
                         "serve several models without --replicas, or one model with it")


def clustered(options: dict[str, Any]) -> bool:
    """Whether Ray Serve replicas run the engine (--replicas, --min-replicas or --max-replicas)."""
    return any(options[name] is not None for name in ("replicas", "min_replicas", "max_replicas"))


def pool_settings(options: dict[str, Any]) -> "PoolSettings":
    from ruvllm_cli.server import PoolSettings

    keep_alive = options["keep_alive"]
    if keep_alive is None:
        keep_alive = DEFAULT_KEEP_ALIVE_S if len(options["models"]) > 1 else NEVER
    return PoolSettings(max_loaded=options["models_max"], keep_alive=None if keep_alive < 0 else keep_alive)


def located_models(app: "AppContext", options: dict[str, Any]) -> list[Any]:
    """Each MODEL located (registry.locate: the registry, the cache, a path; no download)."""
    from ruvllm_cli.registry.locate import locate_model

    return [locate_model(model, app.cache_dir, options["quantization"]) for model in options["models"]]


def model_names(app: "AppContext", options: dict[str, Any]) -> list[list[str]]:
    """Each MODEL's names (cli/serve.served_names). A name two models share names
    neither of them; the MODEL as typed always names its own."""
    from ruvllm_cli.cli.serve import served_names

    models = options["models"]
    names = [served_names(located, model, options["served_model_name"])
             for model, located in zip(models, located_models(app, options))]
    shared = Counter(name for own in names for name in own)
    return [[name for name in own if name == model or (shared[name] == 1 and name not in models)]
            for model, own in zip(models, names)]


def model_specs(app: "AppContext", options: dict[str, Any],
                on_failure: Callable[[BaseException], None]) -> list["ModelSpec"]:
    """The pool's models; --lora adapters go with the first."""
    from ruvllm_cli.server import ModelSpec

    located = located_models(app, options)
    return [ModelSpec(tuple(names), loader(app, options, model, on_failure),
                      tuple(options["adapters"]) if position == 0 else (), located[position].path)
            for position, (model, names) in enumerate(zip(options["models"], model_names(app, options)))]


def loader(app: "AppContext", options: dict[str, Any], model: str,
           on_failure: Callable[[BaseException], None]) -> Callable[[Sequence[Any]], "EngineLoop"]:
    """Loads `model` with serve's engine options, serving the adapters the pool gives."""
    from ruvllm_cli.cli.serve_backend import load_local
    from ruvllm_cli.engine.loop import EngineLoop

    def load_model(adapters: Sequence[Any]) -> EngineLoop:
        with LOAD_LOCK:
            # A reload must bring the model back even when an adapter went bad since (its
            # directory removed); the pool then forgets that adapter (ModelPool._load).
            backend = load_local(app, {**options, "model": model, "adapters": list(adapters),
                                       "skip_bad_adapters": True})
        return backend.start(on_failure)

    return load_model


async def serve_models(app: "AppContext", options: dict[str, Any], web_app: Any, server: "RunningServer",
                       stop: asyncio.Event) -> None:
    """Serve until a signal, the models loading as requests name them."""
    from rich.markup import escape

    from ruvllm_cli.cli.serve import end_now, install_signal_handlers, print_banner, stop_on_failure
    from ruvllm_cli.server import attach_models

    out = app.output()
    failures: list[BaseException] = []
    specs = model_specs(app, options, stop_on_failure(stop, failures))
    settings = pool_settings(options)
    pool = attach_models(web_app, specs, settings, options["max_concurrent"])
    from ruvllm_cli.registry.in_use import register

    unregister = register([spec.path for spec in specs if spec.path is not None], server.url, app.cache_dir)
    try:
        pool.report = lambda line: out.info(f"[dim]{escape(line)}[/dim]")
        described = (f"{len(specs)} models, each loaded on first use" if len(specs) > 1
                     else "1 model, loaded on first use")
        print_banner(app, server.url, described, [spec.names[0] for spec in specs], options,
                     models=banner_lines(specs, settings))
        await stop.wait()
        out.info(f"Shutting down: in-flight requests may finish for up to {options['shutdown_timeout']:g} s "
                 "(Ctrl+C again: end them now) ...")
        install_signal_handlers(lambda: end_now(server, out))
        await server.stop()   # its cleanup stops the engines of the models loaded
    finally:
        unregister()
    if failures:
        # Exit non-zero, so a supervisor (systemd, Kubernetes) restarts the server.
        raise RuvllmError(f"the engine failed: {type(failures[0]).__name__}: {failures[0]}",
                          "restart the server; --verbose shows the traceback") from failures[0]
    out.info("Stopped.")


def banner_lines(specs: Sequence["ModelSpec"], settings: "PoolSettings") -> list[str]:
    """One line per model (its state, its other names), then how the pool behaves."""
    from ruvllm_cli.server.models import duration_text

    lines = [f"{spec.names[0]}: unloaded" + (f" (also {', '.join(spec.names[1:])})" if spec.names[1:] else "")
             for spec in specs]
    limit = f"at most {settings.max_loaded} loaded at once" if settings.max_loaded else "no limit on how many"
    if settings.keep_alive is None:
        idle = "idle ones stay loaded"
    else:
        idle = (f"unloaded after {duration_text(settings.keep_alive)} idle" if settings.keep_alive
                else "unloaded when their last request ends")
    return [*lines, f"loaded on first use; {limit}; {idle}"]

