"""GridMin: an INT minimum whose off-grid values compare as below it (sizes x16, frame counts 4n+1)."""

from __future__ import annotations

import copy
import json
import pickle

import pytest

from lingbot_core.workflow.grid import GridMin


def test_off_grid_values_compare_below_the_minimum_and_on_grid_ones_do_not():
    size, frames = GridMin(16, 16), GridMin(1, 4)
    assert [v < size for v in (0, 8, 15, 16, 32, 100, 4096, 4100)] == [True, True, True, False, False, True,
                                                                         False, True]
    assert [v < frames for v in (0, 1, 2, 5, 9, 10, 121, 120)] == [True, False, True, False, False, True, False, True]
    assert size == 16 and int(size) == 16 and hash(size) == hash(16)


def test_the_message_comfyui_builds_from_it_stays_true():
    """ComfyUI formats its range error with str.format: "Value {} smaller than min of {}"."""
    template = "Value {} smaller than min of {}"
    assert template.format(100, GridMin(16, 16)) == "Value 100 smaller than min of 16, or not a multiple of 16"
    assert template.format(10, GridMin(1, 4)) == \
        "Value 10 smaller than min of 1, or not one of 1, 5, 9, ... (1 plus a multiple of 4)"
    assert f"{GridMin(16, 16):d}" == "16" and str(GridMin(16, 16)) == "16"


def test_problem_names_the_nearest_valid_values():
    assert GridMin(16, 16).problem(100) == "value 100 is not a multiple of 16; try 96 or 112"
    assert GridMin(1, 4).problem(10) == "value 10 is not one of 1, 5, 9, ... (1 plus a multiple of 4); try 9 or 13"
    assert GridMin(16, 16).problem(0) == "value 0 is smaller than the minimum 16"
    assert GridMin(16, 16).problem(832) is None and GridMin(1, 4).problem(1) is None


def test_it_is_a_plain_int_in_json_and_survives_copies():
    spec = {"min": GridMin(16, 16), "max": 4096}
    assert json.dumps(spec) == '{"min": 16, "max": 4096}'  # what /object_info sends the editor
    for clone in (copy.deepcopy(spec)["min"], pickle.loads(pickle.dumps(spec))["min"]):
        assert isinstance(clone, GridMin) and clone.step == 16 and 100 < clone


@pytest.mark.parametrize("low,step", [(True, 4), (16, 0), (16, False)])
def test_a_bad_grid_is_refused(low, step):
    with pytest.raises(ValueError, match="grid"):
        GridMin(low, step)
