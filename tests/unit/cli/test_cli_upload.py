"""``vidx upload --wait`` settles each upload by what its catalog row says after the upload, shows a
bar of videos indexed/failed of N on a terminal, exits 1 naming each failed video with its reason and
124 when ``--timeout`` passes, and never lets an API call outlive that deadline."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

import pipeline.cli.upload as cli_upload
from pipeline.cli.errors import ApiError
from pipeline.cli.main import app
from pipeline.cli.upload import TIMEOUT_EXIT, WAIT_PROBES_PER_ROUND, IndexWait, Uploaded
from tests.unit.cli.cli_fakes import FakeApi, FakeMinio, services_reachable, unused_port, video_row


@pytest.fixture
def stack(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> tuple[FakeApi, FakeMinio]:
    """Settings at unused ports, every probe answering, the API and MinIO as stand-ins, fast polls."""
    monkeypatch.setenv("VIDX_STATE_DIR", str(tmp_path / "state"))
    monkeypatch.setenv("VIDX_SERVE__PORT", str(unused_port()))
    monkeypatch.setenv("VIDX_S3__ENDPOINT_URL", f"http://127.0.0.1:{unused_port()}")
    for name in ("VIDX_API_KEY", "VIDX_API_KEYS", "VIDX_API_KEY_FILE", "VIDX_ADMIN_KEY", "VIDX_ADMIN_KEY_FILE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(cli_upload, "WAIT_POLL_S", 0.01)
    services_reachable(monkeypatch)
    return FakeApi().install(monkeypatch), FakeMinio().install(monkeypatch)


def _clips(tmp_path: Path, *names: str) -> list[str]:
    paths = []
    for name in names:
        (tmp_path / name).write_bytes(f"video bytes of {name}".encode())
        paths.append(str(tmp_path / name))
    return paths


def _script(api: FakeApi, steps: dict[str, list[tuple[str, str | None]]]) -> None:
    """On the Nth listing, each video takes the Nth (status, error) of its steps (its last one after)."""

    def advance(fake: FakeApi) -> None:
        for name, seq in steps.items():
            status, error = seq[min(fake.lists - 1, len(seq) - 1)]
            fake.put(
                f"s3://videos/{name}", status, at=10 * fake.lists, error=error, frames=4 if status == "indexed" else 0
            )

    api.on_list = advance


def test_wait_settles_every_upload_and_shows_the_result(stack: tuple[FakeApi, FakeMinio], tmp_path: Path) -> None:
    api, minio = stack
    _script(api, {"a.mp4": [("queued", None), ("indexing", None), ("indexed", None)], "b.mp4": [("indexed", None)]})
    result = CliRunner().invoke(app, ["upload", *_clips(tmp_path, "a.mp4", "b.mp4"), "--wait", "--timeout", "30"])
    assert result.exit_code == 0, result.output
    assert set(minio.objects) == {("videos", "a.mp4"), ("videos", "b.mp4")}
    header, *rows = result.stdout.splitlines()
    assert header.split() == ["STATUS", "FRAMES", "URI", "ERROR"]
    assert [row.split() for row in rows] == [
        ["indexed", "4", "s3://videos/a.mp4", "-"],
        ["indexed", "4", "s3://videos/b.mp4", "-"],
    ]
    assert api.lists == 3 and result.stderr == ""


def test_wait_lists_each_failed_video_with_its_reason_and_exits_1(
    stack: tuple[FakeApi, FakeMinio], tmp_path: Path
) -> None:
    api, _ = stack
    _script(api, {"ok.mp4": [("indexed", None)], "bad.mp4": [("failed", "not a video: no video stream")]})
    result = CliRunner().invoke(app, ["upload", *_clips(tmp_path, "ok.mp4", "bad.mp4"), "--wait"])
    assert result.exit_code == 1, result.output
    assert result.stderr.splitlines() == [
        "vidx: failed: s3://videos/bad.mp4: not a video: no video stream",
        "vidx: 1 of 2 videos failed",
    ]
    assert "failed" in result.stdout and "not a video: no video stream" in result.stdout


def test_wait_gives_up_at_its_timeout_with_exit_124_and_no_call_past_it(
    stack: tuple[FakeApi, FakeMinio], tmp_path: Path
) -> None:
    api, _ = stack
    _script(api, {"slow.mp4": [("queued", None), ("indexing", None)], "fast.mp4": [("indexed", None)]})
    result = CliRunner().invoke(
        app, ["upload", *_clips(tmp_path, "slow.mp4", "fast.mp4"), "--wait", "--timeout", "0.5"]
    )
    assert result.exit_code == TIMEOUT_EXIT, result.output
    [line] = result.stderr.splitlines()
    assert line.startswith("vidx: 1 of 2 videos not settled within 0.5s: s3://videos/slow.mp4 (indexing)")
    assert "--timeout" in line
    assert api.lists > 3  # it kept polling until the deadline
    assert max(api.timeouts[2:]) <= 0.5  # every call of the wait was bounded by what was left of it


def test_wait_with_json_prints_each_video_and_no_bar(
    stack: tuple[FakeApi, FakeMinio], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import pipeline.cli.output as output

    monkeypatch.setattr(output, "bars_on", lambda as_json: not as_json)  # as on a terminal
    api, _ = stack
    _script(api, {"a.mp4": [("indexing", None), ("indexed", None)]})
    result = CliRunner().invoke(app, ["upload", *_clips(tmp_path, "a.mp4"), "--wait", "--json"])
    assert result.exit_code == 0, result.output
    [video] = json.loads(result.stdout)
    assert (video["uri"], video["status"], video["frames"], video["settled"]) == (
        "s3://videos/a.mp4",
        "indexed",
        4,
        True,
    )
    assert result.stderr == ""


def test_on_a_terminal_the_bar_counts_videos_indexed_and_failed(
    stack: tuple[FakeApi, FakeMinio], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import pipeline.cli.output as output

    monkeypatch.setattr(output, "bars_on", lambda as_json: not as_json)
    api, _ = stack
    _script(api, {"a.mp4": [("indexing", None), ("indexed", None)], "b.mp4": [("failed", "decode error: bad")]})
    result = CliRunner().invoke(app, ["upload", *_clips(tmp_path, "a.mp4", "b.mp4"), "--wait"])
    assert result.exit_code == 1
    assert "indexing: 100%" in result.stderr and "2/2" in result.stderr
    assert "1 indexed, 1 failed" in result.stderr
    assert "B/s" in result.stderr  # the upload's bar of bytes came first


def test_an_upload_of_the_same_content_settles_on_the_row_it_already_has(
    stack: tuple[FakeApi, FakeMinio], tmp_path: Path
) -> None:
    api, minio = stack
    [clip] = _clips(tmp_path, "same.mp4")
    minio.objects["videos", "same.mp4"] = Path(clip).read_bytes()
    api.put("s3://videos/same.mp4", "indexed", at=1, frames=7)  # no job will touch it again
    result = CliRunner().invoke(app, ["upload", clip, "--wait", "--timeout", "5"])
    assert result.exit_code == 0, result.output
    assert result.stdout.splitlines()[1].split()[:2] == ["indexed", "7"] and api.lists == 1


def test_new_content_over_an_indexed_video_waits_for_its_row_to_change(
    stack: tuple[FakeApi, FakeMinio], tmp_path: Path
) -> None:
    api, minio = stack
    minio.objects["videos", "v.mp4"] = b"the old content"
    api.put("s3://videos/v.mp4", "indexed", at=1, frames=7)

    def reindex_on_third_listing(fake: FakeApi) -> None:
        if fake.lists == 3:
            fake.put("s3://videos/v.mp4", "indexed", at=50, frames=9)

    api.on_list = reindex_on_third_listing
    result = CliRunner().invoke(app, ["upload", *_clips(tmp_path, "v.mp4"), "--wait", "--timeout", "30"])
    assert result.exit_code == 0, result.output
    assert api.lists == 3 and result.stdout.splitlines()[1].split()[:2] == ["indexed", "9"]


def test_wait_needs_a_watched_bucket(stack: tuple[FakeApi, FakeMinio], tmp_path: Path) -> None:
    result = CliRunner().invoke(app, ["upload", *_clips(tmp_path, "a.mp4"), "--bucket", "elsewhere", "--wait"])
    assert result.exit_code == 1
    assert result.stderr.splitlines() == [
        "vidx: bucket elsewhere is not watched (VIDX_S3__BUCKETS), so --wait would never end"
    ]
    assert stack[1].objects == {}


def test_wait_checks_the_api_before_uploading(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    port = unused_port()
    monkeypatch.setenv("VIDX_STATE_DIR", str(tmp_path / "state"))
    monkeypatch.setenv("VIDX_SERVE__PORT", str(port))
    services_reachable(monkeypatch)
    minio = FakeMinio().install(monkeypatch)
    result = CliRunner().invoke(app, ["upload", *_clips(tmp_path, "a.mp4"), "--wait"])
    assert result.exit_code == 1
    assert result.stderr.splitlines() == [
        f"vidx: the vidx API is not reachable at http://127.0.0.1:{port} — run `vidx up`, "
        "or set VIDX_SERVE__HOST / VIDX_SERVE__PORT"
    ]
    assert minio.objects == {}


# -- IndexWait alone, on a fake clock -----------------------------------------------------------------------


class Clock:
    def __init__(self) -> None:
        self.now = 100.0
        self.slept: list[float] = []

    def __call__(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.slept.append(seconds)
        self.now += seconds


class ScriptedApi:
    """``request`` answers from ``answers`` in turn (an exception is raised); each call takes ``cost_s``."""

    def __init__(self, clock: Clock, answers: list[Any], cost_s: float = 1.0) -> None:
        self.clock, self.answers, self.cost_s = clock, answers, cost_s
        self.calls: list[tuple[dict[str, Any], float]] = []
        #: (when the call started, the timeout it was given)
        self.started: list[tuple[float, float]] = []

    def request(self, method: str, path: str, *, params: dict[str, Any], timeout_s: float) -> Any:
        self.calls.append((params, timeout_s))
        self.started.append((self.clock.now, timeout_s))
        self.clock.now += min(self.cost_s, timeout_s)
        answer = self.answers[min(len(self.calls) - 1, len(self.answers) - 1)]
        if isinstance(answer, Exception):
            raise answer
        return {"videos": answer}


def _wait(api: ScriptedApi, uploads: list[Uploaded], timeout_s: float) -> tuple[list[Uploaded], list[str]]:
    settled: list[str] = []
    waiter = IndexWait(api, uploads, timeout_s, poll_s=2.0, clock=api.clock, sleep=api.clock.sleep)  # type: ignore[arg-type]
    return waiter.run(lambda u: settled.append(u.uri)), settled


def test_no_call_and_no_sleep_outlives_the_deadline() -> None:
    clock = Clock()
    api = ScriptedApi(clock, [[video_row("s3://videos/a.mp4", "queued")]], cost_s=1.5)
    pending, settled = _wait(api, [Uploaded("s3://videos/a.mp4", "v")], timeout_s=10.0)
    assert [u.uri for u in pending] == ["s3://videos/a.mp4"] and settled == []
    assert clock.now <= 110.0 and len(api.calls) >= 3
    for started_at, timeout_s in api.started:
        assert started_at + timeout_s <= 110.0, (started_at, timeout_s)  # each call gets only what is left
    assert all(s <= 2.0 for s in clock.slept)
    assert pending[0].status == "queued"


def test_an_unreachable_or_failing_api_is_retried_a_refusal_is_not() -> None:
    clock = Clock()
    row = video_row("s3://videos/a.mp4", "indexed", at=5)
    api = ScriptedApi(clock, [ApiError("down"), ApiError("busy", 503), [row]])
    pending, settled = _wait(api, [Uploaded("s3://videos/a.mp4", "v")], timeout_s=60.0)
    assert pending == [] and settled == ["s3://videos/a.mp4"]
    refused = ScriptedApi(Clock(), [ApiError("refused", 401)])
    with pytest.raises(ApiError, match="refused"):
        _wait(refused, [Uploaded("s3://videos/a.mp4", "v")], timeout_s=60.0)


def test_a_row_left_as_it_was_before_the_upload_does_not_settle_it() -> None:
    before = video_row("s3://videos/a.mp4", "indexed", at=1)
    after = video_row("s3://videos/a.mp4", "failed", at=9, error="decode error: x")
    api = ScriptedApi(Clock(), [[before], [before], [after]])
    upload = Uploaded("s3://videos/a.mp4", "v", before=before["updated_at"])
    pending, _ = _wait(api, [upload], timeout_s=60.0)
    assert pending == [] and len(api.calls) == 3
    assert (upload.status, upload.error, upload.failed) == ("failed", "decode error: x", True)


def test_a_deleted_video_settles_as_failed_with_a_reason() -> None:
    api = ScriptedApi(Clock(), [[video_row("s3://videos/a.mp4", "deleted", at=3)]])
    upload = Uploaded("s3://videos/a.mp4", "v")
    _wait(api, [upload], timeout_s=60.0)
    assert upload.failed and upload.error == "deleted: the object is gone from the bucket"


def test_a_full_listing_looks_up_a_bounded_number_of_videos_per_round() -> None:
    others = [video_row(f"s3://videos/other-{i}.mp4", "indexed", at=i) for i in range(cli_upload.WAIT_LIST_LIMIT)]
    uploads = [Uploaded(f"s3://videos/mine-{i}.mp4", f"v{i}") for i in range(WAIT_PROBES_PER_ROUND + 5)]
    clock = Clock()

    class Api(ScriptedApi):
        def request(self, method: str, path: str, *, params: dict[str, Any], timeout_s: float) -> Any:
            self.calls.append((params, timeout_s))
            if "uri" in params:
                return {"videos": [video_row(params["uri"], "indexed", at=99)]}
            return {"videos": others}

    api = Api(clock, [])
    pending, settled = _wait(api, uploads, timeout_s=60.0)
    assert pending == [] and len(settled) == len(uploads)
    lookups_per_round: list[int] = []
    for params, _ in api.calls:
        if "limit" in params:
            lookups_per_round.append(0)
        else:
            lookups_per_round[-1] += 1
    assert lookups_per_round == [WAIT_PROBES_PER_ROUND, 5]


def test_videos_lists_a_page_and_says_how_to_get_the_next(stack: tuple[FakeApi, FakeMinio]) -> None:
    api, _ = stack
    for i in range(3):
        api.put(f"s3://videos/v{i}.mp4", "indexed", at=i)
    first = CliRunner().invoke(app, ["videos", "--limit", "2"])
    assert first.exit_code == 0, first.output
    assert "v2.mp4" in first.stdout and "v1.mp4" in first.stdout and "v0.mp4" not in first.stdout
    assert "(more: vidx videos --cursor 2)" in first.stderr
    rest = CliRunner().invoke(app, ["videos", "--limit", "2", "--cursor", "2"])
    assert rest.exit_code == 0 and "v0.mp4" in rest.stdout and "more:" not in rest.stderr


def test_wait_counts_by_status_from_the_catalog_not_from_a_listing(stack: tuple[FakeApi, FakeMinio]) -> None:
    api, _ = stack
    for i in range(1500):  # more than one listing page holds
        api.put(f"s3://videos/v{i}.mp4", "indexed", at=i)
    result = CliRunner().invoke(app, ["wait", "--count", "1500", "--timeout", "5", "--json"])
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout) == {"indexed": 1500} and api.lists == 0
