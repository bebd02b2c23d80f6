"""`/metrics` and the chat page's HTTP side, on a real uvicorn server over the session's tiny
pair (`tests/test_server.serving`), asked with real clients (openai, anthropic, httpx).

The counters must add up to what the requests' own replies reported in `timings`."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import anthropic
import httpx
import pytest

from dflash_mlx.server.security import same_origin_ip

from .test_server import KEY, TIMEOUT, USER, WIDTH, Server, serving

PAGE = Path(__file__).parent.parent / "dflash_mlx" / "server" / "page"


def scrape(base: str, key: str | None = KEY) -> dict[str, float]:
    """`/metrics` as {'name{labels}': value}, checked to be Prometheus' text format."""
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    r = httpx.get(f"{base}/metrics", headers=headers, timeout=TIMEOUT)
    assert r.status_code == 200, r.text
    assert r.headers["content-type"].startswith("text/plain; version=0.0.4")
    out: dict[str, float] = {}
    typed = set()
    for line in r.text.splitlines():
        if line.startswith("# TYPE "):
            name, kind = line.split()[2:4]
            assert kind in ("counter", "gauge", "histogram"), line
            typed.add(name)
            continue
        if line.startswith("#"):
            continue
        label = r'[a-z_]+="(?:[^"\\\n]|\\[\\"n])*"'
        found = re.fullmatch(rf"([a-z_]+)(\{{{label}(?:,{label})*\}})? (\S+)", line)
        assert found, f"not an exposition line: {line!r}"
        family = re.sub(r"_(bucket|sum|count)$", "", found.group(1))
        assert found.group(1) in typed or family in typed, f"no # TYPE for {line!r}"
        out[found.group(1) + (found.group(2) or "")] = float(found.group(3))
    return out


@pytest.fixture(scope="module")
def keyed(models_dir) -> Iterator[Server]:
    """A server of its own (fresh counters), with an API key and a fixed verify width (real
    draft-and-verify cycles), batching up to 4 requests."""
    with serving(models_dir, api_key=KEY, verify_width=WIDTH, max_batch=4) as s:
        yield s


def test_metrics_add_up_to_what_the_replies_timings_reported(keyed):
    client = keyed.client(KEY)
    timings, prompts = [], []

    def took(t: dict, prompt_tokens: int) -> None:
        timings.append(t)
        prompts.append(prompt_tokens)

    # Chat, whole and streamed; the same conversation's second turn reuses its cache. Greedy
    # throughout: a sampled reply may end at EOS before its max_tokens, which the sum counts.
    r = client.chat.completions.create(model="tiny", messages=USER, max_tokens=12, temperature=0)
    took(r.model_extra["timings"], r.usage.prompt_tokens)
    turn = USER + [{"role": "assistant", "content": r.choices[0].message.content}]
    turn += [{"role": "user", "content": "and again"}]
    r = client.chat.completions.create(model="tiny", messages=turn, max_tokens=9, temperature=0)
    took(r.model_extra["timings"], r.usage.prompt_tokens)
    assert timings[-1]["cache_n"] > 0, "the second turn resumed from the first one's cache"
    stream = client.chat.completions.create(
        model="tiny",
        messages=[{"role": "user", "content": "class Stack:"}],
        max_tokens=10,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    last = next(c for c in chunks if c.choices and c.choices[0].finish_reason)
    took(last.model_extra["timings"], chunks[-1].usage.prompt_tokens)
    # Text completions and Anthropic's Messages.
    r = client.completions.create(model="tiny", prompt="def f(x):", max_tokens=7, temperature=0)
    took(r.model_extra["timings"], r.usage.prompt_tokens)
    claude = anthropic.Anthropic(base_url=keyed.base, api_key=KEY, max_retries=0)
    m = claude.messages.create(
        model="tiny", max_tokens=8, messages=USER, extra_body={"temperature": 0}
    )
    took(m.model_extra["timings"], m.usage.input_tokens + (m.usage.cache_read_input_tokens or 0))
    # Three at once: decoded together, in batches.
    with ThreadPoolExecutor(3) as pool:
        together = list(
            pool.map(
                lambda i: client.completions.create(
                    model="tiny", prompt=f"def f{i}(x):", max_tokens=48, temperature=0
                ),
                range(3),
            )
        )
    for r in together:
        took(r.model_extra["timings"], r.usage.prompt_tokens)
    # Refusals: a bad field, a missing key, a foreign page.
    bad = httpx.post(
        f"{keyed.base}/v1/chat/completions",
        json={"messages": USER, "max_tokens": -1},
        headers={"Authorization": f"Bearer {KEY}"},
        timeout=TIMEOUT,
    )
    assert bad.status_code == 400
    assert httpx.post(f"{keyed.base}/v1/completions", json={}, timeout=TIMEOUT).status_code == 401
    foreign = httpx.post(
        f"{keyed.base}/v1/messages",
        json={"messages": USER, "max_tokens": 4, "model": "x"},
        headers={"Origin": "https://evil.example", "x-api-key": KEY},
        timeout=TIMEOUT,
    )
    assert foreign.status_code == 403
    keyed.wait_idle()

    m = scrape(keyed.base)

    def total(key: str) -> float:
        return sum(t[key] for t in timings)

    assert m['dflash_requests_total{api="chat_completions",outcome="completed"}'] == 3
    assert m['dflash_requests_total{api="chat_completions",outcome="client_error"}'] == 1
    assert m['dflash_requests_total{api="completions",outcome="completed"}'] == 4
    assert m['dflash_requests_total{api="completions",outcome="client_error"}'] == 1
    assert m['dflash_requests_total{api="messages",outcome="completed"}'] == 1
    assert m['dflash_requests_total{api="messages",outcome="client_error"}'] == 1
    assert m["dflash_prompt_tokens_total"] == sum(prompts)
    assert m["dflash_prompt_cached_tokens_total"] == total("cache_n") > 0
    assert m["dflash_prompt_prefilled_tokens_total"] == total("prompt_n")
    assert m["dflash_generated_tokens_total"] == total("predicted_n") == 12 + 9 + 10 + 7 + 8 + 144
    assert m["dflash_draft_tokens_total"] == total("draft_n") > 0
    assert m["dflash_draft_accepted_tokens_total"] == total("draft_n_accepted")
    assert m["dflash_verify_cycles_total"] == total("cycles")
    committed = sum(t["tau"] * t["cycles"] for t in timings)
    assert m["dflash_committed_tokens_total"] == pytest.approx(committed)
    assert m["dflash_tau"] == pytest.approx(committed / total("cycles"))
    widths: dict[str, list[int]] = {}
    batches: dict[str, int] = {}
    for t in timings:
        for w, ran in t["ran"]["widths"].items():
            widths.setdefault(w, [0, 0])
            widths[w][0] += ran["cycles"]
            widths[w][1] += ran["tokens"]
        for rows, cycles in t["ran"]["batches"].items():
            batches[rows] = batches.get(rows, 0) + cycles
    assert str(WIDTH) in widths
    for w, (cycles, tokens) in widths.items():
        assert m[f'dflash_verify_width_cycles_total{{width="{w}"}}'] == cycles
        assert m[f'dflash_verify_width_tokens_total{{width="{w}"}}'] == tokens
    assert batches, "the three requests sent at once decoded in batches"
    assert {k: v for k, v in m.items() if k.startswith("dflash_batch_cycles_total")} == {
        f'dflash_batch_cycles_total{{rows="{b}"}}': c for b, c in batches.items()
    }
    assert m["dflash_time_to_first_token_seconds_count"] == len(timings)
    assert m["dflash_time_to_first_token_seconds_sum"] == pytest.approx(total("prompt_ms") / 1000)
    assert m['dflash_time_to_first_token_seconds_bucket{le="+Inf"}'] == len(timings)
    assert m["dflash_time_per_output_token_seconds_count"] == total("predicted_n") - len(timings)
    assert m["dflash_time_per_output_token_seconds_sum"] == pytest.approx(
        total("predicted_ms") / 1000
    )
    hits = sum(1 for t in timings if t["cache_n"] > 0)
    assert m.get('dflash_prompt_cache_requests_total{source="miss"}', 0) == len(timings) - hits
    assert m["dflash_running_rows"] == 0 and m["dflash_queue_depth"] == 0
    assert m["dflash_max_batch"] == keyed.engine.max_batch


def test_a_stream_stopped_by_its_client_is_counted_cancelled(keyed):
    before = scrape(keyed.base)
    key = 'dflash_requests_total{api="chat_completions",outcome="cancelled"}'
    with httpx.stream(
        "POST",
        f"{keyed.base}/v1/chat/completions",
        json={"messages": USER, "max_tokens": 4000, "stream": True},
        headers={"Authorization": f"Bearer {KEY}"},
        timeout=TIMEOUT,
    ) as r:
        lines = r.iter_lines()
        assert any('"content"' in line and '""' not in line for line in lines)
    keyed.wait_idle()
    after = scrape(keyed.base)
    assert after.get(key, 0) == before.get(key, 0) + 1
    assert after["dflash_generated_tokens_total"] > before["dflash_generated_tokens_total"]


def test_metrics_names_what_is_served_with_label_values_escaped(models_dir):
    odd = 'my "model"\\v1'
    with serving(models_dir, warm_up=False, settings={"model_id": odd, "draft_id": "z-lab/d"}) as s:
        m = scrape(s.base, key=None)
    (info,) = [k for k in m if k.startswith("dflash_info{")]
    assert info.startswith('dflash_info{model="my \\"model\\"\\\\v1",draft="z-lab/d",version="')
    assert m[info] == 1


def test_metrics_needs_the_key_when_the_server_has_one(keyed):
    for headers in ({}, {"Authorization": "Bearer wrong"}):
        r = httpx.get(f"{keyed.base}/metrics", headers=headers, timeout=TIMEOUT)
        assert r.status_code == 401
        assert "API key" in r.json()["error"]["message"]
    assert (
        "dflash_requests_total"
        in httpx.get(f"{keyed.base}/metrics", headers={"x-api-key": KEY}, timeout=TIMEOUT).text
    )


def test_the_chat_page_is_served_from_the_package_without_a_key(keyed):
    r = httpx.get(f"{keyed.base}/", timeout=TIMEOUT)
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/html")
    assert "default-src 'self'" in r.headers["content-security-policy"]
    # Nothing from elsewhere: every script and stylesheet is the package's own.
    assert re.findall(r'(?:src|href)="([^"]+)"', r.text) == [
        "/favicon.ico",
        "/page/chat.css",
        "/page/markdown.js",
        "/page/chat.js",
    ]
    # Its icon, without a key (a browser asks /favicon.ico whatever the page says: a 404
    # in the console before).
    icon = httpx.get(f"{keyed.base}/favicon.ico", timeout=TIMEOUT)
    assert icon.status_code == 200 and icon.headers["content-type"] == "image/svg+xml"
    assert icon.content == (PAGE / "favicon.svg").read_bytes()
    for name in ("chat.css", "markdown.js", "chat.js"):
        served = httpx.get(f"{keyed.base}/page/{name}", timeout=TIMEOUT)
        assert served.status_code == 200
        assert served.content == (PAGE / name).read_bytes()
        assert "http://" not in served.text and "https://" not in served.text.replace("https?:", "")
    assert httpx.get(f"{keyed.base}/page/../app.py", timeout=TIMEOUT).status_code == 404
    # The page asks its API with the key: without one the API refuses it.
    assert httpx.get(f"{keyed.base}/v1/models", timeout=TIMEOUT).status_code == 401


def test_a_foreign_host_or_origin_cannot_use_the_page_or_the_api(keyed):
    rebound = httpx.get(f"{keyed.base}/", headers={"Host": "evil.example:80"}, timeout=TIMEOUT)
    assert rebound.status_code == 403 and "host_not_allowed" in rebound.text
    page = httpx.post(
        f"{keyed.base}/v1/chat/completions",
        json={"messages": USER, "max_tokens": 2},
        headers={"Origin": "http://evil.example", "Authorization": f"Bearer {KEY}"},
        timeout=TIMEOUT,
    )
    assert page.status_code == 403 and "origin_not_allowed" in page.text
    assert "access-control-allow-origin" not in page.headers


def test_same_origin_is_allowed_at_an_address_never_at_a_name(models_dir):
    """Bound beyond loopback, the page at http://ADDRESS:PORT/ may call its own API; a page
    at a name (which could be an attacker's, resolving here) may not."""
    assert same_origin_ip("http://192.168.1.5:8080", "192.168.1.5:8080")
    assert same_origin_ip("http://[fe80::1]:8080", "[fe80::1]:8080")
    assert not same_origin_ip("http://192.168.1.5:8080", "192.168.1.5:9090")
    assert not same_origin_ip("http://evil.example:8080", "evil.example:8080")
    assert not same_origin_ip("null", "192.168.1.5:8080")
    with serving(models_dir, warm_up=False, settings={"loopback_only": False, "api_key": KEY}) as s:
        auth = {"Authorization": f"Bearer {KEY}"}

        def models(host: str, origin: str) -> int:
            headers = {"Host": host, "Origin": origin, **auth}
            return httpx.get(f"{s.base}/v1/models", headers=headers, timeout=TIMEOUT).status_code

        assert models("192.168.1.5:8080", "http://192.168.1.5:8080") == 200
        assert models("192.168.1.5:8080", "http://192.168.1.6:8080") == 403
        assert models("evil.example:8080", "http://evil.example:8080") == 403


NODE = shutil.which("node")


@pytest.mark.skipif(NODE is None, reason="no node to run the page's markdown.js")
@pytest.mark.parametrize(
    "markdown, html",
    [
        ("def __init__(self): __x__", '<p class="md-p">def __init__(self): __x__</p>'),
        (
            "```python\nclass A:\n    def __init__(self):\n        return '<b>' & 1\n```",
            '<pre><code class="language-python">class A:\n    def __init__(self):\n'
            "        return &#39;&lt;b&gt;&#39; &amp; 1</code></pre>",
        ),
        (
            "**bold** `**not** <i>` *it*",
            '<p class="md-p"><strong>bold</strong> <code>**not** &lt;i&gt;</code> <em>it</em></p>',
        ),
        ("<script>alert(1)</script>", '<p class="md-p">&lt;script&gt;alert(1)&lt;/script&gt;</p>'),
        ("[x](javascript:alert(1))", '<p class="md-p">[x](javascript:alert(1))</p>'),
        ("- a\n- b", "<ul><li>a</li><li>b</li></ul>"),
        (
            "text\n\n    indented\n      more",
            '<p class="md-p">text</p>\n<pre><code>indented\n  more</code></pre>',
        ),
        ("```\nnot closed yet\n  x", "<pre><code>not closed yet\n  x</code></pre>"),
    ],
)
def test_markdown_shows_code_exactly_and_escapes_html(markdown, html):
    script = f"process.stdout.write(require({json.dumps(str(PAGE / 'markdown.js'))})"
    script += f".render({json.dumps(markdown)}))"
    done = subprocess.run([NODE, "-e", script], capture_output=True, text=True, timeout=30)
    assert done.returncode == 0, done.stderr
    assert done.stdout == html
