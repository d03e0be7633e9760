"""The front end's chat page (GET /) in Debian's headless Chromium, driven by Selenium, against
the real tritonserver and front end: greedy replies equal the gRPC endpoint's for the same chat,
the whole history goes out as `messages`, Stop cancels the Triton request, errors are shown."""
import json
import os
import shutil
import time
import urllib.request
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from tritonlm_client import Client
from tritonlm_client.chat_defaults import CHAT_DEFAULTS, chat_settings
from tritonlm_frontend.chat_page import script_json

CHROMIUM, CHROMEDRIVER = Path("/usr/bin/chromium"), Path("/usr/bin/chromedriver")
ARTIFACTS = Path(__file__).parent / "artifacts"
CONTROLS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty", "max_tokens")
NOT_SAMPLING = ("model", "messages", "stream", "stream_options")
QUESTION = "What is the capital of France?"


# Records the body of every request the page sends (installed after each page load).
RECORD_FETCH = """
window.sentBodies = [];
const original = window.fetch;
window.fetch = (url, options) => {
  if (options && options.body) window.sentBodies.push(JSON.parse(options.body));
  return original(url, options);
};"""


@pytest.fixture(scope="module")
def browser():
    if not (CHROMIUM.exists() and CHROMEDRIVER.exists()):
        pytest.skip("Debian's chromium and chromium-driver are not installed "
                    "(apt-get install -y chromium chromium-driver, or tools/setup.sh)")
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service
    options = webdriver.ChromeOptions()
    options.binary_location = str(CHROMIUM)
    for arg in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage",
                "--window-size=1280,860"):
        options.add_argument(arg)
    # Both paths given, so Selenium Manager never looks for (or downloads) a browser or driver.
    driver = webdriver.Chrome(service=Service(str(CHROMEDRIVER)), options=options)
    yield driver
    driver.quit()


@pytest.fixture
def page(browser, smollm2_server):
    browser.get(smollm2_server.frontend_url + "/")
    wait_for(browser, lambda d: d.execute_script("return document.body.dataset.state") == "idle")
    browser.execute_script(RECORD_FETCH)
    return browser


def wait_for(driver, condition, timeout: float = 120):
    from selenium.webdriver.support.ui import WebDriverWait
    return WebDriverWait(driver, timeout, poll_frequency=0.05).until(condition)


def set_control(driver, name: str, value) -> None:
    field = driver.find_element("id", name)
    field.clear()
    field.send_keys(str(value))


def control_values(driver) -> dict:
    return {name: driver.find_element("id", name).get_attribute("value") for name in CONTROLS}


def ask(driver, text: str, timeout: float = 120) -> str:
    """Type `text`, press Send, wait until the reply has streamed; returns the reply's text."""
    driver.find_element("id", "input").send_keys(text)
    driver.find_element("id", "send").click()
    return finish(driver, timeout)


def finish(driver, timeout: float = 120) -> str:
    # The click's handler has set the state to "busy" and called fetch by the time click() returns.
    wait_for(driver, lambda d: d.execute_script("return document.body.dataset.state") == "idle",
             timeout)
    return last_reply(driver)


def last_reply(driver) -> str:
    return driver.execute_script("const r = document.querySelectorAll('.msg.assistant .text');"
                                 "return r.length ? r[r.length - 1].textContent : null;")


def sent(driver) -> list[dict]:
    return driver.execute_script("return window.sentBodies")


def grpc_reply(server, body: dict) -> str:
    """What the gRPC endpoint answers to the chat the page sent, with the same settings."""
    sampling = {k: v for k, v in body.items() if k not in NOT_SAMPLING}
    return Client(server.grpc_url, model=body["model"]).chat(body["messages"], **sampling).text


def model_settings(repo: Path) -> dict:
    """chat_settings() for the served model's own sampling defaults, as the page should start."""
    config = repo / "1" / "weights" / "generation_config.json"
    values = json.loads(config.read_text()) if config.is_file() else {}
    keys = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")
    return chat_settings({k: values[k] for k in keys if k in values})


def save_screenshot(driver, name: str) -> Path:
    ARTIFACTS.mkdir(exist_ok=True)
    path = ARTIFACTS / name
    driver.save_screenshot(str(path))
    if os.environ.get("TRITONLM_TEST_ARTIFACTS"):
        target = Path(os.environ["TRITONLM_TEST_ARTIFACTS"])
        target.mkdir(parents=True, exist_ok=True)
        shutil.copy(path, target / name)
    return path


def scrape(server) -> dict:
    with urllib.request.urlopen(f"http://{server.metrics_url}/metrics", timeout=10) as response:
        text = response.read().decode()
    return {(s.name, s.labels.get("finished_reason")): s.value
            for family in text_string_to_metric_families(text) for s in family.samples
            if s.name.startswith("tritonlm:")}


def test_chat_settings_take_the_models_own_values_first():
    assert chat_settings({}) == CHAT_DEFAULTS
    assert chat_settings({"temperature": 0.6, "min_p": 0.05, "top_k": None}) == {
        **CHAT_DEFAULTS, "temperature": 0.6, "min_p": 0.05}


def test_injected_settings_cannot_close_the_script():
    value = {"models": {"</script><script>alert(1)</script>&<!--": {"settings": {}}}}
    text = script_json(value)
    assert "<" not in text and ">" not in text and "&" not in text
    assert json.loads(text) == value


@pytest.mark.server
def test_page_streams_the_grpc_answer_and_sends_the_whole_history(page, smollm2_server,
                                                                   smollm2_repo):
    source = page.page_source
    assert "http://" not in source and "https://" not in source  # nothing loads from outside
    expected = model_settings(smollm2_repo)
    assert control_values(page) == {k: str(expected.get(k, "")) for k in CONTROLS}
    set_control(page, "temperature", 0)
    set_control(page, "max_tokens", 24)

    reply = ask(page, QUESTION)
    first, = sent(page)
    assert first["model"] == "llm" and first["stream"] is True
    assert first["messages"] == [{"role": "user", "content": QUESTION}]
    assert {k: v for k, v in first.items() if k not in NOT_SAMPLING} == {
        **expected, "temperature": 0, "max_tokens": 24}
    assert reply and reply == grpc_reply(smollm2_server, first)
    assert "tokens" in page.find_element("css selector", ".msg.assistant .meta").text

    follow_up = "And what is the capital of Germany?"
    second_reply = ask(page, follow_up)
    second = sent(page)[-1]
    assert second["messages"] == [{"role": "user", "content": QUESTION},
                                  {"role": "assistant", "content": reply},
                                  {"role": "user", "content": follow_up}]
    assert second_reply and second_reply == grpc_reply(smollm2_server, second)

    page.find_element("id", "regenerate").click()  # greedy: the same question, the same answer
    assert finish(page) == second_reply
    assert sent(page)[-1] == second
    assert len(page.find_elements("css selector", ".msg.assistant")) == 2
    path = save_screenshot(page, "chat_page.png")
    assert path.stat().st_size > 10_000

    resources = page.execute_script(
        "return performance.getEntriesByType('resource').map(e => e.name)")
    assert all(r.startswith(smollm2_server.frontend_url) for r in resources), resources

    page.find_element("id", "clear").click()
    system = "You are a pirate. Answer in one short sentence."
    page.find_element("id", "system").send_keys(system)
    reply = ask(page, QUESTION)
    third = sent(page)[-1]
    assert third["messages"] == [{"role": "system", "content": system},
                                 {"role": "user", "content": QUESTION}]
    assert reply == grpc_reply(smollm2_server, third)


@pytest.mark.server
def test_stop_ends_the_generation_and_cancels_the_triton_request(page, smollm2_server):
    set_control(page, "max_tokens", 400)
    before = scrape(smollm2_server)
    page.find_element("id", "input").send_keys("Write a long story about a dragon who learns to fly.")
    page.find_element("id", "send").click()
    wait_for(page, lambda d: len(last_reply(d) or "") > 0)
    page.find_element("id", "stop").click()
    text = finish(page, timeout=10)
    assert "stopped" in page.find_elements("css selector", ".msg.assistant .meta")[-1].text
    time.sleep(1)
    assert last_reply(page) == text  # nothing arrives after Stop

    aborted = ("tritonlm:request_success_total", "abort")
    deadline = time.monotonic() + 30
    while scrape(smollm2_server).get(aborted, 0) <= before.get(aborted, 0):
        assert time.monotonic() < deadline, "the front end never cancelled the Triton request"
        time.sleep(0.2)
    after = scrape(smollm2_server)
    assert after[("tritonlm:num_requests_running", None)] == 0
    generated = ("tritonlm:request_generation_tokens_sum", None)
    assert after[generated] - before.get(generated, 0) < 400
    assert page.find_element("id", "send").is_enabled()


@pytest.mark.server
def test_errors_are_shown_and_the_question_is_given_back(page):
    set_control(page, "max_tokens", 0)  # a 400 with an OpenAI error object
    ask(page, QUESTION)
    error = page.find_element("id", "error")
    assert error.is_displayed() and "max_tokens" in error.text
    assert page.find_element("id", "input").get_attribute("value") == QUESTION
    assert not page.find_elements("css selector", ".msg")

    # An error event inside an SSE stream (as the server sends when a request fails mid-way).
    page.execute_script("""window.fetch = async () => new Response(
        'data: {"choices": [{"index": 0, "delta": {"content": "Par"}}]}\\n\\n' +
        'data: {"error": {"message": "the engine died", "code": 500}}\\n\\ndata: [DONE]\\n\\n',
        {status: 200, headers: {"Content-Type": "text/event-stream"}});""")
    page.find_element("id", "send").click()
    finish(page)
    assert page.find_element("id", "error").text == "the engine died"
    assert not page.find_elements("css selector", ".msg.assistant")
