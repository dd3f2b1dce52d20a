"""GGUF files that are truncated, lie about their counts, lengths, shapes, types and
offsets, or describe a model far larger than they hold (tests/engine/gguf_mutations.py):
each load ends in one ModelLoadError line, quickly, within a 4 GiB address space,
and the CLI says it in one `Error:` line.

The loads run in a subprocess under RLIMIT_AS and a timeout, so a blow-up or a hang
fails the test with the mutation's name instead of taking the machine down.
"""

from __future__ import annotations

import json
import resource
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.engine.gguf_mutations import mutations

pytest.importorskip("gguf")

# A CUDA build of torch maps more than 4 GiB in its libraries alone.
ADDRESS_SPACE = (4 if torch.version.cuda is None else 64) * 2**30
# argv: a JSON file of [name, path] pairs. One JSON line per load, and the peak RSS.
WORKER = r'''
import json, resource, sys, time
from ruvllm_cli.engine.loader import load_model
from ruvllm_cli.errors import RuvllmError
from ruvllm_cli.quantization import Quantization

for name, path in json.load(open(sys.argv[1])):
    print(json.dumps({"started": name}), flush=True)
    started = time.monotonic()
    try:
        load_model(path, "cpu", Quantization.F32)
        result = {"outcome": "loaded"}
    except RuvllmError as error:
        result = {"outcome": type(error).__name__, "message": error.message, "hint": error.hint}
    except BaseException as error:
        result = {"outcome": type(error).__name__, "message": str(error)}
    print(json.dumps({"name": name, "seconds": time.monotonic() - started, **result}), flush=True)
print(json.dumps({"max_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss // 1024}), flush=True)
'''
# Well-formed files whose model cannot be built: the message after the structure check.
BUILD_FAILURES = {
    "tensor count 19": "{path} lacks weights the model needs: model.norm.weight",
    "llama.embedding_length = 2147483648":
        "cannot load the model in {path}: its weights do not have the shapes its configuration gives",
    "llama.feed_forward_length = 2147483648":
        "cannot load the model in {path}: its weights do not have the shapes its configuration gives",
    "llama.vocab_size = 2147483648":
        "cannot load the model in {path}: its weights do not have the shapes its configuration gives",
    "llama.attention.head_count = 2147483648":
        "cannot load the model in {path}: StrictDataclassClassValidationError: Class validation error for "
        "validator 'validate_architecture': ValueError: The hidden size (64) is not a multiple of the number "
        "of attention heads (2147483648).",
    "llama.attention.head_count_kv = 2147483648":
        "unsupported model in {path}: cannot reshape array of size 2048 into shape (2147483648,0,2,64)",
}


def limit_address_space() -> None:
    resource.setrlimit(resource.RLIMIT_AS, (ADDRESS_SPACE, ADDRESS_SPACE))


def on_cpu(env: dict[str, str]) -> dict[str, str]:
    """The loads stay on the CPU, also where a GPU is."""
    return {**env, "CUDA_VISIBLE_DEVICES": ""}


@pytest.fixture(scope="module")
def mutated(tmp_path_factory, engine_model_dir) -> dict[str, Path]:
    """Every mutation written to its own file: name -> path."""
    from ruvllm_cli.testing.tiny_gguf import write_gguf

    root = tmp_path_factory.mktemp("gguf-fuzz")
    valid = write_gguf(engine_model_dir, root / "tiny-Q8_0.gguf")
    aligned = write_gguf(engine_model_dir, root / "tiny-aligned.gguf", alignment=64)
    paths = {}
    for index, (name, data) in enumerate(mutations(valid, aligned).items()):
        paths[name] = root / f"mutation-{index:03d}.gguf"
        paths[name].write_bytes(data)
    return paths


def run_worker(pairs: list[tuple[str, str]], list_file: Path, env: dict[str, str],
               timeout: float) -> tuple[dict[str, dict], int]:
    list_file.write_text(json.dumps(pairs))
    try:
        done = subprocess.run([sys.executable, "-c", WORKER, str(list_file)], env=on_cpu(env), capture_output=True,
                              text=True, timeout=timeout, preexec_fn=limit_address_space)
        stdout = done.stdout
    except subprocess.TimeoutExpired as expired:
        stdout = expired.stdout.decode() if isinstance(expired.stdout, bytes) else expired.stdout or ""
    lines = [json.loads(line) for line in stdout.splitlines()]
    results = {line["name"]: line for line in lines if "name" in line}
    started = [line["started"] for line in lines if "started" in line]
    assert started and started[-1] in results, f"the load of {started[-1:]!r} crashed or hung"
    return results, lines[-1]["max_rss_mib"]


def test_every_mutation_ends_in_one_model_load_error_line(mutated, cli_env, tmp_path):
    results, max_rss_mib = run_worker([(name, str(path)) for name, path in mutated.items()],
                                      tmp_path / "list.json", cli_env, timeout=300)
    print(f"{len(results)} mutations, slowest {max(r['seconds'] for r in results.values()):.2f} s, "
          f"peak RSS {max_rss_mib} MiB")
    assert len(results) == len(mutated) >= 250
    for name, result in results.items():
        path = mutated[name]
        assert result["outcome"] == "ModelLoadError", (name, result)
        assert "\n" not in result["message"] and "\n" not in (result["hint"] or ""), (name, result)
        if name in BUILD_FAILURES:
            assert result["message"] == BUILD_FAILURES[name].format(path=path), name
        else:
            assert result["message"].startswith(f"{path} is not a valid GGUF file: "), (name, result)
            assert result["hint"] == "the file is damaged or truncated: download it again"
        assert result["seconds"] < 30, (name, result)
    assert max_rss_mib < 2048


@pytest.mark.parametrize("name, message", [
    ("truncated at 0", "is not a valid GGUF file: it is 0 bytes, shorter than a GGUF header"),
    ("token array length 1099511627776", "is not a valid GGUF file: tokenizer.ggml.tokens says it holds "
                                         "1099511627776 strings, more than the file has room for"),
    ("2**40 elements", "is not a valid GGUF file: the tensor token_embd.weight (1168231104512 bytes at 0) runs "
                       "past the end of the 114432-byte data section"),
    ("llama.block_count = 2147483648", "is not a valid GGUF file: llama.block_count says 2147483648 layers; "
                                       "it holds tensors for 2"),
])
def test_the_cli_says_it_in_one_error_line(mutated, cli_env, name, message):
    path = mutated[name]
    result = subprocess.run([sys.executable, "-m", "ruvllm_cli", "chat", str(path), "--max-tokens", "4"],
                            env=on_cpu(cli_env), input="hello\n", capture_output=True, text=True, timeout=120,
                            preexec_fn=limit_address_space)
    assert result.returncode == 1, result.stderr
    assert "Traceback" not in result.stderr and result.stdout == ""
    errors = [line for line in result.stderr.splitlines() if line.startswith("Error:")]
    assert errors == [f"Error: {path} {message}"], result.stderr
    assert result.stderr.splitlines()[-1] == "Hint: the file is damaged or truncated: download it again"
