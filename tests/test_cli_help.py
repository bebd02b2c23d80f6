"""Help and error messages in the command line's own terms (issue 25, item 9): no `<bool>`
after on/off flags, arguments as `SOURCE` in usage lines (not `{source}`), and errors about
a generation option naming the flag the user typed (`--block-size`, `--verify-width`,
`--draft-window`), with the CLI spelling of its default (leaving it out), never `None`. The
real `dflash-mlx` command in a subprocess."""

from __future__ import annotations

import pytest

from .test_cli_serve import dflash, text

HELPS = [
    ["generate"],
    ["chat"],
    ["serve"],
    ["bench"],
    ["train"],
    ["quantize", "draft"],
    ["quantize", "target"],
]


@pytest.mark.parametrize("command", HELPS, ids=" ".join)
def test_help_shows_no_bool_after_flags_and_no_braces_in_usage(command):
    out, err = text(done := dflash(*command, "--help", env={"COLUMNS": "200"}))
    assert done.returncode == 0, err
    assert "<bool>" not in out, out
    usage = next(line for line in out.splitlines() if "Usage:" in line)
    assert "{" not in usage and "}" not in usage, usage
    if command[0] == "quantize":
        assert usage.strip().endswith("[OPTIONS] SOURCE"), usage


@pytest.fixture(scope="module")
def pair(models_dir) -> list[str]:
    return ["-m", str(models_dir / "qwen3"), "-d", str(models_dir / "draft")]


@pytest.mark.parametrize("command", ["generate", "chat", "serve", "bench"])
def test_a_bad_draft_window_names_the_flag_and_its_cli_spelling(pair, command):
    done = dflash(command, *pair, "--draft-window", "1", input="hi")
    (line,) = text(done)[1].strip().splitlines()
    assert done.returncode == 2, line
    assert line.startswith("error: --draft-window 1 must be an integer >= 2"), line
    assert "or left out for the draft's own window" in line
    assert "None" not in line and "draft_window" not in line


@pytest.mark.parametrize("command", ["generate", "chat", "serve"])
def test_a_bad_draft_sink_names_the_flag_before_loading(pair, command):
    done = dflash(command, *pair, "--draft-window", "8", "--draft-sink", "-1", input="hi")
    (line,) = text(done)[1].strip().splitlines()
    assert done.returncode == 2, line
    assert line.startswith("error: --draft-sink -1 must be an integer >= 0"), line
    assert "or left out for the draft's default" in line and "draft_sink" not in line


def test_pair_errors_name_the_flag_typed(pair):
    done = dflash("generate", *pair, "--verify-width", "99", "hi")
    err = text(done)[1]
    assert done.returncode == 2
    assert "error: --verify-width 99 exceeds the draft's trained block size 16" in err, err
    done = dflash("generate", *pair, "--block-size", "32", "hi")  # the deprecated name
    err = text(done)[1]
    assert done.returncode == 2 and "--block-size is deprecated" in err
    assert "error: --verify-width 32 exceeds" in err and "block_size" not in err, err
    done = dflash("serve", *pair, "--max-tokens", "0")
    err = text(done)[1]
    assert done.returncode == 2 and "error: --max-tokens 0 must be an integer >= 1" in err, err
    done = dflash("generate", *pair, "--verify-width", "0", "hi")
    assert "or left out (chosen per cycle)" in text(done)[1]
