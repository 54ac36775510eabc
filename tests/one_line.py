"""The check behind every bad-input test: an error of the CLI is one line on stderr,
``embodied: error: <message naming the culprit>``, exit code 2, no traceback."""

import pytest

from embodied.cli import main


def run_cli(argv: list[str], capsys) -> tuple[int, str]:
    try:
        rc = main(argv)
    except SystemExit as e:  # argparse's usage errors
        rc = e.code
    return rc, capsys.readouterr().err


def one_line_error(rc: int, err: str, *culprits: str) -> str:
    lines = [line for line in err.splitlines() if line.strip()]
    assert rc == 2, err
    assert len(lines) == 1, err
    assert lines[0].startswith("embodied: error: "), err
    assert "Traceback" not in err
    for culprit in culprits:
        assert culprit in lines[0], f"{culprit!r} not named in: {lines[0]}"
    return lines[0]


def fill(text: str, paths: dict) -> str:
    for key, path in paths.items():
        text = text.replace("{" + key + "}", path)
    return text


def params(cases: list) -> list:
    """Each case with its command line as the test id."""
    out = []
    for case in cases:
        values, marks = (case.values, case.marks) if hasattr(case, "values") else (case, ())
        name = " ".join(values[0]).replace("{root}/", "").replace("configs/", "")
        out.append(pytest.param(*values, marks=marks, id=name[:90]))
    return out
