"""The reports of a short demo and a short RL run, opened in a real headless browser (Chromium
through Playwright): no script error, no empty section and no broken image, the summary first and
the reward the first of the key curves, the held-out answers marked (and the "only the answers
that are not right" switch works), the demo's reports linked to each other.

Needs Chromium (Debian's ``chromium`` package; ``.ci/run`` installs it) and the ``playwright``
package (the dev extra); without them the test says what is missing and is skipped."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from posttrain.cli import main

sync_api = pytest.importorskip("playwright.sync_api", reason="needs playwright: pip install -e '.[dev]'")
CHROMIUM = next(filter(None, map(shutil.which, ("chromium", "chromium-browser", "google-chrome"))), None)
pytestmark = pytest.mark.skipif(CHROMIUM is None, reason="needs Chromium: apt-get install chromium")

TINY_RL = [
    "rl", "model.tiny.layers=1", "model.tiny.hidden=32", "model.tiny.heads=2", "data.task=reverse",
    "data.n_train=64", "data.n_eval=12", "rewards=[tests.telemetry.test_report_browser:has_a_vowel]", "steps=4",
    "prompts_per_step=4", "samples_per_prompt=4", "max_new_tokens=8", "eval_every=2", "report_to=[]",
    "reward_workers=0",
]  # fmt: skip


def has_a_vowel(prompts, completions, **columns):
    """A 0/1 reward a random model meets about half the time, so every key curve moves."""
    return [float(any(ch in "aeiou" for ch in completion)) for completion in completions]


@pytest.fixture(scope="module")
def browser():
    with sync_api.sync_playwright() as playwright:
        chromium = playwright.chromium.launch(executable_path=CHROMIUM)
        yield chromium
        chromium.close()


class Opened:
    """A report loaded in a browser tab, with the script errors it raised."""

    def __init__(self, browser, path: Path) -> None:
        self.errors: list[str] = []
        self.page = browser.new_page()
        self.page.on("pageerror", lambda error: self.errors.append(str(error)))
        self.page.on("console", lambda message: message.type == "error" and self.errors.append(message.text))
        self.page.goto(path.resolve().as_uri())
        self.page.wait_for_load_state("load")

    def sections(self) -> list[tuple[str, int]]:
        """Each h2 and how much follows it up to the next one (characters of text plus images)."""
        return self.page.evaluate(
            """() => Array.from(document.querySelectorAll('h2')).map(h => {
                let amount = 0;
                for (let n = h.nextElementSibling; n && n.tagName !== 'H2'; n = n.nextElementSibling)
                    amount += n.innerText.trim().length + n.querySelectorAll('img').length + (n.tagName === 'IMG');
                if (!h.nextElementSibling && h.parentElement.tagName === 'DIV') amount = 1;  // a boxed notice
                const box = h.parentElement.tagName === 'DIV' ? h.parentElement.innerText.length : 0;
                return [h.textContent, Math.max(amount, box - h.textContent.length)];
            })"""
        )

    def broken_images(self) -> list[str]:
        return self.page.evaluate(
            "() => Array.from(document.images).filter(i => !i.complete || i.naturalWidth === 0).map(i => i.src)"
        )

    def check_plain(self) -> list[str]:
        """The checks every report passes; returns its section titles."""
        assert self.errors == []
        assert self.broken_images() == []
        sections = self.sections()
        assert sections and all(amount > 0 for _, amount in sections), sections
        assert "(none)" not in self.page.inner_text("body")
        return [title for title, _ in sections]


def test_an_rl_report_reads_headline_first_in_a_browser(tmp_path, browser):
    assert main([*TINY_RL, f"output_dir={tmp_path / 'rl'}"]) == 0
    opened = Opened(browser, tmp_path / "rl" / "report.html")
    titles = opened.check_plain()
    first = [t for t in titles if not t.startswith(("Warnings", "The run stopped"))]
    assert first[:2] == ["Summary", "Key curves"], titles
    assert opened.page.inner_text("p.panels").startswith("Panels: reward")
    assert "held out, eval/accuracy" in opened.page.inner_text("table.summary")
    # the held-out answers, each marked; the switch hides the right ones and shows them again
    marked = opened.page.locator("tr.right, tr.wrong")
    assert marked.count() == 12
    assert all(text in ("✓ right", "✗ wrong", "unscored") for text in opened.page.locator("td.mark").all_inner_texts())
    right = opened.page.locator("tr.right").count()
    opened.page.check("#only-wrong")
    assert (
        opened.page.locator("tr.right:visible").count() == 0
        and opened.page.locator("tr.wrong:visible").count() == 12 - right
    )
    opened.page.uncheck("#only-wrong")
    assert opened.page.locator("tr.right:visible").count() == right
    assert opened.errors == []


def test_the_demo_reports_open_clean_and_link_to_each_other(tmp_path, browser):
    out = tmp_path / "demo"
    # a tiny budget: 10 SFT steps leave the reward at 0 on the first batch, which the demo then allows
    args = ["demo", "--rl-steps", "3", "--sft-max-steps", "10", "--threads", "2", "--output-dir", str(out)]
    assert main([*args, "allow_constant_reward=[reverse_reward]", "eval_every=2"]) == 0
    pages = {name: out / name / "report.html" for name in ("sft", "rl", "sft_continued")} | {"": out / "report.html"}
    for name, path in pages.items():
        opened = Opened(browser, path)
        titles = opened.check_plain()
        assert titles[0] in ("Summary", "Warnings (1)", "Warnings (2)", "Warnings (3)"), (name, titles)
        targets = opened.page.eval_on_selector_all("a", "links => links.map(a => a.href)")
        others = {p.resolve().as_uri() for n, p in pages.items() if n != name}
        if name == "rl":  # the stage that sampled also links its recorded rollouts (posttrain view)
            others.add((out / "rl" / "rollouts.html").resolve().as_uri())
        assert set(targets) == others, (name, targets)
    assert "held-out exact match, SFT continued as long" in (out / "report.html").read_text()
