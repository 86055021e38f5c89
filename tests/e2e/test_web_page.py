"""The web page in a real browser (Debian's Chromium, headless, driven by Playwright) over the real
Ray Serve app, MinIO and RabbitMQ, with API keys on: the key prompt, a text query's grid of moments,
the player at the moment's second, image search by file, a moment found by its words (a subtitle track)
showing them with the query's marked, and a video uploaded from the page going
``queued → indexing → indexed``, the dead letters, and the Model tab following a model switch.
Screenshots are kept as test artifacts (``VIDX_ARTIFACTS_DIR``, else
pytest's temp dir) and, with ``VIDX_UPDATE_SCREENSHOTS=1``, written to docs/img/."""

from __future__ import annotations

import io
import os
import secrets
import shutil
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
from PIL import Image

from infra.harness.faults import start_app
from infra.harness.services import Services, eventually, unique_prefix
from pipeline.settings import Settings
from storage.ids import video_id
from tests.media import frame_at, write_corrupt_mp4, write_video

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(600)]

INDEX_TIMEOUT_S = 120.0
#: Longest wait for the page to show something (a search embeds the query on a CPU).
UI_TIMEOUT_MS = 30_000
DOCS_IMG = Path(__file__).resolve().parents[2] / "docs" / "img"
SEEDS = {"harbour at dusk.mp4": 701, "city traffic.mp4": 702, "forest walk.mp4": 703}


def chromium_path() -> str:
    """Debian's Chromium (``infra/local/install-system.sh`` installs it); no browser download."""
    found = shutil.which("chromium") or shutil.which("chromium-browser")
    if found is None:
        pytest.fail("chromium is not installed: run `make system` (Debian package `chromium`)")
    return found


@dataclass
class Site:
    settings: Settings
    services: Services
    http: httpx.Client
    api_key: str
    admin_key: str
    browser: Any
    artifacts: Path

    @property
    def url(self) -> str:
        return self.settings.api_url + "/"

    @property
    def bucket(self) -> str:
        return self.settings.s3.upload_bucket

    def page(self, key: str | None) -> Any:
        """A fresh tab (its own session storage); with ``key``, already entered through the prompt."""
        context = self.browser.new_context(viewport={"width": 1280, "height": 860})
        page = context.new_page()
        urls: list[str] = []
        page.on("request", lambda request: urls.append(request.url))
        page.vidx_urls = urls  # every URL this tab asked for: the key must never be in one
        page.goto(self.url)
        if key is not None:
            page.locator("#key-dialog").wait_for(state="visible", timeout=UI_TIMEOUT_MS)
            page.fill("#api-key", key)
            page.click("#key-form button[type=submit]")
            page.locator("#key-dialog").wait_for(state="hidden", timeout=UI_TIMEOUT_MS)
        return page

    def shot(self, page: Any, name: str) -> None:
        path = self.artifacts / name
        page.screenshot(path=str(path), full_page=False)
        if os.environ.get("VIDX_UPDATE_SCREENSHOTS") == "1":
            DOCS_IMG.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(path, DOCS_IMG / name)

    def status(self, vid: str) -> str | None:
        resp = self.http.get(f"/v1/videos/{vid}", headers={"Authorization": f"Bearer {self.api_key}"})
        return resp.json()["status"] if resp.status_code == 200 else None


@pytest.fixture(scope="module")
def site(services: Services, tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Site]:
    from playwright.sync_api import sync_playwright

    api_key, admin_key = secrets.token_urlsafe(24), secrets.token_urlsafe(24)
    # A model switch the Model tab's test starts never completes before it aborts it.
    # Subtitles on: a moment found by its words shows them, the query's marked.
    env = {
        "VIDX_API_KEY": api_key,
        "VIDX_ADMIN_KEY": admin_key,
        "VIDX_REINDEX__CLOCK_SKEW_S": "3600",
        "VIDX_TEXT__SUBTITLES": "true",
    }
    media = tmp_path_factory.mktemp("media")
    artifacts = Path(os.environ.get("VIDX_ARTIFACTS_DIR") or tmp_path_factory.mktemp("screenshots"))
    artifacts.mkdir(parents=True, exist_ok=True)
    with (
        start_app(services, unique_prefix(), tiny_model_dir, tmp_path_factory.mktemp("state"), env=env) as host,
        sync_playwright() as playwright,
    ):
        browser = playwright.chromium.launch(executable_path=chromium_path(), args=["--no-sandbox"])
        site = Site(host.settings, services, host.http, api_key, admin_key, browser, artifacts)
        minio = services.minio_client()
        for name, seed in SEEDS.items():
            minio.fput_object(site.bucket, name, str(write_video(media / name, seconds=10, seed=seed)))
        ids = [video_id(site.bucket, name) for name in SEEDS]
        eventually(
            lambda: all(site.status(v) == "indexed" for v in ids), "the sample videos to be indexed", INDEX_TIMEOUT_S
        )
        try:
            yield site
        finally:
            browser.close()
            print(f"\nscreenshots: {artifacts}")


def test_the_page_asks_for_the_api_key_and_keeps_it_for_the_tab_only(site: Site) -> None:
    page = site.page(key=None)
    page.locator("#key-dialog").wait_for(state="visible", timeout=UI_TIMEOUT_MS)
    site.shot(page, "web-key-prompt.png")
    page.fill("#api-key", site.api_key)
    page.click("#key-form button[type=submit]")
    page.locator("#key-dialog").wait_for(state="hidden", timeout=UI_TIMEOUT_MS)
    assert page.evaluate("sessionStorage.getItem('vidx.apiKey')") == site.api_key
    assert page.evaluate("localStorage.length") == 0
    # A user key does not open the dead letters.
    page.locator("#tab-dlq").wait_for(state="hidden", timeout=UI_TIMEOUT_MS)
    # Reloaded, the tab keeps its key: the page's first call is answered 200 and no prompt opens.
    with page.expect_response(lambda r: "v1/videos?limit=1" in r.url, timeout=UI_TIMEOUT_MS) as first:
        page.reload()
    assert first.value.status == 200
    assert not page.locator("#key-dialog").is_visible()
    page.context.close()
    # A new tab has its own session storage: it asks again.
    other = site.page(key=None)
    other.locator("#key-dialog").wait_for(state="visible", timeout=UI_TIMEOUT_MS)
    other.context.close()


def test_a_text_query_shows_moments_and_a_click_plays_from_the_moments_start(site: Site) -> None:
    page = site.page(site.api_key)
    page.fill("#q", "boats in a harbour at dusk")
    page.press("#q", "Enter")
    moments = page.locator("#results .moment")
    moments.first.wait_for(timeout=UI_TIMEOUT_MS)
    assert moments.count() >= 3
    # Every thumbnail loaded: an <img> sends no Authorization header, so each came through its signed link.
    page.wait_for_function(
        "() => [...document.querySelectorAll('#results img')].every(i => i.complete && i.naturalWidth > 0)",
        timeout=UI_TIMEOUT_MS,
    )
    assert page.locator("#results .moment .timeline .hit").count() >= moments.count()
    names = set(page.locator("#results .moment .name").all_inner_texts())
    assert names <= set(SEEDS) and len(names) == len(SEEDS)
    site.shot(page, "web-search.png")

    # A moment well into its video: a player that ignored the start would sit at 0.
    starts = [float(s) for s in (moments.nth(i).get_attribute("data-start-s") for i in range(moments.count()))]
    later = max(range(len(starts)), key=lambda i: starts[i])
    start_s = starts[later]
    assert start_s >= 2.0, starts
    moments.nth(later).locator("button.open").click()
    page.locator("#player").wait_for(state="visible", timeout=UI_TIMEOUT_MS)
    page.wait_for_function("() => document.querySelector('#player-video').readyState >= 2", timeout=UI_TIMEOUT_MS)
    page.evaluate("document.querySelector('#player-video').pause()")
    current_s = page.evaluate("document.querySelector('#player-video').currentTime")
    # Paused right after loading: at the moment's start (the media fragment), within one frame or so.
    assert abs(current_s - start_s) < 0.5, (current_s, start_s)
    site.shot(page, "web-player.png")
    assert all(site.api_key not in url and site.admin_key not in url for url in page.vidx_urls)
    page.context.close()


def test_image_search_by_file_finds_the_video_at_that_second(site: Site, tmp_path: Path) -> None:
    query = tmp_path / "frame.png"
    Image.fromarray(frame_at(6, SEEDS["city traffic.mp4"])).save(query)
    page = site.page(site.api_key)
    page.set_input_files("#image-file", str(query))
    top = page.locator("#results .moment").first
    top.wait_for(timeout=UI_TIMEOUT_MS)
    assert top.get_attribute("data-video-id") == video_id(site.bucket, "city traffic.mp4")
    assert "06.0" in top.locator(".span").inner_text()  # best frame at 00:06.0
    assert "image frame.png" in page.locator("#search-summary").inner_text()
    page.context.close()


def test_a_video_uploaded_from_the_page_is_followed_until_indexed(site: Site, tmp_path: Path) -> None:
    clip = write_video(tmp_path / "from the page.mp4", seconds=6, seed=704)
    page = site.page(site.api_key)
    page.click(".tabs [data-view=videos]")
    seen: list[str] = []
    page.expose_function("vidxSeen", lambda status: seen.append(status))
    # Record every status the upload row shows, as it shows it.
    page.evaluate(
        """new MutationObserver(() => {
             const row = document.querySelector('#uploads li');
             if (row && row.dataset.status) window.vidxSeen(row.dataset.status);
           }).observe(document.querySelector('#uploads'), {subtree: true, attributes: true, childList: true})"""
    )
    page.set_input_files("#upload-file", str(clip))
    row = page.locator("#uploads li[data-status=indexed]")
    row.wait_for(timeout=INDEX_TIMEOUT_S * 1000)
    assert "6 frames" in row.inner_text()
    # (Its text job may hold the row "indexing" for a moment after: subtitles are on in this app.)
    uploaded = video_id(site.bucket, "from the page.mp4")
    eventually(lambda: site.status(uploaded) == "indexed", "the upload indexed", INDEX_TIMEOUT_S)
    # The object came from the browser: it is in the bucket under the file's name.
    assert site.services.minio_client().stat_object(site.bucket, "from the page.mp4").size == clip.stat().st_size
    statuses = list(dict.fromkeys(seen))
    assert statuses[0] == "uploaded" and statuses[-1] == "indexed", statuses
    assert set(statuses) <= {"uploading", "uploaded", "queued", "indexing", "indexed"}, statuses
    page.locator("#videos tbody tr[data-status=indexed]").nth(len(SEEDS)).wait_for(timeout=UI_TIMEOUT_MS)
    site.shot(page, "web-videos.png")
    page.context.close()


def test_the_admin_key_sees_a_failed_video_in_the_dead_letters_and_replays_it(site: Site, tmp_path: Path) -> None:
    broken = write_corrupt_mp4(tmp_path / "broken.mp4")
    site.services.minio_client().fput_object(site.bucket, "broken upload.mp4", str(broken))
    vid = video_id(site.bucket, "broken upload.mp4")
    eventually(lambda: site.status(vid) == "failed", "the broken video to fail", INDEX_TIMEOUT_S)

    def dead_lettered() -> bool:
        resp = site.http.get("/v1/admin/dlq", headers={"Authorization": f"Bearer {site.admin_key}"})
        return resp.status_code == 200 and "broken upload.mp4" in resp.text

    # The catalog says `failed` a moment before the consumer stores the dead letter, and the tab
    # lists what is stored when it is opened.
    eventually(dead_lettered, "its dead letter to be stored", INDEX_TIMEOUT_S)
    page = site.page(site.admin_key)
    page.click(".tabs [data-view=videos]")
    failed = page.locator(f"#videos tbody tr[data-video-id='{vid}']")
    failed.wait_for(timeout=UI_TIMEOUT_MS)
    assert "decode error" in failed.locator(".reason").inner_text()
    page.locator("#tab-dlq").wait_for(state="visible", timeout=UI_TIMEOUT_MS)
    page.click("#tab-dlq")
    letter = page.locator("#dlq tbody tr", has_text="broken upload.mp4")
    letter.wait_for(timeout=UI_TIMEOUT_MS)
    letter.locator("button").click()
    page.locator("#notice", has_text="Replayed 1").wait_for(timeout=UI_TIMEOUT_MS)
    page.context.close()


def test_the_page_is_public_but_nothing_it_shows_is(site: Site) -> None:
    assert site.http.get("/").status_code == 200
    assert site.http.get("/v1/videos").status_code == 401
    buf = io.BytesIO()
    Image.fromarray(frame_at(2, 701)).save(buf, format="PNG")
    assert (
        site.http.post("/v1/search/image", files={"image": ("q.png", buf.getvalue(), "image/png")}).status_code == 401
    )


def test_a_moment_found_by_its_words_shows_them_with_the_querys_marked(site: Site, tmp_path: Path) -> None:
    from infra.dev.textclips import Cue, subtitled_clip

    cues = [Cue(1.0, 3.0, "Welcome aboard"), Cue(4.0, 6.5, "the lighthouse keeper waves from the rocks")]
    clip = subtitled_clip(tmp_path / "lighthouse tour", cues, 8, "mov_text")
    key = "lighthouse tour.mp4"
    site.services.minio_client().fput_object(site.bucket, key, str(clip), content_type="video/mp4")
    vid = video_id(site.bucket, key)
    auth = {"Authorization": f"Bearer {site.api_key}"}

    def worded() -> bool:
        found = site.http.get("/v1/search", params={"q": "lighthouse keeper", "sources": "subtitle"}, headers=auth)
        return found.status_code == 200 and any(m["video_id"] == vid for m in found.json()["results"])

    eventually(worded, "the video's words to be searchable", INDEX_TIMEOUT_S)
    page = site.page(site.api_key)
    page.fill("#q", '"lighthouse keeper"')
    page.press("#q", "Enter")
    moment = page.locator(f"#results .moment[data-video-id='{vid}']").first
    moment.wait_for(timeout=UI_TIMEOUT_MS)
    # Under the thumbnail: what found it, and its words with the query's marked
    assert "subtitle" in moment.locator(".span").inner_text()
    assert moment.locator(".words").inner_text() == "the lighthouse keeper waves from the rocks"
    assert moment.locator(".words mark").all_inner_texts() == ["lighthouse", "keeper"]
    assert moment.get_attribute("data-start-s") == "4"
    page.wait_for_function(
        "() => [...document.querySelectorAll('#results img')].every(i => i.complete && i.naturalWidth > 0)",
        timeout=UI_TIMEOUT_MS,
    )
    site.shot(page, "web-text-search.png")
    # And in the player, from the second the words come
    moment.locator("button.open").click()
    page.locator("#player").wait_for(state="visible", timeout=UI_TIMEOUT_MS)
    assert page.locator("#player-words mark").all_inner_texts() == ["lighthouse", "keeper"]
    page.wait_for_function("() => document.querySelector('#player-video').readyState >= 2", timeout=UI_TIMEOUT_MS)
    page.evaluate("document.querySelector('#player-video').pause()")
    assert abs(page.evaluate("document.querySelector('#player-video').currentTime") - 4.0) < 0.5
    site.shot(page, "web-text-player.png")
    page.context.close()


def test_the_model_tab_follows_a_switch_and_search_says_which_model_answered(site: Site, tmp_path: Path) -> None:
    """A backfill to a second tiny model, started and aborted through the admin API while the page
    shows it: which model answered a search, the Model tab's state, target and counted progress."""
    from infra.dev.tinymodel import build_tiny_siglip

    admin = {"Authorization": f"Bearer {site.admin_key}"}
    model_a = site.settings.model.id
    model_b = str(build_tiny_siglip(tmp_path / "model-b", seed=1, hidden_size=48))
    page = site.page(site.admin_key)
    page.fill("#q", "boats in a harbour at dusk")
    page.press("#q", "Enter")
    page.locator("#search-model", has_text=f"answered by {model_a}").wait_for(timeout=UI_TIMEOUT_MS)
    page.click("#tab-model")
    page.locator("#model-state", has_text="idle").wait_for(timeout=UI_TIMEOUT_MS)
    assert model_a in page.locator("#model-active").inner_text()
    assert page.locator("#model-target-row").is_hidden()

    started = site.http.post("/v1/admin/reindex", json={"model": model_b}, headers=admin)
    assert started.status_code == 202, started.text
    try:
        page.click("#model-refresh")
        page.locator("#model-state", has_text="backfilling").wait_for(timeout=UI_TIMEOUT_MS)
        assert (
            model_b in page.locator("#model-target").inner_text()
            and "dim 48" in page.locator("#model-target").inner_text()
        )
        # The coordinator's first round counts the videos: the tab shows done of total, with rate and ETA.
        page.wait_for_function(
            "() => /^\\d+\\/\\d+/.test(document.querySelector('#model-progress-text').textContent)",
            timeout=UI_TIMEOUT_MS,
        )
        progress = page.locator("#model-progress-text").inner_text()
        total = int(progress.split("/")[1].split()[0].rstrip(","))
        assert total >= len(SEEDS), progress
        site.shot(page, "web-model-switch.png")
        # Search still answers from the active model during the backfill.
        page.click(".tabs [data-view=search]")
        page.evaluate("document.querySelector('#search-model').textContent = ''")  # this search's answer, not the last
        page.fill("#q", "city traffic")
        page.press("#q", "Enter")
        page.locator("#search-model", has_text=f"answered by {model_a}").wait_for(timeout=UI_TIMEOUT_MS)
    finally:
        aborted = site.http.post("/v1/admin/reindex/abort", headers=admin)
    assert aborted.status_code == 200, aborted.text
    page.click("#tab-model")
    page.locator("#model-state", has_text="idle").wait_for(timeout=UI_TIMEOUT_MS)
    assert page.locator("#model-target-row").is_hidden()
    page.context.close()
