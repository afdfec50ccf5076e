"""The documentation pages work with no internet: `/` (Scalar) and `/docs` (Swagger UI) render the
API in headless Chromium that may reach loopback only, and the schema's example request succeeds."""

from __future__ import annotations

import json
import shutil
from collections.abc import Iterator
from dataclasses import dataclass, field
from urllib.parse import urlsplit

import pytest
from playwright.sync_api import Browser, ConsoleMessage, Page, Request, Response, Route, expect, sync_playwright

from harness.stacks import Stack
from harness.web import web

CHROMIUM = shutil.which("chromium")
CHROMIUM_FLAGS = [
    "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
    "--disable-background-networking", "--disable-component-update", "--disable-sync",
    # A second wall behind the request router: requests Playwright cannot see (the favicon) fail too.
    "--host-resolver-rules=MAP * ~NOTFOUND, EXCLUDE 127.0.0.1",
]
OPERATION = "Evaluate a state against named questions"
# Chromium renders these pages in ~2 s on a quiet 2-core machine; under a loaded CI one took over 30 s.
LOAD_TIMEOUT_MS = 120_000

needs_chromium = pytest.mark.skipif(
    CHROMIUM is None, reason="needs Debian's `chromium` package (apt-get install -y chromium)")


@dataclass
class OfflinePage:
    """A page whose every request off loopback is blocked and recorded, with what went wrong."""

    page: Page
    blocked: list[str] = field(default_factory=list)
    failed: list[str] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.page.route("**/*", self._only_loopback)
        self.page.on("requestfailed", self._request_failed)
        self.page.on("response", self._response)
        self.page.on("console", self._console)
        self.page.on("pageerror", lambda error: self.errors.append(f"uncaught: {error}"))

    def _only_loopback(self, route: Route) -> None:
        if urlsplit(route.request.url).hostname == "127.0.0.1":
            route.continue_()
        else:
            self.blocked.append(route.request.url)
            route.abort("internetdisconnected")

    def _request_failed(self, request: Request) -> None:
        self.failed.append(f"{request.url}: {request.failure}")

    def _response(self, response: Response) -> None:
        if response.status >= 400:
            self.failed.append(f"{response.url}: HTTP {response.status}")

    def _console(self, message: ConsoleMessage) -> None:
        if message.type == "error":
            self.errors.append(f"{message.text} at {message.location.get('url')}")

    def show(self, url: str, *texts: str) -> None:
        """Load `url` and wait until each of `texts` is visible on it."""
        self.page.goto(url, wait_until="networkidle", timeout=LOAD_TIMEOUT_MS)
        for text in texts:
            expect(self.page.get_by_text(text).first).to_be_visible(timeout=LOAD_TIMEOUT_MS)

    def assert_clean(self) -> None:
        self.page.wait_for_load_state("networkidle", timeout=LOAD_TIMEOUT_MS)
        assert self.blocked == [], "the page reached for the internet"
        assert self.failed == [], "assets failed to load"
        assert self.errors == [], "the page logged errors"


@pytest.fixture(scope="module")
def browser() -> Iterator[Browser]:
    """Debian's Chromium; each launch gets a fresh temporary --user-data-dir from Playwright."""
    with sync_playwright() as playwright:
        chromium = playwright.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_FLAGS)
        yield chromium
        chromium.close()


@pytest.fixture
def offline(browser: Browser) -> Iterator[OfflinePage]:
    context = browser.new_context()
    yield OfflinePage(context.new_page())
    context.close()


def schema_example(url: str) -> dict:
    schema = web.get(f"{url}/openapi.json", timeout=10).json()
    body = schema["paths"]["/v1/systemone"]["post"]["requestBody"]["content"]["application/json"]
    return body["examples"]["ticket"]["value"]


def test_schema_example_request_gets_three_answers(scripted_stack: Stack) -> None:
    example = schema_example(scripted_stack.url)
    r = scripted_stack.post(example)
    assert r.status_code == 200, r.text
    assert list(r.json()["answers"]) == list(example["questions"])
    assert len(example["questions"]) == 3


@needs_chromium
def test_scalar_reference_renders_the_api_offline(scripted_stack: Stack, offline: OfflinePage) -> None:
    offline.show(f"{scripted_stack.url}/", OPERATION, "/v1/systemone")
    offline.assert_clean()


@needs_chromium
def test_swagger_ui_renders_the_api_offline(scripted_stack: Stack, offline: OfflinePage) -> None:
    offline.show(f"{scripted_stack.url}/docs", OPERATION, "/v1/systemone")
    expect(offline.page.locator(".opblock-summary-path", has_text="/v1/systemone")).to_be_visible()
    offline.assert_clean()


@needs_chromium
def test_scalar_example_request_is_editable_and_sends_from_the_page(scripted_stack: Stack,
                                                                     offline: OfflinePage) -> None:
    page = offline.page
    offline.show(f"{scripted_stack.url}/", OPERATION)
    page.get_by_role("button", name="Test Request (post /v1/systemone)").click()
    editor = page.get_by_role("dialog").locator(".cm-content").filter(has_text='"questions"')
    assert schema_example(scripted_stack.url)["state"] in editor.inner_text()

    edited = {"model": "jev-latest", "state": "Edited in the page.", "questions": {"edited": {"type": "noul"}}}
    editor.click()
    page.keyboard.press("Control+A")
    page.keyboard.insert_text(json.dumps(edited))
    page.wait_for_timeout(1000)  # the client commits editor changes to the request after a debounce
    with page.expect_response(lambda r: r.url.endswith("/v1/systemone")) as sent:
        page.get_by_role("dialog").get_by_role("button", name="Send").first.click()

    assert sent.value.status == 200
    assert list(sent.value.json()["answers"]) == ["edited"]
    offline.assert_clean()
