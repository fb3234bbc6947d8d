"""An autouse fixture for modules that run many tiny torch forwards of the fixture model."""

import pytest
import torch


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    # Forwards of a 1M-parameter model are too small to split; on a shared two-core machine
    # a second intra-op thread only contends (measured: 20x slower under load).
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)
