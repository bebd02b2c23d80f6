"""The chat page while a reply streams (issue 62, item 3; issue 63, item 6), in headless
chromium against `serve --demo`: the view follows the reply unless the user scrolled up
(and follows again once they scroll back down), what arrives is appended (the parts already
drawn stay the same nodes, and the page renders about the reply's length in all, not the
square of it), the reply ends drawn exactly as Markdown renders it, and the icon loads (no
404 in the console).

The reply is fed to the page by the test, chunk by chunk, through its own `fetch` of
/v1/chat/completions (the server's stream, as the page reads it: SSE `data:` lines), so each
check waits for what the page shows, never for a time."""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import pytest

from .test_chat_page import browser as browser  # noqa: F401  (a fixture)
from .test_chat_page import css, shot, wait_for
from .test_cli_serve import serve

PAGE = Path(__file__).parent.parent / "dflash_mlx" / "server" / "page"
NODE = shutil.which("node")

# The server's stream, fed by the test: window.__push(text) sends one delta,
# window.__finish() the last chunk and [DONE]. Markdown.render counts what it is given.
FAKE_STREAM = """
const realFetch = window.fetch;
const enc = new TextEncoder();
window.__rendered = 0;
window.__largest = 0;
const render = Markdown.render;
Markdown.render = (src) => {
  window.__rendered += src.length;
  window.__largest = Math.max(window.__largest, src.length);
  return render(src);
};
window.fetch = (url, opts) => {
  if (!String(url).endsWith("/v1/chat/completions")) return realFetch(url, opts);
  const body = new ReadableStream({ start(c) { window.__ctl = c; } });
  return Promise.resolve(new Response(body, {
    status: 200, headers: { "Content-Type": "text/event-stream" } }));
};
const sse = (chunk) =>
  window.__ctl.enqueue(enc.encode("data: " + JSON.stringify(chunk) + "\\n\\n"));
window.__push = (texts) => {
  for (const t of texts) sse({ choices: [{ index: 0, delta: { content: t } }] });
};
window.__finish = () => {
  sse({ choices: [{ index: 0, delta: {}, finish_reason: "stop" }],
        timings: { predicted_n: 1, predicted_per_second: 1, prompt_ms: 1, cache_n: 0 } });
  window.__ctl.enqueue(enc.encode("data: [DONE]\\n\\n"));
  window.__ctl.close();
};
"""


def reply_text() -> str:
    """About 16,000 characters of Markdown: paragraphs, lists, a heading, a quote, code
    fences (one long), an indented block."""
    parts = []
    for i in range(40):
        parts.append(f"Paragraph {i}: " + "a *streamed* word, " * 12 + "and `code`.")
        if i % 5 == 0:
            parts.append("- one\n- two\n- three")
        if i % 7 == 0:
            parts.append(f"## Section {i}\n> a quote\n")
        if i % 9 == 0:
            body = "\n".join(f"    x{i}_{k} = {k} * 2  # <b>not bold</b>" for k in range(40))
            parts.append(f"```python\n{body}\n```")
        if i % 11 == 0:
            parts.append("    indented code\n\n    still code")
    return "\n\n".join(parts) + "\n\nThe end."


def chunks(text: str, size: int = 23) -> list[str]:
    return [text[i : i + size] for i in range(0, len(text), size)]


def shown_length(driver) -> int:
    return driver.execute_script(
        "const b = document.querySelector('.msg.assistant:last-child .body');"
        "return b ? b.textContent.length : 0"
    )


def at_bottom(driver) -> bool:
    return driver.execute_script(
        "const p = document.scrollingElement;"
        "return p.scrollHeight - p.scrollTop - p.clientHeight <= 2"
    )


def push(driver, texts: list[str]) -> None:
    """Feed `texts` and wait until the page has drawn them."""
    before = shown_length(driver)
    driver.execute_script("window.__push(arguments[0])", texts)
    wait_for(driver, lambda d: shown_length(d) > before, "the chunks drawn")


def converse(driver, message: str, reply: list[str]) -> None:
    """One whole exchange through the fake stream."""
    css(driver, "#input")[0].send_keys(message)
    css(driver, "#send")[0].click()
    wait_for(driver, lambda d: d.execute_script("return !!window.__ctl"), "the request")
    driver.execute_script("window.__push(arguments[0]); window.__finish()", reply)
    wait_for(driver, lambda d: not css(d, ".msg.assistant.streaming"), "the reply done")
    driver.execute_script("window.__ctl = null")


@pytest.mark.slow  # a browser against serve --demo
def test_a_streaming_reply_is_appended_and_followed_unless_the_user_scrolls_up(browser):
    from selenium.webdriver.common.action_chains import ActionChains

    text = reply_text()
    assert 15_000 < len(text) < 20_000
    pieces = chunks(text)
    with serve("--demo", "--verify-width", "4") as server:  # no calibration at start
        browser.get(server.base + "/")
        wait_for(browser, lambda d: "dflash-mlx-demo" in css(d, "#model")[0].text, "the model")
        browser.execute_script(FAKE_STREAM)
        for n in range(3):  # a conversation taller than the window
            converse(browser, f"turn {n}", ["line\n\n"] * 12)
        assert browser.execute_script("return document.scrollingElement.scrollHeight") > 900

        css(browser, "#input")[0].send_keys("the long one")
        css(browser, "#send")[0].click()
        wait_for(browser, lambda d: d.execute_script("return !!window.__ctl"), "the request")
        at = 0
        push(browser, pieces[:20])
        at = 20
        first = browser.execute_script(
            "window.__first = document.querySelector('.msg.assistant.streaming .body')"
            ".firstElementChild; return window.__first.outerHTML"
        )
        assert first.startswith('<p class="md-p">Paragraph 0:'), first
        # Following: the bottom stays in view as the reply grows.
        for _ in range(5):
            push(browser, pieces[at : at + 40])
            at += 40
            assert at_bottom(browser), "the view did not follow the reply"
        # The user scrolls up to read: the view stays where they put it.
        ActionChains(browser).scroll_by_amount(0, -600).perform()
        wait_for(browser, lambda d: d.execute_script("return !state.pinned"), "unpinned")
        where = browser.execute_script("return window.scrollY")
        for _ in range(3):
            push(browser, pieces[at : at + 40])
            at += 40
            assert browser.execute_script("return window.scrollY") == where, "yanked down"
        shot(browser, "scrolled-up")
        # Back at the bottom: following again.
        ActionChains(browser).scroll_by_amount(0, 100_000).perform()
        wait_for(browser, lambda d: d.execute_script("return state.pinned"), "pinned again")
        push(browser, pieces[at : at + 40])
        at += 40
        assert at_bottom(browser)
        # The rest, then the end.
        while at < len(pieces):
            push(browser, pieces[at : at + 100])
            at += 100
        browser.execute_script("window.__finish()")
        wait_for(browser, lambda d: css(d, ".msg.assistant.done"), "the reply done")
        wait_for(browser, lambda d: not css(d, ".msg.assistant.streaming"), "the stream closed")

        # Appended: the first part drawn is the same node as at the start.
        assert browser.execute_script(
            "return window.__first.isConnected && document.querySelector("
            "'.msg.assistant:last-child .body').firstElementChild === window.__first"
        ), "the reply was drawn again from the start"
        # Each chunk drew the open part only, never the reply so far: no render longer than
        # the longest block a chunk can leave open (fences are appended to, not drawn), and
        # in all a small multiple of the reply (drawing it all on every chunk: ~ n² / 46,
        # 7 million characters here).
        longest = max(len(b) for b in text.split("\n\n") if not b.startswith("```"))
        rendered, largest = browser.execute_script("return [window.__rendered, window.__largest]")
        assert largest <= longest + 23, (largest, longest)
        assert rendered < 10 * len(text), (rendered, len(text))
        # Drawn exactly as Markdown renders the whole reply.
        same = browser.execute_script(
            "const body = document.querySelector('.msg.assistant:last-child .body');"
            "const want = document.createElement('div');"
            "want.innerHTML = Markdown.render(arguments[0]);"
            "const html = (el) => [...el.children].map((c) => c.outerHTML).join('');"
            "return [html(body), html(want)]",
            text,
        )
        assert same[0] == same[1]
        assert browser.execute_script("return state.messages.at(-1).content") == text
        assert at_bottom(browser)
        shot(browser, "long-reply")
        # The icon loaded: nothing failed in the console (favicon.ico was a 404).
        logs = browser.get_log("browser")
        assert not [e for e in logs if "favicon" in e["message"] or "404" in e["message"]], logs


# Markdown.Stream, alone: whatever the chunks, its settled parts and the open part rendered
# at the end are Markdown.render of the whole reply (node runs the page's own file).
STREAM_CHECK = """
const M = require(%s);
const docs = %s;
const kinds = ["text", "more *b*", "", "", "    ind", "\\tind", "```", "```js", "~~~", "- li",
  "1. ol", "# h", "> q", "  ```", "    ```", "\\t```", "####### x", "  > q", "`c`"];
let seed = 7;
const rnd = () => (seed = (seed * 48271) %% 2147483647) / 2147483647;
for (let d = 0; d < 3000; d++) {
  const lines = [];
  for (let k = 0, n = 1 + Math.floor(rnd() * 14); k < n; k++) {
    lines.push(kinds[Math.floor(rnd() * kinds.length)]);
  }
  docs.push(lines.join("\\n") + (rnd() < 0.5 ? "\\n" : ""));
}
let bad = [];
for (const doc of docs) {
  const s = new M.Stream();
  let parts = [];
  for (let i = 0; i < doc.length; ) {
    i = Math.min(doc.length, i + 1 + Math.floor(rnd() * 9));
    parts = parts.concat(s.feed(doc.slice(0, i)).html);
  }
  const open = M.render(doc.slice(s.settled));
  if (open) parts.push(open);
  if (parts.join("\\n") !== M.render(doc)) bad.push(doc);
}
process.stdout.write(JSON.stringify(bad.slice(0, 3)));
"""


@pytest.mark.skipif(NODE is None, reason="no node to run the page's markdown.js")
def test_the_stream_renders_each_part_once_and_the_whole_as_render_does():
    docs = [
        reply_text(),
        "Hello *world*\n\nSecond\nline two\n\n- a\n- b\n\n1. x\n\n# Head\ntext\n> q\nmore\n",
        "```py\ndef f():\n    return 1\n```\nafter\n\n    code\n\n    more\n\nnot code\n",
        "    code\n\t```\n    still code\ntext\n```\nfenced\n\n\nx\n```\n\ntail",
        "x\r\ny\r\n\r\n```\r\nz\r\n```\r\nw",
    ]
    script = STREAM_CHECK % (json.dumps(str(PAGE / "markdown.js")), json.dumps(docs))
    done = subprocess.run([NODE, "-e", script], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout) == [], "parts that differ from render"
