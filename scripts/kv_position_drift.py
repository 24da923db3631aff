"""How far an engine's quantised keys move attention when the calibration text sits further into the context; JSON.

The build's calibration text covers the first 512 positions. RoPE turns each key's offset with its position, so the
one mean key the cache subtracts (key centering) and the per-channel key scale fit those positions and drift from
keys thousands of positions on. This runs the build's calibration pass on the engine's weights and, for each shift,
turns every query and key on by that many positions (q·k unchanged) and measures each quantised layer's attention
error ‖O′ − O‖/‖O‖ through each cache format with the engine's own centering and scale
(`bie_trt.builder.kv_choice.attention_errors`, what the build's bound check measures at positions up to its
--max-model-len).

    python scripts/kv_position_drift.py --engine engines/coder-int4 --shifts 0,2048,8192,16384,32768 \\
        --out benchmarks/results/kv_position_drift_coder.json
"""
from __future__ import annotations

import argparse
import dataclasses
from pathlib import Path

from report import emit


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--engine", required=True)
    ap.add_argument("--shifts", default="0,2048,8192,16384,32768", help="positions to move the text on by")
    ap.add_argument("--formats", default="int4_asym,fp8", help="cache formats, each with the engine's settings")
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()

    from safetensors.torch import load_file

    from bie_trt.builder.build import calibrate_keys
    from bie_trt.builder.kv_choice import attention_errors
    from bie_trt.engine_format import WEIGHTS, read_manifest

    manifest = read_manifest(args.engine)
    weights = load_file(str(Path(args.engine) / WEIGHTS))
    mean, scale = weights.pop("kv.key_mean").float(), weights.pop("kv.key_scale").float()
    calibration = calibrate_keys(manifest.model, weights, Path(args.engine))
    kv = manifest.kv
    result = {"engine": args.engine, "kv": dataclasses.asdict(kv), "formats": {}}
    for fmt in args.formats.split(","):
        result["formats"][fmt] = {}
        for shift in map(int, args.shifts.split(",")):
            errors = attention_errors(calibration, manifest.model, mean, dataclasses.replace(kv, dtype=fmt), scale,
                                      [shift])
            worst = max(errors, key=lambda li: errors[li][0])
            result["formats"][fmt][shift] = {"worst": {"layer": worst, "attention_error": errors[worst][0]},
                                             "per_layer": {str(li): e for li, (e, _) in errors.items()}}
            print(f"{fmt} shifted {shift:>6}: worst {errors[worst][0]:.3f} (layer {worst})", flush=True)
    emit(result, args.out)


if __name__ == "__main__":
    main()
