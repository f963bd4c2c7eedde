import pytest
import torch


@pytest.fixture(autouse=True, scope="package")
def one_torch_thread():
    """Tiny models gain nothing from threads, and on a shared machine oversubscribed threads make
    each forward ~10x slower."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
