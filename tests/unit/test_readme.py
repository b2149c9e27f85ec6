"""The README's settings table is the one generated from the settings classes."""

from pathlib import Path

from deploy.settings_doc import table

README = Path(__file__).resolve().parents[2] / "README.md"


def test_settings_table_is_current():
    text = README.read_text()
    start = text.index("<!-- settings:start -->") + len("<!-- settings:start -->")
    end = text.index("<!-- settings:end -->")
    assert text[start:end].strip() == table().strip(), "run: python -m deploy.settings_doc and paste into README.md"


def test_every_setting_says_what_it_does():
    missing = [line for line in table().splitlines()[2:] if line.rstrip().endswith("|  |")]
    assert not missing, "settings without a description:\n" + "\n".join(missing)
