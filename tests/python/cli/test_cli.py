"""The `mlc_lora` command line: the command list, unknown commands, --version, and every option of
every command described with its default."""

from __future__ import annotations

import argparse
import importlib
import importlib.metadata

import pytest

import mlc_lora
from mlc_lora.cli import HelpFormatter
from mlc_lora.cli.main import COMMANDS, main


def run(capsys, *argv: str) -> tuple[int, str, str]:
    try:
        rc = main(list(argv))
    except SystemExit as e:  # argparse's --help, --version and usage errors
        rc = e.code
    out = capsys.readouterr()
    return rc, out.out, out.err


def test_help_lists_every_command(capsys):
    rc, out, _ = run(capsys, "--help")
    assert rc == 0
    for name in COMMANDS:
        assert f"\n  {name} " in out, out
    assert "mlc_lora COMMAND --help" in out


def test_no_command_prints_the_help_and_fails(capsys):
    rc, _, err = run(capsys)
    assert rc == 2
    assert all(f"\n  {name} " in err for name in COMMANDS)


def test_unknown_command_names_the_commands(capsys):
    rc, out, err = run(capsys, "chta", "--prompt", "hi")
    assert rc == 2 and out == ""
    assert "unknown command 'chta'" in err
    assert "compile, chat, serve" in err


def test_version_is_the_installed_distribution(capsys):
    rc, out, _ = run(capsys, "--version")
    assert rc == 0
    assert out.strip() == f"mlc_lora {mlc_lora.__version__}"
    assert importlib.metadata.version("mlc-lora") == mlc_lora.__version__


@pytest.mark.parametrize("command", list(COMMANDS))
def test_every_option_is_described_with_its_default(command, capsys):
    parser = importlib.import_module(COMMANDS[command][0]).parser()
    assert parser.formatter_class is HelpFormatter
    fmt = HelpFormatter(parser.prog)
    for action in parser._actions:  # pylint: disable=protected-access
        if isinstance(action, argparse._HelpAction):  # pylint: disable=protected-access
            continue
        assert action.help, f"{command} {action.dest}: no help"
        if action.option_strings and action.nargs != 0 and not action.required:
            assert "default" in fmt._get_help_string(action).lower(), (  # pylint: disable=protected-access
                f"{command} {'/'.join(action.option_strings)}: its help shows no default")
    rc, out, _ = run(capsys, command, "--help")
    assert rc == 0 and f"usage: mlc_lora {command}" in out


def test_the_formatter_shows_zero_defaults_and_hides_flags():
    p = argparse.ArgumentParser(formatter_class=HelpFormatter)
    p.add_argument("--temperature", type=float, default=0.0, help="sampling temperature")
    p.add_argument("--flag", action="store_true", help="a flag")
    p.add_argument("--name", default=None, help="a name (default: the model's)")
    text = " ".join(p.format_help().split())
    assert "sampling temperature (default: 0.0)" in text
    assert "a flag" in text and "a flag (default" not in text
    assert "(default: the model's)" in text and "(default: None)" not in text


def test_chat_demo_adapters_are_package_data(capsys):
    rc, _, err = run(capsys, "chat", "--adapter", "no-such-adapter", "--prompt", "hi")
    assert rc == 1
    assert "all-caps, pirate" in err, err
    root = mlc_lora.__file__.rsplit("/", 1)[0]
    from mlc_lora.chat import DEMO_ADAPTERS  # pylint: disable=import-outside-toplevel

    assert str(DEMO_ADAPTERS).startswith(root)
    for name in ("all-caps", "pirate"):
        assert (DEMO_ADAPTERS / name / "adapter_config.json").is_file()
        assert (DEMO_ADAPTERS / name / "adapter_model.safetensors").is_file()


@pytest.mark.parametrize("text, n", [("0", 0), ("4096", 4096), ("512M", 512 * 2**20), ("8G", 8 * 2**30),
                                     ("8GiB", 8 * 2**30), ("64k", 64 * 2**10), ("3 MB", 3 * 2**20), ("1.5G", None),
                                     ("-1", None), ("", None), ("G", None)])
def test_serve_adapter_host_bytes_reads_a_byte_count(text, n, capsys):
    from mlc_lora.cli.serve import parser  # pylint: disable=import-outside-toplevel

    if n is None:
        with pytest.raises(SystemExit):
            parser().parse_args(["m", "--adapter-host-bytes", text])
        assert "byte count" in capsys.readouterr().err
    else:
        assert parser().parse_args(["m", "--adapter-host-bytes", text]).adapter_host_bytes == n
    a = parser().parse_args(["m"])
    assert (a.adapter_host_bytes, a.no_adapter_prefetch) == (None, False)


def test_compile_kernel_flags_reach_the_options(monkeypatch, tmp_path):
    """The base model's one-kernel options and prefill memory at its bounds are on unless turned off
    by their --no- flags; a sharded library plans prefill per token count (its runner does not check
    prefills against the bounds), and asking for the bounds there is refused."""
    from mlc_lora.cli import compile as compile_cli  # pylint: disable=import-outside-toplevel
    from mlc_lora.compile import CompileError, CompileOptions  # pylint: disable=import-outside-toplevel

    seen = []
    monkeypatch.setattr(compile_cli, "compile_model", lambda model, out, opts: seen.append(opts) or out)
    compile_cli.main(["m", "-o", str(tmp_path), "--target", "cuda"])
    compile_cli.main(["m", "-o", str(tmp_path), "--target", "cuda", "--no-rope-append", "--no-add-norm",
                      "--no-bounded-prefill-memory"])
    compile_cli.main(["m", "-o", str(tmp_path), "--tensor-parallel-shards", "2"])
    assert [(o.rope_append, o.add_norm, o.bounded_prefill_memory) for o in seen] == [
        (True, True, True), (False, False, False), (True, True, False)]
    assert CompileOptions().bounded_prefill_memory is True
    with pytest.raises(CompileError, match="single-device"):
        CompileOptions(tensor_parallel_shards=2, bounded_prefill_memory=True)
