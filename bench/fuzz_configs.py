"""Config fuzz: whatever the four component configs hold, opening ends in our error or a quick build.

    python -m bench.fuzz_configs [--examples 2000] [--base tiny|published] [--seed 0] [--slow-s 20]

Each example takes the configs of a base checkpoint (the tiny MoE fixture, or the published LingBot-Video
MoE / Wan 2.1 VAE / Qwen3-VL-4B configs in `lingbot_core/configs/`), replaces one to four values anywhere
in them (hypothesis picks the places and the values: huge and negative integers, floats, NaN, strings,
lists, objects, null), then runs the open-time checks (`check_values_and_shapes`) and, when they accept,
the meta-device skeleton builds of the DiT and the VAE (the step that hung on `"depth": 1000000`).
Outcomes: `refused` (a CheckpointError), `accepted`, `crash` (any other exception) and `slow` (accepted
or refused after more than --slow-s seconds). Prints a JSON summary with the first crashes. The quick
version of this (60 examples, one value, tiny base) runs in the suite (tests/test_config_bounds.py).
"""

from __future__ import annotations

import argparse
import copy
import json
import time
import traceback
from pathlib import Path
from typing import Any

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from lingbot_core.checkpoints.inspection import check_values_and_shapes
from lingbot_core.errors import CheckpointError
from lingbot_core.weights import checks

REPO = Path(__file__).resolve().parents[1]
CONFIGS = Path(checks.__file__).parents[1] / "configs"  # lingbot_core/configs
FILES = {"transformer": "transformer/config.json", "vae": "vae/config.json",
         "text_encoder": "text_encoder/config.json", "scheduler": "scheduler/scheduler_config.json"}

VALUES = st.one_of(
    st.none(), st.booleans(), st.integers(min_value=-(2**70), max_value=2**70), st.integers(0, 4096),
    st.sampled_from([0, 1, 2**31 - 1, 2**31, 10**6, 10**9, -1, 1e308, -1e308, 1e-308, 0.5]),
    st.floats(allow_nan=True, allow_infinity=True), st.text(max_size=8),
    st.lists(st.integers(min_value=-(2**40), max_value=2**40), max_size=6),
    st.lists(st.floats(allow_nan=True), max_size=20),
    st.dictionaries(st.text(max_size=4), st.integers(), max_size=2),
)


def base_configs(base: str) -> dict[str, dict[str, Any]]:
    if base == "tiny":
        folder = REPO / "tests" / "fixtures" / "lingbot" / "models" / "tiny-moe"
        return {name: json.loads((folder / rel).read_text()) for name, rel in FILES.items()}
    return {"transformer": json.loads((CONFIGS / "moe-30b-a3b.transformer.json").read_text()),
            "vae": json.loads((CONFIGS / "wan2.1.vae.json").read_text()),
            "text_encoder": json.loads((CONFIGS / "qwen3-vl-4b.text_encoder.json").read_text()),
            "scheduler": {"_class_name": "FlowUniPCMultistepScheduler", "num_train_timesteps": 1000, "shift": 1.0}}


def _leaves(config: Any, prefix: tuple = ()) -> list[tuple]:
    out = []
    for key, value in config.items():
        out += _leaves(value, (*prefix, key)) if isinstance(value, dict) and value else [(*prefix, key)]
    return out


def _set(config: dict, path: tuple, value: Any) -> None:
    for key in path[:-1]:
        config = config[key]
    config[path[-1]] = value


def one(configs: dict[str, dict], edits: list[tuple[str, int, Any]]) -> str:
    """Apply the edits, open-check and build; 'refused' or 'accepted' (other exceptions propagate)."""
    configs = copy.deepcopy(configs)
    for component, pick, value in edits:
        leaves = _leaves(configs[component])
        _set(configs[component], leaves[pick % len(leaves)], value)
    try:
        check_values_and_shapes(REPO, configs, {})
        checks.dit_shapes(configs["transformer"], "transformer/config.json")
        checks.vae_shapes(configs["vae"], "vae/config.json")
    except CheckpointError:
        return "refused"
    return "accepted"


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--examples", type=int, default=2000)
    parser.add_argument("--base", choices=("tiny", "published"), default="tiny")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--slow-s", type=float, default=20.0)
    args = parser.parse_args(argv)
    configs = base_configs(args.base)
    one(configs, [])  # imports and the unchanged skeletons, outside the timings
    counts = {"refused": 0, "accepted": 0, "crash": 0, "slow": 0}
    crashes: list[dict[str, Any]] = []
    slowest = 0.0
    edit = st.tuples(st.sampled_from(sorted(FILES)), st.integers(0, 400), VALUES)

    @settings(max_examples=args.examples, deadline=None, database=None, derandomize=False,
              suppress_health_check=list(HealthCheck))
    @given(edits=st.lists(edit, min_size=1, max_size=4))
    def run(edits):
        nonlocal slowest
        start = time.perf_counter()
        try:
            outcome = one(configs, edits)
        except Exception as err:  # noqa: BLE001 - counting what escapes is the point
            outcome = "crash"
            if len(crashes) < 10:
                crashes.append({"edits": repr(edits)[:300], "error": f"{type(err).__name__}: {str(err)[:200]}",
                                "where": traceback.format_exc().strip().splitlines()[-3][:200]})
        took = time.perf_counter() - start
        slowest = max(slowest, took)
        counts[outcome] += 1
        if took > args.slow_s:
            counts["slow"] += 1

    start = time.perf_counter()
    run._hypothesis_internal_use_seed = args.seed
    run()
    summary = {"base": args.base, "examples": sum(counts[k] for k in ("refused", "accepted", "crash")), **counts,
               "slowest_s": round(slowest, 3), "total_s": round(time.perf_counter() - start, 1), "crashes": crashes}
    print(json.dumps(summary, indent=1))
    return summary


if __name__ == "__main__":
    main()
