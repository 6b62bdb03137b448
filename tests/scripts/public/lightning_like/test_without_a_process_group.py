"""A command whose tests import torch.distributed (distcheck arms its hooks at that import) and start no process
group: under ``distcheck run --`` it must end with pytest's own exit code. No Lightning here, so that it is quick."""

import warnings

import pytest
import torch.distributed as dist


def test_torch_distributed_is_imported_and_no_group_is_started():
    assert dist.is_available() and not dist.is_initialized()


def test_a_warning_is_an_error_in_this_project():
    with pytest.raises(UserWarning):
        warnings.warn("pytest.ini's filterwarnings makes every warning an error here", UserWarning)
