"""The web UI in real headless Chromium against the real server (uvicorn in a thread, tiny
random MLX model, a heap small enough that documents evict): streamed replies, stop,
documents with progress, the live heap view, conversations, themes, and no request ever
leaves localhost. Screenshots go to artifacts/ for a human to look at.

Needs Debian's chromium (`apt-get install -y chromium`) and `pip install playwright`
(never `playwright install`: the system browser is used); skipped when either is missing.
"""

from __future__ import annotations

import json
import os
import shutil
import time
from pathlib import Path
from urllib.parse import urlparse

import httpx
import pytest

pytest.importorskip("mlx.core")
if os.environ.get("LOCALHEAP_REQUIRE_BROWSER"):   # CI: a missing browser is a failure, not a skip
    import playwright.sync_api  # noqa: F401
    assert shutil.which(os.environ.get("LOCALHEAP_CHROMIUM") or "chromium"), "chromium is not installed"
sync_api = pytest.importorskip("playwright.sync_api", reason="pip install playwright (no browser download needed)")

CHROMIUM = os.environ.get("LOCALHEAP_CHROMIUM") or shutil.which("chromium") or "/usr/bin/chromium"
if not os.access(CHROMIUM, os.X_OK):
    pytest.skip("no chromium: apt-get install -y chromium (or set LOCALHEAP_CHROMIUM)", allow_module_level=True)

from test_server_openai import HEAP, load_mlx_backend  # noqa: E402

from localheap.server import ServerSettings, create_app  # noqa: E402
from localheap.server.settings import package_web_dir  # noqa: E402
from localheap.server.testing import ServerThread  # noqa: E402

ARTIFACTS = Path(__file__).resolve().parents[1] / "artifacts"
LOCAL_HOSTS = {"127.0.0.1", "localhost"}
DOC = "\n".join(f"Paragraph {i}: the heap keeps sinks, heavy hitters and a recent window." for i in range(150))
CAPACITY = HEAP.sinks + HEAP.budget + HEAP.slack
LAPTOP = {"width": 1280, "height": 800}
LARGE_LAPTOP = {"width": 1440, "height": 900}


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    web = package_web_dir()
    assert web is not None, "the package must ship web/index.html"
    settings = ServerSettings(heap=HEAP, web_dir=web, sessions_dir=tmp_path_factory.mktemp("spill"),
                              heap_events_interval=0.1)
    with ServerThread(create_app(load_mlx_backend(), settings)) as srv:
        yield srv


@pytest.fixture(scope="module")
def browser():
    with sync_api.sync_playwright() as p:
        b = p.chromium.launch(executable_path=CHROMIUM,
                              args=["--no-sandbox", "--disable-background-networking", "--disable-gpu"])
        yield b
        b.close()


class Guarded:
    """A page whose requests may only go to localhost; page errors and failed loads are kept."""

    def __init__(self, browser, url, scheme="light", viewport=LAPTOP, routes=None, ready="#live[data-state=live]"):
        self.context = browser.new_context(viewport=viewport, color_scheme=scheme)
        self.context.set_default_timeout(30_000)
        self.blocked: list[str] = []
        self.errors: list[str] = []
        self.context.route("**/*", self._guard)
        for pattern, handler in (routes or {}).items():   # later routes are tried first
            self.context.route(pattern, handler)
        self.page = self.context.new_page()
        self.page.on("pageerror", lambda e: self.errors.append(str(e)))
        self.page.on("response", lambda r: r.status >= 400 and self.errors.append(f"{r.status} {r.url}"))
        self.page.goto(url)
        self.page.wait_for_selector(ready)

    def _guard(self, route):
        if urlparse(route.request.url).hostname in LOCAL_HOSTS:
            route.continue_()
        else:
            self.blocked.append(route.request.url)
            route.abort()

    def close(self):
        self.context.close()
        assert self.blocked == [], f"requests left localhost: {self.blocked}"
        assert self.errors == [], self.errors


@pytest.fixture
def open_page(browser, server):
    opened: list[Guarded] = []

    def open_(**kw) -> Guarded:
        opened.append(Guarded(browser, server.url, **kw))
        return opened[-1]

    yield open_
    for g in opened:
        g.close()


def shot(page, name):
    ARTIFACTS.mkdir(exist_ok=True)
    page.screenshot(path=str(ARTIFACTS / f"web-{name}.png"))


def send(page, text, max_tokens, temperature=0):
    """Type and send a message (greedy by default: random weights sample EOS now and then)."""
    page.fill("#max-tokens", str(max_tokens))
    page.fill("#temperature", str(temperature))
    page.fill("#prompt", text)
    page.press("#prompt", "Enter")


def send_long(page, text, chars):
    """Send a message whose reply should stream for a long time; wait until `chars` of it are
    shown, still streaming. Tries again if the model ended the reply on its own."""
    for attempt in range(3):
        replies = page.locator(".msg-assistant").count()
        send(page, f"{text} ({attempt})" if attempt else text, 32768)
        page.wait_for_function(f"""() => {{
            const reply = document.querySelectorAll('.msg-assistant')[{replies}];
            return reply && (!reply.classList.contains('streaming') || reply.querySelector('.msg-body').textContent.length > {chars});
        }}""")
        if page.locator(".msg-assistant.streaming").count() and page.is_visible("#stop"):
            return
        page.wait_for_selector("#send:not([hidden])")
    pytest.fail("every reply ended by itself before it could be stopped")


def number(page, selector) -> int:
    return int(page.get_attribute(selector, "data-value"))


def current_session(page) -> str:
    return page.evaluate("localStorage.getItem('localheap.current')")


def test_page_loads_offline_with_model_settings_and_labels(open_page, server):
    g = open_page()
    page = g.page
    page.wait_for_selector("#model-name:text('random:llama:tiny')")
    # The guard is live: a request to elsewhere is caught (and then forgiven: the page made none).
    page.evaluate("fetch('https://cdn.example.com/x.js').catch(() => null)")
    assert g.blocked == ["https://cdn.example.com/x.js"]
    g.blocked.clear()
    page.reload()
    page.wait_for_selector("#live[data-state=live]")
    chips = page.inner_text("#model-settings")
    assert "budget 64" in chips and "policy h2o" in chips and "slack 32" in chips
    assert page.inner_text("#capacity") == f"{CAPACITY} slots"
    # Every control has an accessible name.
    unnamed = page.evaluate("""() => [...document.querySelectorAll('button, input, textarea')].filter(e => {
        if (e.closest('[hidden]') || e.type === 'hidden') return false;
        const label = e.getAttribute('aria-label') || (e.labels && [...e.labels].map(l => l.textContent).join(''))
            || e.textContent;
        return !label || !label.trim();
    }).map(e => e.outerHTML)""")
    assert unnamed == []
    # No horizontal overflow at either laptop size.
    for viewport in (LAPTOP, LARGE_LAPTOP):
        page.set_viewport_size(viewport)
        assert page.evaluate("document.documentElement.scrollWidth <= window.innerWidth")
        for sel in ("#prompt", "#send", "#seen", "#layers", "#ram-meter", "#thermal"):
            box = page.locator(sel).bounding_box()
            assert box and box["y"] + box["height"] <= viewport["height"], sel
    shot(page, "empty-light-1280x800")


def test_a_reply_streams_in_and_enter_sends(open_page, server):
    page = open_page().page
    page.evaluate("""() => {
        window.lengths = [];
        window.counts = [];
        new MutationObserver(() => {
            const reply = [...document.querySelectorAll('.msg-assistant.streaming')].pop();
            if (!reply) return;
            window.lengths.push(reply.querySelector('.msg-body').textContent.length);
            const foot = reply.querySelector('.msg-foot');
            if (foot) window.counts.push(Number(foot.textContent.match(/([\\d,]+) tokens/)[1].replace(/,/g, '')));
        }).observe(document.getElementById('messages'), {childList: true, subtree: true});
    }""")
    page.fill("#prompt", "first line")
    page.press("#prompt", "Shift+Enter")
    page.type("#prompt", "second line")
    assert page.input_value("#prompt") == "first line\nsecond line"
    assert page.locator(".msg-user").count() == 0
    page.fill("#max-tokens", "300")
    page.fill("#temperature", "0")   # greedy: random weights sample EOS now and then
    page.press("#prompt", "Enter")
    page.wait_for_selector(".msg-assistant.done")
    assert page.inner_text(".msg-user") == "first line\nsecond line"
    assert page.input_value("#prompt") == ""
    # Painted token by token: the text grows in several steps (not always monotonically, as
    # markdown can shrink it: "*ab" shows 3 characters, "*ab*" 2) while the token count in the
    # footer only ever grows.
    lengths, counts = page.evaluate("window.lengths"), page.evaluate("window.counts")
    assert len(set(lengths)) >= 3 and lengths[-1] > 0, lengths
    assert len(set(counts)) >= 3 and counts == sorted(counts), counts
    assert "tokens" in page.inner_text(".msg-assistant .msg-foot")
    sid = current_session(page)
    page.wait_for_function("Number(document.getElementById('seen').dataset.value) > 0")
    info = httpx.get(f"{server.url}/v1/sessions/{sid}").json()
    assert info["turns"] == 1 and info["tokens"] > 0
    assert page.inner_text(".conv.current .conv-title") == "first line second line"


def test_stop_aborts_the_reply_and_the_server_cancels_it(open_page, server):
    page = open_page(scheme="dark", viewport=LARGE_LAPTOP).page
    send_long(page, "Tell me a very long story about **heaps**.", 200)
    assert page.is_visible("#stop") and not page.is_visible("#send")
    shot(page, "chat-streaming-dark-1440x900")
    page.click("#stop")
    page.wait_for_selector(".msg-assistant.stopped")
    assert "stopped" in page.inner_text(".msg-assistant .msg-foot")
    assert page.is_visible("#send") and not page.is_visible("#stop")
    # stopped through its session and read to its end: the reply kept is every token the session has of it
    sid = current_session(page)
    kept = page.evaluate(f"JSON.parse(localStorage.getItem('localheap.conversations.v1'))[{json.dumps(sid)}]"
                         ".messages.at(-1)")
    assert kept["status"] == "stopped" and kept["interrupted"] == "stopped" and kept["content"]
    svc = server.services
    s = svc.store.get(sid)
    assert svc.tokenizer.decode(list(s.fed) + list(s.unfed_reply)).endswith(kept["content"])
    deadline = time.monotonic() + 10
    while httpx.get(f"{server.url}/health").json()["in_flight"] and time.monotonic() < deadline:
        time.sleep(0.1)
    assert httpx.get(f"{server.url}/health").json()["in_flight"] == 0
    # Esc stops too, and the conversation carries on in the same session afterwards.
    send_long(page, "Another one.", 20)
    page.keyboard.press("Escape")
    page.wait_for_function("document.querySelectorAll('.msg-assistant.stopped').length === 2")
    assert httpx.get(f"{server.url}/v1/sessions/{current_session(page)}").json()["turns"] >= 1


def test_document_longer_than_the_heap_shows_progress_then_evictions(open_page, server, tmp_path):
    page = open_page().page
    page.evaluate("""() => {
        window.progress = [];
        new MutationObserver(() => {
            const doc = document.querySelector('.msg-document');
            if (doc) window.progress.push([doc.className, Number(doc.querySelector('.progress').getAttribute('aria-valuenow'))]);
        }).observe(document.getElementById('messages'), {childList: true, subtree: true});
    }""")
    empty_picture = page.get_attribute("#layers", "aria-label")
    page.click("#add-document")
    page.set_input_files("#document-file", files=[{"name": "heap-notes.txt", "mimeType": "text/plain",
                                                   "buffer": DOC.encode()}])
    page.wait_for_function(f"document.getElementById('document-text').value.length === {len(DOC)}")
    assert "characters" in page.inner_text("#document-size")
    page.click("#document-submit")
    page.wait_for_selector(".msg-document.done", timeout=60_000)
    progress = page.evaluate("window.progress")
    assert any(0 < v < 100 for cls, v in progress if "reading" in cls), progress   # the bar moved
    assert page.get_attribute(".msg-document .progress", "aria-valuenow") == "100"
    assert "heap-notes.txt" in page.inner_text(".msg-document .doc-name")

    page.wait_for_function("Number(document.getElementById('stat-evicted').dataset.value) > 0")
    seen = number(page, "#seen")
    assert seen > CAPACITY and number(page, "#capacity") == CAPACITY
    assert number(page, "#stat-evicted") > 0
    assert page.get_attribute("#layers", "aria-label") != empty_picture
    assert page.locator("#layers .layer-row").count() == 2
    assert "went through it" in page.inner_text("#hero-note")
    time.sleep(0.3)   # let the sparkline take the last snapshot
    shot(page, "document-read-light-1280x800")

    # A question about it goes to the same session (X-Session-Id).
    sid = current_session(page)
    send(page, "What does paragraph 3 say?", 24)
    page.wait_for_selector(".msg-assistant.done")
    info = httpx.get(f"{server.url}/v1/sessions/{sid}").json()
    assert info["turns"] == 2 and info["heap"]["tokens_seen"] > seen
    assert info["heap"]["resident"] <= CAPACITY

    # Dark theme by the toggle, kept across a reload.
    page.click("#theme-toggle")
    assert page.evaluate("document.documentElement.dataset.theme") == "dark"
    page.set_viewport_size(LARGE_LAPTOP)
    time.sleep(0.2)
    shot(page, "document-read-dark-1440x900")
    page.reload()
    page.wait_for_selector(".msg-document.done")
    assert page.evaluate("document.documentElement.dataset.theme") == "dark"
    background = page.evaluate("getComputedStyle(document.body).backgroundColor")
    page.click("#theme-toggle")
    assert page.evaluate("getComputedStyle(document.body).backgroundColor") != background


def test_conversations_switch_and_delete(open_page, server):
    page = open_page().page
    send(page, "one", 4)
    page.wait_for_selector(".msg-assistant.done")
    first = current_session(page)
    page.click("#new-chat")
    assert page.locator(".msg").count() == 0 and page.inner_text("#chat-title") == "New conversation"
    send(page, "two", 4)
    page.wait_for_selector(".msg-assistant.done")
    second = current_session(page)
    assert second != first
    page.click(f".conv[data-id='{first}'] .conv-open")
    assert page.inner_text(".msg-user") == "one" and current_session(page) == first
    delete = page.locator(f".conv[data-id='{first}'] .conv-delete")
    delete.click()
    assert page.locator(f".conv[data-id='{first}']").count() == 1   # first click only arms it
    delete.click()
    page.wait_for_selector(f".conv[data-id='{first}']", state="detached")
    assert httpx.get(f"{server.url}/v1/sessions/{first}").status_code == 404
    assert page.inner_text("#chat-title") == "New conversation"
    # Deleted elsewhere (another client, a restart): the page lets go of it and says so.
    page.click(f".conv[data-id='{second}'] .conv-open")
    assert httpx.delete(f"{server.url}/v1/sessions/{second}").status_code == 200
    page.wait_for_selector(f".conv[data-id='{second}']", state="detached")
    assert "no longer exists" in page.inner_text("#notice")
    assert page.inner_text("#chat-title") == "New conversation" and current_session(page) is None


def test_two_tabs_keep_each_others_conversations(open_page, server):
    """Two tabs of one browser: each saves its own conversation without writing the other's back
    as it was (a tab's whole stale copy of the history used to replace the other's)."""
    first = open_page()
    second = first.context.new_page()
    second.goto(server.url)
    second.wait_for_selector("#live[data-state=live]")
    ids = {}
    for text, page in {"tab one": first.page, "tab two": second}.items():
        send(page, text, 4)
        page.wait_for_selector(".msg-assistant.done")
        ids[text] = current_session(page)   # (the key the tabs share: read before the other tab writes it)
    third = first.context.new_page()
    third.goto(server.url)
    third.wait_for_selector("#live[data-state=live]")
    for text, sid in ids.items():
        third.click(f".conv[data-id='{sid}'] .conv-open")
        assert third.inner_text(".msg-user") == text
        assert third.locator(".msg-assistant").count() == 1
    # deleted in one tab: gone from the others, and not written back by their next save
    delete = first.page.locator(f".conv[data-id='{ids['tab one']}'] .conv-delete")
    delete.click()
    delete.click()
    first.page.wait_for_selector(f".conv[data-id='{ids['tab one']}']", state="detached")
    send(second, "tab two again", 4)
    second.wait_for_function("document.querySelectorAll('.msg-assistant.done').length === 2")
    stored = json.loads(third.evaluate("localStorage.getItem('localheap.conversations.v1')"))
    assert ids["tab one"] not in stored and len(stored[ids["tab two"]]["messages"]) == 4
    for page in (second, third):
        page.close()


def llama8b_heap(seen: int, layers=32, sinks=4, budget=4096, recent=256, slack=256) -> dict:
    """Heap stats shaped like Llama 3 8B's (128 KiB of KV a token) after `seen` tokens."""
    per_token, capacity = 2 * layers * 8 * 128 * 2, sinks + budget + slack
    resident = seen if seen <= sinks + budget else sinks + budget + seen % slack
    rows = [{"layer": i, "capacity": capacity, "budget": budget, "resident": resident, "seen": seen,
             "evicted": seen - resident, "evictions": max(0, seen - sinks - budget) // slack,
             "sinks": min(sinks, resident), "recent": min(recent, max(0, resident - sinks)),
             "heavy_hitters": max(0, resident - sinks - recent), "free": capacity - resident} for i in range(layers)]
    return {"tokens_seen": seen, "resident": resident, "evicted": seen - resident, "capacity": capacity,
            "kv_bytes": capacity * per_token, "evictions": rows[0]["evictions"], "layers": rows}


BOOK = {"id": "sess_book", "object": "session", "state": "resident", "busy": False, "turns": 2,
        "created": 0, "last_used": 0, "origin": "web", "title": None}
CARD = {"id": "llama3-8b-q4", "object": "model", "created": 0, "owned_by": "localheap",
        "localheap": {"backend": "mlx", "weights_bytes": 4_600_000_000, "heap_bytes_per_session": 4356 << 17,
                      "heap": {"budget": 4096, "sinks": 4, "recent": 256, "slack": 256, "policy": "h2o",
                               "positions": "compact", "profile": "uniform"}}}


def book_page(open_page, heaps: list):
    """A page fed synthetic server payloads: one session (BOOK) whose heap events carry `heaps` in
    turn, opened on it once the last one is shown."""
    def snapshot(heap):
        return {"time": 0, "model": CARD["id"], "sessions": [{**BOOK, "tokens": heap["tokens_seen"], "heap": heap}],
                "memory": {"rss_bytes": 6_300_000_000, "ram_budget_bytes": 12 << 30, "weights_bytes": 4_600_000_000,
                           "kv_bytes": 4356 << 17, "max_resident_heaps": 12},
                "thermal": "fair", "throughput": {"decode_tokens_per_s": 31.4, "prefill_tokens_per_s": 1840.0},
                "engine": {"active": 0, "waiting": 0, "in_flight": 0}}

    streams = iter(["".join(f"event: heap\ndata: {json.dumps(snapshot(h))}\n\n" for h in heaps)])
    last = f"event: heap\ndata: {json.dumps(snapshot(heaps[-1]))}\n\n"   # each reconnect: no news
    routes = {
        "**/v1/models": lambda r: r.fulfill(json={"object": "list", "data": [CARD]}),
        "**/v1/sessions": lambda r: r.fulfill(json={"object": "list", "data": [{**BOOK, "tokens": 0, "heap": None}]}),
        "**/v1/heap/events": lambda r: r.fulfill(body=next(streams, last), content_type="text/event-stream"),
    }
    page = open_page(routes=routes, ready="#model-name:text('llama3-8b-q4')").page
    page.click(".conv[data-id='sess_book'] .conv-open")
    page.wait_for_function(f"document.getElementById('seen').dataset.value === '{heaps[-1]['tokens_seen']}'")
    return page


def test_a_million_tokens_through_a_32_layer_heap(open_page):
    """The picture at scale, from synthetic server payloads: the counter says 1,000,000 while
    the heap stays 4,356 slots; 32 layer bars fit a laptop screen, 4 sinks still show."""
    steps = [0, 2_000, 4_356, 20_000, 100_000, 250_000, 500_000, 750_000, 1_000_000]
    page = book_page(open_page, [llama8b_heap(n) for n in steps])
    assert "1,000,000 tokens" in page.inner_text("#empty-elsewhere") and page.is_hidden("#empty-new")
    assert page.inner_text("#seen") == "1,000,000" and page.inner_text("#capacity") == "4,356 slots"
    assert "230× the heap's size" in page.inner_text("#hero-note")
    assert page.inner_text("#stock") == "A stock KV cache would need ≈ 122 GiB; this heap: 545 MiB."
    assert page.locator("#layers .layer-row").count() == 32
    sinks = page.locator("#layers .seg-sinks").first.bounding_box()
    assert sinks["width"] >= 1.5   # 4 of 4,356 slots, still visible
    for sel in ("#layers", "#ram-meter", "#thermal"):
        box = page.locator(sel).bounding_box()
        assert box["y"] + box["height"] <= LAPTOP["height"], sel
    assert page.inner_text("#thermal") == "fair" and page.get_attribute("#ram-meter", "aria-valuenow") == "49"
    points = page.get_attribute("#spark-resident", "points").split()
    assert len(points) == len(steps)   # the whole story, seen rising and resident flat
    shot(page, "1M-tokens-32-layers-light-1280x800")


def test_a_heap_repacked_before_it_is_full_says_so_and_its_disk_line_fits(open_page):
    """Decode repacks every `slack` tokens, before the heap's capacity is reached: the note tells
    of the repack, not of room before the first one; the recall tier's line stays in its card."""
    heap = llama8b_heap(4_200)
    heap.update(resident=4_150, evicted=50, evictions=1)
    heap["pages"] = {"tokens_on_disk": 87_968, "disk_bytes": 26_529_000,
                     "last_recall": {"tokens": 32, "ms": 74.6123}}
    page = book_page(open_page, [heap])
    assert page.inner_text("#hero-note") == "Repacked 1× so far: 50 tokens evicted by score; it never grew."
    assert page.inner_text("#stat-disk") == "87,968 tokens · 25.3 MiB · last recall 32 in 75 ms"
    line, card = (page.locator(sel).bounding_box() for sel in ("#stat-disk", "#stat-disk-row"))
    assert line["x"] + line["width"] <= card["x"] + card["width"] and line["y"] + line["height"] <= card["y"] + card["height"]


def test_markdown_is_rendered_and_safe(open_page):
    """web/markdown.js: marked + DOMPurify + highlight.js (vendored); checked on the DOM it builds."""
    page = open_page().page
    found = page.evaluate("""async () => {
        const { renderMarkdown } = await import('/markdown.js');
        const box = document.createElement('div');
        box.innerHTML = renderMarkdown([
            '# Title', 'Some **bold**, *italic*, `co*de*` and snake_case_name.',
            '', '- a', '- b', '  1. nested', '',
            '```js', 'if (a < b) alert("x")', '```',
            '[ok](https://example.com/?a=1&b=2) [bad](javascript:alert(1)) <img src=x onerror=alert(1)>',
            '<script>alert(1)</script>', '[q](https://x.org/" onmouseover="alert(1))',
            '<a href="https://x.org" onclick="alert(1)" style="color:red">styled</a>',
        ].join('\\n'));
        const q = (s) => box.querySelector(s);
        return {
            h1: q('h1')?.textContent, strong: q('strong')?.textContent, em: q('em')?.textContent,
            code: q('p code')?.textContent, text: box.textContent,
            nested: q('ul > li:nth-child(2) > ol > li')?.textContent,
            js: q('pre code')?.textContent, jsLang: q('pre code')?.dataset.lang,
            keyword: q('pre code .hljs-keyword')?.textContent,
            links: [...box.querySelectorAll('a')].map(a => [a.textContent, a.getAttribute('href'), a.target, a.rel]),
            banned: box.querySelectorAll('img, script, style, [style]').length,
            handlers: [...box.querySelectorAll('*')].flatMap(e => [...e.attributes].map(a => a.name)).filter(n => n.startsWith('on')),
        };
    }""")
    assert (found["h1"], found["strong"], found["em"], found["code"]) == ("Title", "bold", "italic", "co*de*")
    assert "snake_case_name" in found["text"] and found["nested"] == "nested"
    assert found["js"] == 'if (a < b) alert("x")' and found["jsLang"] == "js" and found["keyword"] == "if"
    links = {text: (href, target, rel) for text, href, target, rel in found["links"]}
    assert links["ok"] == ("https://example.com/?a=1&b=2", "_blank", "noopener noreferrer")
    assert links["bad"][0] is None and links["styled"][0] == "https://x.org"   # javascript: dropped
    assert not any(href and href.lower().startswith("javascript:") for href, _, _ in links.values())
    assert found["banned"] == 0 and found["handlers"] == []


def test_an_api_key_is_asked_for_once_and_sent(browser, tmp_path):
    from test_engine import FakeBackend

    settings = ServerSettings(heap=HEAP, web_dir=package_web_dir(), api_key="sesame", heap_events_interval=0.1)
    with ServerThread(create_app(FakeBackend(), settings)) as srv:
        context = browser.new_context(viewport=LAPTOP)
        page = context.new_page()
        page.goto(srv.url)
        page.wait_for_selector("#key-banner:not([hidden])")
        assert page.inner_text("#model-name") == "API key needed" and page.is_hidden("#key-refused")
        page.fill("#key-input", "open sesame")   # a wrong key: asked again, and told so
        page.press("#key-input", "Enter")
        page.wait_for_selector("#key-refused:not([hidden])")
        assert page.is_visible("#key-banner")
        page.fill("#key-input", "sesame")
        page.press("#key-input", "Enter")
        page.wait_for_selector("#model-name:text('fake-model')")
        page.wait_for_selector("#live[data-state=live]")
        assert page.is_hidden("#key-banner")
        context.close()


def test_stop_after_the_last_token_while_the_turn_is_saved_reads_the_reply_to_its_end(
        browser, model_dirs, tmp_path_factory, tmp_path, torch_one_thread):
    """Stop pressed once the reply's last token is out, its turn still being saved (the saver thread, held
    here): nothing runs to stop ("stopped": 0), but the session is busy, so the reply is read to its end,
    marked done with its finish and "saved", not "stopped" with its last chunk left unread."""
    from tool_server import HEAP as TOOL_HEAP, qwen_model

    from localheap.grammar import ForcedTokens
    from localheap.models import load_backend

    reply = "Hello there, this is the whole reply."
    app = create_app(load_backend(str(qwen_model(model_dirs, tmp_path_factory)), "torch"),
                     ServerSettings(heap=TOOL_HEAP, web_dir=package_web_dir(), sessions_dir=tmp_path,
                                    persist_sessions=True))
    svc = app.state.services
    ids = svc.tokenizer.encode(reply, add_special_tokens=False)
    svc.force_tokens = lambda: ForcedTokens(ids, svc.backend.eos_token_ids)
    real_write = svc.store.write_heap

    def slow_write(s):   # a big heap's file being written
        time.sleep(3)
        return real_write(s)

    svc.store.write_heap = slow_write
    with ServerThread(app) as srv:
        g = Guarded(browser, srv.url)
        page = g.page
        answered = []
        page.on("response", lambda r: r.url.endswith("/stop") and answered.append(r.json()))
        page.fill("#prompt", "hi")
        page.press("#prompt", "Enter")
        page.wait_for_function("""(want) => {
            const r = document.querySelector('.msg-assistant');
            return r && r.classList.contains('streaming') && r.querySelector('.msg-body').textContent.includes(want);
        }""", arg="whole reply.")
        page.click("#stop")
        page.wait_for_selector(".msg-assistant:not(.streaming)")
        sid = current_session(page)
        kept = page.evaluate(f"JSON.parse(localStorage.getItem('localheap.conversations.v1'))[{json.dumps(sid)}]"
                             ".messages.at(-1)")
        g.close()
    assert [a["stopped"] for a in answered] == [0]
    assert kept["content"] == reply and kept["status"] == "done" and kept["finish"] == "stop" and kept["saved"] is True


def test_a_document_whose_file_name_is_longer_than_a_title_is_read(open_page, server):
    """A file name of 244 characters (legal on Linux and macOS) made the whole upload a 400: the page sends
    it cut to the server's 200 (by characters: an emoji's halves are never split), and it titles the
    conversation as a shorter one does (trimmed further there)."""
    page = open_page().page
    name = "n" * 198 + "\U0001F642" * 3 + "x" * 40 + ".txt"
    page.click("#add-document")
    page.set_input_files("#document-file", files=[{"name": name, "mimeType": "text/plain", "buffer": b"A short note."}])
    page.wait_for_function("document.getElementById('document-text').value.length === 13")
    page.click("#document-submit")
    page.wait_for_selector(".msg-document.done", timeout=60_000)
    title = httpx.get(f"{server.url}/v1/sessions/{current_session(page)}").json()["title"]
    assert title.startswith("n" * 60) and "\ufffd" not in title, title
    assert page.locator(".msg-document .doc-name").inner_text().startswith("n" * 60)
