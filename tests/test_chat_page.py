"""The chat page at `/` in a real headless browser (Debian's chromium and chromium-driver,
through selenium) against `dflash-mlx serve --demo` on loopback: a message streams its reply
with its τ and tok/s, a long reply is stopped mid-stream (and the server cancels it), the
API key is asked for, and a page from a foreign origin cannot drive the server. Screenshots
are kept under `test-artifacts/` (git-ignored). Skipped where no chromium is installed."""

from __future__ import annotations

import http.server
import re
import shutil
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from functools import partial
from pathlib import Path

import httpx
import pytest

from .test_cli_serve import serve
from .test_server_metrics import scrape

pytestmark = pytest.mark.slow

ARTIFACTS = Path(__file__).parent.parent / "test-artifacts"
WAIT = 120.0  # seconds, for anything the page does
KEY = "page-test-key"


def _browser_paths() -> tuple[str | None, str | None]:
    browser = next(
        (
            shutil.which(n)
            for n in ("chromium", "chromium-browser", "google-chrome")
            if shutil.which(n)
        ),
        None,
    )
    return browser, shutil.which("chromedriver")


try:
    import selenium  # noqa: F401

    MISSING = None
except ImportError:
    MISSING = "selenium is not installed (pip install -e '.[test]')"
if MISSING is None and None in _browser_paths():
    MISSING = "no chromium / chromedriver (apt-get install chromium chromium-driver)"


@pytest.fixture
def browser() -> Iterator:
    if MISSING:
        pytest.skip(MISSING)
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    binary, driver_path = _browser_paths()
    options = webdriver.ChromeOptions()
    options.binary_location = binary
    for arg in (
        "--headless=new",
        "--no-sandbox",
        "--disable-dev-shm-usage",
        "--disable-gpu",
        "--window-size=1000,900",
        # A foreign site for the Origin test: evil.test is this machine, under another name.
        "--host-resolver-rules=MAP evil.test 127.0.0.1",
    ):
        options.add_argument(arg)
    options.set_capability("goog:loggingPrefs", {"browser": "ALL"})  # the console, read back
    driver = webdriver.Chrome(options=options, service=Service(executable_path=driver_path))
    driver.set_script_timeout(WAIT)
    try:
        yield driver
    finally:
        driver.quit()


def wait_for(driver, condition, what: str):
    deadline = time.monotonic() + WAIT
    while time.monotonic() < deadline:
        try:
            found = condition(driver)
        except IndexError:  # the element it reads is not on the page yet
            found = None
        if found:
            return found
        time.sleep(0.05)
    shot(driver, "failed")
    raise AssertionError(f"the page never showed: {what}")


def shot(driver, name: str) -> Path:
    ARTIFACTS.mkdir(exist_ok=True)
    path = ARTIFACTS / f"chat-page-{name}.png"
    driver.save_screenshot(str(path))
    return path


def css(driver, selector: str):
    return driver.find_elements("css selector", selector)


def send(driver, text: str, max_tokens: int) -> None:
    field = css(driver, "#max-tokens")[0]
    if not field.is_displayed():
        css(driver, "#settings summary")[0].click()
    field.clear()
    field.send_keys(str(max_tokens))
    css(driver, "#input")[0].send_keys(text)
    css(driver, "#send")[0].click()


def test_the_page_streams_a_reply_with_its_stats_and_stops_one(browser):
    with serve("--demo") as server:
        assert f"chat page {server.base}/" in "".join(server.log)  # the banner says where
        browser.get(server.base + "/")
        wait_for(browser, lambda d: "dflash-mlx-demo" in css(d, "#model")[0].text, "the model")
        assert "draft" in css(browser, "#model")[0].text

        # A reply, streamed, with the engine's figures under it.
        send(browser, "def fibonacci(n):", 24)
        done = wait_for(browser, lambda d: css(d, ".msg.assistant.done"), "a whole reply")[0]
        stats = done.find_element("css selector", ".stats").text
        assert re.fullmatch(
            r"24 tokens · [\d.]+ tok/s · τ \d+\.\d\d( · accepted \d+%)? · TTFT \d+ ms · "
            r"\d+ cached prompt tokens · length",
            stats,
        ), stats
        assert done.find_element("css selector", ".body").text.strip()
        shot(browser, "reply")

        # The same conversation again: the server's answer at temperature 0 is the page's.
        reply = httpx.post(
            f"{server.base}/v1/chat/completions",
            json={
                "messages": [{"role": "user", "content": "def fibonacci(n):"}],
                "max_tokens": 24,
                "temperature": 0,
            },
            timeout=WAIT,
        ).json()["choices"][0]["message"]["content"]
        shown = browser.execute_script("return state.messages[1].content")
        assert shown == reply

        # A long reply, stopped while it streams: the page says so and the server cancels it.
        before = scrape(server.base, key=None)
        send(browser, "class Stack:", 3000)
        wait_for(
            browser,
            lambda d: (
                css(d, ".msg.assistant.streaming .body")
                and css(d, ".msg.assistant.streaming .body")[0].text.strip()
            ),
            "a reply streaming",
        )
        assert css(browser, "#stop")[0].is_displayed()
        css(browser, "#stop")[0].click()
        stopped = wait_for(browser, lambda d: css(d, ".msg.assistant.stopped"), "stopped")[0]
        assert stopped.find_element("css selector", ".stats").text == "stopped"
        assert (
            css(browser, "#send")[0].is_displayed() and not css(browser, "#stop")[0].is_displayed()
        )
        path = shot(browser, "stopped")
        assert path.stat().st_size > 1000
        deadline = time.monotonic() + WAIT
        cancelled = 'dflash_requests_total{api="chat_completions",outcome="cancelled"}'
        while scrape(server.base, key=None).get(cancelled, 0) < before.get(cancelled, 0) + 1:
            assert time.monotonic() < deadline, "the server never cancelled the stopped reply"
            time.sleep(0.1)
        after = scrape(server.base, key=None)
        made = after["dflash_generated_tokens_total"] - before["dflash_generated_tokens_total"]
        assert 0 < made < 3000, "the reply was cut short"

        # New chat: an empty conversation.
        css(browser, "#new-chat")[0].click()
        assert not css(browser, ".msg") and browser.execute_script("return state.messages") == []


ATTACK = """<!doctype html><title>waiting</title><script>
async function attempt(type) {
  try {
    const r = await fetch("%s/v1/chat/completions", {method: "POST",
      headers: {"Content-Type": type},
      body: JSON.stringify({messages: [{role: "user", content: "hi"}], max_tokens: 4})});
    return "answered " + r.status + " " + (await r.text()).slice(0, 40);
  } catch (e) { return "blocked"; }
}
Promise.all([attempt("application/json"), attempt("text/plain")]).then(
  (r) => { document.title = r.join(" | "); });
</script>"""


@contextmanager
def foreign_site(folder: Path, server_base: str) -> Iterator[str]:
    (folder / "attack.html").write_text(ATTACK % server_base)
    handler = partial(http.server.SimpleHTTPRequestHandler, directory=str(folder))
    site = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=site.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://evil.test:{site.server_address[1]}/attack.html"
    finally:
        site.shutdown()
        site.server_close()


def test_with_an_api_key_the_page_asks_for_it_and_foreign_pages_get_nothing(browser, tmp_path):
    with serve("--demo", "--api-key", KEY) as server:
        browser.get(server.base + "/")
        form = wait_for(
            browser, lambda d: [f for f in css(d, "#key-form") if f.is_displayed()], "the key form"
        )[0]
        css(browser, "#key")[0].send_keys("wrong")
        form.find_element("css selector", "button").click()
        wait_for(browser, lambda d: "refused" in css(d, "#key-error")[0].text, "key refused")
        css(browser, "#key")[0].clear()
        css(browser, "#key")[0].send_keys(KEY)
        form.find_element("css selector", "button").click()
        wait_for(browser, lambda d: "dflash-mlx-demo" in css(d, "#model")[0].text, "the model")
        assert not css(browser, "#key-form")[0].is_displayed()
        send(browser, "import os", 8)
        done = wait_for(browser, lambda d: css(d, ".msg.assistant.done"), "a reply")[0]
        assert "τ" in done.find_element("css selector", ".stats").text
        shot(browser, "api-key")

        # A page elsewhere (another site, even one that knows the key cannot be sent by it):
        # neither a preflighted JSON request nor a "simple" text/plain one gets through.
        before = scrape(server.base, key=KEY)
        with foreign_site(tmp_path, server.base) as url:
            browser.get(url)
            title = wait_for(browser, lambda d: d.title != "waiting" and d.title, "the attempt")
        assert title == "blocked | blocked", title
        after = scrape(server.base, key=KEY)
        completed = 'dflash_requests_total{api="chat_completions",outcome="completed"}'
        assert after[completed] == before[completed], "nothing was generated for that page"
        assert after["dflash_generated_tokens_total"] == before["dflash_generated_tokens_total"]

        # Its name rebound to this server (DNS rebinding): the server refuses the Host.
        browser.get(server.base.replace("127.0.0.1", "evil.test") + "/")
        assert "host_not_allowed" in browser.page_source
