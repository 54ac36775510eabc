"""The check behind every bad-input test: an error of the CLI is one line on stderr,
``embodied: error: <message naming the culprit>``, exit code 2, no traceback; and the guards
that fail a test whose bad input reached the hardware or built a simulator."""

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


def refuse_hardware(monkeypatch) -> None:
    """An arm (or its twin) that connects, or a policy server that listens, fails the test."""

    def opened(*args, **kwargs):
        raise AssertionError("a bad input reached the hardware or opened a port")

    import embodied.robots.arm
    import embodied.robots.server
    import embodied.twin

    monkeypatch.setattr(embodied.robots.arm, "make_robot", opened)
    monkeypatch.setattr(embodied.robots.arm, "connect", opened)
    monkeypatch.setattr(embodied.twin, "make_twin_robot", opened)
    monkeypatch.setattr(embodied.robots.server.PolicyServer, "start", opened)


def refuse_simulators(monkeypatch) -> None:
    """A simulator built fails the test: the factory, and the modules that bound it by name."""

    def built(*args, **kwargs):
        raise AssertionError("a bad input built a simulator")

    import embodied.bench
    import embodied.multitask
    import embodied.runner
    import embodied.sft

    for module in (embodied.multitask, embodied.runner, embodied.bench, embodied.sft):
        monkeypatch.setattr(module, "make_env", built)


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
