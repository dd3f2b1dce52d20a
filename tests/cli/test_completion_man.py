"""Shell completion (`ruvllm completion`, Click's `_RUVLLM_COMPLETE` protocol) and the man page."""

from __future__ import annotations

import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from ruvllm_cli import __version__
from ruvllm_cli.cli.completion import command as completion_command
from ruvllm_cli.cli.completion import complete_model
from ruvllm_cli.cli.main import COMMANDS

REPO_ROOT = Path(__file__).resolve().parents[2]
SHELLS = ("bash", "zsh", "fish")
GEN_COMPLETIONS = "scripts/gen_completions.py"
GEN_MAN = "scripts/gen_man.py"


@pytest.fixture
def env(cli_env: dict[str, str]) -> dict[str, str]:
    """tests/conftest.py's isolated subprocess env, without the user's colour or completion settings."""
    return {k: v for k, v in cli_env.items() if k != "NO_COLOR" and not k.startswith("_RUVLLM")}


def run(args: list[str], env: dict[str, str], **extra_env: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "ruvllm_cli", *args], cwd=REPO_ROOT,
                          env={**env, **extra_env}, capture_output=True, text=True, timeout=120)


def run_script(script: str, args: list[str], env: dict[str, str]) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, script, *args], cwd=REPO_ROOT, env=env,
                          capture_output=True, text=True, timeout=120)


def missing_commands(*names: str) -> list[str]:
    names = names or tuple(COMMANDS)
    return [name for name in names if importlib.util.find_spec(COMMANDS[name][0]) is None]


def skip_unless_written(*names: str) -> None:
    missing = missing_commands(*names)
    if missing:
        pytest.skip(f"command modules not written yet: {', '.join(missing)}")


# --- generated files are committed and fresh ---------------------------------------------------

@pytest.mark.parametrize("script", [GEN_COMPLETIONS, GEN_MAN])
def test_committed_files_are_fresh(env: dict[str, str], script: str) -> None:
    result = run_script(script, ["--check"], env)
    assert result.returncode == 0, (
        f"generated files are stale: run `.venv/bin/python {script}` and commit the result\n{result.stderr}")


def test_check_names_stale_files_and_writes_nothing(env: dict[str, str], tmp_path: Path) -> None:
    root = tmp_path / "root"
    root.mkdir()
    result = run_script(GEN_COMPLETIONS, ["--check", "--root", str(root)], env)
    assert result.returncode == 1
    assert ("stale: completions/ruvllm.bash, completions/ruvllm.zsh, completions/ruvllm.fish "
            f"(run .venv/bin/python {GEN_COMPLETIONS})") in result.stderr
    result = run_script(GEN_MAN, ["--check", "--root", str(root)], env)
    assert result.returncode == 1
    assert f"stale: man/ruvllm.1 (run .venv/bin/python {GEN_MAN})" in result.stderr
    assert list(root.iterdir()) == []


def test_generators_write_what_is_committed(env: dict[str, str], tmp_path: Path) -> None:
    for script in (GEN_COMPLETIONS, GEN_MAN):
        assert run_script(script, ["--root", str(tmp_path)], env).returncode == 0
        assert run_script(script, ["--check", "--root", str(tmp_path)], env).returncode == 0
    for rel in [*(f"completions/ruvllm.{shell}" for shell in SHELLS), "man/ruvllm.1"]:
        assert (tmp_path / rel).read_text() == (REPO_ROOT / rel).read_text(), rel
    (tmp_path / "completions/ruvllm.zsh").write_text("# edited\n")
    result = run_script(GEN_COMPLETIONS, ["--check", "--root", str(tmp_path)], env)
    assert result.returncode == 1
    assert "stale: completions/ruvllm.zsh (" in result.stderr


# --- the man page ------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def man_page() -> str:
    return (REPO_ROOT / "man/ruvllm.1").read_text()


def test_man_page_sections(man_page: str) -> None:
    sections = re.findall(r"^\.SH (.+)$", man_page, flags=re.M)
    assert sections == ["NAME", "SYNOPSIS", "DESCRIPTION", "GLOBAL OPTIONS", "COMMANDS",
                        "ENVIRONMENT", "EXIT STATUS", "FILES"]
    assert man_page.splitlines()[0] == f'.TH RUVLLM 1 "" "ruvllm {__version__}" "User Commands"'
    assert "ruvllm \\- download, chat with, serve and benchmark local LLMs" in man_page


def test_man_page_describes_every_written_command(man_page: str) -> None:
    titles = re.findall(r'^\.SS "(.+)"$', man_page, flags=re.M)
    for name, (_, aliases) in COMMANDS.items():
        if missing_commands(name):
            continue
        title = f"{name} (alias: {', '.join(aliases)})" if aliases else name
        assert title in titles
        assert f"\\fBruvllm {name}\\fR" in man_page
    assert '.SS "benchmark (alias: bench)"' in man_page


def test_man_page_options_defaults_and_examples(man_page: str) -> None:
    benchmark = man_page.split('.SS "benchmark (alias: bench)"')[1].split(".SS ")[0]
    iterations = "\\fB\\-i\\fR, \\fB\\-\\-iterations\\fR \\fIINTEGER RANGE\\fR\n"
    assert iterations in benchmark
    # The option's help line ends with its default and range.
    help_line = benchmark.split(iterations)[1].split("\n")[0]
    assert help_line.endswith("Default: 10. Range: x>=1.")
    assert ("\\fB\\-\\-format\\fR \\fI[table|json|csv]\\fR\nTables for people; JSON or CSV, alone on stdout, "
            "for scripts (fields: docs/benchmark.md). Default: table.\n") in benchmark
    assert "\\fB\\-\\-no\\-color\\fR" not in benchmark  # global options are described once
    assert "Examples:\n.RS 4\n.nf\nruvllm benchmark qwen\n" in benchmark
    globals_ = man_page.split(".SH GLOBAL OPTIONS")[1].split(".SH ")[0]
    for option in ("\\fB\\-V\\fR, \\fB\\-\\-version\\fR", "\\fB\\-v\\fR, \\fB\\-\\-verbose\\fR",
                   "\\fB\\-\\-no\\-color\\fR", "\\fB\\-\\-cache\\-dir\\fR \\fIDIRECTORY\\fR",
                   "\\fB\\-h\\fR, \\fB\\-\\-help\\fR"):
        assert option in globals_


def test_man_page_environment_exit_status_files(man_page: str) -> None:
    section = lambda name: man_page.split(f".SH {name}\n")[1].split("\n.SH ")[0]  # noqa: E731
    environment = re.findall(r"^\\fB(\w+)\\fR$", section("ENVIRONMENT"), flags=re.M)
    assert environment == ["RUVLLM_CACHE_DIR", "RUVLLM_CONFIG_DIR", "RUVLLM_DATA_DIR", "RUVLLM_API_KEY",
                           "HF_TOKEN", "HF_ENDPOINT", "NO_COLOR"]
    assert re.findall(r"^\\fB(\d+)\\fR$", section("EXIT STATUS"), flags=re.M) == ["0", "1", "2", "130"]
    assert "~/.cache/ruvllm" in section("FILES")


def test_man_page_is_valid_roff(man_page: str) -> None:
    for line in man_page.splitlines():
        assert not line.startswith("'"), line
        assert not line.startswith(".") or re.match(r"\.(TH|SH|SS|PP|TP|RS|RE|nf|fi|br)\b", line), line
    if shutil.which("groff") is None:
        pytest.skip("groff not installed")
    result = subprocess.run(["groff", "-man", "-Tutf8", "-ww", "-z", str(REPO_ROOT / "man/ruvllm.1")],
                            capture_output=True, text=True, timeout=60)
    assert (result.returncode, result.stderr) == (0, "")


# --- `ruvllm completion` -----------------------------------------------------------------------

@pytest.mark.parametrize("shell", SHELLS)
def test_completion_prints_committed_script(env: dict[str, str], shell: str) -> None:
    result = run(["completion", shell], env)
    assert result.returncode == 0, result.stderr
    assert result.stdout == (REPO_ROOT / f"completions/ruvllm.{shell}").read_text()
    assert "_RUVLLM_COMPLETE=" in result.stdout


@pytest.mark.parametrize("args,message", [
    (["completion", "tcsh"], "Error: Invalid value for 'SHELL': 'tcsh' is not one of 'bash', 'zsh', 'fish'."),
    (["completion"], "Error: Missing argument 'SHELL'."),
])
def test_completion_bad_shell_is_a_usage_error(env: dict[str, str], args: list[str], message: str) -> None:
    result = run(args, env)
    assert (result.returncode, result.stdout) == (2, "")
    assert message in result.stderr


# --- the completion protocol, as the shell scripts drive it ------------------------------------

def complete(env: dict[str, str], line: str, shell: str = "bash") -> list[str]:
    """What `ruvllm` answers to the completion request for `line` (the cursor at its end)."""
    words = line.split()
    cword = len(words) if line.endswith(" ") else len(words) - 1
    extra = {"_RUVLLM_COMPLETE": f"{shell}_complete", "COMP_WORDS": line}
    if shell == "fish":
        extra["COMP_CWORD"] = "" if line.endswith(" ") else words[-1]
    else:
        extra["COMP_CWORD"] = str(cword)
    result = run([], env, **extra)
    assert (result.returncode, result.stderr) == (0, ""), result.stderr
    return result.stdout.splitlines()


def test_complete_command_names(env: dict[str, str]) -> None:
    assert complete(env, "ruvllm ch") == ["plain,chat"]
    assert complete(env, "ruvllm b") == ["plain,benchmark"]
    assert complete(env, "ruvllm com") == ["plain,completion"]
    skip_unless_written("download")
    assert complete(env, "ruvllm dow") == ["plain,download"]


def test_complete_all_command_names(env: dict[str, str]) -> None:
    skip_unless_written()
    assert complete(env, "ruvllm ") == [f"plain,{name}" for name in COMMANDS]


def test_complete_options(env: dict[str, str]) -> None:
    global_options = ["plain,--verbose", "plain,--no-color", "plain,--cache-dir", "plain,--version", "plain,--help"]
    assert complete(env, "ruvllm --") == global_options
    assert complete(env, "ruvllm chat --max-t") == ["plain,--max-tokens"]
    assert complete(env, "ruvllm chat --max-l") == ["plain,--max-loras", "plain,--max-lora-rank"]
    assert complete(env, "ruvllm chat --ad") == ["plain,--adapter"]
    assert complete(env, "ruvllm bench --fo") == ["plain,--format"]


def test_complete_download_options(env: dict[str, str]) -> None:
    skip_unless_written("download")
    options = complete(env, "ruvllm download --")
    assert {"plain,--quantization", "plain,--force", "plain,--revision", "plain,--cache-dir"} <= set(options)
    assert complete(env, "ruvllm dl --") == options


def test_complete_values(env: dict[str, str]) -> None:
    assert complete(env, "ruvllm completion ") == ["plain,bash", "plain,zsh", "plain,fish"]
    assert complete(env, "ruvllm benchmark qwen --format ") == ["plain,table", "plain,json", "plain,csv"]
    assert complete(env, "ruvllm chat qwen --device c") == ["plain,cpu", "plain,cuda"]
    assert complete(env, "ruvllm --cache-dir ") == ["dir,"]


# The short help shown beside `completion` by shells that show descriptions.
COMPLETION_HELP = completion_command.get_short_help_str()


def test_complete_zsh_and_fish_formats(env: dict[str, str]) -> None:
    assert complete(env, "ruvllm com", "zsh") == ["plain", "completion", COMPLETION_HELP]
    assert complete(env, "ruvllm com", "fish") == [f"plain,completion\t{COMPLETION_HELP}"]


def test_complete_model_offers_registry_and_user_aliases() -> None:
    from ruvllm_cli.registry.registry import add_user_alias, aliases_path, builtin_entries

    add_user_alias("qwen-mine", "Qwen/Qwen2.5-0.5B-Instruct", name="Mine")
    items = complete_model(None, None, "qwen")  # type: ignore[arg-type]
    expected = [alias for alias in builtin_entries() if alias.startswith("qwen")] + ["qwen-mine"]
    assert [item.value for item in items] == expected
    assert (items[-1].help, items[-1].type) == ("Mine", "plain")
    # No alias matches: the shell falls back to file names (local model directories, .gguf files).
    fallback = complete_model(None, None, "./mod")  # type: ignore[arg-type]
    assert [(item.value, item.type) for item in fallback] == [("./mod", "file")]
    aliases_path().write_text("not json")
    assert "qwen" in [item.value for item in complete_model(None, None, "qw")]  # type: ignore[arg-type]


def test_complete_quantization_values_as_typed(env: dict[str, str]) -> None:
    """Issue 23, item 2: -q's values complete, in lowercase, and --help shows them so."""
    names = ["plain,q4k", "plain,q8", "plain,f16", "plain,none"]
    for command in ("chat qwen", "serve qwen", "bench qwen", "download qwen", "alias set x org/y"):
        assert complete(env, f"ruvllm {command} -q ") == names
    assert complete(env, "ruvllm chat qwen --quantization Q") == ["plain,q4k", "plain,q8"]
    assert complete(env, "ruvllm chat qwen -q fp") == ["plain,fp16", "plain,fp32"]
    help_text = run(["chat", "--help"], env).stdout
    assert "-q, --quantization [q4k|q8|f16|none]" in help_text and "Q4K" not in help_text


def fake_download(cache_dir: Path, repo_id: str) -> None:
    """A complete download of `repo_id` in the cache (one safetensors file)."""
    from ruvllm_cli.registry.cache import FileRecord, ModelCache

    cache, commit = ModelCache(cache_dir), "a" * 40
    snapshot = cache.snapshot_dir(repo_id, commit)
    snapshot.mkdir(parents=True)
    (snapshot / "config.json").write_text("{}")
    cache.write_ref(repo_id, "main", commit)
    cache.write_manifest(repo_id=repo_id, revision="main", commit=commit, files=[FileRecord("config.json", 2)])


def test_complete_model_arguments_with_aliases_and_downloads(env: dict[str, str], isolated_env,
                                                             tmp_path: Path) -> None:
    """Issue 23, item 2: every MODEL argument completes aliases, then downloaded repo ids."""
    from ruvllm_cli.registry.registry import add_user_alias

    add_user_alias("qwen-mine", "Qwen/Qwen2.5-0.5B-Instruct")
    fake_download(isolated_env.cache_dir, "Acme/Tiny-Chat")
    for command in ("download", "dl", "info", "chat", "serve", "benchmark"):
        assert complete(env, f"ruvllm {command} qwen-") == [
            "plain,qwen-coder", "plain,qwen-large", "plain,qwen-0.5b", "plain,qwen-1.5b", "plain,qwen-mine"]
        assert complete(env, f"ruvllm {command} acme") == ["plain,Acme/Tiny-Chat"]
    # rm completes what there is to remove: aliases with a repo in the cache, downloaded ids
    assert complete(env, "ruvllm rm qwen-") == [""] and complete(env, "ruvllm rm acme") == ["plain,Acme/Tiny-Chat"]
    fake_download(isolated_env.cache_dir, "Qwen/Qwen2.5-0.5B-Instruct")
    assert complete(env, "ruvllm rm qwen-") == ["plain,qwen-0.5b", "plain,qwen-mine"]
    other = tmp_path / "other-cache"
    fake_download(other, "Acme/Elsewhere")
    assert complete(env, f"ruvllm --cache-dir {other} rm Acme") == ["plain,Acme/Elsewhere"]
    assert complete(env, "ruvllm chat ./mod") == ["file,./mod"]  # the shell completes file names
    assert complete(env, "ruvllm alias rm q") == ["plain,qwen-mine"]


COMPLETION_TIMING = """
import json, os, sys, time
from ruvllm_cli.cli.main import main
started = time.perf_counter()
try:
    main()
except SystemExit:
    pass
print(json.dumps({"seconds": time.perf_counter() - started,
                  "heavy": sorted(m for m in ("torch", "transformers", "huggingface_hub") if m in sys.modules)}),
      file=sys.stderr)
"""


@pytest.mark.parametrize("line", ["ruvllm chat qw", "ruvllm serve qwen -q ", "ruvllm bench qwen --format ",
                                  "ruvllm rm ", "ruvllm download qwen --revision m"])
def test_completion_is_fast_and_never_imports_torch(env: dict[str, str], line: str) -> None:
    """Click's completion protocol, in-process after Python starts: no torch, no
    transformers, no hub client; well under a second even on a busy 2-core machine."""
    words = line.split()
    cword = len(words) if line.endswith(" ") else len(words) - 1
    done = subprocess.run([sys.executable, "-c", COMPLETION_TIMING], cwd=REPO_ROOT, capture_output=True, text=True,
                          env={**env, "_RUVLLM_COMPLETE": "bash_complete", "COMP_WORDS": line,
                               "COMP_CWORD": str(cword)}, timeout=120)
    assert done.returncode == 0, done.stderr
    measured = json.loads(done.stderr.splitlines()[-1])
    assert measured["heavy"] == []
    assert measured["seconds"] < 1.0, measured


# --- the scripts in real shells ----------------------------------------------------------------

@pytest.fixture
def ruvllm_on_path(env: dict[str, str], tmp_path: Path) -> dict[str, str]:
    """PATH with a `ruvllm` command: the installed console script, else a wrapper of this checkout."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    installed = Path(sys.executable).parent / "ruvllm"
    wrapper = bin_dir / "ruvllm"
    if installed.exists():
        wrapper.symlink_to(installed)
    else:
        wrapper.write_text(f'#!/bin/sh\nexec "{sys.executable}" -m ruvllm_cli "$@"\n')
        wrapper.chmod(0o755)
    return {**env, "PATH": f"{bin_dir}{os.pathsep}{env.get('PATH', '')}"}


BASH_DRIVER = """
source completions/ruvllm.bash
complete -p ruvllm
read -r -a COMP_WORDS <<< "$LINE"
[[ "$LINE" == *" " ]] && COMP_WORDS+=("")
COMP_CWORD=$(( ${#COMP_WORDS[@]} - 1 ))
_ruvllm_completion ruvllm
printf '%s\\n' "${COMPREPLY[@]}"
"""


@pytest.mark.skipif(shutil.which("bash") is None, reason="bash not installed")
@pytest.mark.parametrize("line,expected", [
    ("ruvllm ch", ["chat"]),
    ("ruvllm bench --fo", ["--format"]),
    ("ruvllm completion ", ["bash", "zsh", "fish"]),
])
def test_bash_script_completes(ruvllm_on_path: dict[str, str], line: str, expected: list[str]) -> None:
    result = subprocess.run(["bash", "--norc", "--noprofile", "-c", BASH_DRIVER], cwd=REPO_ROOT,
                            env={**ruvllm_on_path, "LINE": line}, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert lines[0] == "complete -o nosort -F _ruvllm_completion ruvllm"
    assert lines[1:] == expected


@pytest.mark.skipif(shutil.which("fish") is None, reason="fish not installed")
def test_fish_script_completes(ruvllm_on_path: dict[str, str]) -> None:
    script = "source completions/ruvllm.fish; complete -C 'ruvllm com'; complete -C 'ruvllm completion '"
    result = subprocess.run(["fish", "--no-config", "-c", script], cwd=REPO_ROOT, env=ruvllm_on_path,
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    # Click's fish script splits each answer at commas, so a description ends at its first comma.
    assert result.stdout.splitlines() == [f"completion\t{COMPLETION_HELP.split(',')[0]}", "bash", "fish", "zsh"]


# Outside an interactive zsh the completion system is absent: stand-ins for its builtins
# print what the script hands them.
ZSH_DRIVER = """
compdef() { :; }
_describe() { print -rl -- "describe:" "${(@P)3}"; }
compadd() { print -rl -- "compadd:" "${(@P)${@[-1]}}"; }
source completions/ruvllm.zsh
words=(ruvllm com); CURRENT=2; _ruvllm_completion
words=(ruvllm completion ""); CURRENT=3; _ruvllm_completion
"""


@pytest.mark.skipif(shutil.which("zsh") is None, reason="zsh not installed")
def test_zsh_script_completes(ruvllm_on_path: dict[str, str]) -> None:
    result = subprocess.run(["zsh", "-f", "-c", ZSH_DRIVER], cwd=REPO_ROOT, env=ruvllm_on_path,
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.splitlines() == [
        "describe:", f"completion:{COMPLETION_HELP}",
        "compadd:", "bash", "zsh", "fish",
    ]
