import pytest

from tilepy import _env


def test_numpy_25_with_numba_cuda_030_is_refused_in_one_line():
    with pytest.raises(ImportError) as info:
        _env.check_versions("2.5.2", "0.30.4")
    msg = str(info.value)
    assert "numpy<2.5" in msg and "row_stack" in msg and "\n" not in msg


@pytest.mark.parametrize("np_v,nc_v", [("2.4.6", "0.30.4"), ("1.26.4", "0.30.4"),
                                        ("2.5.2", "0.31.0"), ("2.5.0rc1", "1.0.0")])
def test_compatible_versions_pass(np_v, nc_v):
    _env.check_versions(np_v, nc_v)


def test_installed_versions_are_compatible():
    _env.check_versions()


@pytest.mark.xdist_group("grouping_check")
def test_xdist_groups_are_honoured(request):
    """Under ``--dist loadgroup`` (setup.cfg) a test marked ``xdist_group`` carries its group
    in its node id — how pytest-xdist sends a group to one worker, so that a session-wide
    compile fixture is computed once, not once per worker. (pytest 9 with pytest-xdist 3.8
    drops the suffix silently: setup.cfg pins pytest below 9.)"""
    if not getattr(request.config.option, "loadgroup", False):
        pytest.skip("not a pytest-xdist worker under --dist loadgroup")
    assert request.node.nodeid.endswith("@grouping_check"), request.node.nodeid
