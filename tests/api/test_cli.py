"""``sluice`` refuses bad options with a message, not a traceback."""

from __future__ import annotations

import logging

import pytest
import torch

from api.cli import build_parser, main
from shared import keys

UNREACHABLE_REDIS = "redis://127.0.0.1:1/0"  # never contacted: the options fail first


@pytest.mark.parametrize(
    ("options", "message"),
    [
        (["--model", "nope"], "The supported API model names are default"),
        (["--quantization", "int8", "--dtype", "float16"], "computes in bfloat16 or float32"),
    ],
)
def test_generate_refuses_bad_options(
    options: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["generate", *options, "hello"]) == 2
    assert message in capsys.readouterr().err


@pytest.mark.parametrize(
    ("option", "value", "message"),
    [
        # 0 is no "unbounded": admission would answer every request with a 429
        ("--max-inflight", "0", "must be at least 1, got 0"),
        ("--max-inflight", "x", "expected a whole number"),
        # a request's stream and lease live an hour from its run's start
        ("--total-timeout", "3600", "must be more than 0 and less than 3600 s, got 3600"),
        ("--total-timeout", "0", "must be more than 0 and less than 3600 s, got 0"),
    ],
)
def test_serve_refuses_limits_it_cannot_keep(
    option: str, value: str, message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exited:
        main(["serve", "--redis", UNREACHABLE_REDIS, option, value])
    assert exited.value.code == 2
    assert f"argument {option}: {message}" in capsys.readouterr().err


def test_serve_takes_limits_within_range() -> None:
    args = build_parser().parse_args(["serve", "--max-inflight", "1", "--total-timeout", "3599"])
    assert (args.max_inflight, args.total_timeout) == (1, 3599.0)


def test_a_killed_worker_s_job_is_back_before_the_api_s_deadlines() -> None:
    """Default timing: a ``kill -9``'d worker's jobs are back well before the API gives up.

    They go back once its registry entry has expired and a live worker has
    beaten since: one TTL and one interval after its last beat. A live worker
    would have to miss several beats in a row to be taken for dead.
    """
    serve = build_parser().parse_args(["serve"])
    back_within_s = keys.HEARTBEAT_TTL_S + 2 * keys.HEARTBEAT_INTERVAL_S
    assert back_within_s <= 3 < serve.queue_timeout < serve.first_token_timeout
    assert keys.HEARTBEAT_TTL_S >= 4 * keys.HEARTBEAT_INTERVAL_S


@pytest.mark.parametrize(
    ("text", "size"),
    [("512MiB", 512 * 2**20), ("2GiB", 2 * 2**30), ("1.5GB", 1_500_000_000), ("4096", 4096)],
)
def test_kv_cache_memory_takes_sizes_as_people_write_them(text: str, size: int) -> None:
    for command in (["serve"], ["generate", "hi"]):
        args = build_parser().parse_args([command[0], "--kv-cache-memory", text, *command[1:]])
        assert args.kv_cache_memory == size


@pytest.mark.parametrize("text", ["lots", "2TB", "-1MiB", "0"])
def test_a_kv_cache_memory_that_is_no_size_is_refused(
    text: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--kv-cache-memory", text])
    assert "argument --kv-cache-memory" in capsys.readouterr().err


@pytest.mark.parametrize("text", ["0", "1.5", "-0.2", "most"])
def test_a_gpu_memory_utilization_that_is_no_fraction_is_refused(
    text: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--gpu-memory-utilization", text])
    assert "argument --gpu-memory-utilization" in capsys.readouterr().err


def test_gpu_memory_utilization_on_a_cpu_is_refused(capsys: pytest.CaptureFixture[str]) -> None:
    """On a machine without CUDA the fraction would size nothing: refused before loading."""
    if torch.cuda.is_available():
        pytest.skip("this machine has a CUDA device")
    assert main(["generate", "--gpu-memory-utilization", "0.9", "Hi"]) == 2
    assert "size it with kv_cache_memory (--kv-cache-memory)" in capsys.readouterr().err


@pytest.mark.parametrize(
    "option",
    [
        ["--kv-cache-memory", "1GiB"],
        ["--gpu-memory-utilization", "0.9"],
        ["--enforce-eager"],
        ["--no-enforce-eager"],
    ],
)
def test_engine_options_are_refused_where_no_engine_runs(
    option: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["serve", "--redis", UNREACHABLE_REDIS, *option]) == 2
    err = capsys.readouterr().err
    assert f"{option[0].replace('--no-', '--')} sets this process's engine" in err
    assert "pass it to each `sluice worker`" in err


def test_enforce_eager_reaches_the_engine(caplog: pytest.LogCaptureFixture) -> None:
    """The suite's default is eager (tests/conftest.py); the flag decides over it."""
    with caplog.at_level(logging.INFO, logger="engine.llm_engine"):
        assert main(["generate", "--enforce-eager", "--max-tokens", "1", "Hi"]) == 0
    assert "decode steps eager" in caplog.text


def test_kv_cache_memory_sizes_the_engine(caplog: pytest.LogCaptureFixture) -> None:
    """``sluice generate`` loads the default model with a cache of the size asked for."""
    from engine.attention import KVCache
    from engine.precision import precision_for

    with caplog.at_level(logging.INFO, logger="engine.llm_engine"):
        assert main(["generate", "--kv-cache-memory", "8MiB", "--max-tokens", "2", "Hi"]) == 0
    # the default model, its cache in the default precision's dtype: 30 layers, 3 KV heads of 64
    kv_dtype = precision_for("auto", "auto", torch.device("cpu")).kv_dtype
    per_block = KVCache.bytes_per_block(30, 16, 3, 64, kv_dtype)
    assert f"{8 * 2**20 // per_block} KV blocks of 16" in caplog.text


VLLM_COMMAND_LINE = [
    "serve", "--model", "default",
    "--host", "0.0.0.0", "--port", "9000", "--max-model-len", "2048", "--max-num-seqs", "8",
    "--dtype", "bfloat16", "--api-key", "sk-1", "--root-path", "/llm",
    "--ssl-keyfile", "key.pem", "--ssl-certfile", "cert.pem", "--uvicorn-log-level", "warning",
    "--kv-cache-memory-bytes", "1073741824", "--served-model-name", "llm", "chat",
    "--chat-template", "{{ messages }}", "--reasoning-parser", "qwen3",
    "--tool-call-parser", "hermes",
]  # fmt: skip


def test_a_vllm_serve_command_line_reads_as_vllm_reads_it() -> None:
    args = build_parser().parse_args(VLLM_COMMAND_LINE)
    assert (args.host, args.port, args.max_model_len, args.max_num_seqs) == (
        "0.0.0.0",
        9000,
        2048,
        8,
    )
    assert (args.dtype, args.api_key, args.root_path) == ("bfloat16", ["sk-1"], "/llm")
    assert (args.ssl_keyfile, args.ssl_certfile) == ("key.pem", "cert.pem")
    assert args.uvicorn_log_level == "warning" and args.kv_cache_memory == 2**30
    assert args.served_model_name == ["llm", "chat"] and args.chat_template == "{{ messages }}"
    assert (args.reasoning_parser, args.tool_call_parser) == ("qwen3", "hermes")


@pytest.mark.parametrize(
    "flag", ["--tensor-parallel-size", "--enable-prefix-caching", "--trust-remote-code"]
)
def test_a_vllm_flag_sluice_does_not_share_is_refused_by_name(
    flag: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exited:
        build_parser().parse_args([*VLLM_COMMAND_LINE, flag])
    assert exited.value.code == 2
    assert flag in capsys.readouterr().err


def test_every_serve_flag_has_an_environment_variable(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("SLUICE_MAX_NUM_SEQS", "7")
    monkeypatch.setenv("SLUICE_API_KEY", "sk-a,sk-b")
    monkeypatch.setenv("SLUICE_PLACEMENT", "shared")
    monkeypatch.setenv("SLUICE_QUEUE_TIMEOUT", "12.5")
    args = build_parser().parse_args(["serve", "--api-key", "sk-c"])
    assert (args.max_num_seqs, args.placement, args.queue_timeout) == (7, False, 12.5)
    assert args.api_key == ["sk-a", "sk-b", "sk-c"]  # the command line adds to the variable's
    assert build_parser().parse_args(["serve", "--max-num-seqs", "3"]).max_num_seqs == 3
    monkeypatch.setenv("SLUICE_PLACEMENT", "nearest")
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve"])
    assert "SLUICE_PLACEMENT='nearest'" in capsys.readouterr().err


def test_the_version_is_the_package_s(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exited:
        build_parser().parse_args(["--version"])
    assert exited.value.code == 0 and capsys.readouterr().out.startswith("sluice ")


def test_tool_call_parser_sets_the_served_models_syntax() -> None:
    from api.settings import Settings, load_models

    args = build_parser().parse_args(["serve", "--tool-call-parser", "llama3_json"])
    registry, [spec] = load_models(Settings(tool_call_parser=args.tool_call_parser))
    assert spec.tool_parser == "llama3_json" == registry.resolve("default").tool_parser
    assert load_models(Settings())[1][0].tool_parser == "hermes"


def test_a_vllm_config_file_of_flags_is_refused_with_a_pointer(
    tmp_path, capsys: pytest.CaptureFixture[str]
) -> None:
    flags = tmp_path / "config.yaml"
    flags.write_text("port: 9000\nmax-num-seqs: 8\n")
    assert main(["serve", "--config", str(flags)]) == 2
    error = capsys.readouterr().err
    assert "model registry" in error and "SLUICE_<FLAG>" in error


def test_served_model_names_replace_the_names_clients_use() -> None:
    from api.settings import Settings, load_models
    from shared.registry import UnknownModel

    registry, [spec] = load_models(Settings(served_model_names=("llm", "chat")))
    assert registry.names() == ["chat", "llm"] and spec.served_name == "llm"
    assert registry.resolve("chat") is spec and spec.name == "smollm2-135m-instruct"
    with pytest.raises(UnknownModel):
        registry.resolve("default")


def test_served_model_names_name_one_model(capsys: pytest.CaptureFixture[str]) -> None:
    command = ["serve", "--model", "default", "--model", "tests/nowhere"]
    assert main([*command, "--served-model-name", "llm"]) == 2
    assert "--served-model-name names one served model" in capsys.readouterr().err


def test_a_chat_template_is_a_file_or_the_template_itself(tmp_path) -> None:
    from api.settings import Settings, load_models

    template = tmp_path / "template.jinja"
    template.write_text("{% for m in messages %}{{ m.content }}\n{% endfor %}")
    [from_file] = load_models(Settings(chat_template=str(template)))[1]
    assert (from_file.prompt_format, from_file.chat_template) == ("jinja", template.read_text())
    inline = "{% for m in messages %}{{ m.content }}\\n{% endfor %}"
    [from_line] = load_models(Settings(chat_template=inline))[1]
    assert from_line.chat_template == template.read_text()
    assert load_models(Settings())[1][0].chat_template is None


@pytest.mark.parametrize(
    ("value", "message"),
    [("{% for m in messages %}", "does not compile"), ("nowhere.jinja", "neither a file")],
)
def test_a_bad_chat_template_fails_at_start(
    value: str, message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["serve", "--chat-template", value]) == 2
    assert message in capsys.readouterr().err


def test_a_reasoning_parser_lets_the_served_model_reason() -> None:
    from api.preparation import can_think
    from api.settings import Settings, load_models

    [spec] = load_models(Settings(reasoning_parser="deepseek_r1"))[1]
    assert can_think(spec) and not can_think(load_models(Settings())[1][0])
