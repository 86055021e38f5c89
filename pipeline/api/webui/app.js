// vidx web page: search (text or image), moments with a timeline and a player, uploads straight
// to the bucket, the videos list, and for the admin key the dead letters and the model lifecycle
// (which model answers, a backfill's progress). Plain DOM, no framework:
// every value from the server goes in through textContent or attributes, never as HTML.
"use strict";

const KEY_STORAGE = "vidx.apiKey";
const POLL_MS = 1000;
// An upload is followed until it is settled, for at most this long.
const UPLOAD_FOLLOW_MS = 15 * 60 * 1000;
// A PUT that sends nothing for this long is abandoned.
const UPLOAD_STALL_MS = 60 * 1000;
// Files sent at once; the others wait their turn.
const MAX_PARALLEL_UPLOADS = 3;
// A re-upload of the very same content changes no record: after this long its record is the answer.
const UNCHANGED_SETTLE_MS = 60 * 1000;
const SETTLED = new Set(["indexed", "failed", "deleted"]);
// Answers that mean "try again shortly": the API shedding load, or not reachable for a moment.
const RETRYABLE = new Set([0, 502, 503, 504]);
// The Model tab re-reads the lifecycle this often while it is shown.
const MODEL_POLL_MS = 5000;

const $ = (sel) => document.querySelector(sel);
const el = (tag, props = {}, ...children) => {
  const node = document.createElement(tag);
  for (const [name, value] of Object.entries(props)) {
    if (name === "class") node.className = value;
    else if (name === "dataset") Object.assign(node.dataset, value);
    else if (name === "style") Object.assign(node.style, value); // CSSOM: allowed by the page's CSP
    else if (name.startsWith("on")) node.addEventListener(name.slice(2), value);
    else node.setAttribute(name, value);
  }
  for (const child of children) node.append(child);
  return node;
};

// -- API --------------------------------------------------------------------------------------------

class ApiError extends Error {
  constructor(status, code, message) {
    super(message);
    this.status = status;
    this.code = code;
  }
}

const apiKey = () => sessionStorage.getItem(KEY_STORAGE) || "";

async function api(path, options = {}) {
  const headers = new Headers(options.headers || {});
  if (apiKey()) headers.set("Authorization", `Bearer ${apiKey()}`);
  let response;
  try {
    response = await fetch(new URL(path, document.baseURI), { ...options, headers });
  } catch (err) {
    throw new ApiError(0, "unreachable", `the vidx API is not reachable (${err.message})`);
  }
  if (response.ok) return response.json();
  let code = "error", message = `${response.status} ${response.statusText}`;
  try {
    const body = await response.json();
    code = body.error.code;
    message = body.error.message;
  } catch (_) { /* not our JSON error: keep the status line */ }
  if (response.status === 401) askForKey(message);
  throw new ApiError(response.status, code, message);
}

function notice(message, kind = "error") {
  const box = $("#notice");
  box.textContent = message;
  box.className = `notice ${kind}`;
  box.hidden = !message;
}

function reportError(err) {
  if (err instanceof ApiError && err.status === 401) return; // the key prompt is open
  notice(err.message || String(err));
}

// -- formatting -------------------------------------------------------------------------------------

function hms(seconds) {
  const s = Math.round(Math.max(0, seconds) * 10) / 10; // rounded first: 59.96 is 01:00.0, not 00:60.0
  const h = Math.floor(s / 3600), m = Math.floor((s % 3600) / 60), rest = s % 60;
  const mm = String(m).padStart(2, "0"), ss = rest.toFixed(1).padStart(4, "0");
  return h ? `${h}:${mm}:${ss}` : `${mm}:${ss}`;
}

// "1h 02m", "4m 05s", "12s": how long a backfill has left.
function duration(seconds) {
  const total = Math.round(Math.max(0, seconds));
  const h = Math.floor(total / 3600), m = Math.floor((total % 3600) / 60), s = total % 60;
  if (h) return `${h}h ${String(m).padStart(2, "0")}m`;
  return m ? `${m}m ${String(s).padStart(2, "0")}s` : `${s}s`;
}

const videoName = (uri) => uri.replace(/^s3:\/\/[^/]+\//, "");
const chip = (status) => el("span", { class: `chip ${status}` }, status);

// -- the API key ------------------------------------------------------------------------------------

function askForKey(why) {
  const dialog = $("#key-dialog");
  if (why) notice(why, "info");
  if (!dialog.open) dialog.showModal();
  $("#api-key").focus();
}

function keyChanged() {
  $("#key-button").classList.toggle("has-key", Boolean(apiKey()));
  notice("");
  detectAdmin();
  if (currentView() === "videos") loadVideos();
}

async function detectAdmin() {
  let admin = false;
  if (apiKey()) {
    try {
      await api("v1/admin/dlq?limit=1");
      admin = true;
    } catch (_) { admin = false; }
  }
  $("#tab-dlq").hidden = !admin;
  $("#tab-model").hidden = !admin;
  if (!admin && (currentView() === "dlq" || currentView() === "model")) show("search");
}

// -- views ------------------------------------------------------------------------------------------

const currentView = () => document.querySelector(".tabs [aria-selected=true]").dataset.view;

function show(view) {
  for (const tab of document.querySelectorAll(".tabs [role=tab]")) {
    tab.setAttribute("aria-selected", String(tab.dataset.view === view));
  }
  for (const section of document.querySelectorAll(".view")) section.hidden = section.id !== `view-${view}`;
  notice("");
  if (view === "videos") loadVideos();
  if (view === "dlq") loadDeadLetters();
  if (view === "model") watchModel();
}

// -- search -----------------------------------------------------------------------------------------

// Each search gets a number; an answer is shown only if no later search was started meanwhile.
let searches = 0;

async function searchText(q) {
  const k = $("#k").value, mine = ++searches;
  const response = await api(`v1/search?q=${encodeURIComponent(q)}&k=${k}`);
  if (mine === searches) renderResults(response, `“${q}”`);
}

async function searchImage(file) {
  const form = new FormData();
  form.append("image", file, file.name || "image");
  $("#search-summary").textContent = "Searching by image…";
  const k = $("#k").value, mine = ++searches;
  const response = await api(`v1/search/image?k=${k}`, { method: "POST", body: form });
  if (mine === searches) renderResults(response, `image ${file.name || ""}`.trim());
}

function timeline(moment) {
  const length = Math.max(moment.duration_s || 0, moment.end_s, ...moment.hits_s) || 1;
  const pct = (t) => `${Math.min(100, (100 * t) / length).toFixed(2)}%`;
  const strip = el("div", { class: "timeline", title: `matching frames over ${hms(length)}` });
  strip.append(el("div", { class: "range", style: { left: pct(moment.start_s), width: pct(moment.end_s - moment.start_s) } }));
  for (const t of moment.hits_s) {
    const inside = t >= moment.start_s && t <= moment.end_s;
    strip.append(el("div", { class: inside ? "hit in" : "hit", style: { left: pct(t) } }));
  }
  return strip;
}

// The matched words of a moment, the query's words in <mark> (built as nodes: the text is never HTML).
// The marks count characters (code points), as the API does; JS strings count UTF-16 units.
function words(moment) {
  const chars = Array.from(moment.text || "");
  const text = { length: chars.length, slice: (a, b) => chars.slice(a, b).join("") };
  const line = el("div", { class: "words", title: `${moment.text_source || "words"}: ${moment.text || ""}` });
  let at = 0;
  for (const [start, end] of [...(moment.text_marks || [])].sort((a, b) => a[0] - b[0])) {
    if (start < at || end > text.length) continue;
    line.append(text.slice(at, start), el("mark", {}, text.slice(start, end)));
    at = end;
  }
  line.append(text.slice(at, chars.length));
  return line;
}

// Scores of a search the words took part in are fused ranks (small numbers): one more digit for all of them.
let scoreDigits = 3;
const score = (m) => m.score.toFixed(scoreDigits);

function renderResults(response, what) {
  const list = $("#results");
  list.replaceChildren();
  scoreDigits = response.results.some((m) => m.text) ? 4 : 3;
  const n = response.results.length;
  $("#search-summary").textContent = n
    ? `${n} moment${n > 1 ? "s" : ""} for ${what} in ${response.took_ms.toFixed(0)} ms`
    : `No moments for ${what} yet — upload videos in the Videos tab.`;
  // Which embedding model answered (during a model switch it changes at one instant); older APIs don't say.
  const model = typeof response.model === "string" ? response.model : "";
  $("#search-model").textContent = model ? `answered by ${model}` : "";
  $("#search-model").title = model;
  for (const m of response.results) {
    const span = `${hms(m.start_s)}–${hms(m.end_s)}`;
    const open = el("button", { type: "button", class: "open", title: `Play from ${hms(m.start_s)}`, onclick: () => play(m) },
      el("img", { src: m.thumbnail_url, alt: `${videoName(m.uri)} at ${hms(m.ts_s)}`, loading: "lazy" }),
      el("span", { class: "score" }, score(m)),
      el("span", { class: "play" }, `▶ ${hms(m.start_s)}`));
    list.append(el("li", { class: "moment", dataset: { videoId: m.video_id, startS: String(m.start_s) } },
      open,
      el("div", { class: "meta" },
        el("div", { class: "name", title: m.uri }, videoName(m.uri)),
        el("div", { class: "span" }, `${span} · best ${hms(m.ts_s)} · ${(m.sources || ["visual"]).join(" + ")}`),
        ...(m.text ? [words(m)] : []),
        timeline(m))));
  }
}

function play(moment) {
  const video = $("#player-video");
  // The presigned link with a media fragment: the player starts at the moment's first second.
  video.src = `${moment.video_url.split("#")[0]}#t=${moment.start_s}`;
  $("#player-title").textContent = videoName(moment.uri);
  $("#player-span").textContent = `${hms(moment.start_s)}–${hms(moment.end_s)} · score ${score(moment)}`;
  $("#player-words").replaceChildren(...(moment.text ? [words(moment)] : []));
  $("#player").dataset.startS = String(moment.start_s);
  $("#player").showModal();
  video.play().catch(() => { /* autoplay refused: the controls are there */ });
}

// -- uploads ----------------------------------------------------------------------------------------

function putFile(link, file, onProgress) {
  return new Promise((resolve, reject) => {
    const xhr = new XMLHttpRequest();
    let lastProgress = Date.now();
    const stalled = setInterval(() => Date.now() - lastProgress > UPLOAD_STALL_MS && xhr.abort(), 1000);
    const done = (fn) => (arg) => { clearInterval(stalled); fn(arg); };
    xhr.open(link.method, link.url);
    for (const [name, value] of Object.entries(link.headers)) xhr.setRequestHeader(name, value);
    xhr.upload.onprogress = (e) => {
      lastProgress = Date.now();
      if (e.lengthComputable) onProgress(e.loaded / e.total);
    };
    xhr.onload = done(() => (xhr.status < 300 ? resolve() : reject(new Error(`the bucket refused the upload (${xhr.status})`))));
    xhr.onerror = done(() => reject(new Error("the object store is not reachable from this browser (check VIDX_S3__PUBLIC_ENDPOINT_URL)")));
    xhr.onabort = done(() => reject(new Error(`the upload sent nothing for ${UPLOAD_STALL_MS / 1000} s and was abandoned`)));
    xhr.send(file);
  });
}

// Uploads wait here for one of the MAX_PARALLEL_UPLOADS slots.
const waiting = [];
let sending = 0;

function enqueueUpload(file) {
  waiting.push(file);
  pumpUploads();
}

function pumpUploads() {
  while (sending < MAX_PARALLEL_UPLOADS && waiting.length) {
    sending += 1;
    upload(waiting.shift()).finally(() => {
      sending -= 1;
      pumpUploads();
    });
  }
}

async function upload(file) {
  const bar = el("progress", { max: "1", value: "0" });
  const state = el("span", { class: "chip uploading" }, "uploading");
  const detail = el("span", { class: "reason" });
  const row = el("li", { dataset: { name: file.name } }, state, el("strong", {}, file.name), bar, detail);
  $("#uploads").prepend(row);
  const set = (status, text = "") => {
    state.className = `chip ${status}`;
    state.textContent = status;
    row.dataset.status = status;
    detail.textContent = text;
  };
  try {
    const link = await api("v1/uploads", {
      method: "POST",
      headers: { "Content-Type": "application/json" },
      body: JSON.stringify({ name: file.name, size_bytes: file.size, content_type: file.type || "application/octet-stream" }),
    });
    row.dataset.videoId = link.video_id;
    await putFile(link, file, (f) => (bar.value = f));
    bar.value = 1;
    set("uploaded", "waiting for the bucket event");
    await follow(link.video_id, link.previous_updated_at, set);
  } catch (err) {
    set("failed", err.message);
  }
}

// Follows the video's record until this upload has settled it. With ``previous`` (the record's
// updated_at when the upload began) only a newer record counts: an overwrite's old "indexed" is not its answer.
async function follow(videoId, previous, set) {
  const started = Date.now(), deadline = started + UPLOAD_FOLLOW_MS;
  while (Date.now() < deadline) {
    await new Promise((r) => setTimeout(r, POLL_MS));
    let video;
    try {
      video = await api(`v1/videos/${encodeURIComponent(videoId)}`);
    } catch (err) {
      // 404: the event has not reached the catalog yet; a shed or unreachable API: ask again.
      if (err.status === 404 || RETRYABLE.has(err.status)) continue;
      throw err;
    }
    const changed = previous === null || video.updated_at !== previous;
    if (!changed && Date.now() - started < UNCHANGED_SETTLE_MS) continue;
    const text = video.status === "indexed" ? `${video.frames} frames, ${hms(video.duration_s || 0)}` : video.error || "";
    set(video.status, changed ? text : `${text} (the same content was already indexed)`.trim());
    if (SETTLED.has(video.status)) {
      if (currentView() === "videos") loadVideos();
      return;
    }
  }
  set("failed", `not settled within ${UPLOAD_FOLLOW_MS / 60000} minutes: see the Videos tab`);
}

// -- videos -----------------------------------------------------------------------------------------

let videoListings = 0, videosCursor = null;
//: Videos per page of the listing (newest first); "Show more" follows the API's cursor.
const VIDEOS_PAGE = 100;

async function loadVideos(more = false) {
  const status = $("#status-filter").value, mine = ++videoListings;
  const params = new URLSearchParams({ limit: String(VIDEOS_PAGE) });
  if (status) params.set("status", status);
  if (more === true && videosCursor) params.set("cursor", videosCursor);
  const page = await api(`v1/videos?${params}`).catch((err) => {
    reportError(err);
    return { videos: [], next_cursor: null };
  });
  if (mine !== videoListings) return; // a later listing (another filter) is on its way
  const body = $("#videos tbody");
  if (more !== true) body.replaceChildren();
  videosCursor = page.next_cursor || null;
  $("#videos-more").hidden = !videosCursor;
  for (const v of page.videos) {
    const reindex = el("button", {
      type: "button",
      title: "Submit an index job: it re-runs unless this content is already indexed with the current model and sampling",
      onclick: () => reindexVideo(v.uri),
    }, "Re-index");
    body.append(el("tr", { dataset: { videoId: v.video_id, status: v.status } },
      el("td", {}, chip(v.status)),
      el("td", { title: v.uri }, videoName(v.uri)),
      el("td", { class: "num" }, String(v.frames)),
      el("td", { class: "num" }, v.duration_s == null ? "" : hms(v.duration_s)),
      el("td", { class: "num" }, new Date(v.updated_at).toLocaleString()),
      el("td", { class: "reason" }, v.error || ""),
      el("td", {}, reindex)));
  }
  if (!body.children.length) body.append(el("tr", {}, el("td", { colspan: "7" }, "No videos yet.")));
}

async function reindexVideo(uri) {
  try {
    const accepted = await api("v1/index", { method: "POST", headers: { "Content-Type": "application/json" }, body: JSON.stringify({ uri }) });
    notice(`Re-index of ${videoName(uri)} queued (task ${accepted.task_id})`, "info");
    setTimeout(loadVideos, POLL_MS);
  } catch (err) { reportError(err); }
}

// -- dead letters (admin key) -------------------------------------------------------------------------

async function loadDeadLetters() {
  const { dead_letters: letters } = await api("v1/admin/dlq?limit=1000").catch((err) => {
    reportError(err);
    return { dead_letters: [] };
  });
  const body = $("#dlq tbody");
  body.replaceChildren();
  for (const d of letters) {
    body.append(el("tr", { dataset: { id: d.id } },
      el("td", { title: d.uri || "" }, d.uri ? videoName(d.uri) : d.id),
      el("td", {}, d.kind),
      el("td", { class: "reason" }, d.reason || ""),
      el("td", { class: "num" }, String(d.attempts ?? "")),
      el("td", { class: "num" }, d.failed_at ? new Date(d.failed_at).toLocaleString() : ""),
      el("td", {}, el("button", { type: "button", onclick: () => replay({ ids: [d.id] }) }, "Replay"))));
  }
  if (!letters.length) body.append(el("tr", {}, el("td", { colspan: "6" }, "The dead-letter queue is empty.")));
}

async function replay(body) {
  try {
    const report = await api("v1/admin/dlq/replay", { method: "POST", headers: { "Content-Type": "application/json" }, body: JSON.stringify(body) });
    notice(`Replayed ${report.replayed.length}; ${report.remaining} left`, "info");
    loadDeadLetters();
  } catch (err) { reportError(err); }
}

// -- the model lifecycle (admin key) ----------------------------------------------------------------

let modelTimer = null;

// Re-reads the lifecycle every MODEL_POLL_MS while the Model tab is shown and the page visible.
function watchModel() {
  loadModel();
  if (modelTimer !== null) return;
  modelTimer = setInterval(() => {
    if (currentView() !== "model") {
      clearInterval(modelTimer);
      modelTimer = null;
    } else if (!document.hidden) {
      loadModel();
    }
  }, MODEL_POLL_MS);
}

const describeModel = (m) => (m ? `${m.model} (dim ${m.dim}, table ${m.table})` : "none");

async function loadModel() {
  let status;
  try {
    status = await api("v1/admin/reindex");
  } catch (err) {
    $("#model-state").textContent = err.status === 503 ? err.message : "unknown";
    $("#model-updated").textContent = "";
    if (err.status !== 503) reportError(err);
    return;
  }
  renderModel(status);
}

function renderModel(status) {
  $("#model-state").textContent = status.state;
  $("#model-active").textContent = describeModel(status.active);
  $("#model-target-row").hidden = !status.target;
  $("#model-target").textContent = describeModel(status.target);
  const p = status.progress;
  $("#model-progress-row").hidden = !status.target;
  if (p && p.progress_at) {
    const bar = $("#model-progress");
    bar.max = Math.max(p.total, 1);
    bar.value = Math.min(p.done, bar.max);
    const pct = p.total ? ` (${((100 * p.done) / p.total).toFixed(1)}%)` : "";
    const rate = p.rate_per_s ? `${p.rate_per_s.toFixed(2)}/s` : "rate not known yet";
    const eta = p.eta_s == null ? "ETA not known yet" : `ETA ${duration(p.eta_s)}`;
    const failed = p.failed ? `, ${p.failed} failed` : "";
    const waits = p.waiting_for ? `; the switch waits for ${p.waiting_for}` : "";
    $("#model-progress-text").textContent = `${p.done}/${p.total}${pct}, ${rate}, ${eta}${failed}${waits}`;
  } else {
    $("#model-progress").removeAttribute("value"); // indeterminate until the first round's count
    $("#model-progress-text").textContent = "not counted yet";
  }
  const retired = status.retired || [];
  $("#model-retired").textContent = retired.length
    ? `${retired.map((t) => `${t.table} (${t.model})`).join(", ")} — drop with vidx reindex --cleanup`
    : "none";
  $("#model-switched").textContent = status.switched_at ? new Date(status.switched_at).toLocaleString() : "never";
  $("#model-updated").textContent = `as of ${new Date().toLocaleTimeString()}`;
}

// -- wiring -----------------------------------------------------------------------------------------

function dropZone(zone, input, onFiles) {
  input.addEventListener("change", () => input.files.length && onFiles([...input.files]));
  zone.addEventListener("keydown", (e) => (e.key === "Enter" || e.key === " ") && input.click());
  zone.addEventListener("dragover", (e) => { e.preventDefault(); zone.classList.add("over"); });
  zone.addEventListener("dragleave", () => zone.classList.remove("over"));
  zone.addEventListener("drop", (e) => {
    e.preventDefault();
    zone.classList.remove("over");
    if (e.dataTransfer.files.length) onFiles([...e.dataTransfer.files]);
  });
}

document.addEventListener("DOMContentLoaded", () => {
  for (const tab of document.querySelectorAll(".tabs [role=tab]")) tab.addEventListener("click", () => show(tab.dataset.view));
  $("#search-form").addEventListener("submit", (e) => {
    e.preventDefault();
    const q = $("#q").value.trim();
    if (q) searchText(q).catch(reportError);
  });
  dropZone($("#image-drop"), $("#image-file"), ([file]) => searchImage(file).catch(reportError));
  document.addEventListener("paste", (e) => {
    const item = [...(e.clipboardData?.items || [])].find((i) => i.type.startsWith("image/"));
    if (item && currentView() === "search") searchImage(item.getAsFile()).catch(reportError);
  });
  dropZone($("#upload-drop"), $("#upload-file"), (files) => files.forEach(enqueueUpload));
  $("#status-filter").addEventListener("change", () => loadVideos());
  $("#videos-refresh").addEventListener("click", () => loadVideos());
  $("#videos-more").addEventListener("click", () => loadVideos(true));
  $("#dlq-refresh").addEventListener("click", loadDeadLetters);
  $("#dlq-replay-all").addEventListener("click", () => replay({ all: true }));
  $("#model-refresh").addEventListener("click", loadModel);
  document.addEventListener("visibilitychange", () => !document.hidden && currentView() === "model" && loadModel());
  $("#player").addEventListener("close", () => $("#player-video").pause());
  $("#key-button").addEventListener("click", () => askForKey(""));
  $("#key-form").addEventListener("submit", () => {
    sessionStorage.setItem(KEY_STORAGE, $("#api-key").value.trim());
    $("#api-key").value = "";
    keyChanged();
  });
  $("#key-forget").addEventListener("click", () => {
    sessionStorage.removeItem(KEY_STORAGE);
    $("#key-dialog").close();
    keyChanged();
  });
  keyChanged();
  // Ask for a key up front when the API needs one (the page itself is public).
  api("v1/videos?limit=1").catch(reportError);
});
