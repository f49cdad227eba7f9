import pytest

from parallel.layout import LayoutError, ParallelLayout


def test_data_parallel_size_is_derived():
    assert ParallelLayout(2, 2).data_parallel_size(8) == 2
    assert ParallelLayout(tensor_model_parallel_size=4, context_parallel_size=2).data_parallel_size(16) == 2


@pytest.mark.parametrize(
    "layout, world, words",
    [
        (ParallelLayout(3, 1), 4, ["world size 4", "tensor (3)", "= 3"]),
        (ParallelLayout(1, 1, 2), 2, ["virtual_pipeline_model_parallel_size", "pp=1"]),
        (ParallelLayout(1, 1, sequence_parallel=True), 1, ["sequence_parallel"]),
        (ParallelLayout(0, 1), 1, ["tensor_model_parallel_size must be >= 1"]),
    ],
)
def test_impossible_layouts_name_the_conflict(layout, world, words):
    with pytest.raises(LayoutError) as err:
        layout.validate(world)
    for word in words:
        assert word in str(err.value)
