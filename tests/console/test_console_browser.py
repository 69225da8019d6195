"""Browser smoke test of the admin console: the real `twinkle console` command (Streamlit) against
the real gateway, driven by Playwright on Debian's Chromium (``apt-get install chromium``;
Playwright downloads no browser). It is refused a non-admin key, signs in with an admin key,
walks every page and saves a full-page screenshot of each (in ``$TWINKLE_CONSOLE_SCREENSHOTS``
when set, else a temp dir), checking that no page shows an error or a traceback.

Skipped only outside CI when Chromium is missing; under CI (``CI=1``) it must run.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.console.conftest import Gateway
from tests.gateway.harness import fwdbwd, model, wait_future
from tests.services import free_port

CHROMIUM = "/usr/bin/chromium"
# what environment.md §10 found reliable in a container: no sandbox, no GPU, nothing phoned home
CHROMIUM_ARGS = [
    "--no-sandbox",
    "--disable-gpu",
    "--disable-dev-shm-usage",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]
PAGES = {
    "Overview": "Overview",
    "Orgs & users": "Organizations and users",
    "Keys": "API keys",
    "Quotas": "Quotas",
    "Usage": "Usage",
    "Audit log": "Audit log",
    "Engine": "Engine",
}

if not Path(CHROMIUM).exists() and not os.environ.get("CI"):
    pytest.skip(f"{CHROMIUM} missing (apt-get install chromium)", allow_module_level=True)


@pytest.fixture(scope="module")
def console(gateway: Gateway) -> Iterator[str]:
    """``twinkle console --gateway URL --port P``, as an operator starts it; its URL."""
    port = free_port()
    twinkle = Path(sys.executable).parent / "twinkle"
    proc = subprocess.Popen(
        [str(twinkle), "console", "--gateway", gateway.url, "--port", str(port)],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            assert proc.poll() is None, proc.communicate()[0][-3000:]
            try:
                if httpx.get(f"{url}/_stcore/health", timeout=1).text == "ok":
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        else:
            raise AssertionError("twinkle console did not become healthy in 60 s")
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        if proc.stdout is not None:
            proc.stdout.close()


@pytest.fixture(scope="module")
def shots(tmp_path_factory: pytest.TempPathFactory) -> Path:
    where = os.environ.get("TWINKLE_CONSOLE_SCREENSHOTS")
    path = Path(where) if where else tmp_path_factory.mktemp("console-screenshots")
    path.mkdir(parents=True, exist_ok=True)
    return path


def _traffic(gateway: Gateway) -> None:
    """Something for every page to show: a user with a trained adapter and a quota."""
    key = gateway.key("erin", org="browser-org")
    with gateway.http(key) as c:
        mid = model(c, key)  # an httpx.Client speaks TestClient's API
        wait_future(c, key, fwdbwd(c, key, mid, 1, 64).json())
    with gateway.http(gateway.admin_key) as c:
        org = next(
            o for o in c.get("/api/v1/admin/orgs").json()["orgs"] if o["name"] == "browser-org"
        )
        limits = {"max_training_clients": 4, "train_tokens_per_day": 1_000_000}
        assert c.put(f"/api/v1/admin/quotas/org/{org['id']}", json={"limits": limits}).is_success


def _settle(page) -> None:
    """Wait until Streamlit's script run is over (its status widget gone) and paint is done."""
    page.wait_for_function(
        "() => !document.querySelector('[data-testid=\"stStatusWidget\"]')", timeout=30_000
    )
    page.wait_for_timeout(700)


def _shoot(page, path: Path) -> None:
    """The whole page: Streamlit scrolls inside its main block, not the document, so a
    full-page screenshot alone stops at the window; grow the window to the content first."""
    height = page.evaluate(
        "() => Math.max(900, ...[...document.querySelectorAll("
        "'[data-testid=stMain], [data-testid=stAppViewContainer]')].map(e => e.scrollHeight))"
    )
    page.set_viewport_size({"width": 1440, "height": min(int(height) + 40, 6000)})
    page.wait_for_timeout(400)
    page.screenshot(path=str(path), full_page=True)
    page.set_viewport_size({"width": 1440, "height": 900})


def _sign_in(page, url: str, key: str) -> None:
    page.goto(url)
    page.get_by_text("Twinkle admin console").wait_for(timeout=30_000)
    page.get_by_label("Admin API key").fill(key)
    page.get_by_role("button", name="Sign in").click()


def test_sign_in_walk_every_page_and_screenshot(gateway: Gateway, console: str, shots: Path):
    from playwright.sync_api import sync_playwright

    _traffic(gateway)
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, headless=True, args=CHROMIUM_ARGS)
        try:
            page = browser.new_page(viewport={"width": 1440, "height": 900})
            _sign_in(page, console, gateway.key("browser-user", org="browser-org"))
            page.get_by_text("This key is not an admin key").wait_for(timeout=30_000)
            _shoot(page, shots / "0-refused.png")

            _sign_in(page, console, gateway.admin_key)
            sidebar = page.get_by_test_id("stSidebar")
            sidebar.get_by_text("Orgs & users").wait_for(timeout=30_000)
            for _ in range(2):  # two more polls: the rate charts need two points
                page.get_by_role("button", name="Refresh now").click()
                _settle(page)
            page.locator(
                "[data-testid='stVegaLiteChart'] canvas, [data-testid='stVegaLiteChart'] svg"
            ).first.wait_for(timeout=30_000)
            for i, (label, title) in enumerate(PAGES.items(), start=1):
                if i > 1:
                    sidebar.get_by_text(label, exact=True).click()
                page.get_by_role("heading", name=title, exact=True).wait_for(timeout=30_000)
                _settle(page)
                if label == "Quotas":  # the organization with limits: its use bars show
                    page.get_by_test_id("stSelectbox").first.click()
                    page.get_by_role("option", name=re.compile("^browser-org")).click()
                    page.get_by_text("Organization browser-org").wait_for(timeout=30_000)
                    _settle(page)
                text = page.inner_text("body")
                assert "Traceback" not in text and "console failed" not in text, (label, text)
                assert page.locator("[data-testid='stAlertContentError']").count() == 0, label
                _shoot(page, shots / f"{i}-{label.split()[0].lower()}.png")
        finally:
            browser.close()
    print(f"console screenshots: {shots}")
    assert len(list(shots.glob("*.png"))) == len(PAGES) + 1
