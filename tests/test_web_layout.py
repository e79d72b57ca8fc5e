"""The web UI in Chromium, part two: the sidebar keeps the page's conversations apart from
API sessions; phones and tablets reach the heap panel with Send always in view; the
document dialog counts tokens with the server's tokenizer; speeds say what they measure and,
with the sparkline, come back after a reload; sinks show in the layer bars; replies are
sanitized markdown with highlighted code. Same harness and skips as test_web_ui.py."""

from __future__ import annotations

import json
import time

import httpx
import pytest

pytest.importorskip("mlx.core")
from test_server_openai import MODEL as MODEL_ID  # noqa: E402
from test_web_ui import browser, current_session, open_page, send, server, shot  # noqa: E402,F401

PHONE = {"width": 390, "height": 844}
TABLET = {"width": 768, "height": 1024}
LAPTOP = {"width": 1280, "height": 800}


def api_chat(server, text):
    """A request as an SDK sends it: the whole history, no session header, no client marker."""
    r = httpx.post(f"{server.url}/v1/chat/completions", timeout=60, json={
        "model": MODEL_ID, "messages": [{"role": "user", "content": text}], "max_tokens": 3, "temperature": 0})
    assert r.status_code == 200, r.text
    return r.headers["X-Session-Id"]


def in_view(page, selector, viewport) -> bool:
    box = page.locator(selector).bounding_box()
    return bool(box) and box["x"] >= 0 and box["y"] >= 0 and box["x"] + box["width"] <= viewport["width"] \
        and box["y"] + box["height"] <= viewport["height"]


def test_the_sidebar_groups_api_sessions_apart_from_conversations(open_page, server):
    api = [api_chat(server, f"Script question {i}") for i in range(2)]
    page = open_page().page
    send(page, "A conversation of my own", 4)
    page.wait_for_selector(".msg-assistant.done")
    mine = current_session(page)
    assert page.inner_text(f"#conversations .conv[data-id='{mine}'] .conv-title") == "A conversation of my own"
    assert page.locator(f"#api-sessions .conv[data-id='{mine}']").count() == 0
    for sid in api:   # in their own group, collapsed, titled by their first message
        assert page.locator(f"#conversations .conv[data-id='{sid}']").count() == 0
        assert page.locator(f"#api-sessions .conv[data-id='{sid}']").count() == 1
    assert page.is_visible("#api-group") and not page.is_visible(f"#api-sessions .conv[data-id='{api[0]}']")
    assert page.inner_text("#api-count") == f"({page.locator('#api-sessions .conv').count()})"
    page.click("#api-group summary")
    assert page.inner_text(f"#api-sessions .conv[data-id='{api[0]}'] .conv-title") == "Script question 0"
    # A title set through the API shows up live; the server's record says where each came from.
    assert httpx.patch(f"{server.url}/v1/sessions/{mine}", json={"title": "Renamed"}).status_code == 200
    page.wait_for_selector(f"#conversations .conv[data-id='{mine}'] .conv-title:text('Renamed')")
    # ... and one set in the page goes to the server.
    page.click("#rename")
    page.fill("#title-input", "My own title")
    page.press("#title-input", "Enter")
    page.wait_for_selector("#chat-title:text('My own title')")
    page.wait_for_function(f"() => document.querySelector(\"#conversations .conv[data-id='{mine}'] .conv-title\").textContent === 'My own title'")
    assert httpx.get(f"{server.url}/v1/sessions/{mine}").json()["title"] == "My own title"
    origins = {s["id"]: s["origin"] for s in httpx.get(f"{server.url}/v1/sessions").json()["data"]}
    assert origins[mine] == "web" and {origins[s] for s in api} == {"api"}


@pytest.mark.parametrize("viewport", [PHONE, TABLET], ids=["390x844", "768x1024"])
def test_narrow_screens_keep_send_in_view_and_reach_the_heap_panel(open_page, viewport):
    page = open_page(viewport=viewport).page
    name = f"{viewport['width']}x{viewport['height']}"
    assert page.evaluate("document.documentElement.scrollWidth <= window.innerWidth")
    assert in_view(page, "#send", viewport) and in_view(page, "#prompt", viewport)
    assert page.is_hidden("#heap-panel") and page.is_hidden(".wide-only")
    assert "watch it in the heap panel" in page.inner_text("#empty-new")
    shot(page, f"empty-{name}")
    send(page, "Tell me about heaps. " * 8, 120)
    page.wait_for_selector(".msg-assistant.done")
    assert in_view(page, "#send", viewport), "a long reply pushed Send out of view"
    shot(page, f"chat-{name}")
    page.click("#show-heap")
    assert page.get_attribute("#show-heap", "aria-expanded") == "true"
    page.wait_for_function("Number(document.getElementById('seen').dataset.value) > 0")
    for sel in ("#seen", "#capacity", "#spark", "#layers"):
        assert in_view(page, sel, viewport), sel
    shot(page, f"heap-{name}")
    page.keyboard.press("Escape")
    assert page.is_hidden("#heap-panel") and in_view(page, "#send", viewport)
    page.click("#show-conversations")
    assert in_view(page, "#new-chat", viewport)
    page.click("#sidebar .sidebar-title")   # a click inside the drawer leaves it open
    assert page.is_visible("#sidebar")
    page.click("#new-chat")   # choosing closes the drawer
    assert page.is_hidden("#sidebar")
    page.click("#empty-new [data-toggle-panel=heap]")   # the empty state's link opens the panel too
    assert page.is_visible("#heap-panel")
    page.click("#heap-panel .close-panel")
    assert page.is_hidden("#heap-panel")


def test_laptop_layout_shows_all_three_columns(open_page):
    page = open_page(viewport=LAPTOP).page
    for sel in ("#sidebar", "#heap-panel", "#send"):
        assert page.is_visible(sel), sel
    assert page.is_hidden("#show-heap") and page.is_hidden("#show-conversations")
    assert "watch it on the right" in page.inner_text("#empty-new")
    send(page, "Hello there", 40)
    page.wait_for_selector(".msg-assistant.done")
    shot(page, "chat-1280x800")


def test_the_document_dialog_counts_tokens_with_the_servers_tokenizer(open_page, server):
    text = "def heap(x):\n    return {k: v for k, v in x.items() if v > 0.5}\n" * 40
    expected = httpx.post(f"{server.url}/v1/tokenize", json={"text": text}).json()["count"]
    page = open_page().page
    page.click("#add-document")
    page.fill("#document-text", text)
    page.wait_for_selector("#document-size[data-tokens]")
    assert int(page.get_attribute("#document-size", "data-tokens")) == expected
    assert page.inner_text("#document-size") == f"{len(text):,} characters · {expected:,} tokens"
    page.fill("#document-text", text + "more")   # an edit counts again
    page.wait_for_selector("#document-size[data-tokens]")
    assert page.inner_text("#document-size").startswith(f"{len(text) + 4:,} characters")


def test_speeds_are_labelled_and_the_sparkline_and_speeds_survive_a_reload(open_page, server):
    page = open_page().page
    send(page, "Count slowly to fifty.", 120)
    page.wait_for_selector(".msg-assistant.done")
    foot = page.inner_text(".msg-assistant .msg-foot")
    assert "this reply:" in foot and "tok/s" in foot, foot
    labels = page.inner_text(".stats")
    assert "Engine decode" in labels and "Engine prefill" in labels
    sid = current_session(page)
    # Sinks are drawn wide enough to see (4 slots of a real heap).
    page.wait_for_function("document.querySelector('#layers .seg-sinks').getBoundingClientRect().width > 0")
    assert page.locator("#layers .seg-sinks").first.bounding_box()["width"] >= 3.5
    before = page.get_attribute("#spark-resident", "points").split()
    assert len(before) >= 2
    time.sleep(6)   # the engine's 5 s rate window empties: live rates read 0 from here on
    history = first_event(server)["history"]
    assert history["throughput"], "the server kept no throughput sample of the reply"
    page.reload()
    page.wait_for_selector("#live[data-state=live]")
    page.wait_for_function("document.getElementById('spark-resident').getAttribute('points') !== ''")
    after = page.get_attribute("#spark-resident", "points").split()
    assert len(after) == len(history["sessions"][sid]) >= 2   # the server's points, not a fresh start
    page.wait_for_selector("#decode-rate.stale")
    assert float(page.get_attribute("#decode-rate", "data-value")) == history["throughput"][-1][1] > 0
    assert "last measured" in page.get_attribute("#decode-rate", "title")


def first_event(server) -> dict:
    with httpx.stream("GET", f"{server.url}/v1/heap/events", timeout=30) as r:
        for line in r.iter_lines():
            if line.startswith("data:"):
                return json.loads(line[5:])
    raise AssertionError("no heap event")


EVIL = ("Some **bold** text.\n\n<img src=x onerror=\"window.pwned='img'\">\n\n<script>window.pwned='script'</script>\n\n"
        "[click](javascript:window.pwned='link') <a href=\"javascript:window.pwned='a'\">a</a> "
        "<a href=\"https://example.com\" onclick=\"window.pwned='onclick'\">ok</a>\n\n"
        "![tracker](https://evil.example/pixel.png)\n\n```python\ndef f(x):\n    return x  # done\n```\n")


def fake_reply(route):
    """A streamed reply carrying hostile HTML, as a model could write it."""
    chunks = [{"choices": [{"index": 0, "delta": {"content": EVIL[i:i + 40]}, "finish_reason": None}]}
              for i in range(0, len(EVIL), 40)]
    chunks.append({"choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}]})
    body = "".join(f"data: {json.dumps(c)}\n\n" for c in chunks) + "data: [DONE]\n\n"
    route.fulfill(body=body, content_type="text/event-stream", headers={"X-Session-Id": "sess_x"})


def test_a_hostile_reply_renders_as_sanitized_markdown_and_runs_nothing(open_page):
    g = open_page(routes={"**/v1/chat/completions": fake_reply})
    page = g.page
    send(page, "say something nasty", 64)
    page.wait_for_selector(".msg-assistant.done")
    body = page.locator(".msg-assistant .msg-body")
    assert page.evaluate("window.pwned") is None
    assert body.locator("img, script, [onerror], [onclick]").count() == 0
    hrefs = body.locator("a").evaluate_all("as => as.map(a => a.getAttribute('href'))")
    assert not any(h and h.lower().startswith("javascript:") for h in hrefs), hrefs
    assert "https://evil.example/pixel.png" in hrefs   # an image becomes a link: nothing is fetched
    assert body.locator("a[href='https://example.com'][target=_blank][rel~=noopener]").count() == 1
    assert body.locator("strong").inner_text() == "bold"
    assert body.locator("pre code.language-python .hljs-keyword").first.inner_text() == "def"
    assert g.blocked == []


def test_layer_bars_split_recalled_slots_from_heavy_hitters(open_page):
    """The recall tier's slots (layer stats' `recalled`) get their own segment and legend entry."""
    page = open_page().page
    seg = page.evaluate("""async () => (await import('/heapview.js')).segments({layer: 0, capacity: 100, budget: 64,
        resident: 58, sinks: 4, recent: 16, recalled: 8, heavy_hitters: 30, free: 42, evicted: 0})""")
    assert seg == {"sinks": 4, "recalled": 8, "heavy": 30, "recent": 16, "fresh": 0, "free": 42}
    assert page.is_hidden("#legend-recalled")   # no recall in this heap
