"""``sluice generate`` refuses bad options with a message, not a traceback."""

from __future__ import annotations

import pytest

from api.cli import main


@pytest.mark.parametrize(
    ("options", "message"),
    [
        (["--model", "nope"], "The supported API model names are default"),
        (["--quantization", "int8", "--dtype", "float32"], "computes in bfloat16"),
    ],
)
def test_generate_refuses_bad_options(
    options: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["generate", *options, "hello"]) == 2
    assert message in capsys.readouterr().err
