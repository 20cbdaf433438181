"""model_state_bytes reproduces the ZeRO paper's figures (Rajbhandari et al. 2020, Fig. 1: 7.5B parameters,
64 data-parallel devices, K = 12)."""
import pytest

from engine.planner import model_state_bytes


@pytest.mark.parametrize("stage,gb", [(0, 120.0), (1, 31.4), (2, 16.6), (3, 1.9)])
def test_zero_paper_7_5b_on_64_devices(stage, gb):
    assert model_state_bytes(7.5e9, 64, stage) / 1e9 == pytest.approx(gb, abs=0.05)


def test_fp32_and_errors():
    assert model_state_bytes(1000, 4, 0, "fp32") == 16000
    assert model_state_bytes(1000, 4, 3, "fp32") == 4000
    assert model_state_bytes(1000, 4, 1, "fp32") == 1000 * (8 + 8 / 4)
    with pytest.raises(ValueError, match="zero_stage=4"):
        model_state_bytes(1000, 4, 4)
