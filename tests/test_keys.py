"""core/keys.py is the one place a key is spelled, and the one place one is read back."""

from __future__ import annotations

import pytest

from stagecoach.core import keys


@pytest.mark.parametrize("job", ["digits-1a2b3c4d", "j", "bert-c1234567"])
@pytest.mark.parametrize("version", [0, 7, 1200])
def test_state_and_checkpoint_keys_read_back_what_they_name(job: str, version: int) -> None:
    for stage in (0, 3, 11):
        assert keys.checkpoint_of(job, keys.checkpoint(job, version, stage)) == (version, stage)
        named = {
            "params": keys.params(job, version, stage, 2, 5),
            "optim": keys.optim(job, version, stage, 2, 5),
            "buffers": keys.buffers(job, version, stage),
        }
        for kind, key in named.items():
            assert key.startswith(keys.state_prefix(job, kind))
            assert keys.state_version(job, kind, key) == version


def test_the_abort_marker_is_the_template_the_window_fills_in() -> None:
    assert keys.window_abort("j-1", "w0-abc") == keys.WINDOW_ABORT.format("j-1", "w0-abc") == "jobs/j-1/abort/w0-abc"
    assert keys.window_abort("j-1", "w40-x").startswith(keys.window_aborts("j-1", 40))
