"""Every command in a code block of README.md and deploy/README.md that starts with `pdserve` parses with the real
CLI: `pdserve.cli.main.main` runs with each command's arguments and stops right after its argparse parser has
parsed them (nothing is served, sent or loaded). A flag that does not exist, a missing value, a value of the wrong
type or an unknown command fails here, naming the file and line."""

from __future__ import annotations

import argparse
import re
import shlex
from pathlib import Path

import pytest

from pdserve.cli.main import main

ROOT = Path(__file__).resolve().parents[2]
DOCS = (ROOT / "README.md", ROOT / "deploy" / "README.md")
FENCE = re.compile(r"^\s*(```|~~~)")
# `pdserve ...`, optionally after a shell prompt `$ ` and VAR=value assignments
COMMAND = re.compile(r"^\s*(?:\$\s+)?((?:[A-Za-z_][A-Za-z0-9_]*=\S*\s+)*)pdserve(\s.*)?$")


def commands(path: Path) -> list[tuple[str, dict[str, str], list[str]]]:
    """(`file:line`, environment assignments, argv after `pdserve`) of each pdserve command in the fenced code
    blocks of `path`; backslash-continued lines are joined and `# comments` dropped."""
    lines = path.read_text().splitlines()
    label = path.relative_to(ROOT) if path.is_relative_to(ROOT) else path.name
    out = []
    in_block, i = False, 0
    while i < len(lines):
        line = lines[i]
        if FENCE.match(line):
            in_block = not in_block
        elif in_block and (m := COMMAND.match(line)):
            where, text = f"{label}:{i + 1}", m.group(2) or ""
            while text.rstrip().endswith("\\") and i + 1 < len(lines):
                i += 1
                text = text.rstrip()[:-1] + " " + lines[i].strip()
            env = dict(a.split("=", 1) for a in shlex.split(m.group(1)))
            out.append((where, env, shlex.split(text, comments=True)))
        i += 1
    return out


class _Parsed(Exception):
    """Raised by the patched parse_args once a parser has accepted the arguments: the command stops there."""


def parse_only(argv: list[str], env: dict[str, str], monkeypatch, capsys) -> str | None:
    """None when `pdserve ARGV` parses (or prints help / usage / version and exits 0), else why not."""
    real = argparse.ArgumentParser.parse_args

    def parse_then_stop(self, args=None, namespace=None):
        raise _Parsed(real(self, args, namespace))

    from pdserve.server.shutdown import Shutdown

    with monkeypatch.context() as m:
        m.setattr(argparse.ArgumentParser, "parse_args", parse_then_stop)
        m.setattr(Shutdown, "install", classmethod(lambda cls, name: None))  # `serve` installs signal handlers
        for name, value in env.items():
            m.setenv(name, value)
        capsys.readouterr()
        try:
            rc = main(argv)
        except _Parsed:
            return None
        except SystemExit as e:
            rc = e.code
    if rc in (0, None):
        return None
    return f"exit {rc}: {capsys.readouterr().err.strip()[-500:]}"


ALL = [c for doc in DOCS for c in commands(doc)]


def test_the_docs_have_pdserve_commands():
    """The extraction works: both files exist and their code blocks hold pdserve commands."""
    assert all(doc.is_file() for doc in DOCS)
    per_doc = {doc.name: sum(w.startswith(str(doc.relative_to(ROOT))) for w, _, _ in ALL) for doc in DOCS}
    assert all(n > 0 for n in per_doc.values()), per_doc
    assert any(argv[:1] == ["bench"] for _, _, argv in ALL) and any(argv[:1] == ["chat"] for _, _, argv in ALL)


@pytest.mark.parametrize(("where", "env", "argv"), ALL, ids=[w for w, _, _ in ALL])
def test_command_parses(where, env, argv, monkeypatch, capsys):
    assert "..." not in argv, f"{where}: `...` stands for flags; write the command out"
    why = parse_only(argv, env, monkeypatch, capsys)
    assert why is None, f"{where}: `pdserve {shlex.join(argv)}` does not parse: {why}"


@pytest.mark.parametrize(
    "line",
    [
        "pdserve chat --tls-ca",  # a missing value
        "pdserve chat --tls ca.pem --ca ca.pem",  # a flag that does not exist
        "pdserve bench --target h:1 --vocab-size 10 --rate fast",  # a value of the wrong type
        "pdserve frobnicate",  # an unknown command
        "pdserve serve router --port eighty",
    ],
)
def test_broken_commands_fail(line, monkeypatch, capsys, tmp_path):
    """The check can fail: each of these lines, in a code block, is extracted and refused."""
    doc = tmp_path / "doc.md"
    doc.write_text(
        f"`pdserve chat --nope` outside a block is prose\n```bash\n$ {line} \\\n  --timeout 5   # note\n```\n"
    )
    ((where, env, argv),) = commands(doc)
    assert where == "doc.md:3" and argv[-2:] == ["--timeout", "5"]
    assert parse_only(argv, env, monkeypatch, capsys) is not None
