"""``draftheads demo`` in a real browser: headless Chromium (Debian's ``chromium`` package) driven
by Playwright loads the page the command serves, submits a prompt, waits for the answer and
checks that its text is plain ``generate``'s, that accepted drafts are coloured and that the speed
lines (tokens/s, τ) are shown; a screenshot is saved (``DRAFTHEADS_DEMO_SCREENSHOT=path`` keeps
it: docs/demo.png is the slow SmolLM2 test's). Skipped, naming the package, where no browser,
Playwright or Gradio is installed (scripts/test.sh installs them)."""
from __future__ import annotations

import os
import re
import shutil
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest
import torch

from helpers import REPO, save_tiny_base, saved_tree_heads

#: the launch arguments that work in a container with no network, no GPU and no sandbox
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                 "--disable-background-networking", "--disable-component-update", "--disable-sync"]
NEEDS = "the demo's browser test needs"  # the skip reason's prefix (conftest.ALLOWED_SKIPS)
SPEED = re.compile(r"draftheads: (\d+) tokens · [\d.]+ tokens/s · τ [\d.]+")
PLAIN_SPEED = re.compile(r"plain generate: (\d+) tokens · [\d.]+ tokens/s")


def chromium() -> str:
    for name in ("chromium", "chromium-browser"):
        path = shutil.which(name)
        if path:
            return path
    pytest.skip(f"{NEEDS} a Chromium browser: apt-get install chromium (Debian's package, /usr/bin/chromium)")


def playwright():
    try:
        from playwright.sync_api import sync_playwright
    except ImportError:
        pytest.skip(f"{NEEDS} Playwright: pip install playwright (it drives the OS's chromium; no browser download)")
    return sync_playwright


def gradio() -> None:
    import importlib.util

    if importlib.util.find_spec("gradio") is None:
        pytest.skip(f"{NEEDS} Gradio, which serves the page: pip install 'draftheads[demo]'")


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


class Demo:
    """``draftheads demo ...`` as a subprocess on a free port, up until :meth:`stop`."""

    def __init__(self, args: list[str], cache: Path, log: Path, timeout: float = 300):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}/"
        env = {**os.environ, "DRAFTHEADS_CACHE": str(cache), "HF_HUB_OFFLINE": "1", "GRADIO_ANALYTICS_ENABLED": "False"}
        self.log = log
        self.process = subprocess.Popen([sys.executable, "-m", "draftheads.cli", "demo", *args, "--port", str(self.port)],
                                        cwd=REPO, env=env, stdout=open(self.log, "w"), stderr=subprocess.STDOUT)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise AssertionError(f"draftheads demo exited ({self.process.returncode}):\n{self.log.read_text()}")
            try:
                with urllib.request.urlopen(self.url, timeout=5) as response:
                    if response.status == 200:
                        return
            except OSError:
                time.sleep(0.5)
        self.stop()
        raise AssertionError(f"draftheads demo did not serve {self.url} in {timeout:.0f}s:\n{self.log.read_text()}")

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()


def ask_in_browser(url: str, prompt: str, screenshot: Path, timeout_s: float = 240) -> dict[str, str]:
    """Load the page in headless Chromium, submit ``prompt``, wait for the verdict line; the
    texts of the answers and speed lines, and the number of coloured draft spans."""
    with playwright()() as p:
        browser = p.chromium.launch(executable_path=chromium(), args=CHROMIUM_ARGS)
        try:
            page = browser.new_page(viewport={"width": 1280, "height": 820})
            page.goto(url, wait_until="domcontentloaded", timeout=60_000)
            page.locator("#prompt textarea").fill(prompt)
            page.locator("#generate").click()
            page.wait_for_function("() => { const v = document.querySelector('#verdict');"
                                   " return v && /speedup|error/.test(v.innerText); }", timeout=timeout_s * 1000)
            seen = {name: page.locator(f"#{name}").inner_text()
                    for name in ("draftheads-answer", "plain-answer", "draftheads-speed", "plain-speed", "verdict")}
            seen["draft_spans"] = page.locator("#draftheads-answer .dh-draft").count()
            seen["base_spans"] = page.locator("#draftheads-answer .dh-base").count()
            page.screenshot(path=str(screenshot), full_page=True)
        finally:
            browser.close()
    keep = os.environ.get("DRAFTHEADS_DEMO_SCREENSHOT")
    if keep:
        shutil.copyfile(screenshot, keep)
    return seen


def plain_answer(base, tokenizer, prompt: str, max_new_tokens: int) -> str:
    from draftheads.prompts import chat_input

    ids = chat_input(tokenizer, prompt)
    out = base.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens, do_sample=False)
    return tokenizer.decode(out[0, ids.shape[1]:], skip_special_tokens=True)


def check_page(seen: dict, expected: str, new_tokens: int | None = None) -> None:
    assert "error" not in seen["verdict"], seen["verdict"]
    assert seen["plain-answer"].strip() == expected.strip(), (seen, expected)
    speed, plain = SPEED.search(seen["draftheads-speed"]), PLAIN_SPEED.search(seen["plain-speed"])
    assert speed and plain, (seen["draftheads-speed"], seen["plain-speed"])
    if new_tokens is not None:
        assert int(speed.group(1)) == int(plain.group(1)) == new_tokens, seen
    assert re.match(r"speedup [\d.]+×", seen["verdict"]), seen["verdict"]
    assert seen["base_spans"] > 0, seen


def test_the_demo_page_in_a_real_browser(tmp_path):
    """A tiny float64 base with a word-level tokenizer and random Medusa heads: the page's
    draftheads answer is token for token plain generate's (float64), drafts accepted and coloured
    (the tree pinned: this machine's calibrated default may decode plainly)."""
    chromium(), playwright(), gradio()  # skip before building anything
    from transformers import AutoTokenizer, LlamaForCausalLM

    base = save_tiny_base(tmp_path / "base")
    saved_tree_heads(tmp_path / "heads", base)
    demo = Demo(["--base", str(tmp_path / "base"), "--heads", str(tmp_path / "heads"), "--dtype", "float64",
                 "--sources", "heads,context", "--tree", "3", "--max-new-tokens", "40"], tmp_path / "cache", tmp_path / "demo.log")
    try:
        seen = ask_in_browser(demo.url, "w5 w6 w7 w8 w5 w6", tmp_path / "demo.png")
    finally:
        demo.stop()
    model = LlamaForCausalLM.from_pretrained(tmp_path / "base", dtype=torch.float64)
    expected = plain_answer(model, AutoTokenizer.from_pretrained(tmp_path / "base"), "w5 w6 w7 w8 w5 w6", 40)
    check_page(seen, expected, new_tokens=40)
    assert seen["draftheads-answer"].strip() == expected.strip(), (seen, expected)
    assert seen["verdict"].endswith("identical to plain generate (float64)"), seen["verdict"]
    assert seen["draft_spans"] > 0, seen
    assert (tmp_path / "demo.png").stat().st_size > 10_000


@pytest.mark.slow
def test_the_demo_page_with_smollm2_and_the_shipped_heads(tmp_path, smollm2):
    """SmolLM2 (float32) with the shipped heads and lookups, as the README shows it: the page's
    plain answer is transformers' own; the draftheads answer equals it (float32: or diverges at
    a near-tie, which the verdict line says)."""
    chromium(), playwright(), gradio()
    prompt = "Explain in three sentences why the sky is blue."
    demo = Demo(["--dtype", "float32", "--max-new-tokens", "96"], Path(os.environ.get("DRAFTHEADS_CACHE", tmp_path / "cache")), tmp_path / "demo.log")
    try:
        seen = ask_in_browser(demo.url, prompt, tmp_path / "demo.png", timeout_s=400)
    finally:
        demo.stop()
    base, tokenizer = smollm2
    expected = plain_answer(base, tokenizer, prompt, 96)
    check_page(seen, expected)
    if "identical to plain generate" in seen["verdict"]:
        assert seen["draftheads-answer"].strip() == expected.strip()
    else:
        assert "within float32 rounding" in seen["verdict"], seen["verdict"]
    tau = float(re.search(r"τ ([\d.]+)", seen["draftheads-speed"]).group(1))
    assert (seen["draft_spans"] > 0) == (tau > 1), seen  # the calibrated default may decode plainly here
