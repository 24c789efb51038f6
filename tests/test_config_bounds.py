"""Config values have upper bounds, checked before any module is built (an absurd depth hung the Loader)."""

from __future__ import annotations

import copy
import json
import shutil
import time
from pathlib import Path
from typing import Any

import pytest

from lingbot_core.checkpoints import configs as config_checks
from lingbot_core.checkpoints.inspection import check_values_and_shapes, inspect_checkpoint
from lingbot_core.errors import CheckpointError
from lingbot_core.weights import checks

PUBLISHED = Path(checks.__file__).parents[1] / "configs"  # lingbot_core/configs
FILES = {"transformer": "transformer/config.json", "vae": "vae/config.json",
         "text_encoder": "text_encoder/config.json", "scheduler": "scheduler/scheduler_config.json"}


def _configs(folder: Path) -> dict[str, dict[str, Any]]:
    return {name: json.loads((folder / rel).read_text()) for name, rel in FILES.items()}


def test_the_published_configs_are_inside_the_bounds():
    for name in ("dense-1.3b", "moe-30b-a3b"):
        config_checks.check_transformer_config(json.loads((PUBLISHED / f"{name}.transformer.json").read_text()), name)
    config_checks.check_vae_config(json.loads((PUBLISHED / "wan2.1.vae.json").read_text()), "vae")
    config_checks.check_text_encoder_config(json.loads((PUBLISHED / "qwen3-vl-4b.text_encoder.json").read_text()),
                                     "text_encoder", 2560)


ABSURD = [  # (component, path into its config, value): each took minutes (or forever) to build
    ("transformer", ("depth",), 10**6),
    ("transformer", ("hidden_size",), 2**30),
    ("transformer", ("num_experts",), 10**7),
    ("transformer", ("axes_lens",), [10**9, 64, 64]),
    ("vae", ("num_res_blocks",), 10**6),
    ("vae", ("base_dim",), 10**7),
    ("vae", ("dim_mult",), [1] * 1000),
    ("text_encoder", ("text_config", "num_hidden_layers"), 10**6),
    ("text_encoder", ("text_config", "vocab_size"), 2**31 - 1),
    ("text_encoder", ("vision_config", "depth"), 10**6),
    ("scheduler", ("num_train_timesteps",), 10**9),
]


def _set(config: dict, path: tuple, value: Any) -> None:
    for key in path[:-1]:
        config = config[key]
    config[path[-1]] = value


@pytest.mark.parametrize(("component", "path", "value"), ABSURD, ids=[f"{c}-{p[-1]}" for c, p, _ in ABSURD])
def test_an_absurd_config_is_refused_at_once(fixtures_root, tmp_path, component, path, value):
    folder = tmp_path / "ckpt"
    shutil.copytree(fixtures_root / "models" / "tiny-dense", folder)
    config = json.loads((folder / FILES[component]).read_text())
    _set(config, path, value)
    (folder / FILES[component]).write_text(json.dumps(config))
    inspect_checkpoint(fixtures_root / "models" / "tiny-dense")  # the imports a first inspection pays, not timed
    start = time.perf_counter()
    with pytest.raises(CheckpointError, match=rf"'{path[-1]}' must be .*no larger than|'{path[-1]}' must be a list"):
        inspect_checkpoint(folder)
    assert time.perf_counter() - start < 2.0  # well under a second unloaded; a build of it took minutes


def test_out_of_range_latent_statistics_are_refused(fixtures_root):
    base = _configs(fixtures_root / "models" / "tiny-dense")["vae"]
    for key, value in (("latents_mean", 1e308), ("latents_std", 1e-30), ("latents_std", 1e30)):
        vae = copy.deepcopy(base)
        vae[key][3] = value
        with pytest.raises(CheckpointError, match=key):
            config_checks.check_vae_config(vae, "vae/config.json")


# -- fuzz: whatever a config holds, the checks refuse it with our error or accept a buildable one ---------

hypothesis = pytest.importorskip("hypothesis")
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

FUZZ = settings(max_examples=60, deadline=None, derandomize=True,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
values = st.one_of(
    st.none(), st.booleans(), st.integers(min_value=-(2**70), max_value=2**70), st.integers(0, 600),
    st.floats(allow_nan=True, allow_infinity=True), st.text(max_size=6),
    st.lists(st.integers(min_value=-(2**40), max_value=2**40), max_size=5), st.dictionaries(st.text(max_size=4),
                                                                                              st.integers(), max_size=2),
)


def _leaves(config: Any, prefix: tuple = ()) -> list[tuple]:
    out = []
    if isinstance(config, dict):
        for k, v in config.items():
            out += _leaves(v, (*prefix, k)) if isinstance(v, dict) else [(*prefix, k)]
    return out


def mutate_and_check(configs: dict[str, dict], component: str, pick: int, value: Any, root: Path) -> str:
    """Set one value of one component's config and run the open-time checks and skeleton builds.
    Returns 'refused' or 'accepted'; any other exception is a crash (the caller's to count)."""
    configs = copy.deepcopy(configs)
    leaves = _leaves(configs[component])
    _set(configs[component], leaves[pick % len(leaves)], value)
    try:
        check_values_and_shapes(root, configs, {})
        checks.dit_shapes(configs["transformer"], "transformer/config.json")
        checks.vae_shapes(configs["vae"], "vae/config.json")
    except CheckpointError as err:
        assert len(str(err)) < 2000
        return "refused"
    return "accepted"


@pytest.fixture(scope="module")
def warm(fixtures_root):
    """The first skeleton builds import diffusers' VAE and our DiT; that is not what the fuzz times."""
    configs = _configs(fixtures_root / "models" / "tiny-moe")
    checks.dit_shapes(configs["transformer"], "warm-up")
    checks.vae_shapes(configs["vae"], "warm-up")
    return configs


@FUZZ
@given(component=st.sampled_from(sorted(FILES)), pick=st.integers(0, 200), value=values)
def test_config_fuzz_ends_in_a_check_or_a_quick_build(warm, fixtures_root, component, pick, value):
    start = time.perf_counter()
    mutate_and_check(warm, component, pick, value, fixtures_root / "models" / "tiny-moe")
    assert time.perf_counter() - start < 10.0  # one value past the tiny model's is bounded: never a long build


def test_the_bench_config_fuzz_runs_and_counts(warm):
    from bench import fuzz_configs

    summary = fuzz_configs.main(["--examples", "8", "--seed", "1"])
    assert summary["examples"] == 8 and summary["crash"] == 0 and summary["refused"] + summary["accepted"] == 8
