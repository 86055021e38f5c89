"""What people and scripts see of ``vidx``: a help line for every command, shell completion, ``vidx open``,
``--json`` (JSON and nothing else on stdout) on every listing, and tables that stay aligned and fit a
narrow terminal. No service runs: the API, MinIO, the broker and the checker are stand-ins."""

from __future__ import annotations

import io
import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import typer.main
from typer.testing import CliRunner

from events.config import AmqpSettings
from pipeline.cli.check import FOUND_EXIT
from pipeline.cli.main import app
from tests.unit.cli.cli_fakes import FakeApi, FakeMinio, offline_env, services_reachable

#: Every command that lists something, with arguments that make it list; each must take ``--json``.
LISTINGS: dict[str, list[str]] = {
    "status": [],
    "videos": [],
    "search": ["a dog"],
    "index": ["s3://videos/clips/dog.mp4"],
    "upload": ["@FILE"],
    "upload --wait": ["@FILE", "--wait", "--timeout", "30"],
    "wait": ["--timeout", "30"],
    "dlq list": [],
    "dlq replay": ["--all"],
    "parked list": [],
    "parked replay": ["--all"],
    "check": [],
    "reconcile": [],
    "reindex": ["--status"],
}


@pytest.fixture
def offline(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    return offline_env(tmp_path, monkeypatch)


def _commands() -> Iterator[tuple[str, Any]]:
    """(path, command) for every command and group registered on the app, sub-apps included."""

    def walk(group: Any, path: list[str]) -> Iterator[tuple[str, Any]]:
        for name, command in group.commands.items():
            yield " ".join([*path, name]), command
            if hasattr(command, "commands"):
                yield from walk(command, [*path, name])

    yield from walk(typer.main.get_command(app), [])


ALL_COMMANDS = [path for path, _ in _commands()]


# -- help -----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("path", ALL_COMMANDS)
def test_every_command_has_help_and_a_one_line_summary(path: str) -> None:
    command = dict(_commands())[path]
    assert (command.help or "").strip(), f"'vidx {path}' has no help text (a docstring, or help= on its Typer)"
    result = CliRunner().invoke(app, [*path.split(), "--help"])
    assert result.exit_code == 0, result.output
    assert result.stdout.startswith("Usage: "), result.stdout
    assert command.help.strip().split()[0] in result.stdout


def test_root_help_lists_every_command_with_its_line() -> None:
    result = CliRunner().invoke(app, ["--help"])
    assert result.exit_code == 0, result.output
    top = [path for path in ALL_COMMANDS if " " not in path]
    for name in top:
        assert re.search(rf"^  {re.escape(name)} +\S", result.stdout, re.MULTILINE), f"{name} missing from --help"
    assert "--install-completion" in result.stdout and "--show-completion" in result.stdout


def test_no_arguments_shows_the_help() -> None:
    result = CliRunner().invoke(app, [])
    assert "Usage: " in result.output and "upload" in result.output


# -- shell completion -----------------------------------------------------------------------------------


def test_show_completion_prints_a_bash_script_for_vidx(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("_TYPER_COMPLETE_TEST_DISABLE_SHELL_DETECTION", "1")
    result = CliRunner().invoke(app, ["--show-completion", "bash"], prog_name="vidx")
    assert result.exit_code == 0, result.output
    assert (
        "_VIDX_COMPLETE=complete_bash" in result.stdout
        and "complete -o default -F _vidx_completion vidx" in result.stdout
    )


@pytest.mark.parametrize(
    ("words", "cword", "expected"),
    [
        ("vidx dl", "1", {"dlq"}),
        ("vidx dlq ", "2", {"list", "replay"}),
        ("vidx upload --w", "2", {"--wait"}),
        ("vidx o", "1", {"open"}),
    ],
)
def test_the_completion_protocol_completes_commands_and_options(words: str, cword: str, expected: set[str]) -> None:
    env = {"_VIDX_COMPLETE": "complete_bash", "COMP_WORDS": words, "COMP_CWORD": cword}
    result = CliRunner().invoke(app, [], prog_name="vidx", env=env)
    assert result.exit_code == 0, result.output
    assert set(result.stdout.split()) == expected


# -- vidx open ------------------------------------------------------------------------------------------


def test_open_print_only_prints_the_page_url(offline: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import webbrowser

    monkeypatch.setattr(webbrowser, "open", lambda url: pytest.fail("--print must not open a browser"))
    monkeypatch.setenv("VIDX_SERVE__PORT", "8123")
    result = CliRunner().invoke(app, ["open", "--print"])
    assert result.exit_code == 0, result.output
    assert result.stdout == "http://127.0.0.1:8123/\n"


def test_open_opens_the_page_in_a_browser(offline: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import webbrowser

    opened: list[str] = []
    monkeypatch.setattr(webbrowser, "open", lambda url: opened.append(url) or True)
    monkeypatch.setenv("VIDX_SERVE__PORT", "8124")
    result = CliRunner().invoke(app, ["open"])
    assert result.exit_code == 0, result.output
    assert opened == ["http://127.0.0.1:8124/"] and result.stdout == "http://127.0.0.1:8124/\n"


def test_open_without_a_browser_says_so_in_one_line(offline: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import webbrowser

    monkeypatch.setattr(webbrowser, "open", lambda url: False)
    result = CliRunner().invoke(app, ["open"])
    assert result.exit_code == 1
    assert result.stdout.endswith("/\n")
    [line] = result.stderr.strip().splitlines()
    assert "no web browser found" in line and "BROWSER" in line and "--print" in line


# -- --json on every listing ----------------------------------------------------------------------------


class FakeChecker:
    def __init__(self) -> None:
        self.runs: list[tuple[list[str], bool]] = []

    def run(self, buckets: list[str], prefix: str = "", repair: bool = False) -> Any:
        from pipeline.upkeep.check import CheckReport, Finding, Inconsistency

        self.runs.append((buckets, repair))
        report = CheckReport(repair=repair, buckets=list(buckets), listed=2, videos=2, in_sync=1)
        report.counts[Finding.MISSING] = 1
        report.found.append(
            Inconsistency(
                Finding.MISSING, f"s3://{buckets[0]}/clips/new one.mp4", "v9", "in the bucket, never cataloged"
            )
        )
        return report


@pytest.fixture
def stand_ins(offline: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> dict[str, Any]:
    """The API (two videos; uploads get indexed), MinIO, a broker holding two parked events and
    two dead letters, a checker that finds one missing video and an index (a local directory)
    answering with one model; every probe succeeds."""
    import pipeline.cli.reindex
    import pipeline.jobs.taskqueue
    import pipeline.upkeep.check
    import storage.tables
    from events.parked import park
    from storage.models import ModelState, ModelTable
    from tests.unit.events.test_deadletters import LETTERS, ListSink, put_letters
    from tests.unit.events.test_parked import VIDEO, FakeChannel, patch_broker

    services_reachable(monkeypatch)
    minio = FakeMinio().install(monkeypatch)

    def index_uploads(api: FakeApi) -> None:
        for bucket, key in minio.objects:
            api.put(f"s3://{bucket}/{key}", "indexed", at=100, frames=3)

    api = FakeApi(on_list=index_uploads).install(monkeypatch)
    api.put("s3://videos/clips/dog.mp4", "indexed", at=1, frames=6)
    api.put("s3://videos/clips/broken.mp4", "failed", at=2, error="not a video: no video stream")
    broker = patch_broker(monkeypatch)
    amqp = AmqpSettings()
    park(FakeChannel(broker), amqp.parked_queue, b"\xffnot json", "not JSON: Expecting value", 1)
    park(FakeChannel(broker), amqp.parked_queue, VIDEO, "gave up after 5 attempts: task queue unavailable", 5)
    put_letters(broker, *LETTERS)
    from pipeline.settings import Settings

    broker.queues[Settings().serve.failed_queue] = broker.queues.pop("failed")
    checker = FakeChecker()
    monkeypatch.setattr(pipeline.upkeep.check, "build_checker", lambda settings, store, sink: checker)
    index = storage.tables.IndexStore(Settings().s3, uri=str(tmp_path / "index"))
    index.models.write(ModelState(active=ModelTable.new("tiny", 8)), 0)
    monkeypatch.setattr(pipeline.cli.reindex, "index_store", lambda settings: index)
    monkeypatch.setattr(storage.tables, "IndexStore", lambda s3: object())
    monkeypatch.setattr(pipeline.jobs.taskqueue, "queueing_sink", lambda settings, store: ListSink())
    clip = tmp_path / "holiday.mp4"
    clip.write_bytes(b"not really a video, the stand-ins don't mind")
    return {"api": api, "minio": minio, "broker": broker, "checker": checker, "file": clip}


def _listing_args(name: str, stand_ins: dict[str, Any]) -> list[str]:
    args = [str(stand_ins["file"]) if a == "@FILE" else a for a in LISTINGS[name]]
    return [*name.split()[: 2 if name.startswith(("dlq", "parked")) else 1], *args]


@pytest.mark.parametrize("name", sorted(LISTINGS))
def test_every_listing_prints_json_and_nothing_else(name: str, stand_ins: dict[str, Any]) -> None:
    result = CliRunner().invoke(app, [*_listing_args(name, stand_ins), "--json"])
    assert result.exit_code in (0, FOUND_EXIT), result.output
    parsed = json.loads(result.stdout)
    assert parsed or parsed == {}, result.stdout
    assert "\r" not in result.stderr and "it/s" not in result.stderr  # no progress bar


@pytest.mark.parametrize("name", sorted(LISTINGS))
def test_every_listing_prints_a_table_for_people(name: str, stand_ins: dict[str, Any]) -> None:
    result = CliRunner().invoke(app, _listing_args(name, stand_ins))
    assert result.exit_code in (0, FOUND_EXIT), result.output
    assert result.stdout.strip(), result.output
    with pytest.raises(ValueError):
        json.loads(result.stdout)


def test_every_command_with_json_is_a_known_listing() -> None:
    with_json = {
        path for path, command in _commands() if any("--json" in getattr(p, "opts", []) for p in command.params)
    }
    assert with_json >= {name.split(" --")[0] for name in LISTINGS}
    assert with_json <= {name.split(" --")[0] for name in LISTINGS}, "add the new listing to LISTINGS"


def test_the_listings_show_what_the_stand_ins_hold(stand_ins: dict[str, Any]) -> None:
    runner = CliRunner()
    videos = runner.invoke(app, ["videos"]).stdout.splitlines()
    assert videos[0].split() == ["STATUS", "FRAMES", "DURATION", "URI", "ERROR"]
    assert videos[1].split() == [
        "failed",
        "0",
        "-",
        "s3://videos/clips/broken.mp4",
        "not",
        "a",
        "video:",
        "no",
        "video",
        "stream",
    ]
    assert videos[2].split() == ["indexed", "6", "00:00:12.5", "s3://videos/clips/dog.mp4", "-"]
    # Aligned: each column starts where its header does.
    assert {line.index("s3://") for line in videos[1:]} == {videos[0].index("URI")}
    dlq = runner.invoke(app, ["dlq", "list"]).stdout.splitlines()
    assert dlq[0].split() == ["ID", "FAILED", "AT", "ATTEMPTS", "KIND", "VIDEO", "REASON"]
    assert [row.split()[0] for row in dlq[1:]] == ["t1", "t2"]
    parked = runner.invoke(app, ["parked", "list"]).stdout.splitlines()
    assert parked[0].split() == ["ID", "PARKED", "AT", "ATTEMPTS", "OBJECTS", "REASON"]
    assert parked[2].endswith("s3://videos/clips/a b.mp4  gave up after 5 attempts: task queue unavailable")
    check = runner.invoke(app, ["check"])
    assert check.exit_code == FOUND_EXIT
    assert check.stdout.splitlines()[0].split() == ["FINDING", "VIDEO", "DETAIL"]
    assert check.stdout.splitlines()[1].startswith("missing  s3://videos/clips/new one.mp4  in the bucket")
    assert check.stdout.splitlines()[-1].startswith("checked 2 videos")
    search = runner.invoke(app, ["search", "a dog"])
    assert search.stdout.splitlines()[1].split()[:4] == [
        "0.812",
        "s3://videos/clips/dog.mp4",
        "00:00:03.0–00:00:07.5",
        "00:00:04.0",
    ]
    assert "X-Amz-Signature=abc" in search.stdout and "1 moments" in search.stderr


def test_search_shows_what_found_each_moment_and_marks_the_words_it_matched(stand_ins: dict[str, Any]) -> None:
    runner = CliRunner()
    result = runner.invoke(app, ["search", '"red boat"', "--sources", "subtitle,visual"])
    header, row = result.stdout.splitlines()[:2]
    assert header.split() == ["SCORE", "VIDEO", "MOMENT", "BEST", "FOUND", "BY", "WORDS", "PLAY"]
    assert row.split()[:5] == [
        "0.0325",
        "s3://videos/clips/dog.mp4",
        "00:00:03.0–00:00:07.5",
        "00:00:04.0",
        "visual+subtitle",
    ]
    assert "A *red* *boat* leaves" in row
    api = stand_ins["api"]
    assert api.search_params[-1] == {"q": '"red boat"', "k": "10", "sources": "subtitle,visual"}
    # A search the words took no part in keeps its columns
    plain = runner.invoke(app, ["search", "a dog"]).stdout.splitlines()
    assert plain[0].split() == ["SCORE", "VIDEO", "MOMENT", "BEST", "PLAY"]


def test_search_never_sends_a_subtitles_control_characters_to_the_terminal() -> None:
    from pipeline.cli.main import marked

    assert marked("red\x1b[2Jboat", [[0, 3]]) == "*red* [2Jboat"


@pytest.mark.parametrize(
    ("alias", "same_as"),
    [(["reconcile"], ["check", "--repair"]), (["reconcile", "--dry-run", "--verbose"], ["check"])],
)
def test_reconcile_is_an_alias_of_check_repair(alias: list[str], same_as: list[str], stand_ins: dict[str, Any]) -> None:
    runner = CliRunner()
    checker = stand_ins["checker"]
    got = runner.invoke(app, [*alias, "-b", "videos", "--prefix", "clips/"])
    expected = runner.invoke(app, [*same_as, "-b", "videos", "--prefix", "clips/"])
    assert (got.exit_code, got.stdout) == (expected.exit_code, expected.stdout), got.output
    assert checker.runs[0] == checker.runs[1] == (["videos"], "--repair" in same_as)


def test_empty_listings_say_so(stand_ins: dict[str, Any]) -> None:
    stand_ins["api"].rows.clear()
    stand_ins["broker"].queues.clear()
    runner = CliRunner()
    assert runner.invoke(app, ["videos"]).stdout == "no videos\n"
    assert runner.invoke(app, ["dlq", "list"]).stdout == "no dead letters\n"
    assert runner.invoke(app, ["parked", "list"]).stdout == "no parked events\n"
    assert json.loads(runner.invoke(app, ["dlq", "list", "--json"]).stdout) == []


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_a_table_fits_a_narrow_terminal_and_keeps_every_character(monkeypatch: pytest.MonkeyPatch) -> None:
    import sys

    from pipeline.cli.output import Column, table

    monkeypatch.setenv("COLUMNS", "40")
    out = _Terminal()
    monkeypatch.setattr(sys, "stdout", out)
    uri = "s3://videos/a/rather/long/path/to/a/holiday/clip.mp4"
    table([Column("STATUS"), Column("FRAMES", right=True), Column("URI", fold=True)], [("indexed", 42, uri)], empty="-")
    lines = re.sub(r"\x1b\[[0-9;]*m", "", out.getvalue()).splitlines()  # a terminal gets a bold header
    assert all(len(line) <= 40 for line in lines), lines
    assert lines[1].startswith("indexed") and lines[1].split()[1] == "42"
    assert "".join(line[lines[0].index("URI") :] for line in lines[1:]).replace(" ", "") == uri


def test_a_table_on_a_pipe_never_wraps(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    from pipeline.cli.output import Column, table

    monkeypatch.setenv("COLUMNS", "40")
    uri = "s3://videos/" + "x" * 300 + ".mp4"
    table([Column("STATUS"), Column("URI", fold=True)], [("indexed", uri), ("[bold]queued[/bold]", None)], empty="-")
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 3 and lines[1].endswith(uri)
    assert lines[2].split() == ["[bold]queued[/bold]", "-"]  # values are text, never markup


def test_bars_only_for_a_terminal_and_never_with_json(monkeypatch: pytest.MonkeyPatch) -> None:
    import sys

    from pipeline.cli.output import bars_on

    monkeypatch.setattr(sys, "stderr", _Terminal())
    assert bars_on(as_json=False) and not bars_on(as_json=True)
    monkeypatch.setattr(sys, "stderr", io.StringIO())
    assert not bars_on(as_json=False)
