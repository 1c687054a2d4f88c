"""A page opened in headless Chromium through selenium, with Debian's `chromium` and
`chromium-driver` (.ci/run installs them; selenium's own driver download needs the internet).
Outside CI a missing browser skips the test; in CI it fails it."""

from __future__ import annotations

import os
import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest

CHROMIUM = "/usr/bin/chromium"
DRIVER = "/usr/bin/chromedriver"


@contextmanager
def page(path: Path, width: int = 1200) -> Iterator[Any]:
    """A headless browser showing the local file `path` (a WebDriver)."""
    missing = [p for p in (CHROMIUM, DRIVER) if not shutil.which(p)]
    try:
        from selenium import webdriver
        from selenium.webdriver.chrome.service import Service
    except ImportError:
        missing.append("selenium (pip install -e '.[dev]')")
    if missing:
        why = f"no headless browser: {', '.join(missing)} missing (apt-get install chromium " \
              "chromium-driver)"
        if os.environ.get("CI"):
            pytest.fail(why)
        pytest.skip(why)
    opts = webdriver.ChromeOptions()
    opts.binary_location = CHROMIUM
    for arg in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
                f"--window-size={width},900"):
        opts.add_argument(arg)
    driver = webdriver.Chrome(service=Service(DRIVER), options=opts)
    try:
        driver.get(path.resolve().as_uri())
        yield driver
    finally:
        driver.quit()


def network_entries(driver: Any) -> list[str]:
    """The names of what the page loaded over the network (performance entries)."""
    names = driver.execute_script("return performance.getEntries().map(e => e.name)")
    return [n for n in names if str(n).startswith(("http:", "https:", "ws:", "wss:", "//"))]


def full_screenshot(driver: Any, dest: Path, width: int = 1200) -> None:
    """The whole page, not only the window."""
    height = int(driver.execute_script("return document.documentElement.scrollHeight"))
    driver.set_window_size(width, min(max(height + 40, 400), 8000))
    driver.save_screenshot(str(dest))
