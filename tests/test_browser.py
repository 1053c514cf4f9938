"""report.html in a real browser: headless Chromium loads every image and shows every table's rows.

Needs the Debian packages chromium and chromium-driver (`.ci/run` installs
them) and selenium (the dev extra); skips, saying which is missing, otherwise.
"""
from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from report_runs import TINY, run_compare, tiny_compare

CHROMIUM = next((p for p in (shutil.which("chromium"), "/usr/bin/chromium") if p and Path(p).exists()), None)
DRIVER = next((p for p in (shutil.which("chromedriver"), "/usr/bin/chromedriver") if p and Path(p).exists()), None)


def browser(tmp_path):
    if CHROMIUM is None or DRIVER is None:
        pytest.skip("headless Chromium is not installed (apt-get install chromium chromium-driver)")
    webdriver = pytest.importorskip("selenium.webdriver", reason="selenium is not installed (pip install -e '.[dev]')")
    from selenium.webdriver.chrome.service import Service
    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for flag in ("--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
                 "--disable-component-update", "--disable-sync", "--no-first-run", "--disable-dev-shm-usage",
                 f"--user-data-dir={tmp_path / 'chromium-profile'}", "--window-size=1280,1000"):
        options.add_argument(flag)
    try:
        return webdriver.Chrome(service=Service(executable_path=DRIVER), options=options)
    except Exception as exc:  # noqa: BLE001 - a browser that cannot start here is a skip, with the reason
        pytest.skip(f"headless Chromium did not start: {type(exc).__name__}: {str(exc).splitlines()[0]}")


@pytest.mark.slow  # 37 s: the default suite stays near 15 min; CI runs the slow suite too
def test_report_renders_in_chromium(tmp_path, tmp_path_factory):
    out, p = tiny_compare(tmp_path_factory.getbasetemp())
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    page = (out / "report.html").resolve()
    driver = browser(tmp_path)
    try:
        driver.get(page.as_uri())
        driver.execute_async_script("""
            const done = arguments[arguments.length - 1];
            Promise.all([...document.images].map(i => i.decode().catch(() => null))).then(() => done());
        """)
        images = driver.execute_script(
            "return [...document.images].map(i => [i.alt, i.complete, i.naturalWidth, i.naturalHeight])")
        assert len(images) >= 6  # throughput, scaling, split time, 2 timelines, memory
        for alt, complete, w, h in images:
            assert complete and w > 0 and h > 0, f"image not loaded: {alt}"
        tables = driver.execute_script(
            "return [...document.querySelectorAll('table')].map(t => "
            "[t.tHead ? t.tHead.rows[0].cells.length : 0, t.tBodies[0] ? t.tBodies[0].rows.length : 0, "
            "t.getBoundingClientRect().height])")
        assert len(tables) >= 5
        for cols, rows, height in tables:
            assert cols >= 2 and rows >= 1 and height > 0
        # the results table: one row per run of the matrix, visible text
        first = driver.execute_script(
            "return [...document.querySelector('table').tBodies[0].rows].map(r => r.cells[0].innerText)")
        assert first == ["single", "ddp", "ddp", "pipeline"]
        # nothing was fetched from anywhere: the page is self-contained
        fetched = driver.execute_script(
            "return performance.getEntriesByType('resource').map(e => e.name).filter(n => !n.startsWith('data:'))")
        assert fetched == []
    finally:
        driver.quit()


ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.slow
def test_a_report_with_the_users_own_strategies_renders_with_them_in_every_figure(tmp_path):
    """The issue's command: single and ddp beside strategies from files, one of them wrong."""
    examples = ROOT / "examples" / "strategies"
    out = tmp_path / "cmp"
    p = run_compare(out, "--strategies", "single,ddp", "--strategy-file", str(examples / "bucketed_ddp.py"),
                    "--strategy-file", str(examples / "forgot_to_average.py"), *TINY)
    assert p.returncode == 1, p.stdout[-3000:] + p.stderr[-3000:]  # forgot_to_average FAILs its check
    driver = browser(tmp_path)
    try:
        driver.get((out / "report.html").resolve().as_uri())
        driver.execute_async_script("""
            const done = arguments[arguments.length - 1];
            Promise.all([...document.images].map(i => i.decode().catch(() => null))).then(() => done());
        """)
        images = driver.execute_script(
            "return [...document.images].map(i => [i.alt, i.complete, i.naturalWidth, i.naturalHeight])")
        for alt, complete, w, h in images:
            assert complete and w > 0 and h > 0, f"image not loaded: {alt}"
        # the one that overlaps its all-reduces with backward has its timeline, as ddp has
        assert any("bucketed_ddp.py w2: one measured step" in alt for alt, *_ in images), [a for a, *_ in images]
        # every table that lists ddp's run lists the own strategies' too
        tables = driver.execute_script("return [...document.querySelectorAll('table')].map(t => t.innerText)")
        listing = [t for t in tables if "ddp" in t.replace("bucketed_ddp", "")]
        assert len(listing) >= 3, tables
        for t in listing:
            assert "bucketed_ddp" in t and "forgot_to_average" in t, t
        rows = driver.execute_script(
            "return [...document.querySelector('table').tBodies[0].rows].map(r => r.innerText)")
        assert any("bucketed_ddp.py" in r and "PASS" in r for r in rows), rows
        assert any("forgot_to_average.py" in r and "FAIL" in r for r in rows), rows
        text = driver.execute_script("return document.body.innerText")
        assert "forgot_to_average.py w2: first divergence: step 1, rank 0, backward of 13.1 (Linear)" in text
        # figures and the results table name an own strategy by its file's name, not its whole path (the
        # commands the report prints keep the path, so they can be pasted)
        assert all(str(examples) not in alt for alt, *_ in images) and all(str(examples) not in r for r in rows)
    finally:
        driver.quit()
