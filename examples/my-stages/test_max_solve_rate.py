import max_solve_rate  # noqa: F401  (the plugin: importing it registers filter.max_solve_rate)
from gfcr.testing import check_stage


def test_max_solve_rate_passes_the_conformance_checks():
    check_stage("filter.max_solve_rate")
