"""Write man/ruvllm.1 (roff) by walking the `ruvllm` Click command tree.

Every command in ruvllm_cli.cli.main.COMMANDS is imported and described from its own
Click definition (arguments, options, defaults, help, docstring examples), so the page
follows the code. A command whose module does not exist yet is left out with a warning.
The output is deterministic: no date, the version from ruvllm_cli.__version__.

Run from the repo root: `.venv/bin/python scripts/gen_man.py` (or `--check` to exit 1,
writing nothing, when man/ruvllm.1 differs from a fresh rendering).
"""

from __future__ import annotations

import enum
import inspect
import re
import sys

import click

import _generated

sys.path.insert(0, str(_generated.REPO_ROOT))

from ruvllm_cli import __version__  # noqa: E402
from ruvllm_cli.cli.main import COMMANDS, cli  # noqa: E402
from ruvllm_cli.registry.registry import ALIASES_FILE  # noqa: E402

COMMAND = ".venv/bin/python scripts/gen_man.py"
MAN_PATH = "man/ruvllm.1"

# Arguments carry no help text in Click; these describe the ones our commands use.
ARGUMENT_HELP = {
    "MODEL": "A registry alias (see ruvllm list), a Hugging Face id org/name, optionally "
             "org/name@revision, or, for the commands that load a model, a local model directory "
             "(with config.json) or .gguf file.",
    "SHELL": "bash, zsh or fish.",
}

ENVIRONMENT = [
    ("RUVLLM_CACHE_DIR", "Model cache directory, as --cache-dir (which takes precedence)."),
    ("RUVLLM_CONFIG_DIR", "Configuration directory, where your own model aliases are kept."),
    ("RUVLLM_DATA_DIR", "Data directory, where chat's /save keeps chats."),
    ("RUVLLM_API_KEY", "API key that serve requires (Authorization: Bearer KEY or x-api-key: KEY), as --api-key."),
    ("HF_TOKEN", "Hugging Face access token, needed for gated or private repositories."),
    ("HF_ENDPOINT", "Hugging Face hub address (default https://huggingface.co), for a mirror."),
    ("NO_COLOR", "When set to a non-empty value, turns all colour off, as --no-color."),
]

EXIT_STATUS = [
    ("0", "Success."),
    ("1", "Runtime error: one line Error: ... on standard error, often with a hint."),
    ("2", "Usage error: an unknown command, option or value, or a missing argument."),
    ("130", "Interrupted (Ctrl-C)."),
]

FILES = [
    ("$RUVLLM_CACHE_DIR",
     "Downloaded models and the chat history. Default: the platform user cache directory, "
     "~/.cache/ruvllm on Linux, ~/Library/Caches/ruvllm on macOS."),
    ("$RUVLLM_CONFIG_DIR",
     "Configuration. Default: the platform user config directory, "
     "~/.config/ruvllm on Linux, ~/Library/Application Support/ruvllm on macOS."),
    (f"$RUVLLM_CONFIG_DIR/{ALIASES_FILE}", "Your own model aliases (ruvllm alias)."),
    ("$RUVLLM_DATA_DIR/chats", "Chats saved by /save without a file name (and found by /load). Default: in the "
     "platform user data directory, ~/.local/share/ruvllm on Linux, ~/Library/Application Support/ruvllm on "
     "macOS; clearing the cache leaves them alone."),
]


# --- roff primitives -------------------------------------------------------------------------

def escape(text: str) -> str:
    """Text safe for a roff text line: literal backslashes and minus signs (for options)."""
    return text.replace("\\", "\\e").replace("-", "\\-")


def bold(text: str) -> str:
    return f"\\fB{escape(text)}\\fR"


def italic(text: str) -> str:
    return f"\\fI{escape(text)}\\fR"


def text_line(line: str) -> str:
    """A text line that roff cannot mistake for a request."""
    return "\\&" + line if line.startswith((".", "'")) else line


def tagged(tag: str, body: str) -> list[str]:
    """A `.TP` paragraph: `tag` (already roff) with `body` (plain text) indented below it."""
    return [".TP", tag, text_line(escape(body)) if body else "\\&"]


def preformatted(lines: list[str]) -> list[str]:
    return [".RS 4", ".nf", *(text_line(escape(line)) for line in lines), ".fi", ".RE"]


# --- docstrings --------------------------------------------------------------------------------

def split_help(help_text: str | None) -> tuple[list[list[str]], list[list[str]]]:
    """Splits a Click docstring into (description blocks, example blocks).

    A block is a list of lines; a `\\b` (verbatim) block keeps its lines, a normal
    paragraph is one line. Verbatim blocks headed `Example...:` are the examples.
    """
    text = inspect.cleandoc(help_text or "").split("\f")[0]
    description: list[list[str]] = []
    examples: list[list[str]] = []
    for paragraph in re.split(r"\n\s*\n", text):
        lines = paragraph.splitlines()
        if lines and lines[0].strip() == "\b":
            block = [line.rstrip() for line in lines[1:]]
            (examples if block and block[0].startswith("Example") else description).append(block)
        elif paragraph.strip():
            description.append([" ".join(line.strip() for line in lines)])
    return description, examples


def render_blocks(blocks: list[list[str]]) -> list[str]:
    out: list[str] = []
    for block in blocks:
        if len(block) == 1:
            out += [".PP", text_line(escape(block[0]))]
        elif block[0].endswith(":") and not block[0].startswith(" "):
            out += [".PP", text_line(escape(block[0])), *preformatted(_dedent(block[1:]))]
        else:
            out += [".PP", *preformatted(_dedent(block))]
    return out


def _dedent(lines: list[str]) -> list[str]:
    indent = min((len(line) - len(line.lstrip()) for line in lines if line.strip()), default=0)
    return [line[indent:] for line in lines]


# --- parameters --------------------------------------------------------------------------------

def default_text(param: click.Parameter, ctx: click.Context) -> str | None:
    """The default worth showing, or None (flags, no default, computed defaults)."""
    if getattr(param, "is_flag", False) or getattr(param, "count", False):
        return None
    value = param.get_default(ctx, call=False)
    if isinstance(value, enum.Enum):
        value = value.value
    if isinstance(value, (list, tuple)):
        return ", ".join(str(item) for item in value) or None
    if isinstance(value, (str, int, float)) and not isinstance(value, bool) and value != "":
        return str(value)
    return None


def option_body(param: click.Option, ctx: click.Context) -> str:
    # A default that is a rule, not a value, is written into the help as "  [default: ...]".
    text, _, written_default = (param.help or "").partition("  [default: ")
    parts = [text.strip().rstrip(".") + "." if text.strip() else ""]
    default = written_default.rstrip("]") or default_text(param, ctx)
    if default is not None:
        parts.append(f"Default: {default}.")
    if isinstance(param.type, (click.IntRange, click.FloatRange)):
        parts.append(f"Range: {param.type._describe_range()}.")
    if isinstance(param.envvar, str) and param.envvar not in (param.help or ""):
        parts.append(f"Environment: {param.envvar}.")
    return " ".join(part for part in parts if part)


def option_tag(param: click.Option, ctx: click.Context) -> str:
    names = ", ".join(bold(name) for name in param.opts)
    if param.secondary_opts:
        names += " / " + ", ".join(bold(name) for name in param.secondary_opts)
    if param.is_flag or param.count:
        return names
    return f"{names} {italic(param.make_metavar(ctx))}"


def render_options(options: list[click.Option], ctx: click.Context) -> list[str]:
    out: list[str] = []
    for option in options:
        if not option.hidden:
            out += tagged(option_tag(option, ctx), option_body(option, ctx))
    return out


def render_arguments(arguments: list[click.Argument], ctx: click.Context) -> list[str]:
    """Arguments with a description; the others are left to the command's docstring."""
    out: list[str] = []
    for argument in arguments:
        metavar = argument.make_metavar(ctx)
        help_text = getattr(argument, "help", None) or ARGUMENT_HELP.get(metavar.strip("[]."), "")
        if help_text:
            out += tagged(italic(metavar), help_text)
    return [".PP", "Arguments:", *out] if out else []


# --- commands ----------------------------------------------------------------------------------

def root_context() -> click.Context:
    return click.Context(cli, info_name="ruvllm", **cli.context_settings)


def global_option_names() -> set[str]:
    return {param.name for param in cli.params if isinstance(param, click.Option) and param.name}


def subcommands(group: click.Group, ctx: click.Context) -> list[tuple[str, click.Command]]:
    """The group's commands in listing order, importing each lazy one; missing modules skipped."""
    found = []
    for name in group.list_commands(ctx):
        try:
            command = group.get_command(ctx, name)
        except ModuleNotFoundError as error:
            if group is not cli or error.name != COMMANDS[name][0]:
                raise
            print(f"warning: {error.name} does not exist yet; `{name}` left out", file=sys.stderr)
            continue
        if command is not None and not command.hidden:
            found.append((name, command))
    return found


def render_command(path: list[str], command: click.Command, parent: click.Context) -> list[str]:
    ctx = click.Context(command, info_name=path[-1], parent=parent)
    aliases = COMMANDS.get(path[0], ("", ()))[1] if len(path) == 1 else ()
    title = " ".join(path) + (f" (alias: {', '.join(aliases)})" if aliases else "")
    usage = " ".join(command.collect_usage_pieces(ctx))
    out = [f'.SS "{title}"', ".PP", f"{bold(' '.join(['ruvllm', *path]))} {escape(usage)}"]
    description, examples = split_help(command.help)
    out += render_blocks(description)
    out += render_arguments([p for p in command.params if isinstance(p, click.Argument)], ctx)
    options = [p for p in command.params
               if isinstance(p, click.Option) and p.name not in global_option_names()]
    out += [".PP", "Options (besides the global options):" if options else
            "Options: only the global options."]
    out += render_options(options, ctx)
    out += render_blocks(examples)
    if isinstance(command, click.Group):
        for name, sub in subcommands(command, ctx):
            out += render_command([*path, name], sub, ctx)
    return out


def render_header(ctx: click.Context) -> list[str]:
    description, examples = split_help(cli.help)
    summary = description[0][0].rstrip(".") if description else "local LLMs"
    return [
        f'.TH RUVLLM 1 "" "ruvllm {__version__}" "User Commands"',
        ".SH NAME",
        f"ruvllm \\- {escape(summary[0].lower() + summary[1:])}",
        ".SH SYNOPSIS",
        f"{bold('ruvllm')} [{italic('GLOBAL OPTIONS')}] {italic('COMMAND')} [{italic('ARGS')}]...",
        ".br",
        f"{bold('ruvllm')} {italic('COMMAND')} {bold('--help')}",
        ".SH DESCRIPTION",
        *render_blocks(description),
        ".PP",
        text_line(escape("Each command is described under COMMANDS; "
                         "ruvllm COMMAND --help prints the same from the installed version.")),
        *render_blocks(examples),
    ]


def render_global_options(ctx: click.Context) -> list[str]:
    options = [p for p in cli.get_params(ctx) if isinstance(p, click.Option)]
    note = ("-v/--verbose, --no-color and --cache-dir are accepted before or after the command "
            "name; a value given after it wins.")
    return [".SH GLOBAL OPTIONS", *render_options(options, ctx), ".PP", text_line(escape(note))]


def render_table(title: str, rows: list[tuple[str, str]]) -> list[str]:
    out = [f".SH {title}"]
    for tag, body in rows:
        out += tagged(bold(tag), body)
    return out


def render_man() -> str:
    """The whole man page, deterministic for a given tree of commands."""
    ctx = root_context()
    lines = [*render_header(ctx), *render_global_options(ctx), ".SH COMMANDS"]
    for name, command in subcommands(cli, ctx):
        lines += render_command([name], command, ctx)
    lines += render_table("ENVIRONMENT", ENVIRONMENT)
    lines += render_table("EXIT STATUS", EXIT_STATUS)
    lines += render_table("FILES", FILES)
    return "\n".join(lines) + "\n"


# --- entry point -------------------------------------------------------------------------------

def main(argv: list[str] | None = None) -> int:
    return _generated.main(__doc__, lambda: {MAN_PATH: render_man()}, COMMAND, argv)


if __name__ == "__main__":
    sys.exit(main())
