"""The gateway's web page in a real browser: headless Chromium from Debian's packages, driven by
Selenium through Debian's chromedriver (both installed by .ci/run; the driver's path is given, so
Selenium Manager downloads nothing), loading the page through nginx. The playground streams a
reply token by token; the fleet view's numbers match the worker's and the gateway's /metrics.

Skipped only where Chromium or its driver is not installed (a developer machine without them).
``INFLIGHT_SCREENSHOTS=docs/images`` also writes the two screenshots committed under docs/.
"""

from __future__ import annotations

import os
import shutil
import threading
import time
from pathlib import Path

import httpx
import pytest

from common.promtext import sample_sum

CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"
CHROMEDRIVER = shutil.which("chromedriver") or "/usr/bin/chromedriver"
pytestmark = pytest.mark.skipif(not (os.access(CHROMIUM, os.X_OK) and os.access(CHROMEDRIVER, os.X_OK)),
                                reason="chromium and chromium-driver are not installed (.ci/run installs them)")


@pytest.fixture(scope="module")
def browser():
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for arg in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--disable-gpu",
                "--window-size=1280,860", "--disable-extensions", "--no-first-run"):
        options.add_argument(arg)
    driver = webdriver.Chrome(service=Service(executable_path=CHROMEDRIVER), options=options)
    driver.set_page_load_timeout(30)
    yield driver
    driver.quit()


def _wait(predicate, timeout_s: float, what: str, interval_s: float = 0.02):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(interval_s)
    raise AssertionError(f"timed out waiting for {what}")


def _use_key(driver, rest_url: str, key: str) -> None:
    from selenium.webdriver.common.by import By

    driver.get(f"{rest_url}/ui/")
    driver.find_element(By.ID, "api-key").send_keys(key)
    driver.find_element(By.ID, "key-save").click()
    _wait(lambda: "key ok" in driver.find_element(By.ID, "key-state").text, 10, "the key to be checked")
    assert driver.execute_script("return sessionStorage.getItem('inflight.apiKey')") == key
    assert driver.execute_script("return localStorage.length") == 0  # the key is kept in this tab only


def _screenshot(driver, name: str, tmp_path: Path) -> None:
    driver.save_screenshot(str(tmp_path / name))
    folder = os.environ.get("INFLIGHT_SCREENSHOTS")
    if folder:
        driver.save_screenshot(str(Path(folder) / name))


def test_playground_streams_a_reply_token_by_token(browser, stack, rest_url, api_key, tmp_path):
    from selenium.webdriver.common.by import By

    _use_key(browser, rest_url, api_key)
    models = [o.get_attribute("value") for o in browser.find_elements(By.CSS_SELECTOR, "#model option")]
    assert models == [httpx.get(f"{rest_url}/v1/models", headers={"Authorization": f"Bearer {api_key}"})
                      .json()["data"][0]["id"]]
    browser.find_element(By.ID, "system").send_keys("You are a helpful assistant.")
    for field, value in (("temperature", "0"), ("max-tokens", "48")):
        browser.find_element(By.ID, field).clear()
        browser.find_element(By.ID, field).send_keys(value)
    browser.find_element(By.ID, "prompt").send_keys("Tell me a short story about a lighthouse keeper.")
    browser.find_element(By.ID, "send").click()

    def reply():
        found = browser.find_elements(By.CSS_SELECTOR, ".msg.assistant")
        return found[-1] if found else None

    lengths = []  # the reply's text length each time it was seen growing, before it ended
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        box = reply()
        done = box is not None and box.find_elements(By.CSS_SELECTOR, ".meta")
        text = box.find_element(By.CSS_SELECTOR, ".text").text if box is not None else ""
        if done:
            break
        if text and (not lengths or len(text) > lengths[-1]):
            lengths.append(len(text))
        time.sleep(0.01)
    meta = reply().find_element(By.CSS_SELECTOR, ".meta").text
    assert meta.startswith("length") and "48 tokens" in meta, meta
    assert len(lengths) >= 3, f"the reply did not appear piece by piece: {lengths}"
    assert len(reply().find_element(By.CSS_SELECTOR, ".text").text) > lengths[0]
    _screenshot(browser, "webui-chat.png", tmp_path)


def _gauge(url: str, name: str) -> float:
    return sample_sum(httpx.get(url, timeout=5).text, name)


def test_fleet_view_numbers_match_the_metrics(browser, stack, rest_url, api_key, tmp_path):
    from selenium.webdriver.common.by import By

    ep = stack.endpoints()
    worker_metrics, gateway_metrics = ep["worker_metrics"], f"{ep['gateway_rest']}/metrics"
    admin = stack.create_key(tenant="ops", name="fleet page", admin=True)
    _use_key(browser, rest_url, admin)
    browser.find_element(By.ID, "tab-fleet").click()
    # one long streamed request runs while the page is read, so running and the KV cache are not
    # zero; closing its stream at the end cancels it (the worker frees its blocks)
    done = threading.Event()

    def long_request() -> None:
        with httpx.stream("POST", f"{rest_url}/v1/completions", headers={"Authorization": f"Bearer {api_key}"},
                          timeout=120, json={"prompt": "Once upon a time", "max_tokens": 2000, "ignore_eos": True,
                                             "temperature": 0, "stream": True}) as resp:
            for _ in resp.iter_lines():
                if done.is_set():
                    return

    long = threading.Thread(target=long_request)
    long.start()
    try:
        _wait(lambda: _gauge(worker_metrics, "inflight_requests_running") == 1, 30, "the long request to run")
        seen = []
        for _ in range(3):  # the page refreshes every 2 s: bracket one refresh by two scrapes
            before = {n: _gauge(worker_metrics, n) for n in ("inflight_requests_running", "inflight_kv_cache_usage",
                                                             "inflight_avg_generation_throughput_toks_per_s")}
            stamp = browser.find_element(By.ID, "fleet-updated").text
            _wait(lambda: browser.find_element(By.ID, "fleet-updated").text != stamp, 10, "a fleet refresh")
            row = browser.find_element(By.CSS_SELECTOR, "#fleet-table tbody tr")
            cells = {td.get_attribute("data-field"): td.text for td in row.find_elements(By.CSS_SELECTOR, "td")}
            after = {n: _gauge(worker_metrics, n) for n in before}
            seen.append((before, cells, after))
            kv = float(cells["kv_usage"].rstrip("%"))
            lo, hi = sorted([100 * before["inflight_kv_cache_usage"], 100 * after["inflight_kv_cache_usage"]])
            gen = {round(before["inflight_avg_generation_throughput_toks_per_s"], 1),
                   round(after["inflight_avg_generation_throughput_toks_per_s"], 1)}
            if (cells["running"] == "1" == str(int(after["inflight_requests_running"]))
                    and lo - 0.05 <= kv <= hi + 0.05 and float(cells["generation_tps"]) in gen):
                break
        else:
            raise AssertionError(f"the fleet view never matched /metrics: {seen}")
        assert kv > 0
        queued = int(sample_sum(httpx.get(gateway_metrics, timeout=5).text, "inflight_queue_depth"))
        assert int(browser.find_element(By.ID, "fleet-queues").get_attribute("data-total")) == queued == 0
        assert browser.find_element(By.ID, "fleet-workers").text == "1"
        _screenshot(browser, "webui-fleet.png", tmp_path)
    finally:
        done.set()
        long.join()
