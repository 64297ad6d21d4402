"""The documentation that is generated from the code stays in step with it."""

from __future__ import annotations

from pathlib import Path

from sqsinfer import config

ROOT = Path(__file__).resolve().parents[2]


def test_the_settings_page_is_generated_from_the_settings() -> None:
    page = (ROOT / "docs" / "settings.md").read_text()
    assert page == config.reference_markdown(), "docs/settings.md is stale: make docs-settings"


def test_every_setting_is_on_the_settings_page() -> None:
    page = (ROOT / "docs" / "settings.md").read_text()
    missing = [name for name in config.ENV_NAMES if f"`{name}`" not in page]
    assert missing == []
