"""`bench serve` sends a workload's priority classes as the server's `priority` field."""
from pagedserve.bench.serve import ServeConfig, _payload
from pagedserve.workload.datasets import random_dataset, with_priority_classes


def test_priority_classes_reach_the_request_body():
    requests = with_priority_classes(random_dataset(2, 8, 2), 2)
    batch, urgent = (_payload(ServeConfig(), "m", r, None) for r in requests)
    assert batch["priority"] == 1 and "priority" not in urgent  # 0 is the server's default
