import pytest

from parallel.layout import LayoutError, ParallelLayout


def test_sequence_parallel_takes_effect_with_more_than_one_tp_rank():
    # One meaning for the config key and the layout: asked for (the default), in effect with TP > 1.
    assert ParallelLayout().sequence_parallel and not ParallelLayout().uses_sequence_parallel
    assert ParallelLayout(2).uses_sequence_parallel and ParallelLayout(2).describe(2) == "tp2,pp1,dp2,sp"
    assert not ParallelLayout(2, sequence_parallel=False).uses_sequence_parallel


def test_a_config_section_is_its_layout():
    from engine.config import MegatronConfig
    from parallel.hybrid_engine import TrainingLayout

    section = MegatronConfig(tensor_model_parallel_size=2, context_parallel_size=2, cp_comm_type="a2a")
    assert isinstance(section, ParallelLayout) and section.data_parallel_size(8) == 2
    training = TrainingLayout.from_parallel_layout(section, 8)
    assert (training.data_parallel_size, training.world_size, training.describe(2)) == (2, 8, section.describe(2))


def test_data_parallel_size_is_derived():
    assert ParallelLayout(2, 2).data_parallel_size(8) == 2
    assert ParallelLayout(tensor_model_parallel_size=4, context_parallel_size=2).data_parallel_size(16) == 2


@pytest.mark.parametrize(
    "layout, world, words",
    [
        (ParallelLayout(3, 1), 4, ["world size 4", "tensor (3)", "= 3"]),
        (ParallelLayout(1, 1, 2), 2, ["virtual_pipeline_model_parallel_size", "pp=1"]),
        (ParallelLayout(2, cp_comm_type="ring"), 2, ["cp_comm_type='ring'", "a2a+p2p"]),
        (ParallelLayout(0, 1), 1, ["tensor_model_parallel_size must be >= 1"]),
    ],
)
def test_impossible_layouts_name_the_conflict(layout, world, words):
    with pytest.raises(LayoutError) as err:
        layout.validate(world)
    for word in words:
        assert word in str(err.value)
