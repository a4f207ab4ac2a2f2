"""The tables in docs/ that mirror code, checked against the code so they cannot drift: the
flags of every command, the oMLX keys, the file layout; and every relative link resolves."""

import inspect
import re
from pathlib import Path

import pytest
import typer

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
FLAG = re.compile(r"`(-{1,2}[a-z][a-z0-9-]*)")


def table_rows(text: str, heading: str, level: int = 2) -> list[str]:
    """The table rows of the section `heading` (up to the next heading of the same or a higher
    level), past the header and the rule."""
    marks = "#" * level
    match = re.search(rf"^{marks} {re.escape(heading)}\n(.*?)(?=^#{{1,{level}}} |\Z)", text,
                      re.M | re.S)
    assert match, f"no section {marks} {heading}"
    rows = [line for line in match.group(1).splitlines() if line.startswith("|")]
    return rows[2:]


def table_cells(text: str, heading: str, level: int = 2) -> list[str]:
    """The first cell of each table row of the section `heading`."""
    return [row.split("|")[1] for row in table_rows(text, heading, level)]


def command_flags(command) -> set[str]:
    names = set()
    for param in command.params:
        names.update(o for o in (*param.opts, *param.secondary_opts)
                     if o.startswith("-") and o not in ("--help", "--install-completion",
                                                        "--show-completion"))
    return names


def commands() -> dict:
    from dflash2_mlx.cli import app
    from dflash2_mlx.train.command import train_command

    found = dict(typer.main.get_command(app).commands)
    sub = typer.Typer()
    sub.command()(train_command)
    found["train"] = typer.main.get_command(sub)    # `train` hands its arguments over
    return found


@pytest.mark.parametrize("name", ["generate", "doctor", "bench", "train", "serve"])
def test_cli_flag_tables_match_the_commands(name):
    text = (DOCS / "cli.md").read_text()
    documented = {f for cell in table_cells(text, name) for f in FLAG.findall(cell)}
    assert documented == command_flags(commands()[name]), (
        f"docs/cli.md ## {name}: missing {command_flags(commands()[name]) - documented}, "
        f"stale {documented - command_flags(commands()[name])}")


def test_every_command_is_documented():
    text = (DOCS / "cli.md").read_text()
    for name in commands():
        assert re.search(rf"^## {name}$", text, re.M), f"docs/cli.md has no ## {name}"


def test_omlx_key_table_matches_what_omlx_reads():
    from dflash2_mlx.loading import omlx

    read = set(re.findall(r'"(dflash_[a-z_]+)"', inspect.getsource(omlx.parse_entry)))
    text = (DOCS / "omlx.md").read_text()
    rows = table_rows(text, "oMLX model settings", level=1)
    used = {k for row in rows if "read past" not in row
            for k in re.findall(r"`(dflash_[a-z_]+)`", row)}
    assert used == read, f"docs/omlx.md: missing {read - used}, stale {used - read}"
    ignored = {k for row in rows if "read past" in row
               for k in re.findall(r"`(dflash_[a-z_]+)`", row)}
    assert not ignored & read


def test_layout_table_matches_the_package():
    text = (DOCS / "api.md").read_text()
    rows = table_rows(text, "Where the code is")
    documented = {p for row in rows for p in re.findall(r"`(dflash2_mlx/[a-z_/]+(?:\.py)?)`",
                                                        row.split("|")[2])}
    pkg = ROOT / "dflash2_mlx"
    actual = {f"dflash2_mlx/{p.name}" for p in pkg.glob("*.py") if p.name != "__init__.py"}
    actual |= {f"dflash2_mlx/{p.name}/" for p in pkg.iterdir()
               if p.is_dir() and (p / "__init__.py").is_file()}
    stale = {p for p in documented if not (ROOT / p).exists()}
    assert actual <= documented and not stale, (f"docs/api.md layout: missing "
                                                 f"{actual - documented}, stale {stale}")


def test_relative_links_resolve():
    for md in [ROOT / "README.md", *DOCS.glob("*.md")]:
        for target in re.findall(r"\]\(([^)#]+)(?:#[^)]*)?\)", md.read_text()):
            if "://" in target:
                continue
            assert (md.parent / target).exists(), f"{md.name}: link to missing {target}"


def test_readme_keeps_the_two_setup_commands():
    text = (ROOT / "README.md").read_text()
    assert 'bash scripts/setup.sh && .venv/bin/dflash2-mlx generate --prompt "' in text
    assert "bash scripts/setup.sh && .venv/bin/python -m pytest -q" in text
