"""The tuning switches (``IRON_BATCH_*``): declared once with their defaults, read once at
model load, refused by name when set to a value they do not take, and shown by the
backend's description and the console banner."""

from __future__ import annotations

from pathlib import Path

import pytest
from iron_batch.backends.torch_backend import TorchBackend
from iron_batch.platform.switches import SWITCHES, SwitchError, Switches, read
from iron_batch.server.ui import banner
from tiny_models import checkpoint


def test_an_unset_environment_gives_the_declared_defaults() -> None:
    values = read({})
    assert values == Switches()
    assert values.as_dict() == {s.env: s.default for s in SWITCHES.values()}
    assert values.changed() == {}


def test_a_switch_set_away_from_its_default_is_reported() -> None:
    values = read({"IRON_BATCH_CPU_DECODER": "0", "IRON_BATCH_QUANT_GEMV_ROWS": "4"})
    assert not values.cpu_decoder and values.quant_gemv_rows == 4
    assert values.changed() == {"IRON_BATCH_CPU_DECODER": "0", "IRON_BATCH_QUANT_GEMV_ROWS": "4"}
    # 0 turns the many-row GEMV off (a switch whose least value is 0).
    assert read({"IRON_BATCH_CPU_GEMV_ROWS": "0"}).cpu_gemv_rows == 0
    assert read({"IRON_BATCH_CPU_GEMM": "f32"}).changed() == {"IRON_BATCH_CPU_GEMM": "f32"}


@pytest.mark.parametrize("env, value", [("IRON_BATCH_CPU_ATTENTION", "fast"),
                                        ("IRON_BATCH_HUGE_PAGES", "yes"),
                                        ("IRON_BATCH_QUANT_GEMV_ROWS", "0"),
                                        ("IRON_BATCH_CPU_GEMV_ROWS", "-1"),
                                        ("IRON_BATCH_CPU_GEMM", "fp32")])
def test_a_value_a_switch_does_not_take_is_refused_by_name(env: str, value: str) -> None:
    with pytest.raises(SwitchError, match=env) as info:
        read({env: value})
    assert "\n" not in str(info.value)


def test_a_model_keeps_what_it_read_at_load_and_says_so(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("IRON_BATCH_CPU_DECODER", "0")
    be = TorchBackend.from_model(str(checkpoint("llama")), device="cpu", dtype="bfloat16",
                                 total_kv_blocks=16, kv_block_size=4)
    # Set after load: nothing changes for the loaded model.
    monkeypatch.setenv("IRON_BATCH_CPU_DECODER", "1")
    assert be.model.decoder is None
    described = be.describe()
    assert described.switches is not None
    assert described.switches["IRON_BATCH_CPU_DECODER"] == "0"
    info = {"model": "m", "backend": "torch", "switches": described.switches,
            "kv": {"blocks": 16, "block_size": 4, "tokens": 64},
            "scheduler": {"max_batch_tokens": 64, "max_running_seqs": 4,
                          "prefix_caching": True},
            "limits": {"max_seq_tokens": 64, "max_waiting_requests": 1,
                       "max_waiting_tokens": None, "max_prompt_tokens": None,
                       "max_new_tokens": None, "max_body_bytes": 1024},
            "auth": False}
    tuning = [line for line in banner(info, ["http://x"], ui=False).splitlines()
              if line.strip().startswith("tuning")]
    assert tuning and "IRON_BATCH_CPU_DECODER=0" in tuning[0]


def test_the_readme_lists_every_switch_with_its_default() -> None:
    readme = (Path(__file__).parents[1] / "README.md").read_text()
    for switch in SWITCHES.values():
        assert f"| `{switch.env}` | `{switch.default}` |" in readme
