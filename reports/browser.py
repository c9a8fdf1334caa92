"""Open a report in headless Chromium (Debian's, driven by Playwright), offline.

Every request that is not a ``file://`` URL is aborted and counted, so a page that needs
the network shows it. ``load`` reports how many plotly graphs rendered, the console
errors and the load time; ``screenshot`` saves a full-page PNG. Playwright is a test
extra: nothing else in the tool imports this module.
"""

import os
import shutil
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, NamedTuple

# Debian's chromium, never a downloaded browser build (`playwright install` is not used).
CHROMIUM_ENV = "DECAY_TUNER_CHROMIUM"
CHROMIUM_ARGS = [
    "--no-sandbox",
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-component-update",
    "--no-first-run",
]
RENDERED_JS = (
    "() => [...document.querySelectorAll('.js-plotly-plot')].filter(d => d.querySelector('svg')).length"
)
GRAPHS_JS = "() => document.querySelectorAll('.plotly-graph-div').length"


class PageLoad(NamedTuple):
    graphs: int  # plotly graph divs in the page
    rendered: int  # of those, plots plotly drew (.js-plotly-plot with an svg inside)
    console_errors: list[str]  # console messages of type error, and uncaught page errors
    blocked: list[str]  # non-file:// requests the page tried (all aborted)
    load_ms: float  # from navigation start until every graph rendered (or the timeout)


def chromium_path() -> str | None:
    """``$DECAY_TUNER_CHROMIUM``, else Debian's chromium on PATH, else None."""
    return os.environ.get(CHROMIUM_ENV) or shutil.which("chromium") or shutil.which("chromium-browser")


def unavailable() -> str | None:
    """Why no headless browser can run here (for a test's skip reason), or None."""
    try:
        import playwright.sync_api  # noqa: F401
    except ImportError:
        return 'the playwright package is not installed (pip install -e ".[test]")'
    if chromium_path() is None:
        return "no chromium executable (apt-get install chromium; .ci/run does)"
    return None


@contextmanager
def _page(width: int, height: int) -> Iterator[tuple[Any, list[str], list[str]]]:
    from playwright.sync_api import sync_playwright

    path = chromium_path()
    if path is None:
        raise RuntimeError(unavailable())
    errors: list[str] = []
    blocked: list[str] = []
    with sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=path, args=CHROMIUM_ARGS)
        try:
            page = browser.new_page(viewport={"width": width, "height": height})
            page.on("console", lambda m: errors.append(m.text) if m.type == "error" else None)
            page.on("pageerror", lambda e: errors.append(f"uncaught: {e}"))

            def route(r: Any) -> None:
                if r.request.url.startswith("file://"):
                    r.continue_()
                else:
                    blocked.append(r.request.url)
                    r.abort()

            page.route("**/*", route)
            yield page, errors, blocked
        finally:
            browser.close()


def _open(page: Any, html: Path, timeout_s: float) -> float:
    from playwright.sync_api import TimeoutError as PlaywrightTimeout

    start = time.perf_counter()
    page.goto(html.resolve().as_uri(), wait_until="load", timeout=timeout_s * 1000)
    try:
        page.wait_for_function(f"() => ({RENDERED_JS})() === ({GRAPHS_JS})()", timeout=timeout_s * 1000)
    except PlaywrightTimeout:
        pass  # PageLoad's counts say which plots did not render
    return (time.perf_counter() - start) * 1000


def load(html: Path, *, timeout_s: float = 60.0, width: int = 1400, height: int = 900) -> PageLoad:
    """Open ``html`` offline and wait until every plotly graph has rendered."""
    with _page(width, height) as (page, errors, blocked):
        load_ms = _open(page, html, timeout_s)
        return _result(page, errors, blocked, load_ms)


def screenshot(html: Path, png: Path, *, width: int = 1400, timeout_s: float = 60.0) -> PageLoad:
    """Save a full-page screenshot of ``html`` once its plots rendered; return the load."""
    with _page(width, 900) as (page, errors, blocked):
        load_ms = _open(page, html, timeout_s)
        png.parent.mkdir(parents=True, exist_ok=True)
        page.screenshot(path=str(png), full_page=True)
        return _result(page, errors, blocked, load_ms)


def _result(page: Any, errors: list[str], blocked: list[str], load_ms: float) -> PageLoad:
    return PageLoad(
        graphs=page.evaluate(GRAPHS_JS),
        rendered=page.evaluate(RENDERED_JS),
        console_errors=list(errors),
        blocked=list(blocked),
        load_ms=load_ms,
    )


def main(argv: list[str] | None = None) -> int:
    """``python -m reports.browser PAGE.html [--screenshot PNG]``: load it offline, report."""
    import argparse

    parser = argparse.ArgumentParser(prog="python -m reports.browser", description=main.__doc__)
    parser.add_argument("html", type=Path)
    parser.add_argument("--screenshot", type=Path, help="also save a full-page PNG here")
    parser.add_argument("--width", type=int, default=1400)
    args = parser.parse_args(argv)
    why = unavailable()
    if why:
        parser.error(why)
    load_ = screenshot(args.html, args.screenshot, width=args.width) if args.screenshot else load(args.html)
    print(
        f"{load_.rendered}/{load_.graphs} plots rendered in {load_.load_ms:.0f} ms; "
        f"console errors: {load_.console_errors or 'none'}; blocked requests: {load_.blocked or 'none'}"
    )
    return 0 if load_.rendered == load_.graphs and not load_.console_errors and not load_.blocked else 1


if __name__ == "__main__":
    raise SystemExit(main())
