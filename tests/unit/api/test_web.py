"""pipeline/api/routes/web.py, pipeline/api/routes/uploads.py and pipeline/query/links.py: the page, its
assets, upload links and signed thumbnail links, over the API's stand-ins (no Ray, no storage)."""

from __future__ import annotations

import asyncio
from datetime import UTC, datetime
from urllib.parse import parse_qs, urlsplit

import pytest
from fastapi.testclient import TestClient
from pydantic import SecretStr

from pipeline.api.routes.uploads import upload_key
from pipeline.api.routes.web import ASSETS
from pipeline.query.links import EXPIRY_STEP_S, MediaSigner, S3Links, derive_key, media_signer
from pipeline.settings import Settings
from storage.catalog import VideoRecord, VideoStatus
from storage.config import S3Settings
from storage.errors import InvalidInput
from storage.ids import video_id
from tests.unit.api.test_api import ADMIN_KEY, KEY, OTHER_KEY, bearer, client

NOW = 1_800_000_000.0


def signer(*keys: str, ttl_s: int = 600) -> MediaSigner:
    return MediaSigner(derive_key(None, [SecretStr(k) for k in keys]), ttl_s)


def query(link: str) -> dict[str, str]:
    return {k: v[0] for k, v in parse_qs(urlsplit(link).query).items()}


# -- signed links -----------------------------------------------------------------------------------


def test_a_signed_link_verifies_until_it_expires_and_not_after() -> None:
    s = signer(KEY)
    link = s.sign("/v1/frames/f1/thumbnail", {"v": "etag1"}, now_s=NOW)
    q = query(link)
    assert s.verify("/v1/frames/f1/thumbnail", q, now_s=NOW)
    assert int(q["exp"]) - NOW >= s.ttl_s
    assert s.verify("/v1/frames/f1/thumbnail", q, now_s=int(q["exp"]))
    assert not s.verify("/v1/frames/f1/thumbnail", q, now_s=int(q["exp"]) + 1)


def test_links_minted_within_one_step_are_the_same_link() -> None:
    s = signer(KEY)
    start = NOW - NOW % EXPIRY_STEP_S + 1
    assert s.sign("/p", {}, now_s=start) == s.sign("/p", {}, now_s=start + EXPIRY_STEP_S - 2)


@pytest.mark.parametrize(
    ("path", "change"),
    [
        ("/v1/frames/f2/thumbnail", {}),
        ("/v1/frames/f1/thumbnail", {"v": "etag2"}),
        ("/v1/frames/f1/thumbnail", {"sig": "A" * 24}),
        ("/v1/frames/f1/thumbnail", {"exp": "x"}),
    ],
)
def test_a_link_for_other_content_or_tampered_does_not_verify(path: str, change: dict[str, str]) -> None:
    s = signer(KEY)
    q = query(s.sign("/v1/frames/f1/thumbnail", {"v": "etag1"}, now_s=NOW))
    assert not s.verify(path, {**q, **change}, now_s=NOW)


def test_a_link_cannot_be_stretched_past_what_the_server_mints() -> None:
    s = signer(KEY)
    far = NOW + s.ttl_s + 2 * EXPIRY_STEP_S
    # Signed with the right key but an expiry the server never hands out.
    q = query(s.sign("/p", {}, now_s=far - s.ttl_s))
    assert not s.verify("/p", q, now_s=NOW)


def test_every_replica_derives_the_same_key_and_rotating_the_keys_retires_links() -> None:
    link = signer(KEY, OTHER_KEY).sign("/p", {}, now_s=NOW)
    assert signer(OTHER_KEY, KEY).verify("/p", query(link), now_s=NOW)
    assert not signer(KEY).verify("/p", query(link), now_s=NOW)
    explicit = MediaSigner(derive_key(SecretStr("m" * 32), []), 600)
    assert not explicit.verify("/p", query(link), now_s=NOW)


# -- the page ---------------------------------------------------------------------------------------


@pytest.fixture
def guarded() -> TestClient:
    http, _, _, _ = client(api_keys=[KEY], admin_key=ADMIN_KEY)
    return http


def test_the_page_and_its_assets_load_without_a_key_and_nothing_else_under_ui(guarded: TestClient) -> None:
    page = guarded.get("/")
    assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
    assert '<script src="ui/app.js"' in page.text
    csp = page.headers["content-security-policy"]
    assert "default-src 'self'" in csp and "connect-src 'self' http://127.0.0.1:9000" in csp
    for name, media_type in ASSETS.items():
        asset = guarded.get(f"/ui/{name}")
        assert asset.status_code == 200 and asset.headers["content-type"] == media_type
    assert guarded.get("/ui/secret.txt").status_code == 401
    assert guarded.get("/ui/secret.txt", headers=bearer(KEY)).status_code == 404
    assert guarded.post("/").status_code == 401


HTML_SINKS = (
    "innerHTML",
    "outerHTML",
    "insertAdjacentHTML",
    "document.write",
    "srcdoc",
    "DOMParser",
    "createContextualFragment",
    "eval(",
    "new Function",
    'setAttribute("href',
)


def test_app_js_uses_no_html_sinks() -> None:
    from importlib import resources

    script = resources.files("pipeline.api").joinpath("webui", "app.js").read_text()
    assert [sink for sink in HTML_SINKS if sink in script] == []


def test_every_element_app_js_looks_up_is_on_the_page() -> None:
    import re
    from importlib import resources

    webui = resources.files("pipeline.api").joinpath("webui")
    script, page = webui.joinpath("app.js").read_text(), webui.joinpath("index.html").read_text()
    wanted = set(re.findall(r'\$\("#([\w-]+)', script))
    assert {"search-model", "tab-model", "model-progress", "model-active"} <= wanted  # the model panel
    assert wanted - set(re.findall(r'\bid="([\w-]+)"', page)) == set()


def test_under_a_route_prefix_the_mount_point_redirects_to_the_page(guarded: TestClient) -> None:
    http = TestClient(guarded.app, root_path="/vidx", raise_server_exceptions=False)
    bare = http.get("/vidx", follow_redirects=False)
    assert bare.status_code == 307 and bare.headers["location"].endswith("/vidx/")
    assert http.get("/vidx/").status_code == 200
    assert http.get("/vidx/ui/app.js").status_code == 200
    assert http.get("/vidx/v1/videos").status_code == 401


# -- thumbnails -------------------------------------------------------------------------------------


def test_a_signed_thumbnail_link_opens_without_a_key_and_only_for_its_version(guarded: TestClient) -> None:
    settings = Settings(api_keys=[SecretStr(KEY)], admin_key=SecretStr(ADMIN_KEY))
    s = media_signer(settings)
    assert guarded.get("/v1/frames/f1/thumbnail").status_code == 401
    current = guarded.get(s.sign("/v1/frames/f1/thumbnail", {"v": "v1"}))
    assert current.status_code == 200 and current.headers["content-type"] == "image/jpeg"
    assert "immutable" in current.headers["cache-control"]
    # The video was overwritten since the link was minted: the old version's picture is gone.
    assert guarded.get(s.sign("/v1/frames/f1/thumbnail", {"v": "v0"})).status_code == 404
    # A signature opens the thumbnail route only.
    link = s.sign("/v1/frames/f1/thumbnail", {"v": "v1"})
    assert guarded.get("/v1/videos?" + urlsplit(link).query).status_code == 401
    assert guarded.get(link.replace("sig=", "sig=x")).status_code == 401
    assert guarded.head(link).status_code == 405  # let through (not 401); the route answers GET only
    assert guarded.post(link).status_code == 401
    # A second value of a signed parameter: both the check and the route read the last one.
    assert guarded.get(link + "&v=v0").status_code == 401
    assert guarded.get(link + "&sig=" + query(link)["sig"]).status_code == 200
    # The same link under the app's route prefix (Serve's root_path): signed below the mount point.
    prefixed = TestClient(guarded.app, root_path="/vidx", raise_server_exceptions=False)
    assert prefixed.get("/vidx" + link).status_code == 200


@pytest.mark.parametrize("exp", ["²", "1" * 40, "-5", " 1"])
def test_a_malformed_expiry_is_refused_not_an_error(guarded: TestClient, exp: str) -> None:
    s = media_signer(Settings(api_keys=[SecretStr(KEY)], admin_key=SecretStr(ADMIN_KEY)))
    q = {**query(s.sign("/v1/frames/f1/thumbnail", {"v": "v1"})), "exp": exp}
    resp = guarded.get("/v1/frames/f1/thumbnail", params=q)
    assert resp.status_code == 401, resp.text


# -- uploads ----------------------------------------------------------------------------------------


def test_an_upload_link_is_a_presigned_put_into_the_upload_bucket(guarded: TestClient) -> None:
    body = {"name": "C:\\Users\\me\\holiday clip.mp4", "size_bytes": 1234, "content_type": "video/mp4"}
    assert guarded.post("/v1/uploads", json=body).status_code == 401
    resp = guarded.post("/v1/uploads", json=body, headers=bearer(KEY))
    assert resp.status_code == 200, resp.text
    link = resp.json()
    assert link["uri"] == "s3://videos/holiday clip.mp4" and link["method"] == "PUT"
    assert link["headers"] == {"Content-Type": "video/mp4"}
    url = urlsplit(link["url"])
    assert url.netloc == "127.0.0.1:9000" and url.path == "/videos/holiday%20clip.mp4"
    signed = query(link["url"])
    # The store refuses a PUT of another type or size than the one checked here.
    assert set(signed["X-Amz-SignedHeaders"].split(";")) == {"content-length", "content-type", "host"}
    assert "X-Amz-Signature" in signed and signed["X-Amz-Expires"] == str(link["expires_in_s"])
    assert link["previous_updated_at"] is None


def test_an_upload_over_an_existing_video_names_the_record_it_replaces() -> None:
    http, store, _, _ = client(api_keys=[KEY])
    vid = video_id("videos", "a.mp4")
    store.catalog.rows[vid] = VideoRecord(
        video_id=vid, uri="s3://videos/a.mp4", status=VideoStatus.INDEXED, updated_at=datetime(2026, 1, 2, tzinfo=UTC)
    )
    body = {"name": "a.mp4", "size_bytes": 10, "content_type": "video/mp4"}
    link = http.post("/v1/uploads", json=body, headers=bearer(KEY)).json()
    assert link["video_id"] == vid and link["previous_updated_at"].startswith("2026-01-02T00:00:00")


@pytest.mark.parametrize(
    ("body", "status", "message"),
    [
        ({"name": "notes.txt", "size_bytes": 10, "content_type": "application/octet-stream"}, 400, "not a video"),
        ({"name": "huge.mp4", "size_bytes": 9 * 1024**3}, 413, "max bytes"),
        ({"name": "../", "size_bytes": 1}, 400, "file name"),
        ({"name": "a\x00.mp4", "size_bytes": 1}, 400, "control"),
        ({"name": "evil\u202egpj.mp4", "size_bytes": 1}, 400, "format characters"),
        ({"name": "a.mp4", "size_bytes": 1, "content_type": "text/html"}, 400, "content_type"),
        ({"name": "a.mp4", "size_bytes": 1, "content_type": "video/mp4\r\nX-Evil: 1"}, 400, "content_type"),
        ({"name": "a.mp4", "size_bytes": -1}, 422, "size_bytes"),
    ],
)
def test_an_upload_that_would_not_be_indexed_is_refused_with_its_reason(
    guarded: TestClient, body: dict[str, object], status: int, message: str
) -> None:
    resp = guarded.post("/v1/uploads", json=body, headers=bearer(KEY))
    assert resp.status_code == status and message in resp.json()["error"]["message"]


def test_a_file_with_an_unknown_suffix_but_a_video_type_is_accepted(guarded: TestClient) -> None:
    body = {"name": "capture.bin", "size_bytes": 10, "content_type": "video/quicktime"}
    assert guarded.post("/v1/uploads", json=body, headers=bearer(KEY)).status_code == 200


@pytest.mark.parametrize(
    ("key", "served_as"), [("a.mp4", "video/mp4"), ("b.webm", "video/webm"), ("c.html", "application/octet-stream")]
)
def test_a_playback_link_makes_the_store_answer_with_a_video_type(key: str, served_as: str) -> None:
    async def link() -> str:
        links = S3Links(S3Settings())
        try:
            return await links.presign_get("videos", key)
        finally:
            await links.aclose()

    assert query(asyncio.run(link()))["response-content-type"] == served_as


def test_upload_keys_are_base_names() -> None:
    assert upload_key("dir/sub/a.mp4") == "a.mp4"
    with pytest.raises(InvalidInput):
        upload_key("x" * 1025)
