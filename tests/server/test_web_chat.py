"""The chat page in a real headless Chromium against the real server on the tiny
model: a reply streams in and ends with its stats, Stop and Esc cancel the request
on the server, LoRA adapters are picked under their base model, markup in a reply
stays text, the API key is asked for, a reload keeps the conversation, a reasoning
model's reasoning is folded above its answer, and light, dark and phone-width
screenshots are taken.

Replies whose words matter are forced through the server's own `structured_outputs`
choice, typed into the page's "Extra request fields" setting: the text still comes
from the engine, down the stream, through the page's renderer.

Needs Chromium, chromedriver and selenium (ruvllm_cli/testing/browser.py: skipped
where absent, failed under CI)."""

from __future__ import annotations

import json
import re
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest

from ruvllm_cli.engine.loader import load_model
from ruvllm_cli.quantization import Quantization
from ruvllm_cli.testing.browser import INSTALL_HINT, BrowserPaths, browser_required, find_browser, start_chromium
from ruvllm_cli.testing.tiny_lora import MLP, build_lora_adapter
from ruvllm_cli.testing.tiny_model import THINK_END

from tests.server.conftest import LiveServer, build_server, start_adapter_server

pytestmark = pytest.mark.timeout(120)
REPO_ROOT = Path(__file__).resolve().parents[2]
WAIT_S = 30
STATS = re.compile(r"^(\d+) tokens · [\d.]+ tok/s · first token [\d.]+ s · prompt \d+ tokens"
                   r"( · cut at max tokens)?$")
HOSTILE = ('<script>window.pwned = 1</script><img src=x onerror="window.pwned = 2"> **bold** '
           '[bad](javascript:window.pwned=3) [good](https://example.com/docs)')
SHOWCASE = ("Here is a function that adds two numbers:\n\n```python\ndef add(a: int, b: int) -> int:\n"
            "    return a + b\n```\n\nCall it as `add(2, 3)`; it returns **5**. Also:\n\n"
            "- it is *pure*\n- it never fails on integers")


@pytest.fixture(scope="session")
def browser_paths() -> BrowserPaths:
    found = find_browser()
    if isinstance(found, str):
        message = f"the chat page's browser tests need Chromium: {found}; install: {INSTALL_HINT}"
        if browser_required():
            pytest.fail(message)
        pytest.skip(message)
    return found


@dataclass
class ChatPage:
    """The page as a user sees it, through the browser."""

    driver: Any
    url: str

    def open(self, ready: bool = True) -> "ChatPage":
        self.driver.get(self.url + "/")
        if ready:
            self.wait(lambda: self.js("return document.querySelectorAll('#model option').length") > 0)
        return self

    def js(self, script: str, *args: Any) -> Any:
        return self.driver.execute_script(script, *args)

    def el(self, css: str) -> Any:
        from selenium.webdriver.common.by import By

        return self.driver.find_element(By.CSS_SELECTOR, css)

    def all(self, css: str) -> list[Any]:
        from selenium.webdriver.common.by import By

        return self.driver.find_elements(By.CSS_SELECTOR, css)

    def wait(self, condition: Any, timeout: float = WAIT_S) -> Any:
        from selenium.webdriver.support.ui import WebDriverWait

        return WebDriverWait(self.driver, timeout, poll_frequency=0.05).until(lambda _: condition())

    def settings(self, **fields: str) -> None:
        """Type into the settings panel's fields (by their form names)."""
        if not self.el("#settings").is_displayed():
            self.el("#toggle-settings").click()
        for name, value in fields.items():
            field = self.el(f"#settings-form [name={name}]")
            field.clear()
            field.send_keys(value)
        self.el("#close-settings").click()

    def force_reply(self, text: str) -> None:
        self.settings(extra=json.dumps({"structured_outputs": {"choice": [text]}}))

    def send(self, text: str) -> None:
        from selenium.webdriver.common.keys import Keys

        self.el("#input").send_keys(text, Keys.ENTER)

    def reply(self) -> Any:
        return self.all(".message.assistant")[-1]

    def wait_reply(self, states: tuple[str, ...] = ("done",)) -> Any:
        self.wait(lambda: self.all(".message.assistant")
                  and self.reply().get_attribute("data-state") != "streaming")
        reply = self.reply()
        assert reply.get_attribute("data-state") in states, reply.text
        return reply

    def reply_length(self) -> int:
        return self.js("const r = [...document.querySelectorAll('.message.assistant .body')].pop();"
                       "return r ? r.textContent.length : 0")

    def severe_logs(self) -> list[dict]:
        return [entry for entry in self.driver.get_log("browser") if entry["level"] == "SEVERE"]


@pytest.fixture
def page_for(browser_paths: BrowserPaths) -> Iterator[Any]:
    """`page_for(url)`: the chat page of the server at `url` in a fresh browser profile."""
    drivers: list[Any] = []

    def make(url: str) -> ChatPage:
        drivers.append(start_chromium(browser_paths))
        return ChatPage(drivers[-1], url)

    yield make
    for driver in drivers:
        driver.quit()


def gauge(url: str, name: str) -> float:
    text = httpx.get(url + "/metrics", timeout=10).text
    match = re.search(rf"^{name} (\S+)$", text, flags=re.M)
    assert match, f"{name} is not in /metrics"
    return float(match.group(1))


def wait_gauge(url: str, name: str, value: float, timeout: float = 10) -> None:
    deadline = time.monotonic() + timeout
    while (seen := gauge(url, name)) != value:
        assert time.monotonic() < deadline, f"{name} stayed at {seen}, not {value}"
        time.sleep(0.05)


def test_a_reply_streams_in_and_ends_with_its_stats(server, page_for):
    page = page_for(server.url).open()
    assert [o.text for o in page.all("#model option")] == ["tiny"]   # one model, whatever its names
    page.settings(maxTokens="120", temperature="0", seed="7", extra='{"ignore_eos": true}')
    # Every change to the reply's text, as the page makes it.
    page.js("window.lengths = []; new MutationObserver(() => {"
            "  const r = [...document.querySelectorAll('.message.assistant .body')].pop();"
            "  if (r) window.lengths.push(r.textContent.length);"
            "}).observe(document.getElementById('messages'), {subtree: true, childList: true, characterData: true});")
    page.send("Hello! How are you today?")
    reply = page.wait_reply()
    lengths = page.js("return window.lengths")
    assert len(set(lengths)) >= 5, lengths   # drawn piece by piece, not all at the end
    assert lengths[-1] == page.reply_length() > 0
    stats = reply.find_element("css selector", ".stats").text
    match = STATS.match(stats)
    assert match and match.group(1) == "120" and match.group(2), stats
    assert page.el(".message.user .body").text == "Hello! How are you today?"
    assert page.el("#chats [aria-current=true]").text == "Hello! How are you today?"
    assert page.el("#send").is_displayed() and not page.el("#stop").is_displayed()
    assert page.severe_logs() == []   # nothing refused by the page's own CSP, no failed request


def test_stop_cancels_the_request_and_the_server_frees_its_slot(server, page_for):
    page = page_for(server.url).open()
    page.settings(maxTokens="900", extra='{"ignore_eos": true}')
    page.send("Tell me a long story")
    page.wait(lambda: page.reply_length() > 0)
    wait_gauge(server.url, "ruvllm_num_requests_running", 1)
    page.el("#stop").click()
    reply = page.wait_reply(("stopped",))
    wait_gauge(server.url, "ruvllm_num_requests_running", 0)
    wait_gauge(server.url, "ruvllm_http_requests_in_flight", 0)
    assert re.fullmatch(r"stopped after [\d.]+ s", reply.find_element("css selector", ".stats").text)
    assert page.reply_length() > 0   # what had arrived stays
    metrics = httpx.get(server.url + "/metrics", timeout=10).text
    assert 'ruvllm_http_requests_total{endpoint="/v1/chat/completions",status="499"}' in metrics


def test_keys_shift_enter_new_line_enter_sends_esc_stops(server, page_for):
    from selenium.webdriver.common.action_chains import ActionChains
    from selenium.webdriver.common.keys import Keys

    page = page_for(server.url).open()
    page.settings(maxTokens="900", extra='{"ignore_eos": true}')
    page.el("#input").send_keys("line one")
    ActionChains(page.driver).key_down(Keys.SHIFT).send_keys(Keys.ENTER).key_up(Keys.SHIFT).perform()
    page.el("#input").send_keys("line two")
    assert page.el("#input").get_attribute("value") == "line one\nline two"
    page.el("#input").send_keys(Keys.ENTER)
    page.wait(lambda: page.reply_length() > 0)
    assert page.el(".message.user .body").text == "line one\nline two"
    page.el("#input").send_keys(Keys.ESCAPE)
    page.wait_reply(("stopped",))
    wait_gauge(server.url, "ruvllm_num_requests_running", 0)


@pytest.fixture
def adapter_server(tiny_model_dir, tmp_path) -> Iterator[LiveServer]:
    """A server with one LoRA adapter, "mlp", on a model of its own (adapters wrap its layers)."""
    adapter = build_lora_adapter(tiny_model_dir, tmp_path / "mlp", rank=8, targets=MLP, seed=2)
    live = start_adapter_server(load_model(tiny_model_dir, "cpu", Quantization.F32), {"mlp": adapter},
                                engine={"max_model_len": 256})
    yield live
    live.assert_clean()
    live.stop()


def test_adapters_are_picked_under_their_base_model(adapter_server, page_for):
    from selenium.webdriver.support.ui import Select

    page = page_for(adapter_server.url).open()
    assert [o.text for o in page.all("#model > option")] == ["tiny"]
    assert page.el("#model optgroup").get_attribute("label") == "Adapters of tiny"
    assert [o.text for o in page.all("#model optgroup option")] == ["mlp (LoRA)"]
    # The default max tokens shown is what a reply gets: the server's 1,024 capped by this
    # server's 256-token context (it had said 1024).
    assert page.el("#settings-form [name=maxTokens]").get_attribute("placeholder") == "256"
    Select(page.el("#model")).select_by_value("mlp")
    page.settings(maxTokens="12", temperature="0", extra='{"ignore_eos": true}')
    page.send("Hello")
    shown = page.js("return arguments[0].innerHTML", page.wait_reply().find_element("css selector", ".body"))
    # The reply is the adapter's: the text the API gives "mlp" (not "tiny"), as the page renders it.
    replies = {}
    for model in ("mlp", "tiny"):
        body = {"model": model, "messages": [{"role": "user", "content": "Hello"}], "max_tokens": 12,
                "temperature": 0, "ignore_eos": True}
        text = httpx.post(adapter_server.url + "/v1/chat/completions", json=body, timeout=30).json()
        replies[model] = render(page, text["choices"][0]["message"]["content"])
    assert shown == replies["mlp"] != replies["tiny"]
    page.open()
    assert page.el("#model").get_attribute("value") == "mlp"   # the choice is kept


def render(page: ChatPage, text: str) -> str:
    """`text` as the page's Markdown renderer builds it (innerHTML of its container)."""
    return page.driver.execute_async_script(
        "const [text, done] = arguments; import('./ui/markdown.js').then(({renderMarkdown}) => {"
        "  const box = document.createElement('div'); renderMarkdown(box, text); done(box.innerHTML); });", text)


def test_markup_in_a_reply_is_shown_as_text(server, page_for):
    page = page_for(server.url).open()
    page.force_reply(HOSTILE)
    page.send("Say something dangerous")
    reply = page.wait_reply()
    body = reply.find_element("css selector", ".body")
    assert page.js("return arguments[0].textContent", body) == HOSTILE.replace("**bold**", "bold").replace(
        "[good](https://example.com/docs)", "good")
    assert page.all("#messages script, #messages img, #messages [onerror]") == []
    assert page.js("return window.pwned") is None
    assert [s.text for s in body.find_elements("css selector", "strong")] == ["bold"]
    [link] = body.find_elements("css selector", "a")
    assert (link.text, link.get_attribute("href")) == ("good", "https://example.com/docs")
    assert set(link.get_attribute("rel").split()) >= {"noopener", "noreferrer"}


def test_a_json_schema_constrains_the_reply(server, page_for):
    page = page_for(server.url).open()
    page.settings(schema='{"type": "object"')
    page.send("Yes or no?")   # not sent: the settings open on what is wrong
    assert page.el("#settings-error").text.startswith("JSON schema: not JSON")
    assert page.all(".message") == [] and page.el("#input").get_attribute("value") == "Yes or no?"
    schema = {"title": "verdict", "type": "object", "properties": {"answer": {"enum": ["yes", "no"]}},
              "required": ["answer"], "additionalProperties": False}
    page.settings(schema=json.dumps(schema), maxTokens="40")
    assert not page.el("#settings-error").is_displayed()
    page.el("#send").click()
    reply = page.wait_reply()
    text = page.js("return arguments[0].textContent", reply.find_element("css selector", ".body"))
    assert json.loads(text)["answer"] in ("yes", "no") and len(json.loads(text)) == 1, text


def test_reload_keeps_the_conversation(server, page_for):
    page = page_for(server.url).open()
    page.force_reply("Kept **across** reloads.")
    page.send("Remember me")
    page.wait_reply()
    before = [m.text for m in page.all(".message")]
    page.open()
    assert [m.text for m in page.all(".message")] == before
    assert page.el(".message.assistant strong").text == "across"
    assert page.el("#settings-form [name=extra]").get_attribute("value").startswith('{"structured_outputs"')
    page.el("#new-chat").click()
    assert page.all(".message") == []
    page.el("#chats .open:not([aria-current])").click()
    assert [m.text for m in page.all(".message")] == before


def test_with_an_api_key_the_page_asks_for_it_then_works(tiny_model_dir, cli_env, free_port, page_for):
    """`ruvllm serve --api-key` as a user starts it: the page loads without the key,
    learns from a 401 that it needs one, refuses a wrong one, then chats."""
    key = "page-key-4711"
    command = [sys.executable, "-m", "ruvllm_cli", "serve", str(tiny_model_dir), "--port", str(free_port),
               "-q", "none", "--device", "cpu", "--max-context", "256", "--kv-cache-memory", "4MiB",
               "--served-model-name", "tiny", "--api-key", key]
    process = subprocess.Popen(command, cwd=REPO_ROOT, env=cli_env, stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE, text=True)
    url = f"http://127.0.0.1:{free_port}"
    try:
        wait_healthy(url, process)
        page = page_for(url).open(ready=False)
        page.wait(lambda: page.el("#key-dialog").is_displayed())
        # dismissed with Esc, then a message: the dialog comes back (it had said "no model to talk to")
        page.el("#key").send_keys("\ue00c")
        page.wait(lambda: not page.el("#key-dialog").is_displayed())
        page.send("Hello")
        page.wait(lambda: page.el("#key-dialog").is_displayed())
        assert not page.el("#settings-error").is_displayed()
        page.js("document.getElementById('input').value = ''")   # else the key's acceptance sends it
        page.el("#key").send_keys("wrong", "\n")
        page.wait(lambda: page.el("#key-error").text == "The server did not accept this key.")
        page.el("#key").clear()
        page.el("#key").send_keys(key, "\n")
        page.wait(lambda: not page.el("#key-dialog").is_displayed())
        assert page.el("#model").get_attribute("value") == "tiny"
        page.settings(maxTokens="5", extra='{"ignore_eos": true}')
        page.send("Hello")
        stats = page.wait_reply().find_element("css selector", ".stats").text
        assert STATS.match(stats) and stats.startswith("5 tokens"), stats
        assert page.js("return sessionStorage.getItem('ruvllm.apiKey')") == json.dumps(key)
        assert page.js("return localStorage.getItem('ruvllm.apiKey')") is None   # "remember" was off
    finally:
        process.send_signal(signal.SIGTERM)
        _, stderr = process.communicate(timeout=30)
    assert f"  Web chat    {url}/" in stderr.splitlines()


def wait_healthy(url: str, process: subprocess.Popen, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        assert process.poll() is None, process.communicate()[1]
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.1)
    raise AssertionError("the server never became healthy")


def test_light_dark_and_phone_width(server, page_for, tmp_path):
    """Screenshots under the test's temp dir; docs/web-chat.png is the light one."""
    page = page_for(server.url).open()
    page.force_reply(SHOWCASE)
    page.send("Write a Python function that adds two numbers")
    reply = page.wait_reply()
    assert reply.find_element("css selector", "pre code").text == "def add(a: int, b: int) -> int:\n    return a + b"
    assert [li.text for li in reply.find_elements("css selector", "li")] == ["it is pure",
                                                                            "it never fails on integers"]
    light = background(page)
    page.driver.save_screenshot(str(tmp_path / "web-chat-light.png"))
    page.driver.execute_cdp_cmd("Emulation.setEmulatedMedia", {
        "features": [{"name": "prefers-color-scheme", "value": "dark"}]})
    dark = background(page)
    assert luminance(light) > 0.9 and luminance(dark) < 0.2, (light, dark)
    page.driver.save_screenshot(str(tmp_path / "web-chat-dark.png"))
    page.driver.execute_cdp_cmd("Emulation.setDeviceMetricsOverride", {
        "width": 390, "height": 844, "deviceScaleFactor": 1, "mobile": True})
    page.wait(lambda: page.el("#toggle-chats").is_displayed())
    assert page.js("return document.documentElement.scrollWidth") <= 390   # nothing wider than the phone
    assert page.el("#input").is_displayed() and page.el("#send").is_displayed()
    page.wait(lambda: page.el("#new-chat").rect["x"] + page.el("#new-chat").rect["width"] <= 0)   # tucked away
    page.driver.save_screenshot(str(tmp_path / "web-chat-narrow.png"))
    page.el("#toggle-chats").click()
    page.wait(lambda: page.el("#new-chat").rect["x"] >= 0)
    for name in ("light", "dark", "narrow"):
        assert (tmp_path / f"web-chat-{name}.png").stat().st_size > 10_000


def background(page: ChatPage) -> tuple[int, ...]:
    color = page.js("return getComputedStyle(document.body).backgroundColor")
    return tuple(int(v) for v in re.findall(r"\d+", color)[:3])


def luminance(rgb: tuple[int, ...]) -> float:
    return sum(rgb) / (3 * 255)


MARKDOWN = [   # (model text, the HTML the renderer builds)
    ("a <b>x</b> & y", "<p>a &lt;b&gt;x&lt;/b&gt; &amp; y</p>"),
    ('<img src=x onerror="alert(1)">', '<p>&lt;img src=x onerror="alert(1)"&gt;</p>'),
    ("**b** and *i* and `c <d>`", "<p><strong>b</strong> and <em>i</em> and <code>c &lt;d&gt;</code></p>"),
    ("snake_case_name and _it_", "<p>snake_case_name and <em>it</em></p>"),
    ("line one\nline two", "<p>line one<br>line two</p>"),
    ("```js\nlet a = '<x>';\n```\nafter", "<pre><code data-lang=\"js\">let a = '&lt;x&gt;';</code></pre><p>after</p>"),
    ("```\nstill streaming", "<pre><code>still streaming</code></pre>"),
    # a longer fence holds shorter ones (Markdown shown with its code): CommonMark's rule
    ("````md\ncode\n```\nstill\n````\nafter",
     "<pre><code data-lang=\"md\">code\n```\nstill</code></pre><p>after</p>"),
    ("~~~\nx\n```\n~~~", "<pre><code>x\n```</code></pre>"),
    ("- a\n- **b**\n1. c", "<ul><li>a</li><li><strong>b</strong></li></ul><ol><li>c</li></ol>"),
    ("# Title\n> quoted", "<h3>Title</h3><blockquote><p>quoted</p></blockquote>"),
    ("[x](javascript:alert(1)) [y](/relative)", "<p>[x](javascript:alert(1)) [y](/relative)</p>"),
    ("[x](https://e.com/a?b=1)", '<p><a href="https://e.com/a?b=1" target="_blank" '
                                 'rel="noopener noreferrer nofollow">x</a></p>'),
    ("see https://e.com/a.", '<p>see <a href="https://e.com/a" target="_blank" '
                             'rel="noopener noreferrer nofollow">https://e.com/a</a>.</p>'),
    ("[w](https://e.com/Foo_(bar)) and (https://e.com/Baz_(q)).",
     '<p><a href="https://e.com/Foo_(bar)" target="_blank" rel="noopener noreferrer nofollow">w</a> and '
     '(<a href="https://e.com/Baz_(q)" target="_blank" rel="noopener noreferrer nofollow">https://e.com/Baz_(q)</a>).'
     '</p>'),
    ("one\n\n---\n\ntwo", "<p>one</p><hr><p>two</p>"),
    # steps split by blank lines stay one list; one that starts at 3 says so (each had restarted at 1)
    ("1. a\n\n2. b\n\n3. c", "<ol><li>a</li><li>b</li><li>c</li></ol>"),
    ("3. c\n4. d\n\ntext", '<ol start="3"><li>c</li><li>d</li></ol><p>text</p>'),
    ("- a\n\n1. b", "<ul><li>a</li></ul><ol><li>b</li></ol>"),
]


def test_the_markdown_renderer_builds_only_its_own_elements(server, page_for):
    page = page_for(server.url).open()
    assert [(text, render(page, text)) for text, _ in MARKDOWN] == MARKDOWN


def test_a_reply_of_deeply_nested_quotes_renders_and_the_page_goes_on(server, page_for):
    """10,000 `>` had run the renderer out of stack: the reply stayed "streaming" and,
    once saved, the page could not start again."""
    page = page_for(server.url).open()
    html = render(page, ">" * 12_000 + " deep")
    assert html.count("<blockquote>") == 16 and html.endswith("deep</p>" + "</blockquote>" * 16)
    page.force_reply("> " * 6_000)
    page.send("quote yourself")
    page.wait_reply()
    page.open()   # a reload draws the saved reply again
    assert len(page.all(".message.assistant blockquote")) == 16 and page.severe_logs() == []


def test_stored_data_of_another_shape_does_not_stop_the_page(server, page_for):
    """Valid JSON of the wrong shape had stopped the page from starting (`messages:
    [null]`), or made Send do nothing (a null system prompt)."""
    page = page_for(server.url).open()
    chats = [{"id": "a", "title": 5, "messages": [None, {"role": "assistant"}, {"role": "user", "content": 7},
                                                   {"role": "user", "content": "kept"},
                                                   {"role": "assistant", "content": "me too", "state": "streaming"}]},
             None, "junk", {"id": "b", "messages": "nope"}]
    page.js("localStorage.setItem('ruvllm.chats', arguments[0]); localStorage.setItem('ruvllm.active', '\"a\"');"
            "localStorage.setItem('ruvllm.settings', arguments[1]);",
            json.dumps(chats), json.dumps({"system": None, "temperature": 0.5, "maxTokens": "3"}))
    page.open()
    assert [m.text for m in page.all(".message .body")] == ["kept", "me too"]
    assert "cut off: the page was closed or reloaded" in page.reply().text   # it was left streaming
    record_requests(page)
    page.send("and now")
    page.wait_reply()
    assert page.js("return window.bodies")[0]["temperature"] == 0.5   # a number kept as its text


def test_a_full_storage_is_said(server, page_for):
    """Saving failed in silence once localStorage was full, and a reload lost the replies."""
    page = page_for(server.url).open()
    page.js("const piece = 'x'.repeat(1 << 18); let n = 0;"   # 256k characters a key until one does not fit
            "for (;;) { try { localStorage.setItem('filler' + n, piece); n += 1; } catch { break; } }"
            "for (let size = 1 << 17; size > 500; size >>= 1) {"
            "  try { localStorage.setItem('filler' + n, piece.slice(0, size)); n += 1; } catch { } }")
    page.settings(maxTokens="3")
    page.send("word " * 150)   # 750 characters: more than the room the filler left
    page.wait_reply()
    assert "storage for the page is full" in page.el("#notice").text
    page.js("for (const key of Object.keys(localStorage)) if (key.startsWith('filler')) localStorage.removeItem(key)")
    page.send("again")
    page.wait_reply()
    assert not page.el("#notice").is_displayed()


def test_enter_twice_while_the_model_list_loads_sends_once(server, page_for):
    """send() waited for the model list before it marked the page busy: a second Enter
    sent the message again, and Stop reached only the second reply."""
    page = page_for(server.url).open()
    record_requests(page)
    page.js("document.getElementById('model').replaceChildren();"   # as before the list came
            "const original = window.fetch; window.fetch = (url, init) => String(url).endsWith('/models')"
            "  ? new Promise((done) => setTimeout(() => done(original(url, init)), 500)) : original(url, init);")
    page.settings(maxTokens="3")
    from selenium.webdriver.common.keys import Keys

    page.el("#input").send_keys("once", Keys.ENTER)
    page.el("#input").send_keys(Keys.ENTER)
    page.wait_reply()
    time.sleep(0.8)
    assert len(page.js("return window.bodies")) == 1 and len(page.all(".message.user")) == 1


def test_a_reply_holding_nul_goes_back_as_it_came(server, page_for):
    """The page had sent a reply's NUL back as U+FFFD, when the server refused NUL; it
    takes NUL as text now, so the conversation goes back as the model wrote it."""
    nul = httpx.post(server.url + "/tokenize", json={"model": server.model, "prompt": "\x00"}).json()["tokens"][-1]
    page = page_for(server.url).open()
    record_requests(page)
    page.settings(maxTokens="2", extra=json.dumps({"logit_bias": {str(nul): 100}}))
    page.send("null please")
    page.wait_reply()
    page.settings(extra="")
    page.send("and again")
    page.wait_reply()
    assert page.js("return window.bodies")[1]["messages"][1] == {"role": "assistant", "content": "\x00\x00"}


def test_n_above_one_shows_the_first_choice(server, page_for):
    """Extra request fields may ask for `n`: the bubble had run every choice's deltas
    together ("abcabc")."""
    page = page_for(server.url).open()
    page.settings(extra=json.dumps({"n": 2, "structured_outputs": {"choice": ["abc"]}}))
    page.send("Pick")
    assert page.wait_reply().find_element("css selector", ".body").text == "abc"


def test_a_tool_call_is_shown_by_its_name_and_arguments(server, page_for):
    """Tools and a forced tool_choice as extra request fields: the reply is a call with
    no text, and its bubble had stayed empty."""
    tool = {"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"enum": ["Paris", "Oslo"]}}, "required": ["city"]}}}
    page = page_for(server.url).open()
    page.settings(extra=json.dumps({"tools": [tool], "tool_choice": "required", "parallel_tool_calls": False}),
                  maxTokens="64", temperature="0")
    page.send("Weather?")
    reply = page.wait_reply()
    call = reply.find_element("css selector", ".calls .call").text
    name, _, arguments = call.partition("(")
    assert name == "get_weather" and json.loads(arguments.removesuffix(")"))["city"] in ("Paris", "Oslo")
    assert "called a tool" in reply.find_element("css selector", ".stats").text
    page.open()                                    # kept with the conversation
    assert page.el(".message.assistant .calls .call").text == call


def test_a_page_opened_while_the_model_loads_gets_it_when_ready(make_server, page_for):
    """The page asked for the model list once: opened during the load (the CLI prints
    its URL before loading), it said "still loading" for good, and Enter opened the
    settings with "no model" (a helper's pass). It asks again while the server answers
    503; a message sent meanwhile stays in the box."""
    from ruvllm_cli.server import attach_engine

    live = make_server(attach=False)
    page = page_for(live.url).open(ready=False)
    page.wait(lambda: "still loading" in page.el("#notice").text)
    page.send("Hello")
    assert page.el("#input").get_attribute("value") == "Hello" and not page.el("#settings").is_displayed()
    live.thread.call(lambda: attach_engine(live.thread.app, live.engine_loop, ["tiny"]))
    page.wait(lambda: page.js("return document.querySelectorAll('#model option').length") > 0)
    assert not page.el("#notice").is_displayed()
    page.send("")   # Enter on the kept text
    assert page.wait_reply().find_element("css selector", ".body").text


def test_a_failed_turn_stays_out_of_later_requests(server, page_for):
    """A refused request (temperature 5) had stayed in the history and gone out with
    every later message, failing each; its text now goes back to the input box."""
    page = page_for(server.url).open()
    page.js("window.bodies = []; const original = window.fetch; window.fetch = (url, init) => {"
            "  if (String(url).endsWith('/chat/completions')) window.bodies.push(JSON.parse(init.body));"
            "  return original(url, init); };")
    page.settings(temperature="5", maxTokens="4")
    page.send("first try")
    reply = page.wait_reply(("error",))
    assert "temperature" in reply.find_element("css selector", ".stats").text
    assert page.el("#input").get_attribute("value") == "first try"
    page.el("#input").clear()
    page.settings(temperature="0.5")
    page.send("second try")
    page.wait_reply()
    bodies = page.js("return window.bodies")
    assert [m["content"] for m in bodies[-1]["messages"]] == ["second try"]
    page.send("third")
    page.wait_reply()
    sent = [m["content"] for m in page.js("return window.bodies")[-1]["messages"]]
    assert sent[0] == "second try" and sent[-1] == "third" and "first try" not in sent


def test_a_reload_mid_reply_keeps_the_message_and_what_came(server, page_for):
    page = page_for(server.url).open()
    page.settings(maxTokens="900", extra='{"ignore_eos": true}')
    page.send("Tell me a long story")
    page.wait(lambda: page.reply_length() > 0)
    time.sleep(1.2)   # past the once-a-second save of a streaming reply
    page.open()
    assert page.el(".message.user .body").text == "Tell me a long story"
    assert page.reply().get_attribute("data-state") == "stopped" and page.reply_length() > 0
    wait_gauge(server.url, "ruvllm_num_requests_running", 0)


def test_two_tabs_keep_each_others_conversations(server, page_for):
    page = page_for(server.url).open()
    page.settings(maxTokens="3")
    page.send("in tab one")
    page.wait_reply()
    first = page.driver.current_window_handle
    page.driver.switch_to.new_window("tab")
    page.open()
    page.el("#new-chat").click()
    page.send("in tab two")
    page.wait_reply()
    page.driver.switch_to.window(first)
    page.wait(lambda: len(page.all("#chats li")) == 2)   # the other tab's chat appears here
    page.send("again in tab one")
    page.wait_reply()
    page.open()
    assert sorted(li.text.rstrip("×").strip() for li in page.all("#chats li")) == ["in tab one", "in tab two"]


# '100-' reaches the page as '' from the browser and had been left out of the request in silence
@pytest.mark.parametrize("typed, said", [("1.7", "Max tokens: a whole number is needed"),
                                         ("100-", "Max tokens: a number is needed")])
def test_settings_that_are_not_whole_numbers_are_said_not_rounded(server, page_for, typed, said):
    page = page_for(server.url).open()
    page.settings(maxTokens=typed)
    page.send("hello")
    assert said in page.el("#settings-error").text
    assert page.all(".message") == []


def test_new_chat_closes_the_list_on_a_phone(server, page_for):
    page = page_for(server.url).open()
    page.driver.execute_cdp_cmd("Emulation.setDeviceMetricsOverride", {
        "width": 360, "height": 740, "deviceScaleFactor": 1, "mobile": True})
    page.wait(lambda: page.el("#toggle-chats").is_displayed())
    page.el("#toggle-chats").click()
    page.wait(lambda: page.el("#new-chat").rect["x"] >= 0)
    page.el("#new-chat").click()
    assert not page.js("return document.body.classList.contains('show-chats')")
    # the open list covers its own button: Escape or a tap outside it closes it
    page.el("#toggle-chats").click()
    assert page.js("return document.body.classList.contains('show-chats')")
    from selenium.webdriver.common.keys import Keys

    page.el("body").send_keys(Keys.ESCAPE)
    assert not page.js("return document.body.classList.contains('show-chats')")


@pytest.fixture
def reasoning_server(make_tiny_model) -> Iterator[LiveServer]:
    """A server on a reasoning model whose template opens the <think> block in the
    generation prompt (DeepSeek-R1's, QwQ's): every reply starts inside its reasoning."""
    live = build_server(load_model(make_tiny_model(reasoning="opens"), "cpu", Quantization.F32),
                        engine={"max_num_seqs": 4})
    yield live
    live.assert_clean()
    live.stop()


def thinking(page: ChatPage, reply: Any) -> dict[str, Any] | None:
    """The reply's "Thinking" section as shown (None where it has none)."""
    return page.js("const d = arguments[0].querySelector(':scope > details.thinking');"
                   "const text = d && d.querySelector('.reasoning');"
                   "return d && {summary: d.querySelector('summary').textContent, open: d.open,"
                   "  text: text.textContent, elements: text.childElementCount}", reply)


def record_requests(page: ChatPage) -> None:
    """Each chat completion request the page makes, its body in `window.bodies`."""
    page.js("window.bodies = []; const original = window.fetch; window.fetch = (url, init) => {"
            "  if (String(url).endsWith('/chat/completions')) window.bodies.push(JSON.parse(init.body));"
            "  return original(url, init); };")


ANSWER = "In Paris."


def thinking_then_answering(live: LiveServer, question: str) -> tuple[int, dict[str, Any]]:
    """A seed and extra request fields under which the reply to `question` reasons a
    while, closes its block and answers ANSWER. Random weights write </think> only now
    and then: logit_bias makes it likely (as tests/server/test_reasoning.py does), and
    structured_outputs, which waits for the end of the reasoning, fixes the answer."""
    end = live.engine(lambda e: e.tokenizer.convert_tokens_to_ids(THINK_END))
    extra = {"logit_bias": {str(end): 3.5}, "structured_outputs": {"choice": [ANSWER]}}
    for seed in range(16):
        body = {"model": live.model, "messages": [{"role": "user", "content": question}], "temperature": 1,
                "seed": seed, "max_tokens": 60, **extra}
        message = httpx.post(live.url + "/v1/chat/completions", json=body, timeout=60).json()["choices"][0]["message"]
        if len(message["reasoning"] or "") >= 8 and message["content"] == ANSWER:
            return seed, extra
    raise AssertionError("no seed gave a reply that reasoned, then answered")


def test_a_reasoning_models_thinking_is_folded_above_its_answer(reasoning_server, page_for):
    question = "Where is the Eiffel Tower?"
    seed, extra = thinking_then_answering(reasoning_server, question)
    page = page_for(reasoning_server.url).open()
    record_requests(page)
    page.settings(temperature="1", seed=str(seed), maxTokens="60", extra=json.dumps(extra))
    page.send(question)
    reply = page.wait_reply()
    # The page's own request, whole: what it shows is what the API gives.
    [body] = page.js("return window.bodies")
    whole = {key: value for key, value in body.items() if key != "stream_options"}
    message = httpx.post(reasoning_server.url + "/v1/chat/completions", json={**whole, "stream": False},
                         timeout=60).json()["choices"][0]["message"]
    assert message["content"] == ANSWER and len(message["reasoning"]) >= 8
    shown = thinking(page, reply)
    assert shown == {"summary": "Thought", "open": False, "text": message["reasoning"], "elements": 0}
    assert page.js("return arguments[0].textContent", reply.find_element("css selector", ".body")) == ANSWER
    assert STATS.match(reply.find_element("css selector", ".stats").text)
    text = reply.find_element("css selector", ".thinking .reasoning")
    assert not text.is_displayed()   # folded until asked for
    reply.find_element("css selector", ".thinking summary").click()
    assert text.is_displayed() and thinking(page, reply)["open"]
    # The next turn sends the answer only.
    page.send("And the Colosseum?")
    page.wait_reply()
    sent = page.js("return window.bodies")[-1]["messages"]
    assert sent[:2] == [{"role": "user", "content": question}, {"role": "assistant", "content": ANSWER}]
    assert all(set(m) == {"role", "content"} for m in sent)
    # A reload shows it again, folded: it is kept with the conversation.
    page.open()
    assert thinking(page, page.all(".message.assistant")[0]) == shown
    saved = json.loads(page.js("return localStorage.getItem('ruvllm.chats')"))
    assert saved[0]["messages"][1]["reasoning"] == message["reasoning"]
    assert page.severe_logs() == []


def test_stop_mid_reasoning_keeps_the_thinking_that_came(reasoning_server, page_for):
    page = page_for(reasoning_server.url).open()
    end = reasoning_server.engine(lambda e: e.tokenizer.convert_tokens_to_ids(THINK_END))
    # </think> ruled out (random weights write it now and then): reasoning all along
    page.settings(maxTokens="900", extra=json.dumps({"ignore_eos": True, "logit_bias": {str(end): -100}}))
    page.send("Think about a long story")
    page.wait(lambda: (thinking(page, page.reply()) or {}).get("text"))
    streaming = thinking(page, page.reply())
    assert streaming["summary"] == "Thinking…" and not streaming["open"]
    wait_gauge(reasoning_server.url, "ruvllm_num_requests_running", 1)
    page.el("#stop").click()
    reply = page.wait_reply(("stopped",))
    wait_gauge(reasoning_server.url, "ruvllm_num_requests_running", 0)
    kept = thinking(page, reply)
    assert kept["summary"] == "Thought" and kept["text"].startswith(streaming["text"])
    page.open()
    assert page.reply().get_attribute("data-state") == "stopped"
    assert thinking(page, page.reply()) == kept


def test_a_reply_without_reasoning_shows_no_thinking(server, page_for):
    page = page_for(server.url).open()
    page.settings(maxTokens="4")
    page.send("Hello")
    assert thinking(page, page.wait_reply()) is None and page.all("#messages details") == []
    # A conversation saved before the page kept reasoning still loads.
    old = [{"id": "old-1", "title": "From before", "messages": [
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello **there**.", "state": "done", "stats": "3 tokens"}]}]
    page.js("localStorage.setItem('ruvllm.chats', arguments[0]); localStorage.setItem('ruvllm.active', '\"old-1\"')",
            json.dumps(old))
    page.open()
    assert [m.find_element("css selector", ".body").text for m in page.all(".message")] == ["Hi", "Hello there."]
    assert page.all("#messages details") == []
