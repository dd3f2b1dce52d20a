"""A headless Chromium for the chat page's tests, driven by Selenium through the
system's chromedriver (Debian's `chromium` and `chromium-driver`): never a browser
or driver downloaded at test time (Selenium Manager is never asked).

Where either is missing the tests skip, unless CI or RUVLLM_REQUIRE_BROWSER is set:
there they fail, naming what to install (.ci/run runs scripts/setup, which
installs both)."""

from __future__ import annotations

import importlib.util
import os
import shutil
from dataclasses import dataclass
from typing import Any

CHROMIUM_NAMES = ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable")
INSTALL_HINT = ("apt-get install chromium chromium-driver (scripts/setup does it as root or with sudo), "
                "and selenium (pip install -e '.[dev]')")


@dataclass(frozen=True)
class BrowserPaths:
    chromium: str
    chromedriver: str


def browser_required() -> bool:
    return bool(os.environ.get("CI") or os.environ.get("RUVLLM_REQUIRE_BROWSER"))


def find_browser() -> BrowserPaths | str:
    """The binaries to run, or why they cannot run here."""
    if importlib.util.find_spec("selenium") is None:
        return "selenium is not installed"
    chromium = next(filter(None, map(shutil.which, CHROMIUM_NAMES)), None)
    driver = shutil.which("chromedriver")
    if chromium is None or driver is None:
        missing = [name for name, path in (("chromium", chromium), ("chromedriver", driver)) if path is None]
        return f"{' and '.join(missing)} not found on PATH"
    return BrowserPaths(chromium, driver)


def start_chromium(paths: BrowserPaths, width: int = 1200, height: int = 800) -> Any:
    """A new headless Chromium with a fresh profile (its own localStorage); quit() it."""
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = paths.chromium
    for argument in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
                     "--disable-extensions", "--no-first-run", "--hide-scrollbars",
                     f"--window-size={width},{height}"):
        options.add_argument(argument)
    options.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    driver = webdriver.Chrome(options=options, service=Service(paths.chromedriver))
    driver.set_page_load_timeout(30)
    driver.set_script_timeout(30)
    return driver
