"""A search over llama-tiny's small space before any trial: what the tests of a search's conclusions start from."""

from sltune.tuning.cost.shape import shape_of
from sltune.tuning.search.state import SearchState
from sltune.tuning.space import SearchSpace
from tests.support.specs import admitted_spec


def state(**search):
    spec = admitted_spec({"name": "s", "model": {"preset": "llama-tiny"}, "workload": {"seq_len": 32},
                          "search": {"sub_batch_size": [1, 2, 4], "num_sub_batches": [1, 2, 4],
                                     "num_live_blocks": [1, 2, 4], **search}})
    shape = shape_of("llama-tiny")
    return SearchState(spec, shape, SearchSpace(spec, shape))
