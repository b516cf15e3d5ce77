"""The page in headless Chromium (Debian's browser, driven by playwright): the key prompt, the
live view, a streamed request from the playground, the request table, the numbers against
/metrics, and 128 requests in flight. Screenshots of each view go to $ENGINE_TEST_ARTIFACTS/ui
(else the test's tmp_path)."""

from __future__ import annotations

import asyncio
import os
import threading
import time
from pathlib import Path

import pytest

from tests.serve.conftest import wait_until
from tests.ui.conftest import API_KEY, MODEL, metrics_now

CHROMIUM = "/usr/bin/chromium"
ARGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--no-first-run",
]

if not os.path.exists(CHROMIUM):
    pytest.skip(f"{CHROMIUM} is not installed (apt-get install chromium)", allow_module_level=True)
sync_api = pytest.importorskip("playwright.sync_api")


@pytest.fixture
def shots(tmp_path) -> Path:
    root = os.environ.get("ENGINE_TEST_ARTIFACTS")
    path = Path(root) / "ui" if root else tmp_path
    path.mkdir(parents=True, exist_ok=True)
    print(f"screenshots in {path}")
    return path


@pytest.fixture
def page(ui_server):
    with sync_api.sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=ARGS)
        try:
            page = browser.new_page(viewport={"width": 1280, "height": 900})
            errors: list[str] = []
            page.on("pageerror", lambda e: errors.append(str(e)))
            yield page
            assert not errors, errors
        finally:
            browser.close()


def _page_numbers(page) -> dict[str, float]:
    cells = page.locator("#now td[data-metric]")
    return {
        cells.nth(i).get_attribute("data-metric"): float(cells.nth(i).get_attribute("data-value"))
        for i in range(cells.count())
    }


def _wait_for_poll(page) -> None:
    """Until the page shows a snapshot taken after now."""
    since = time.time()
    page.wait_for_function(
        f"+document.getElementById('status').dataset.time > {since}", timeout=10_000
    )


def _flood(url: str, n: int, max_tokens: int, done: threading.Event) -> None:
    """n streamed completions at once (in a thread with its own event loop)."""
    import aiohttp

    async def one(session: aiohttp.ClientSession, i: int) -> None:
        body = {
            "model": MODEL,
            "prompt": f"request {i} of the flood",
            "max_tokens": max_tokens,
            "stream": True,
            "ignore_eos": True,
        }
        async with session.post(
            url + "/v1/completions", json=body, headers={"Authorization": f"Bearer {API_KEY}"}
        ) as resp:
            assert resp.status == 200
            async for _ in resp.content:
                pass

    async def run() -> None:
        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:
            await asyncio.gather(*(one(session, i) for i in range(n)))

    try:
        asyncio.run(run())
    finally:
        done.set()


def test_page_in_chromium(ui_server, page, shots):
    url = ui_server.api_url
    page.goto(url + "/")
    # The data endpoints want the key: the page asks for it.
    page.wait_for_selector("#keybar:not([hidden])", timeout=10_000)
    page.fill("#key", API_KEY)
    page.click("#keyset")
    page.wait_for_selector("#now td[data-metric]", timeout=10_000)
    page.wait_for_selector("#processes tbody tr[data-role='engine core']")
    assert page.inner_text("[data-config='block size']") == "16"
    assert page.inner_text("[data-config='max model length']") == "256"
    assert page.locator("#processes tbody tr[data-role='API server']").count() == 2
    # No --speculative-config: no acceptance chart, no speculative-decoding numbers.
    assert page.locator("#chart-spec").is_hidden()
    assert page.locator("#now td[data-metric^='vllm:spec_decode']").count() == 0
    page.screenshot(path=str(shots / "engine-idle.png"), full_page=True)
    # Percentiles interpolate within buckets as Prometheus's histogram_quantile does.
    assert page.evaluate("quantile(0.5, [0.1, 0.2, 0.4], [2, 6, 8], 8)") == pytest.approx(0.15)
    assert page.evaluate("quantile(0.99, [0.1, 0.2], [1, 1], 4)") == 0.2  # in the +Inf bucket
    assert page.evaluate("quantile(0.5, [0.1], [0], 0)") is None

    # The playground streams a completion from /v1 and counts its tokens.
    page.click("nav button[data-view='playground']")
    page.select_option("#pg-mode", "completion")
    page.fill("#pg-prompt", "Once upon a time")
    page.fill("#pg-max_tokens", "24")
    page.fill("#pg-temperature", "0")
    before = metrics_now(url).get("vllm:generation_tokens_total", 0.0)
    page.click("#pg-send")
    page.wait_for_function(
        "document.getElementById('pg-output').dataset.done === '1'", timeout=60_000
    )
    output = page.inner_text("#pg-output")
    stats = page.inner_text("#pg-stats")
    tokens = int(page.get_attribute("#pg-stats", "data-tokens"))
    assert output.strip() and 0 < tokens <= 24, stats
    assert "tokens/s" in stats or tokens == 1, stats
    page.screenshot(path=str(shots / "playground.png"), full_page=True)
    # Chat too, with a system prompt, through /v1/chat/completions.
    page.select_option("#pg-mode", "chat")
    page.fill("#pg-system", "You are terse.")
    page.fill("#pg-prompt", "Say hello")
    page.fill("#pg-max_tokens", "6")
    page.click("#pg-send")
    page.wait_for_function(
        "document.getElementById('pg-output').dataset.done === '1'", timeout=60_000
    )
    assert page.inner_text("#pg-output").strip()
    chat_tokens = int(page.get_attribute("#pg-stats", "data-tokens"))
    assert 0 < chat_tokens <= 6
    page.screenshot(path=str(shots / "playground-chat.png"), full_page=True)

    # The request table lists it; a click shows its text.
    page.click("nav button[data-view='requests']")
    rows = page.locator("#requests tbody tr")
    page.wait_for_function(
        "document.querySelectorAll('#requests tbody tr').length >= 2", timeout=10_000
    )
    chat_row, completion_row = rows.nth(0), rows.nth(1)
    assert chat_row.locator("td").first.inner_text().startswith("chat")
    assert chat_row.locator("td").nth(9).inner_text() == str(chat_tokens)
    assert completion_row.locator("td").first.inner_text().startswith("completion")
    assert completion_row.locator("td").nth(9).inner_text() == str(tokens)
    assert completion_row.locator("td").nth(4).get_attribute("data-chunks") == "1"
    completion_row.click()
    page.wait_for_selector("#detail pre.output")
    assert page.inner_text("#detail pre.output") == output
    assert page.inner_text("#detail pre") == "Once upon a time"
    chat_row.click()
    page.wait_for_function(
        "document.querySelector('#detail pre')?.textContent === "
        "'system: You are terse.\\nuser: Say hello'",
        timeout=10_000,
    )
    page.screenshot(path=str(shots / "requests.png"), full_page=True)

    # Back on the engine view: the generation chart has drawn the tokens, and once the engine
    # is idle the page's numbers are /metrics's.
    page.click("nav button[data-view='engine']")
    assert wait_until(
        lambda: metrics_now(url)["vllm:generation_tokens_total"] >= before + tokens + chat_tokens
    )
    _wait_for_poll(page)
    _wait_for_poll(page)
    numbers = _page_numbers(page)
    prom = metrics_now(url)
    assert numbers, "no numbers on the page"
    for name, value in numbers.items():
        assert value == pytest.approx(prom.get(name, 0.0), abs=1e-9), name
    assert numbers["vllm:generation_tokens_total"] >= before + tokens + chat_tokens
    assert "L" in page.get_attribute("#chart-gen svg path", "d")
    page.screenshot(path=str(shots / "engine-after-request.png"), full_page=True)

    # A poll redraws in place: the table rows and chart lines are the elements built at first.
    page.evaluate(
        "window.kept = [document.querySelector('#now tr'), "
        "document.querySelector('#chart-gen svg path')]"
    )
    _wait_for_poll(page)
    assert page.evaluate(
        "window.kept[0] === document.querySelector('#now tr') && "
        "window.kept[1] === document.querySelector('#chart-gen svg path')"
    )
    # A hidden tab polls nothing; shown again, it catches up at once.
    page.evaluate(
        "Object.defineProperty(document, 'visibilityState', "
        "{value: 'hidden', configurable: true}); "
        "document.dispatchEvent(new Event('visibilitychange'))"
    )
    time.sleep(1.5)  # a poll already under way lands
    hidden_at = page.get_attribute("#status", "data-time")
    time.sleep(2.5)
    assert page.get_attribute("#status", "data-time") == hidden_at
    page.evaluate(
        "delete document.visibilityState; document.dispatchEvent(new Event('visibilitychange'))"
    )
    _wait_for_poll(page)

    # 128 requests in flight: the page keeps polling, answers at once, and shows the load.
    done = threading.Event()
    flood = threading.Thread(target=_flood, args=(url, 128, 64, done), daemon=True)
    flood.start()
    seen_load, slowest = 0.0, 0.0
    while not done.is_set():
        t0 = time.monotonic()
        _wait_for_poll(page)
        page.evaluate("1 + 1")
        slowest = max(slowest, time.monotonic() - t0)
        load = _page_numbers(page)
        seen_load = max(
            seen_load, load["vllm:num_requests_running"] + load["vllm:num_requests_waiting"]
        )
        if seen_load >= 64 and not (shots / "engine-128-in-flight.png").exists():
            page.screenshot(path=str(shots / "engine-128-in-flight.png"), full_page=True)
    flood.join(timeout=120)
    assert seen_load >= 64, seen_load
    assert slowest < 5.0, slowest
