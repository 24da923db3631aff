"""Key calibration runs the model over one pool holding every attention layer: each layer's keys must land in
rows of its own. A hybrid model's sliding and full layers count from 0 inside their own cache groups, so
their group indices coincide; over the one pool they must not share rows (the full layer's keys written over
the first sliding layer's, its own rows left zero)."""
from __future__ import annotations

from bie_trt.builder.key_centering import calibration_pass


def test_each_gemma3_layer_calibrates_keys_of_its_own(tiny_gemma3_engine):
    """The tiny Gemma 3: layers 0 and 1 slide, layer 2 is full (index 0 in both groups)."""
    keys = calibration_pass(tiny_gemma3_engine.core.runner.model, list(range(3, 67)), skip=16).keys
    assert keys.shape[:3] == (3, 2, 48)
    assert all(keys[i].abs().max() > 0 for i in range(3))
    assert all((keys[i] - keys[j]).abs().max() > 1e-3 for i in range(3) for j in range(i))
