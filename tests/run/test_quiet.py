"""`run -q` shows nothing while loading: no spinner, no library bars. Without it, a load from a folder shows
specdec's spinner, not transformers' "Loading weights" bar (a bar a model, on every start)."""

import json

from typer.testing import CliRunner
from transformers.utils import logging as transformers_logging

from specdec_cli.cli import app


def test_quiet_hides_the_libraries_loading_bars_and_restores_them(tiny_pair, tmp_path):
    (tmp_path / "in.jsonl").write_text(json.dumps({"prompt": "def add(a, b):"}) + "\n")

    def run(*flags):
        arguments = ["run", str(tmp_path / "in.jsonl"), "-o", str(tmp_path / "out.jsonl"), "--overwrite", "--target",
                     tiny_pair.target, "--draft", tiny_pair.draft, "--dtype", "float32", "-n", "4", *flags]
        return CliRunner().invoke(app, arguments)

    loud = run()
    assert loud.exit_code == 0, loud.output
    assert loud.stderr  # the run's summary: what -q must hide
    assert "Loading weights" not in loud.stderr
    quiet = run("-q")
    assert quiet.exit_code == 0, quiet.output
    assert (quiet.stdout, quiet.stderr) == ("", "")
    assert transformers_logging.is_progress_bar_enabled()  # only for the load
